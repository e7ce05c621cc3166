"""A phase in pieces (issue 52: Phase 1; issue 61: Phase 2 too): stop at an epoch boundary,
continue later, elsewhere.

`StopAtEpochEnd` is a Lightning callback for `run_phase1(..., stop=...)` and
`run_phase2(..., stop=...)`: at the end of a
training epoch, after that epoch's `last.ckpt` is written (it is a `Checkpoint` callback
appended after `LastCheckpoint`, and Lightning runs checkpoint callbacks last, in their
order), it stops the trainer when

- a stop was requested: `request()`, a SIGTERM while the trainer fits (with `sigterm=True`,
  see below), or the file `stop_file` exists (how a pipeline driver asks a Phase-1 task in
  another process or on another node);
- or the deadline `deadline_s` (seconds after the callback was made) would pass before the
  next epoch ends: the epoch just finished is taken as the estimate of the next one.

It never stops the last epoch or one in which early stopping has already decided (that run
is finishing, not pausing), and every sitting trains at least one epoch (the check runs at
an epoch's end), so a sequence of sittings always progresses. `run_phase1` then returns a
`Phase1Paused` instead of testing and writing `phase1.pt`: `<out>/phase1_ckpt/last.ckpt`
holds everything the next sitting continues from (weights, optimiser, schedule, the RNG,
the history, early stopping's and best.ckpt's state), and running it again on the same
directory, or on a copy of it anywhere (`LastCheckpoint` relocates best.ckpt's path),
continues there. A run stopped and continued ends with the same `phase1.pt` bytes as one
that never stopped (same CPU kind, same threads).

SIGTERM (`sigterm=True`, the main thread only): Lightning's trainer installs its own SIGTERM
handler while it fits, which ends the fit with `SIGTERMException` after the current batch
(the epoch in progress is lost). With `sigterm=True` this callback takes SIGTERM over from
train start to train end: the first one asks for a stop at the epoch end and puts Lightning's
handler back, so a second SIGTERM ends the fit after the current batch as Lightning does
(last.ckpt then holds the epoch before). The pipeline's Phase-1 tasks do not use it (Ray
owns its workers' signals); their driver writes `stop_file` instead.

Nothing here knows about stores or Ray; the store's side is `pmnet.store_progress`, the
driver's `pipelines.driver.sigterm_writes_stop_file`.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.callbacks import Checkpoint

#: why a Phase 1 paused (`Phase1Paused.reason`)
REASON_DEADLINE = "max-wall"
REASON_REQUEST = "stop requested"


@dataclass(frozen=True)
class PhasePaused:
    """What `run_phase1` (or `run_phase2`, `phase=2`) returns when it stopped at an epoch
    boundary before the end.

    `epoch`: the 0-based epoch last.ckpt holds (Lightning's, as `checkpoint_epoch` reads it);
    `epochs_done` = epoch + 1 of `max_epochs`; -1 for a pipeline trial that did not start
    (its run's deadline had passed). No test pass ran and no phase1.pt (Phase 2: no
    result.json) was written."""

    epoch: int
    max_epochs: int
    reason: str
    last_ckpt: str
    train_time_s: float  # training so far, earlier sittings included
    phase: int = 1

    @property
    def epochs_done(self) -> int:
        return self.epoch + 1

    def describe(self) -> str:
        if self.epoch < 0:  # a pipeline trial that started past its run's deadline
            return f"not started ({self.reason}): the next run trains it"
        return (f"paused after epoch {self.epochs_done} of {self.max_epochs} ({self.reason}); "
                f"its state is {self.last_ckpt}")


#: the name Phase 1's callers know (a Phase 1 in pieces came first)
Phase1Paused = PhasePaused


class StopAtEpochEnd(Checkpoint):
    """Stop training at the end of an epoch once a deadline is near or a stop is requested
    (see the module docstring). `paused_at` is the 0-based epoch it stopped after, None when
    training ran to its end; `reason` says why."""

    def __init__(self, deadline_s: float | None = None, stop_file: str | Path | None = None,
                 *, sigterm: bool = False):
        if deadline_s is not None and not deadline_s == deadline_s:  # NaN
            raise ValueError("deadline_s must be a number of seconds or None")
        self.deadline = None if deadline_s is None else time.monotonic() + float(deadline_s)
        self.stop_file = Path(stop_file) if stop_file is not None else None
        self.paused_at: int | None = None
        self.reason: str | None = None
        self._requested = False
        self._epoch_t0: float | None = None
        self.sigterm = bool(sigterm)
        self._previous = None  # the SIGTERM handler this callback replaced, while it holds it

    def request(self) -> None:
        """Ask for a stop at the next epoch end (safe from a signal handler)."""
        self._requested = True

    def requested(self) -> bool:
        return self._requested or (self.stop_file is not None and self.stop_file.exists())

    def on_train_start(self, trainer, pl_module):
        if self.sigterm and threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)  # Lightning's, during a fit

            def handler(signum, frame):
                self.request()
                self._give_back()

            signal.signal(signal.SIGTERM, handler)

    def _give_back(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_end(self, trainer, pl_module):
        self._give_back()

    def on_exception(self, trainer, pl_module, exception):
        self._give_back()

    def on_train_epoch_start(self, trainer, pl_module):
        self._epoch_t0 = time.monotonic()

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.should_stop:
            return  # early stopping has ended the run: it finishes, it does not pause
        if trainer.max_epochs is not None and trainer.max_epochs >= 0 \
                and trainer.current_epoch + 1 >= trainer.max_epochs:
            return  # the last epoch: the run finishes
        now = time.monotonic()
        if self.requested():
            reason = REASON_REQUEST
        elif self.deadline is not None and now + (now - (self._epoch_t0 or now)) > self.deadline:
            reason = REASON_DEADLINE
        else:
            return
        self.paused_at, self.reason = int(trainer.current_epoch), reason
        trainer.should_stop = True
