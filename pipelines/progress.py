"""Stage-1 progress: the Phase-1 trial reports it to Tune, and keeps it in `progress.json`.

Phase 1 runs as a Tune trial whose output stays in Ray's logs, and it takes 16 minutes on the
`cpu` preset and hours at paper scale. `Phase1Progress` (a Lightning callback added to the
Phase-1 trainer by the trial, `pipelines.stages.train_phase1_unit`) records, at most every
`every_s` seconds plus at every validation, the step, the epoch, the elapsed time, an
estimate of the time left and the per-epoch validation history: atomically into
`progress.json` beside the training (for a person, or a test, on the node), and through
`report` (Tune's `tune.report`) to the driver, whose `stages.TrialConsole` prints one line
per unit at a steady rate (`describe`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from pipelines.faults import epoch_pause
from pipelines.records import Progress, as_float

PROGRESS_FILE = "progress.json"
REPORT_KEY = "phase1_progress"  # the result key `report` gets the record under


class Phase1Progress(Callback):
    """Write Phase-1 progress to `path` (JSON) at a bounded rate, and pass it to `report`
    (`{REPORT_KEY: the record as JSON}`, with the last epoch's history only)."""

    def __init__(self, path: str | Path, every_s: float = 10.0, report=None):
        self.path, self.every_s, self.report = Path(path), float(every_s), report
        self._t0 = time.time()
        self._last = 0.0
        self._start_step = 0

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.time()
        self._start_step = int(trainer.global_step)  # a resumed run: rate of this attempt
        self._write(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            epoch_pause()  # a test hook (pipelines.faults); nothing unless it is set

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if time.time() - self._last >= self.every_s:
            self._write(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._write(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer, pl_module, done=True)

    def _write(self, trainer, pl_module, done: bool = False) -> None:
        now = time.time()
        step = int(trainer.global_step)
        total = trainer.estimated_stepping_batches
        total = int(total) if isinstance(total, (int, float)) and math.isfinite(total) else None
        elapsed = now - self._t0
        done_here = step - self._start_step
        eta = (elapsed / done_here * (total - step)) if total and done_here > 0 else None
        history = [{k: f if f is not None and math.isfinite(f) else None
                    for k, v in row.items() for f in (as_float(v),)}
                   for row in getattr(pl_module, "history", [])]
        record = Progress(step=step, total_steps=total, epoch=int(trainer.current_epoch),
                          max_epochs=trainer.max_epochs, elapsed_s=elapsed, eta_s=eta,
                          done=done, time=now, history=history)
        record.write(self.path)
        if self.report is not None:  # one JSON string: no clash with Tune's keys ("done")
            self.report({REPORT_KEY: json.dumps(
                record.to_dict() | {"history": history[-1:]})})
        self._last = now


def describe(progress: Progress | None, waited_s: float, label: str = "") -> str:
    """One console line from a progress record (or the time waited when there is none);
    `label` names the checkpoint when Stage 1 trains several (e.g. `phase1-p1s1`)."""
    tag = f" {label}:" if label else ""
    if progress is None:
        return (f"[stage 1/3]{tag} running for {waited_s / 60:.1f} min (Phase 0 / set-up; no "
                "Phase-1 step yet)")
    step, total = progress.step, progress.total_steps
    frac = f" ({100 * step / total:.0f}%)" if total else ""
    val = progress.history[-1].get("val/mean_stm") if progress.history else None
    val_s = f", val mean_stm {val:.2f}" if isinstance(val, (int, float)) else ""
    eta = progress.eta_s
    eta_s = (f", ~{eta / 60:.1f} min left at most (early stopping may end it sooner)"
             if isinstance(eta, (int, float)) else "")
    if progress.done:
        eta_s = "; training done, writing the checkpoint"
    return (f"[stage 1/3]{tag} Phase 1 epoch {epoch_shown(progress)}/"
            f"{progress.max_epochs or '?'}, step {step}/{total or '?'}{frac}{val_s}; "
            f"{waited_s / 60:.1f} min so far{eta_s}")


def epoch_shown(progress: Progress) -> int:
    """The epoch a progress line names, 1-based: the one in progress while Phase 1 trains
    (Lightning's `current_epoch` + 1); once it is done, the epochs it ran (Lightning counts
    the last epoch as completed, so `current_epoch` is then their number: the last line
    said "epoch 41/40"). Never above `max_epochs`."""
    shown = progress.epoch if progress.done else progress.epoch + 1
    if progress.max_epochs:
        shown = min(shown, int(progress.max_epochs))
    return max(shown, 1)
