"""What MKL's strict reproducible mode costs a training step (`pmnet/__init__.py` sets
`MKL_CBWR=AUTO,STRICT` unless the environment sets it).

Two workers of `bench_step.py` (this checkout's eager step of one kind and preset, one
thread), the same in everything but `MKL_CBWR`: `AUTO` (MKL's default: a long reduction is
split among threads) and `AUTO,STRICT` (the same bits on any number of threads). They time
`--iters` steps each in turn for `--rounds` rounds, so a slow spell of the machine hits both
alike: the figure is the ratio of their medians, taken within one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mkl_strict.py --preset cpu --kind phase1

Writes benchmarks/results/mkl-strict-<preset>-<kind>-<YYYYmmdd-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import code_version, machine  # noqa: E402
from bench_step import REPO, Proc, save_result  # noqa: E402

MODES = ("AUTO", "AUTO,STRICT")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--kind", default="phase1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    procs, ready = {}, {}
    for mode in MODES:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore",
                   MKL_CBWR=mode)
        cmd = [sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--worker",
               "--tree", str(REPO), "--variant", "eager", "--preset", args.preset,
               "--kind", args.kind, "--threads", str(args.threads), "--seed", "42",
               "--warmup", str(args.warmup)]
        procs[mode] = Proc(mode, cmd, env)
        ready[mode] = procs[mode].recv()
    times = {m: [] for m in MODES}
    loads = []
    for rnd in range(args.rounds):
        for m in MODES:
            procs[m].send({"cmd": "time", "n": args.iters})
            times[m] += procs[m].recv()["times"]
        loads.append(os.getloadavg()[0])
        print(f"round {rnd}: " + "  ".join(
            f"{m} {1000 * statistics.median(times[m]):.1f} ms" for m in MODES)
            + f"  (load {loads[-1]:.2f})", flush=True)
    for p in procs.values():
        p.close()
    med = {m: statistics.median(times[m]) for m in MODES}
    ratio = med["AUTO,STRICT"] / med["AUTO"]
    print(f"{args.preset} {args.kind}, {args.threads} thread(s): AUTO {1000 * med['AUTO']:.1f} ms, "
          f"AUTO,STRICT {1000 * med['AUTO,STRICT']:.1f} ms: strict / default = {ratio:.3f}")
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "args": vars(args),
           "code": code_version(), "machine": machine("cpu"), "load_1m_per_round": loads,
           "median_ms": {m: 1000 * v for m, v in med.items()}, "strict_over_default": ratio,
           "times_s": times}
    if not args.no_save:
        save_result(out, f"mkl-strict-{args.preset}-{args.kind.replace(':', '-')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
