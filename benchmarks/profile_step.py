"""Where a training step's time goes: torch.profiler over a few steps of one kind.

The step is `benchmarks/bench_step.py`'s Worker (training_step, backward, clipping,
AdamW), eager or compiled; `--warmup` steps first (a compiled step compiles or loads its
graphs there). Prints the ops by self CPU time (a compiled step shows its graphs'
generated code as `CompiledFxGraph` rows and its library calls, matmuls and SDPA, as
aten rows) and writes them, per step, to benchmarks/results/profile-<kind>-<time>.json.

    .venv/bin/python benchmarks/profile_step.py --preset cpu \\
        --kind phase2:consolidator_only --variant compiled --cache /tmp/inductor-cache
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--kind", default="phase2:consolidator_only")
    ap.add_argument("--variant", choices=("eager", "compiled"), default="compiled")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cache", default=None, help="inductor cache directory")
    args = ap.parse_args()
    if args.cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.cache).resolve())
    sys.path[:0] = [str(HERE), str(REPO)]
    import bench_step
    from torch.profiler import ProfilerActivity, profile

    w = bench_step.Worker(str(REPO), args.variant, args.preset, args.kind, args.batch,
                          args.threads, 42)
    for _ in range(args.warmup):
        w.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        w.step()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            w.step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    total = sum(e.self_cpu_time_total for e in rows) / 1000 / args.steps
    print(f"{args.kind} {args.variant}: {1000 * statistics.median(times):.1f} ms per step "
          f"unprofiled (median of {args.steps}), {total:.1f} ms of self CPU time per "
          "profiled step")
    out = {"command": " ".join(["python", *sys.argv]), "kind": args.kind,
           "variant": args.variant, "threads": args.threads,
           "step_ms_median": 1000 * statistics.median(times), "self_ms_per_step": total,
           "ops": [{"name": e.key, "calls_per_step": e.count / args.steps,
                    "self_ms_per_step": e.self_cpu_time_total / 1000 / args.steps}
                   for e in rows[:100]]}
    bench_step.save_result(out, f"profile-{args.kind.replace(':', '-')}-{args.variant}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
