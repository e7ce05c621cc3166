"""Phase 0's success test while it trains (issue 61, item 3): held-out per-position copy
accuracy (`pmnet.evaluate.copy_accuracy`), never the loss alone.

The copy task's loss first falls to ln 26 = 3.258 (the payload's letter distribution, no
memory) and then sits there until routed writes and reads carry the payload; below the
plateau a loss of 2.5-2.6 was measured at 10-13% accuracy (docs/choices.md, "The Phase-0
recipe"). So `CopyProbe` reads the accuracy on COPY_HELDOUT_N examples of a seed training
never draws (`COPY_HELDOUT_SEED`; training batch i is seed `phase1_seed * 1_000_003 + i`)
every `every` steps and after the last, and keeps the curve; `run_phase1` writes it into
`phase0_metrics.json` (`phase0/copy_curve`, and the last point as `phase0/copy_acc` and
`phase0/copy_acc_by_position`, with `phase0/copy_chance`).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from pmnet import task
from pmnet.evaluate import COPY_CHANCE, COPY_HELDOUT_SEED, copy_accuracy

#: held-out copy examples per reading (chance's standard error at 1,024 x 16 positions: 0.15 pp)
COPY_HELDOUT_N = 1024
#: readings over a Phase 0 (the first after step 1, then every steps // COPY_READINGS)
COPY_READINGS = 20


class CopyProbe(Callback):
    """Held-out per-position copy accuracy every `every` optimiser steps and after the last
    (`curve`: a list of {"step", "acc", "by_position"}, accuracies as fractions)."""

    def __init__(self, copy_len: int, steps: int, every: int | None = None,
                 n: int = COPY_HELDOUT_N, seed: int = COPY_HELDOUT_SEED):
        self.steps = int(steps)
        self.every = max(1, every if every is not None else self.steps // COPY_READINGS)
        self.batch = task.make_copy_batch(n, copy_len, seed)
        self.curve: list[dict] = []

    def read(self, model, step: int) -> None:
        acc = copy_accuracy(model, self.batch).cpu()  # on the model's device
        self.curve.append({"step": int(step), "acc": float(acc.mean()),
                           "by_position": [round(float(a), 6) for a in acc]})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 1 or step % self.every == 0 or step >= self.steps:
            if not self.curve or self.curve[-1]["step"] != step:
                self.read(pl_module.model, step)

    def metrics(self) -> dict:
        """What phase0_metrics.json records of the probe (empty before any reading)."""
        if not self.curve:
            return {}
        last = self.curve[-1]
        return {"phase0/copy_acc": last["acc"], "phase0/copy_acc_by_position": last["by_position"],
                "phase0/copy_chance": COPY_CHANCE, "phase0/copy_curve": self.curve}
