"""The matmul floor of a training step: what its matrix products alone take on this machine.

For each kind (as `benchmarks/bench_step.py`: `phase1`, `phase2:<condition>`), one process
runs the step as bench_step's Worker does (training_step, backward, clipping, AdamW) and
records every matrix product it dispatches (`mm`, `addmm`, `bmm`, `baddbmm`: op, shapes,
strides, dtype) over `--steps` steps. Each distinct product is then timed alone, on inputs
of the same shapes and strides, at the same thread count, in the recorded dtype or
`--time-dtype` (bf16: the floor of the same step under bf16 autocast, whose products are
bf16), as the median of `--reps` calls after warm-up (caches warm: the best case for the
library). The floor of a step is the sum
over its products of count x that time, divided by the number of steps: no implementation
of the same maths on this machine, eager or compiled, takes less, unless it computes fewer
or cheaper products (another precision, another algorithm). The step's own median time
over the same steps is printed beside it.

    .venv/bin/python benchmarks/matmul_floor.py --preset cpu --threads 1 \\
        --kinds phase1,phase2:consolidator_only --steps 16

Writes benchmarks/results/matmul-floor-<preset>-<YYYYmmdd-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")


def flops(op: str, shapes: tuple) -> int:
    """2 m k n (times the batch) of a product's output from its operands' shapes."""
    if op in ("mm", "addmm"):
        (m, k), (_, n) = shapes[-2:]
        return 2 * m * k * n
    (b, m, k), (_, _, n) = shapes[-2:]
    return 2 * b * m * k * n


def record_products(worker, steps: int) -> tuple[Counter, list[float]]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in PRODUCTS:
                ts = [a for a in args if isinstance(a, torch.Tensor)]
                seen[(name, tuple(tuple(t.shape) for t in ts),
                      tuple(tuple(t.stride()) for t in ts), str(ts[-1].dtype))] += 1
            return func(*args, **(kwargs or {}))

    times = []
    for _ in range(steps):
        t = time.perf_counter()
        worker.step()  # the step's own time, without the recorder
        times.append(time.perf_counter() - t)
    start = worker._step
    worker._step -= steps  # record the same steps (same numbers of demonstrations)
    with Recorder():
        for _ in range(steps):
            worker.step()
    assert worker._step == start
    return seen, times


def time_product(op: str, shapes: tuple, strides: tuple, dtype: str, reps: int) -> float:
    import torch

    dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype.split(".")[-1]))
    ts = [torch.empty_strided(s, st, dtype=dt).normal_() for s, st in zip(shapes, strides)]
    fn = getattr(torch, op)
    for _ in range(3):
        fn(*ts)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*ts)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--kinds", default="phase1,phase2:consolidator_only")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--time-dtype", choices=("fp32", "bf16"), default=None,
                    help="time the products in this dtype (default: as recorded)")
    args = ap.parse_args()
    import bench_step
    import torch

    torch.set_num_threads(args.threads)
    out = {"command": " ".join(["python", *sys.argv]), "preset": args.preset,
           "threads": args.threads, "time_dtype": args.time_dtype, "torch": torch.__version__,
           "kinds": {}}
    for kind in args.kinds.split(","):
        w = bench_step.Worker(str(REPO), "eager", args.preset, kind, args.batch,
                              args.threads, args.seed)
        for _ in range(3):
            w.step()
        seen, times = record_products(w, args.steps)
        rows, floor_s, total_flops = [], 0.0, 0
        for (op, shapes, strides, dtype), n in seen.items():
            t = time_product(op, shapes, strides, args.time_dtype or dtype, args.reps)
            f = flops(op, shapes)
            floor_s += n * t
            total_flops += n * f
            rows.append({"op": op, "shapes": shapes, "dtype": dtype, "count": n,
                         "ms": 1000 * t, "gflop_per_s": f / t / 1e9})
        rows.sort(key=lambda r: -r["count"] * r["ms"])
        step_ms = 1000 * statistics.median(times)
        floor_ms = 1000 * floor_s / args.steps
        out["kinds"][kind] = {
            "gflop_per_step": total_flops / args.steps / 1e9, "floor_ms_per_step": floor_ms,
            "step_ms_median": step_ms, "products_per_step": sum(seen.values()) / args.steps,
            "gflop_per_s_at_floor": total_flops / floor_s / 1e9, "products": rows}
        print(f"{kind:32s} {total_flops / args.steps / 1e9:7.2f} GFLOP/step  matmul floor "
              f"{floor_ms:8.1f} ms/step ({total_flops / floor_s / 1e9:5.1f} GFLOP/s)  "
              f"eager step {step_ms:8.1f} ms (median of {args.steps})", flush=True)
    tag = f"{args.preset}-{args.time_dtype}" if args.time_dtype else args.preset
    bench_step.save_result(out, f"matmul-floor-{tag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
