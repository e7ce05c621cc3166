"""The measurement behind `pmnet.gpu.footprint.ACTIVATION_FACTOR`: for one Phase-2 training
step on CPU, the peak of live tensor memory (torch.profiler's memory timeline: every
allocation and free during forward and backward) against the bytes the memory model counts as
saved for backward.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_peak_cpu.py --preset paper --batch 8 \\
        --conditions learned_full,learned_full_dual,memory_consolidator,consolidator_only

Prints one line per condition: saved (memory model), the CPU peak of live tensors during the
step (parameters excluded: they existed before), and their ratio. The ratio includes every
transient of the step (activation gradients in flight, temporaries) and the gradients of the
trainable parameters as they are created; the caching allocator's own overhead on a GPU is not
in it (docs/choices.md, "Memory model").
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

from pmnet import task
from pmnet.conditions import get_condition
from pmnet.config import ModelConfig
from pmnet.gpu import footprint as mm


def peak_live(model, cond, spec, batch_size: int, precision: str) -> int:
    batch = task.train_episodes(0, 0, batch_size, segments=spec.segments)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        with mm.precision_context(precision):
            loss = mm.phase2_step(model, batch, cond, spec)
        loss.backward()
        del loss
    cur = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", default="bf16-mixed", choices=mm.PRECISIONS)
    ap.add_argument("--conditions", default="learned_full,consolidator_only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig.from_name(args.preset)
    rows = []
    for name in args.conditions.split(","):
        cond = get_condition(name)
        model = mm.build_model(cfg, cond)
        saved = mm.measure_step(model, cond, mm.StepSpec(), args.batch, args.precision)
        t0 = time.time()
        peak = peak_live(model, cond, mm.StepSpec(), args.batch, args.precision)
        rows.append({"condition": name, "batch": args.batch, "precision": args.precision,
                     "saved_bytes": saved, "cpu_peak_live_bytes": peak,
                     "ratio": peak / saved, "seconds": time.time() - t0})
        r = rows[-1]
        print(f"{name:<30} saved {saved / 2**20:9.1f} MiB  CPU peak live {peak / 2**20:9.1f} MiB"
              f"  ratio {r['ratio']:.3f}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
