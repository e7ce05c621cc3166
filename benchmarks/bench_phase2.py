"""Phase-2 training-step speed of a preset: eager against torch.compile, in one run.

One step is what `Phase2Module.training_step` does for a Consolidator-only condition, plus
the optimiser: `run_episodes` (segment 1 -> consolidate -> clear -> segment 2 ->
consolidate -> clear -> final query), cross-entropy on the final answer, backward, AdamW.
Only the Consolidator is trainable, as in the `consolidator_only` conditions; the batches
are real task episodes.

Variants (each in its own fresh process, so one does not warm the other's caches):

    eager     the model as the pipeline runs it
    compile   `torch.compile` of `PMNet.forward` and `Consolidator.forward` (inductor); its
              compile time is reported apart from the step time
    bf16      eager under `torch.autocast("cpu", bfloat16)` (angles stay fp32 by design)

Rounds alternate the variants (eager, compile, bf16, eager, ...), so a slow spell of the
machine hits all alike; the ratio of medians is the figure to read.

    .venv/bin/python benchmarks/bench_phase2.py --preset cpu --threads 1 --rounds 2

Writes benchmarks/results/phase2-<preset>-<YYYYmmdd-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
VARIANTS = ("eager", "compile", "bf16")


def one_variant(preset: str, variant: str, threads: int, batch: int, steps: int,
                warmup: int) -> dict:
    """Time `steps` training steps after `warmup` untimed ones, in this process."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from pmnet import task
    from pmnet.config import ModelConfig
    from pmnet.model import PMNet
    from pmnet.runner import RunOptions, run_episodes

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = PMNet(ModelConfig.from_name(preset)).train()
    model.consolidator.reinit(0.18, torch.Generator().manual_seed(0))
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("consolidator."))
    opt = torch.optim.AdamW(model.consolidator.parameters(), lr=1e-3)
    episodes = task.train_episodes(42, 0, batch * (warmup + steps))
    opts = RunOptions("learned", True)
    compile_s = 0.0
    if variant == "compile":
        model.forward = torch.compile(model.forward, dynamic=False)
        model.consolidator.forward = torch.compile(model.consolidator.forward, dynamic=False)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16")

    times = []
    for i in range(warmup + steps):
        b = episodes[i * batch:(i + 1) * batch]
        t = time.perf_counter()
        with autocast:
            out = run_episodes(model, b, opts)["updated_ltm"]
        loss = F.cross_entropy(out.float(), b.target[:, 1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t
        if i == 0 and variant == "compile":
            compile_s = elapsed
        if i >= warmup:
            times.append(elapsed)
    med = statistics.median(times)
    return {"variant": variant, "median_ms": 1000 * med, "episodes_per_s": batch / med,
            "min_ms": 1000 * min(times), "first_step_s": compile_s, "times_s": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    if args.child:  # one variant in this process; print its JSON
        print(json.dumps(one_variant(args.preset, args.child, args.threads, args.batch,
                                     args.steps, args.warmup)))
        return 0
    runs = []
    for r in range(args.rounds):
        for v in variants:
            cmd = [sys.executable, __file__, "--child", v, "--preset", args.preset,
                   "--threads", str(args.threads), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            res["round"] = r
            runs.append(res)
            print(f"round {r} {v:8s} {res['median_ms']:8.1f} ms/step "
                  f"{res['episodes_per_s']:7.1f} episodes/s"
                  + (f"  (first step {res['first_step_s']:.0f} s)" if v == "compile" else ""),
                  flush=True)
    summary = {}
    for v in variants:
        meds = [x["median_ms"] for x in runs if x["variant"] == v]
        summary[v] = {"median_ms": statistics.median(meds)}
    base = summary.get("eager", {}).get("median_ms")
    for v in variants:
        if base:
            summary[v]["speedup_vs_eager"] = base / summary[v]["median_ms"]
    compile_first = [x["first_step_s"] for x in runs if x["variant"] == "compile"]
    if compile_first:
        summary["compile"]["first_step_s"] = statistics.median(compile_first)
    print(json.dumps(summary, indent=1))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"phase2-{args.preset}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({"args": vars(args), "git_commit": commit, "summary": summary,
                                "runs": runs}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
