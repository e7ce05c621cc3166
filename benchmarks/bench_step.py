"""Training-step speed and eager op counts of every phase, this code against a baseline.

One step is what Lightning runs per batch in the pipeline, minus logging: the phase's
LightningModule `training_step` (the very method the pipeline calls; `self.log` is a no-op
here), `backward`, gradient clipping to TrainConfig.grad_clip, AdamW over the trainable
parameters, `zero_grad`. Batches are real task episodes (copy batches for Phase 0); Phase 1
draws its number of demonstrations per step from the preset's curriculum, as in training.

Kinds: `phase0`, `phase1`, and `phase2:<condition>` for any condition (the Consolidator's
Phase-2 start as the preset sets it, from a freshly initialised model: the speed of a step
does not depend on the weights).

Variants, each in its own process (a fresh interpreter, its own caches):

    base      the baseline code (`--baseline REV`, default 235df21: the eager model before
              issue 20), extracted with `git archive` into a temporary directory
    eager     this checkout, TrainConfig.compile=() (every step eager)
    compiled  this checkout, TrainConfig.compile naming every phase's training step
              (torch.compile of the step);
              its cold compile (the first steps, with an empty inductor cache unless
              `--warm-cache`) is reported apart from the step time

The workers start one after another and then time `--iters` steps each in turn for
`--rounds` rounds (base, eager, compiled, base, ...), so a slow spell of the machine hits
every variant alike: read the ratios of medians. Before timing, each worker counts the ops
of one step with `pmnet.opcount.OpCounter` (forward = `training_step`, backward =
`loss.backward()`; views excluded; host syncs listed).

    .venv/bin/python benchmarks/bench_step.py --preset cpu --threads 1
    .venv/bin/python benchmarks/bench_step.py --preset paper --batch 64 --threads 2 \\
        --kinds phase1,phase2:consolidator_only --variants base,eager --iters 2

`--presets cpu,small,medium` times presets instead of variants (issue 52, the scale
ladder): one worker per preset, each this checkout's eager step (as the `cpu` recipe
trains Phase 1), interleaved in the same rounds, so the figure to read is each preset's
median step over the first one's (`ratio_vs_<first>`):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_step.py --presets cpu,small,medium \\
        --kinds phase1 --threads 1 --rounds 3 --iters 3 --warmup 3

Writes benchmarks/results/step-<preset>-<YYYYmmdd-HHMMSS>.json
(`step-ladder-<presets>-...` with `--presets`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
VARIANTS = ("base", "eager", "compiled")
DEFAULT_KINDS = ("phase1", "phase2:consolidator_only", "phase2:consolidator_only_routing_off")
BASELINE = "235df21"


# -----------------------------------------------------------------------------------------
# Worker: one variant of one kind in this process, driven over stdin / stdout
# -----------------------------------------------------------------------------------------


def _op_counter_class():
    """`pmnet.opcount.OpCounter` of this checkout, whichever `pmnet` the worker imports."""
    spec = importlib.util.spec_from_file_location("_bench_opcount", REPO / "pmnet" / "opcount.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.OpCounter


class Worker:
    def __init__(self, tree: str, variant: str, preset: str, kind: str, batch: int | None,
                 threads: int, seed: int):
        sys.path.insert(0, tree)
        import torch

        from pmnet import task
        from pmnet import train as T

        torch.set_num_threads(threads)
        self.torch, self.task = torch, task
        over = {} if batch is None else {"batch_size": batch}
        if variant != "base":  # compiled: every phase's training step (not evaluation)
            over["compile"] = ("phase0", "phase1", "phase2") if variant == "compiled" else ()
        cfg = T.TrainConfig.from_name(preset, **over)
        self.cfg = cfg
        torch.manual_seed(seed)
        model = T.PMNet(cfg.model)
        B = cfg.batch_size
        if kind == "phase0":
            module = T.Phase0Module(cfg, model, cfg.phase1_lr)
            self.batches = [task.make_copy_batch(B, cfg.phase0_copy_len, seed * 1000 + i)
                            for i in range(8)]
        elif kind == "phase1":
            for n, p in model.named_parameters():
                p.requires_grad_(not n.startswith("consolidator."))
            module = T.Phase1Module(cfg, model, cfg.phase1_lr)
            eps = task.train_episodes(cfg.phase1_seed + 1_000_000, 0, 8 * B)
            self.batches = [eps[i * B:(i + 1) * B] for i in range(8)]
        elif kind.startswith("phase2:"):
            cond = T.get_condition(kind.split(":", 1)[1])
            if cond.consolidation in T.OPERATORS:
                T.init_operator(model, cfg, cond.consolidation, seed)
            else:
                T.init_consolidator(model, cfg, seed)
            module = T.Phase2Module(cfg, model, cond)
            eps = task.train_episodes(seed, 0, 8 * B, segments=cfg.segments)
            self.batches = [eps[i * B:(i + 1) * B] for i in range(8)]
        else:
            raise SystemExit(f"unknown kind {kind!r}")
        module.log = lambda *a, **k: None  # no trainer: logging is not part of the step
        module.train()
        self._step = 0
        # the curriculum reads `global_step`, which needs a trainer: feed it ours
        type(module).global_step = property(lambda m: self._step)
        self.module = module
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, betas=tuple(cfg.betas))

    def step(self, count=None):
        torch = self.torch
        batch = self.batches[self._step % len(self.batches)]
        self.module.on_train_batch_start(batch, self._step)  # Phase 1 draws its demos here
        if count is None:
            loss = self.module.training_step(batch, self._step)
            loss.backward()
        else:
            with count[0]:
                loss = self.module.training_step(batch, self._step)
            with count[1]:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._step += 1

    def count_ops(self) -> dict:
        Counter = _op_counter_class()
        fwd, bwd = Counter(), Counter()
        self.step((fwd, bwd))
        syncs = {**fwd.syncs}
        for k, v in bwd.syncs.items():
            syncs[k] = syncs.get(k, 0) + v
        return {"forward": fwd.total, "backward": bwd.total, "total": fwd.total + bwd.total,
                "views": fwd.views + bwd.views, "syncs": syncs,
                "top": (fwd.ops + bwd.ops).most_common(12)}


def worker_main(args) -> int:
    def send(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    t0 = time.perf_counter()
    w = Worker(args.tree, args.variant, args.preset, args.kind, args.batch, args.threads,
               args.seed)
    setup_s = time.perf_counter() - t0
    import torch

    first = time.perf_counter()
    w.step()  # the first step: compiles, for the compiled variant
    first_s = time.perf_counter() - first
    t = time.perf_counter()
    for _ in range(args.warmup):  # more shapes (Phase 1's numbers of demos), caches
        w.step()
    warmup_s = time.perf_counter() - t
    graphs = None
    if args.variant == "compiled":
        from torch._dynamo.utils import counters
        from torch._inductor import metrics

        graphs = {"unique_graphs": int(counters["stats"]["unique_graphs"]),
                  "graph_breaks": int(sum(counters["graph_break"].values())),
                  "break_reasons": sorted(counters["graph_break"])[:10],
                  # fused kernels inductor generated for every graph (forward and backward;
                  # 0 when all came from a warm cache)
                  "generated_kernels": int(metrics.generated_kernel_count)}
    # the eager op count (a dispatch mode makes a compiled function fall back to eager for
    # good: the compiled variant reports its graphs instead)
    ops = w.count_ops() if args.variant != "compiled" else None
    send({"ready": True, "setup_s": setup_s, "first_step_s": first_s, "warmup_s": warmup_s,
          "warmup_steps": args.warmup, "ops": ops, "graphs": graphs, "batch": w.cfg.batch_size,
          "torch": torch.__version__, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "time":
            times = []
            for _ in range(cmd["n"]):
                t = time.perf_counter()
                w.step()
                times.append(time.perf_counter() - t)
            send({"times": times})
        else:
            break
    return 0


# -----------------------------------------------------------------------------------------
# Driver
# -----------------------------------------------------------------------------------------


def extract_baseline(rev: str, into: Path) -> Path:
    """`git archive REV pmnet` into `into`; returns the tree to put on sys.path."""
    archive = into / "base.tar"
    with open(archive, "wb") as fh:
        subprocess.run(["git", "archive", rev, "pmnet"], cwd=REPO, stdout=fh, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


class Proc:
    def __init__(self, label: str, cmd: list[str], env: dict):
        self.label = label
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=REPO)

    def recv(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.label} died (exit {self.p.wait()})")
        return json.loads(line)

    def send(self, obj) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        try:
            self.send({"cmd": "quit"})
            self.p.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        self.p.wait(timeout=60)


def save_result(out: dict, prefix: str) -> Path:
    """Write `out` to benchmarks/results/<prefix>-<YYYYmmdd-HHMMSS>.json and say where."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{prefix}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return path


def arms(args) -> dict[str, tuple[str, str]]:
    """{label: (variant, preset)} of the workers one kind runs: the variants of one preset,
    or with `--presets` this checkout's eager step of each preset (labelled by the preset)."""
    if args.presets:
        return {p: ("eager", p) for p in args.presets}
    return {v: (v, args.preset) for v in args.variants}


def run_kind(args, kind: str, trees: dict[str, Path], cache_dir: Path) -> dict:
    procs, ready = {}, {}
    labels = arms(args)
    for label, (variant, preset) in labels.items():
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore",
                   TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
        cmd = [sys.executable, __file__, "--worker", "--tree", str(trees[variant]),
               "--variant", variant, "--preset", preset, "--kind", kind,
               "--threads", str(args.threads), "--seed", str(args.seed),
               "--warmup", str(args.warmup)]
        if args.batch:
            cmd += ["--batch", str(args.batch)]
        procs[label] = Proc(label, cmd, env)
        ready[label] = procs[label].recv()  # one at a time: compiles do not overlap
        r = ready[label]
        ops = r["ops"]
        print(f"  {kind:40s} {label:8s} ready: first step {r['first_step_s']:.1f} s, "
              f"warm-up {r['warmup_s']:.1f} s, "
              + (f"{ops['total']} ops/step ({ops['forward']} fwd + {ops['backward']} bwd), "
                 f"syncs {ops['syncs'] or 0}" if ops else
                 f"graphs {r['graphs']['unique_graphs']}, breaks {r['graphs']['graph_breaks']}, "
                 f"generated kernels {r['graphs']['generated_kernels']}"),
              flush=True)
    times = {v: [] for v in labels}
    loads = []  # the 1-minute load average after each round: other work skews a round
    for rnd in range(args.rounds):
        for v in labels:
            procs[v].send({"cmd": "time", "n": args.iters})
            times[v] += procs[v].recv()["times"]
        loads.append(os.getloadavg()[0])
        line = "  ".join(f"{v} {1000 * statistics.median(times[v]):.1f} ms" for v in labels)
        print(f"  {kind:40s} round {rnd}: {line}  (load {loads[-1]:.2f})", flush=True)
    for p in procs.values():
        p.close()
    out = {"variants": {}, "load_1m_per_round": loads}
    for v in labels:
        med = statistics.median(times[v])
        out["variants"][v] = {**ready[v], "preset": labels[v][1], "median_ms": 1000 * med,
                              "min_ms": 1000 * min(times[v]),
                              "episodes_per_s": ready[v]["batch"] / med, "times_s": times[v]}
    base = "base" if "base" in times else next(iter(labels))
    for v in labels:
        ratio = out["variants"][v]["median_ms"] / out["variants"][base]["median_ms"]
        if args.presets:  # how many times the first preset's step each preset's takes
            out["variants"][v]["ratio_vs_" + base] = ratio
        else:
            out["variants"][v]["speedup_vs_" + base] = 1 / ratio
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--presets", default="", help="time these presets' eager steps against "
                    "the first one's in the same rounds (e.g. cpu,small,medium) instead of "
                    "variants of --preset")
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the base variant")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the preset's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps after the first")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--warm-cache", default=None, metavar="DIR",
                    help="inductor cache to use (default: a new empty one: cold compiles)")
    ap.add_argument("--no-save", action="store_true")
    # worker mode
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(args.variants) - set(VARIANTS))
    if bad:
        ap.error(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    kinds = [k for k in args.kinds.split(",") if k]
    args.presets = [p for p in args.presets.split(",") if p]
    if args.presets:  # every preset must exist before any worker starts
        sys.path.insert(0, str(REPO))
        from pmnet.config import PRESETS

        unknown = [p for p in args.presets if p not in PRESETS]
        if unknown or len(set(args.presets)) != len(args.presets):
            ap.error(f"--presets must name distinct presets of {', '.join(PRESETS)}; "
                     f"got {','.join(args.presets)}")
        args.variants = ["eager"]

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_model import code_version, machine

    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        tmp = Path(tmp)
        trees = {"eager": REPO, "compiled": REPO}
        if "base" in args.variants:
            trees["base"] = extract_baseline(args.baseline, tmp)
        cache = Path(args.warm_cache) if args.warm_cache else tmp / "inductor-cache"
        started = time.time()
        results = {}
        for kind in kinds:
            results[kind] = run_kind(args, kind, trees, cache)
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
           "started": dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
           "wall_s": time.time() - started, "args": vars(args), "baseline": args.baseline,
           "code": code_version(), "machine": machine("cpu"), "kinds": results}
    shown = list(arms(args))
    print(f"{'kind':40s} " + " ".join(f"{v:>14s}" for v in shown))
    for kind, r in results.items():
        cells = []
        for v in shown:
            x = r["variants"][v]
            cells.append(f"{x['median_ms']:8.1f} ms " + (f"{x['ops']['total']:5d}" if x["ops"]
                                                          else "    -"))
        print(f"{kind:40s} " + " ".join(f"{c:>14s}" for c in cells))
        if args.presets:
            print(f"{'':40s} " + " ".join(
                f"{r['variants'][v]['ratio_vs_' + shown[0]]:>13.2f}x" for v in shown))
    if not args.no_save:
        save_result(out, f"step-ladder-{'-'.join(args.presets)}" if args.presets
                    else f"step-{args.preset}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
