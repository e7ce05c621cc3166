"""Phase-1 steps as the `cpu` pipeline's Stage 1 runs them: N one-thread processes side by
side on the machine's cores, eager or compiled, timed together.

Each process builds `benchmarks/bench_step.py`'s Worker (the Phase1Module's training step,
backward, clipping, AdamW; the preset's curriculum of 1..8 demonstrations), runs `--warmup`
untimed steps (for `compiled`: loading or compiling the graphs, reported as `ready_s`), then
waits for a common start time and times `--steps` steps. The variants run one after the
other, so each is measured under its own N-way contention and nothing else.

    .venv/bin/python benchmarks/phase1_side_by_side.py --procs 3 --steps 120 \\
        --cache /tmp/inductor-cache

`--cache`: the inductor cache the compiled processes share (warm it first, e.g. with
bench_step.py --warm-cache DIR, to time loading rather than compiling).
Writes benchmarks/results/phase1-side-by-side-<YYYYmmdd-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def child(args) -> None:
    sys.path[:0] = [str(HERE), str(REPO)]
    import bench_step

    t0 = time.time()
    w = bench_step.Worker(str(REPO), args.variant, args.preset, "phase1", None, 1, args.seed)
    for _ in range(args.warmup):
        w.step()
    ready = time.time() - t0
    while time.time() < args.start:
        time.sleep(0.05)
    t = time.perf_counter()
    for _ in range(args.steps):
        w.step()
    wall = time.perf_counter() - t
    print(json.dumps({"ready_s": ready, "late_s": max(0.0, t0 + ready - args.start),
                      "wall_s": wall, "ms_per_step": 1000 * wall / args.steps}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--variants", default="eager,compiled")
    ap.add_argument("--cache", default=None, help="shared inductor cache directory")
    ap.add_argument("--start-after", type=float, default=None,
                    help="seconds from spawning to the common start (default: 25 eager, "
                         "150 compiled)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if args.cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.cache).resolve())
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "procs": args.procs,
           "steps": args.steps, "cpus": os.cpu_count(), "variants": {}}
    for variant in args.variants.split(","):
        after = args.start_after or (150.0 if variant == "compiled" else 25.0)
        start = time.time() + after
        cmd = [sys.executable, __file__, "--child", "--variant", variant, "--preset",
               args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--seed", str(args.seed), "--start", str(start)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
                 for _ in range(args.procs)]
        rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        ms = [r["ms_per_step"] for r in rows]
        out["variants"][variant] = {"processes": rows, "median_ms_per_step": statistics.median(ms),
                                    "steps_per_s_all": sum(1000 / m for m in ms)}
        late = max(r["late_s"] for r in rows)
        ready = ", ".join(f"{r['ready_s']:.0f}" for r in rows)
        print(f"{variant:9s} {args.procs} side by side: ms/step "
              + ", ".join(f"{m:.1f}" for m in ms) + f"; ready in {ready} s"
              + (f" (one started {late:.0f} s late: raise --start-after)" if late > 0 else ""),
              flush=True)
    sys.path.insert(0, str(HERE))
    from bench_step import save_result

    save_result(out, "phase1-side-by-side")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
