"""Speed benchmark of PMNet: one two-segment memory episode, with and without memory.

What one "step" is (an episode of batch B):

    state = model.init_state(B)
    segment 1 (B, 40 tokens)  -> consolidate(mode="learned") -> clear_context()
    segment 2 (B, 40 tokens)  -> consolidate(mode="learned") -> clear_context()
    query     (B, 4 tokens), logits="last"  -> cross-entropy against a random target

`train` times forward + backward (model.train(), ltm_routing=True; no optimizer, grads are
dropped before each step outside the timed region); `eval` times the forward only
(model.eval(), torch.no_grad()). The same Transformer built with `use_memory=False` runs the
same episode without consolidate (segment 1, clear, segment 2, clear, query); the ratio
memory / no-memory is the cost of the memory path on top of attention + MLP.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_model.py --preset paper --repeats 3
    .venv/bin/python benchmarks/bench_model.py --preset cpu --repeats 20
    .venv/bin/python benchmarks/bench_model.py --preset paper --device cuda --dtypes bf16
    .venv/bin/python benchmarks/bench_model.py --preset paper --profile   # + op profile

Every run writes benchmarks/results/<preset>-<device>-<YYYYmmdd-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pmnet.config import ModelConfig  # noqa: E402
from pmnet.model import Consolidator, MemoryRead, MemoryWrite, PMNet  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
MODES = ("train", "eval")


# -----------------------------------------------------------------------------------------
# Machine description
# -----------------------------------------------------------------------------------------


def cpu_model() -> str:
    from pmnet.hardware import cpu_kind

    return cpu_kind()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx2")))
    except OSError:
        pass
    return []


def load_1m() -> float | None:
    """1-minute load average: a figure taken while other work ran on the machine is suspect."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_busy(seconds: float = 3.0) -> float | None:
    """Percent of all CPUs busy over `seconds` (from /proc/stat), None when unavailable."""
    def snap():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t1, i1 = snap()
        time.sleep(seconds)
        t2, i2 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return 100.0 * (1.0 - (i2 - i1) / max(t2 - t1, 1))


def wait_for_idle(max_wait: float, threshold: float = 10.0, quiet: bool = False
                  ) -> float | None:
    """Wait (at most `max_wait` s) until the CPUs are under `threshold` % busy; return busy %.

    Called while this process does nothing, so what it sees is other processes' load.
    """
    deadline = time.monotonic() + max_wait
    while True:
        busy = cpu_busy(1.5 if quiet else 3.0)
        if busy is None or busy < threshold or time.monotonic() >= deadline:
            return None if busy is None else round(busy, 1)
        if not quiet:
            print(f"# machine {busy:.0f}% busy; waiting for it to go idle", flush=True)
        time.sleep(5)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def code_version() -> dict:
    """Commit, uncommitted changes under pmnet/, and a hash of the model file benchmarked.

    Taken when the script starts (the model code is imported then): a commit made while a
    long run goes on must not be credited with figures of the code loaded before it.
    """
    try:
        model_sha = hashlib.sha256((REPO / "pmnet" / "model.py").read_bytes()).hexdigest()
    except OSError:
        model_sha = None
    dirty = _git("status", "--porcelain", "--", "pmnet")
    return {"git_commit": _git("rev-parse", "HEAD") or None,
            "pmnet_dirty": None if dirty is None else bool(dirty),
            "model_py_sha256": model_sha}


CODE_VERSION = code_version()


def machine(device: str) -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg_1m_at_start": load_1m(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": None,
    }
    if device == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


# -----------------------------------------------------------------------------------------
# One episode
# -----------------------------------------------------------------------------------------


def make_batch(vocab: int, batch: int, seg_len: int, query_len: int, device: str,
               gen: torch.Generator) -> dict:
    def ids(T: int) -> torch.Tensor:
        return torch.randint(0, min(vocab, 256), (batch, T), generator=gen).to(device)

    target = torch.randint(0, min(vocab, 256), (batch,), generator=gen).to(device)
    return {"seg1": ids(seg_len), "seg2": ids(seg_len), "query": ids(query_len),
            "target": target}


def episode(model: PMNet, data: dict, *, train: bool, dtype,
            full_backward: bool = False) -> torch.Tensor:
    """Run one two-segment episode; backward when `train`. Returns the (detached) loss.

    Without memory, the query loss does not depend on the segments (their KV cache is
    cleared), so backward only covers the 4 query tokens. `full_backward` adds
    0 * (last logits of each segment) to the loss: same value, but backward then covers all
    84 tokens, as it does through LTM in the memory model (a matched-work baseline).
    """
    memory = model.cfg.use_memory
    B = data["seg1"].shape[0]
    autocast = (torch.autocast(data["seg1"].device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    grad = contextlib.nullcontext() if train else torch.no_grad()
    with grad:
        with autocast:
            state = model.init_state(B)
            extra = []
            for seg in ("seg1", "seg2"):
                seg_logits, state = model(data[seg], state, ltm_routing=True,
                                          logits="last" if full_backward else "none")
                if full_backward:
                    extra.append(seg_logits.float().sum() * 0.0)
                if memory:
                    state = model.consolidate(state, mode="learned")
                state = state.clear_context()
            logits, _ = model(data["query"], state, ltm_routing=True, logits="last")
            loss = F.cross_entropy(logits.float(), data["target"]) + sum(extra)
        if train:
            loss.backward()
    return loss.detach()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(model: PMNet, data: dict, *, train: bool, dtype, device: str, warmup: int,
               repeats: int, full_backward: bool = False) -> list[float]:
    """Seconds per step for `repeats` steps after `warmup` untimed steps."""
    model.train(train)
    times = []
    for i in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        loss = episode(model, data, train=train, dtype=dtype, full_backward=full_backward)
        sync(device)
        elapsed = time.perf_counter() - t0
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()} at step {i}")
        if i >= warmup:
            times.append(elapsed)
    model.zero_grad(set_to_none=True)
    return times


def paired_ratio(num: list[float], den: list[float]) -> dict:
    """memory / baseline: ratio of medians, and median of the per-round ratios."""
    return {"of_medians": statistics.median(num) / statistics.median(den),
            "median_per_round": statistics.median(a / b for a, b in zip(num, den)),
            "of_minima": min(num) / min(den)}


def summarize(times: list[float], batch: int) -> dict:
    med = statistics.median(times)
    return {
        "median_ms": 1e3 * med,
        "min_ms": 1e3 * min(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "episodes_per_s": batch / med,
        "times_ms": [1e3 * t for t in times],
    }


# -----------------------------------------------------------------------------------------
# Profile of the memory path
# -----------------------------------------------------------------------------------------


def label_modules(model: PMNet) -> list:
    """record_function ranges around every memory module's forward (for the profile)."""
    handles = []
    for mod in model.modules():
        if isinstance(mod, MemoryWrite | MemoryRead | Consolidator):
            kind = type(mod).__name__

            def pre(m, args, kind=kind):
                m._bench_rf = torch.autograd.profiler.record_function(f"mem::{kind}")
                m._bench_rf.__enter__()

            def post(m, args, out):
                m._bench_rf.__exit__(None, None, None)

            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))
    return handles


def profile_ops(model: PMNet, data: dict, *, dtype, top: int,
                full_backward: bool = False) -> dict:
    """Self-CPU time per op (ms) of one train step, after the timed runs (so it is warm)."""
    from torch.profiler import ProfilerActivity, profile

    handles = label_modules(model)
    model.train(True)
    model.zero_grad(set_to_none=True)
    episode(model, data, train=True, dtype=dtype, full_backward=full_backward)  # warm, hooked
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        episode(model, data, train=True, dtype=dtype, full_backward=full_backward)
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top))
    ops = {}
    for ev in averages:
        ops[ev.key] = {"self_cpu_ms": ev.self_cpu_time_total / 1e3,
                       "cpu_total_ms": ev.cpu_time_total / 1e3, "count": ev.count}
    return ops


def profile_diff(mem_ops: dict, base_ops: dict, top: int) -> list[dict]:
    """Ops by self-CPU time the memory model spends on top of the no-memory model."""
    rows = []
    for key, v in mem_ops.items():
        if key.startswith("mem::") or key.startswith("ProfilerStep"):
            continue
        base = base_ops.get(key, {"self_cpu_ms": 0.0, "count": 0})
        rows.append({"op": key, "memory_ms": v["self_cpu_ms"], "no_memory_ms": base["self_cpu_ms"],
                     "extra_ms": v["self_cpu_ms"] - base["self_cpu_ms"],
                     "memory_calls": v["count"], "no_memory_calls": base["count"]})
    rows.sort(key=lambda r: -r["extra_ms"])
    return rows[:top]


# -----------------------------------------------------------------------------------------
# Driver
# -----------------------------------------------------------------------------------------


def atomic_write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; give it a normal file's mode
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="paper", help="model preset (paper, cpu, debug)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per figure (default: 5 for paper on CPU, 20 on CUDA, "
                         "20 for small presets)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (>= 1)")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda or cpu,cuda (default: cpu, plus cuda when available)")
    ap.add_argument("--dtypes", default=None,
                    help="comma list of fp32,bf16 (default: fp32,bf16 on CPU, bf16 on CUDA)")
    ap.add_argument("--modes", default="train,eval", help="comma list of train,eval")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seg-len", type=int, default=40)
    ap.add_argument("--query-len", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-full-bwd", action="store_true",
                    help="skip the no-memory baseline whose backward covers every token")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one train step (memory and no-memory) per dtype")
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for the CPUs to be idle (other jobs skew "
                         "CPU timings); the busy %% seen is saved")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (first steps are several seconds slower)")
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be >= 1")
    for d in (args.dtypes or "").split(","):
        if d and d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    for m in args.modes.split(","):
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    return args


def run_device(args: argparse.Namespace, device: str) -> dict:
    dtypes = (args.dtypes or ("fp32,bf16" if device == "cpu" else "bf16")).split(",")
    modes = args.modes.split(",")
    repeats = args.repeats or (5 if (args.preset == "paper" and device == "cpu") else 20)
    busy = wait_for_idle(args.wait_idle) if (args.wait_idle > 0 and device == "cpu") else None
    machine_info = machine(device)  # at the start: its load average is the one before timing
    machine_info["cpu_busy_pct_before"] = busy
    cfgs = {"memory": ModelConfig.from_name(args.preset),
            "no_memory": ModelConfig.from_name(args.preset, use_memory=False)}
    torch.manual_seed(args.seed)
    models = {v: PMNet(cfg).to(device) for v, cfg in cfgs.items()}
    gen = torch.Generator().manual_seed(args.seed)
    data = make_batch(cfgs["memory"].vocab_size, args.batch, args.seg_len, args.query_len,
                      device, gen)
    params = {v: sum(p.numel() for p in m.parameters()) for v, m in models.items()}
    print(f"# preset={args.preset} device={device} batch={args.batch} repeats={repeats} "
          f"warmup={args.warmup} threads={torch.get_num_threads()} load={load_1m()} "
          f"params: memory={params['memory']:,} no_memory={params['no_memory']:,}", flush=True)

    variants = [("memory", "memory", False), ("no_memory", "no_memory", False)]
    if "train" in modes and not args.no_full_bwd:
        variants.append(("no_memory_full_bwd", "no_memory", True))
    results: dict = {}
    ratios: dict = {}
    ratios_full: dict = {}
    rounds: dict = {}
    profiles: dict = {}
    for dname in dtypes:
        dtype = DTYPES[dname]
        # every (variant, mode) figure of this dtype, timed in interleaved rounds: one step
        # of each per round, so a slow spell (other jobs on the machine) hits all of them
        # alike and the per-round ratios stay meaningful
        figures = [(variant, key, full_bwd, mode) for variant, key, full_bwd in variants
                   for mode in modes if not (full_bwd and mode != "train")]
        t0 = time.perf_counter()
        for _variant, key, full_bwd, mode in figures:
            time_steps(models[key], data, train=mode == "train", dtype=dtype, device=device,
                       warmup=args.warmup, repeats=0, full_backward=full_bwd)
        print(f"  {dname}: warm-up done ({time.perf_counter() - t0:.0f} s)", flush=True)
        times = {f: [] for f in figures}
        round_busy = []
        for r in range(repeats):
            if args.wait_idle > 0 and device == "cpu":
                round_busy.append(wait_for_idle(args.wait_idle, quiet=True))
            t_round = time.perf_counter()
            for f in figures:
                _variant, key, full_bwd, mode = f
                times[f] += time_steps(models[key], data, train=mode == "train", dtype=dtype,
                                       device=device, warmup=0, repeats=1,
                                       full_backward=full_bwd)
            print(f"  {dname}: round {r + 1}/{repeats} {time.perf_counter() - t_round:.1f} s "
                  f"(load {load_1m()})", flush=True)
        results[dname] = {}
        for f in figures:
            variant, _, _, mode = f
            s = summarize(times[f], args.batch)
            results[dname].setdefault(variant, {})[mode] = s
            print(f"  {dname:<5} {variant:<18} {mode:<5} median {s['median_ms']:9.1f} ms "
                  f"{s['episodes_per_s']:9.1f} episodes/s  (min {s['min_ms']:.1f} ms)",
                  flush=True)
        rounds[dname] = {"loadavg_1m_after": load_1m(),
                         "cpu_busy_pct_before_each_round": round_busy}
        ratios[dname], ratios_full[dname] = {}, {}
        for mode in modes:
            ratios[dname][mode] = paired_ratio(times[("memory", "memory", False, mode)],
                                               times[("no_memory", "no_memory", False, mode)])
            key = ("no_memory_full_bwd", "no_memory", True, mode)
            if key in times:
                ratios_full[dname][mode] = paired_ratio(
                    times[("memory", "memory", False, mode)], times[key])
        if args.profile:
            print(f"\n## profile, {dname}, memory model, one train step (self CPU time)")
            mem_ops = profile_ops(models["memory"], data, dtype=dtype, top=args.profile_top)
            print(f"## profile, {dname}, no-memory model, one train step with backward "
                  "through all tokens (self CPU time)")
            base_ops = profile_ops(models["no_memory"], data, dtype=dtype,
                                   top=args.profile_top, full_backward=True)
            diff = profile_diff(mem_ops, base_ops, args.profile_top)
            labels = {k: v for k, v in mem_ops.items() if k.startswith("mem::")}
            print(f"## ops the memory model spends on top of no-memory ({dname}, ms)")
            print(f"{'op':<60} {'memory':>9} {'no-mem':>9} {'extra':>9} {'calls':>7}")
            for r in diff:
                print(f"{r['op'][:60]:<60} {r['memory_ms']:9.1f} {r['no_memory_ms']:9.1f} "
                      f"{r['extra_ms']:9.1f} {r['memory_calls']:7d}")
            print("## forward time inside memory modules (record_function, total CPU ms)")
            for k, v in labels.items():
                print(f"  {k:<24} {v['cpu_total_ms']:9.1f} ms over {v['count']} calls")
            print()
            profiles[dname] = {"memory_extra_ops": diff, "memory_module_forward": labels,
                               "memory_ops": mem_ops, "no_memory_ops": base_ops}

    out = {
        "benchmark": "pmnet two-segment episode (seg 40 + consolidate + clear) x2 + query 4",
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info,
        "git_commit": CODE_VERSION["git_commit"],
        "code": CODE_VERSION,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "preset": args.preset,
        "device": device,
        "batch": args.batch,
        "repeats": repeats,
        "warmup": args.warmup,
        "seg_len": args.seg_len,
        "query_len": args.query_len,
        "dtypes": dtypes,
        "modes": modes,
        "parameters": params,
        "config": cfgs["memory"].to_dict(),
        "results": results,
        "ratio_memory_over_no_memory": ratios,
        "ratio_memory_over_no_memory_full_backward": ratios_full,
        "rounds": rounds,
    }
    if profiles:
        out["profile"] = profiles
    return out


def print_table(out: dict) -> None:
    print(f"\n{out['preset']} / {out['device']} / batch {out['batch']} / "
          f"{out['machine']['threads']} threads / median of {out['repeats']}")
    print(f"{'dtype':<6}{'mode':<7}{'memory ms':>11}{'ep/s':>9}{'no-mem ms':>11}{'ep/s':>9}"
          f"{'ratio':>8}{'no-mem full-bwd ms':>20}{'ratio':>8}")
    for dname in out["dtypes"]:
        for mode in out["modes"]:
            m = out["results"][dname]["memory"][mode]
            n = out["results"][dname]["no_memory"][mode]
            r = out["ratio_memory_over_no_memory"][dname][mode]["median_per_round"]
            line = (f"{dname:<6}{mode:<7}{m['median_ms']:11.1f}{m['episodes_per_s']:9.1f}"
                    f"{n['median_ms']:11.1f}{n['episodes_per_s']:9.1f}{r:8.2f}")
            full = out["results"][dname].get("no_memory_full_bwd", {}).get(mode)
            if full is not None:
                rf = (out["ratio_memory_over_no_memory_full_backward"][dname][mode]
                      ["median_per_round"])
                line += f"{full['median_ms']:20.1f}{rf:8.2f}"
            print(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = args.device.split(",")
    for device in devices:
        if device not in ("cpu", "cuda"):
            raise SystemExit(f"unknown device {device!r}; use cpu or cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda requested but CUDA is not available")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for device in devices:
        out = run_device(args, device)
        print_table(out)
        if not args.no_save:
            path = args.out_dir / f"{args.preset}-{device}-{stamp}.json"
            atomic_write_json(path, out)
            print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
