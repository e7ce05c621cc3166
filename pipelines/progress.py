"""Stage-1 progress: the Phase-1 trial keeps it in `progress.json` and reports it to Tune at
each validation; the driver's `stages.TrialConsole` prints it (`describe`). docs/pipeline.md,
"Console output".
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
    """Write Phase-1 progress to `path` (JSON) at a bounded rate, and at each validation and
    the end pass it to `report` (`{REPORT_KEY: the record as JSON}`, with the last epoch's
    history only)."""

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
            self._write(trainer, pl_module, report=True)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer, pl_module, done=True, report=True)

    def _write(self, trainer, pl_module, done: bool = False, report: bool = False) -> None:
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
        if report and self.report is not None:  # one JSON string: Tune's "done" is not set
            self.report({REPORT_KEY: json.dumps(
                record.to_dict() | {"history": history[-1:]})})
        self._last = now


def describe(progress: Progress) -> str:
    """One console line from a progress record."""
    step, total = progress.step, progress.total_steps
    frac = f" ({100 * step / total:.0f}%)" if total else ""
    val = progress.history[-1].get("val/mean_stm") if progress.history else None
    val_s = f", val mean_stm {val:.2f}" if isinstance(val, (int, float)) else ""
    eta = progress.eta_s
    eta_s = (f", ~{eta / 60:.1f} min left at most (early stopping may end it sooner)"
             if isinstance(eta, (int, float)) else "")
    if progress.done:
        eta_s = "; training done, writing the checkpoint"
    return (f"Phase 1 epoch {epoch_shown(progress)}/{progress.max_epochs or '?'}, step "
            f"{step}/{total or '?'}{frac}{val_s}; {progress.elapsed_s / 60:.1f} min so far{eta_s}")


def epoch_shown(progress: Progress) -> int:
    """The epoch a progress line names, 1-based: the one in progress (Lightning's
    `current_epoch` + 1); once done, the epochs run (`current_epoch`). Never above
    `max_epochs`."""
    shown = progress.epoch if progress.done else progress.epoch + 1
    if progress.max_epochs:
        shown = min(shown, int(progress.max_epochs))
    return max(shown, 1)
