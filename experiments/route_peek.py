"""Route diagnostics of a Phase-1 run in progress (issue 21): STM recall with learned, random
and one-path routes on the validation stream, read from the run's last Lightning checkpoint.

    python experiments/route_peek.py RUN_DIR [--n 500] [--set model.route_gain=4.0 ...]
    python experiments/route_peek.py RUN_DIR --ckpt A.ckpt --ckpt B.ckpt ...

RUN_DIR is the `--out` of `pmnet train phase1 --preset cpu`; pass the same `--set`
overrides the run was started with (parsed as `pmnet train` parses them). `--ckpt` reads
the given Lightning checkpoints instead of RUN_DIR's last one (copies of last.ckpt kept
after each epoch: a run's route trajectory; `--out` writes the figures as JSON). Screens
candidates before their Phase 1 ends; the final figures come from the run's own
route_diagnostics.json (1,000 episodes).
"""

from __future__ import annotations

import argparse
import json

import torch

from pmnet import task
from pmnet.diagnose import Probe, stm_recall
from pmnet.model import PMNet
from pmnet.train import TrainConfig, parse_overrides


def peek(run_dir: str, n: int, cfg: TrainConfig, ckpt_path: str | None = None) -> dict:
    ckpt = torch.load(ckpt_path or f"{run_dir}/phase1_ckpt/last.ckpt", map_location="cpu",
                      weights_only=False)  # our own Lightning checkpoint
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.")}
    model = PMNet(cfg.model)
    model.load_state_dict(state)
    model.eval()
    stream = task.validation_stream(n)
    base = stm_recall(model, stream)
    rnd = stm_recall(model, stream, Probe(random_routes=True))
    one = stm_recall(model, stream, Probe(one_path=True))
    return {"epoch": ckpt["epoch"], "stm": base, "random_drop": base - rnd,
            "one_path_drop": base - one}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--ckpt", action="append", default=[], metavar="PATH")
    ap.add_argument("--out", help="write the figures of every checkpoint read as JSON")
    a = ap.parse_args()
    cfg = TrainConfig.from_name("cpu", **parse_overrides(a.set))
    torch.set_num_threads(1)
    found = []
    for path in a.ckpt or [None]:
        r = peek(a.run_dir, a.n, cfg, path)
        found.append(r)
        print(f"{path or a.run_dir} epoch {r['epoch']}: STM {r['stm']:.1f}, random routes "
              f"{r['random_drop']:+.1f} pp, one path {r['one_path_drop']:+.1f} pp", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
