"""The watchdog (issue 62): a training that is not learning stops, with its own error.

`NotLearning` is a Lightning callback every phase's trainer carries (`phases._trainer`,
`TrainConfig.watchdog`; `--set watchdog=false` leaves it out). It reads the phase's training
loss in windows of `WINDOW_STEPS` steps; once `TrainConfig.watchdog_share` of the phase's
planned steps is spent, a window whose mean loss is not below the phase's line minus
`TrainConfig.watchdog_margin` ends the run with `NotLearningError` (raised from the step that
closes the window: the last finished epoch's `last.ckpt` stays, no `phase1.pt` or
`result.json` is written). Every window from that point on is checked, so a run that learned
and then diverged (a loss of nan, or one back at its line) stops too.

The lines, one per phase (why each: docs/choices.md, "The watchdog"):

- Phase 0 (copy): ln 26, the loss per payload letter of a model that knows the payload is
  lowercase letters and nothing of the payload itself (the loss is taken over the whole byte
  vocabulary, so an untrained model sits above it, near ln 256).
- Phase 1: chance over the answers, step by step: ln 10 for the held-out query plus, with
  the auxiliary loss (`phase1_aux_demo_loss` w) and k > 1 demonstrations in the step, w ln 10
  for the demonstrations' answers (`chance_loss`; the window's line is the mean of its
  steps'). Over the whole vocabulary again, so an untrained model sits above it.
- Phase 2: the trial's own start, the mean loss of its first window, not chance: the
  presets' Phase 2 starts from a random Consolidator (`consolidator_init_std`), whose LTM
  puts the first epoch's loss above ln 10 in 254 of the 271 stored trials (median 1.59
  nats above); a trial that learns falls from there, in half of them without going below
  ln 10 in its run.
  Only a sitting that trained the first window knows the start: a Phase 2 resumed from a
  checkpoint is judged by nothing but a loss that is not finite. The no-memory floor
  (`FLOOR_CONSOLIDATIONS`) is not judged: nothing crosses its boundaries, so it sits at
  chance by construction, and it is the floor the other arms are compared with.

The loss is summed on the device and read back once per window (no host sync in a step);
nothing is checked before the window that ends at the share point, and a phase whose share
point comes before its first full window (Phase 2: its second) is not judged (the `debug`
preset's budgets). A window only partly trained in this sitting (a resumed run) is skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from pmnet import task

#: the steps a window averages (one read back from the device per window)
WINDOW_STEPS = 50
LN10 = math.log(10)
#: Phase 0 is judged no earlier than this step (or its last, if it is shorter): the copy
#: task's loss sits on its ln-26 plateau until routed memory starts to carry the payload,
#: which took 200-420 steps at the shapes measured on a CPU (`cpu`, 4-byte payloads: about
#: step 220; docs/choices.md, "The watchdog"), so 15% of a short Phase 0 (120 of 800 steps)
#: would stop a run that learns
PHASE0_MIN_STEPS = 500
#: Phase 0's line: a payload letter is one of 26 (`task.PAYLOAD_TOKENS`)
LN26 = math.log(len(task.PAYLOAD_TOKENS))
#: `pmnet train`'s exit code for a run the watchdog stopped (`pmnet.cli`)
NOT_LEARNING_EXIT = 5
PHASE_NUMBER = {"phase0": 0, "phase1": 1, "phase2": 2}
#: Phase-2 consolidations at chance by construction, which the watchdog leaves alone: the
#: no-memory floor (`baseline_no_memory`: KV, STM and LTM cleared at every boundary). Its
#: loss stays within 0.03 nats of its start (measured: +0.013 over ln 10 in steps 1-50,
#: -0.015 in steps 101-150 of a `cpu` trial), so the Phase-2 rule would stop it.
FLOOR_CONSOLIDATIONS = ("no_memory",)


class NotLearningError(RuntimeError):
    """A phase stopped by its watchdog: its training loss stayed at its line. Attributes:
    `phase` (0, 1, 2), `step` (the steps done), `planned` (the phase's planned steps),
    `window` ((first, last) step of the window), `mean` (its mean loss), `line` (chance, or
    Phase 2's start), `threshold` (line - margin), `line_kind` (what the line is), `last_ckpt`
    (the state kept, or None). Picklable (a Ray task raises it to its driver)."""

    def __init__(self, message: str, **info):
        super().__init__(message)
        self.phase = info.get("phase")
        self.step = info.get("step")
        self.planned = info.get("planned")
        self.window = info.get("window")
        self.mean = info.get("mean")
        self.line = info.get("line")
        self.threshold = info.get("threshold")
        self.line_kind = info.get("line_kind")
        self.last_ckpt = info.get("last_ckpt")


def not_learning(error: BaseException) -> NotLearningError | None:
    """The NotLearningError behind `error` (itself, or the cause a Ray task error carries);
    None when it is another error."""
    for e in (error, getattr(error, "cause", None), error.__cause__):
        if isinstance(e, NotLearningError):
            return e
    return None


def chance_loss(module) -> float:
    """The chance level of the current training step's loss (`module`: a phase's
    LightningModule, `module.phase`): the loss of a model that knows which tokens the answers
    are drawn from and nothing else, per the terms of that phase's objective. Phase 2's
    watchdog does not use it as its line (see the module docstring); it is defined there
    too, for the message."""
    phase = module.phase
    if phase == "phase0":  # Phase0Module.copy_loss: mean CE over the payload letters
        return LN26
    cfg = module.cfg
    if phase == "phase1":  # Phase1Module.stm_loss: query CE + w x demonstrations' answers CE
        aux = cfg.phase1_aux_demo_loss if module._demos > 1 else 0.0
        return LN10 * (1.0 + aux)
    if phase == "phase2":  # runner.phase2_losses: Eq. 10 (+ initial_ltm_loss, + dual STM)
        dual = getattr(module, "condition", None) is not None \
            and module.condition.objective == "dual"
        return LN10 * (1.0 + cfg.initial_ltm_loss + (1.0 if dual else 0.0))
    raise ValueError(f"no chance level for phase {phase!r}")


def check_point(planned: int, share: float, phase: str, window: int = WINDOW_STEPS) -> int | None:
    """The step at which a phase of `planned` steps is first judged: the share point
    ceil(share x planned), for Phase 0 no earlier than PHASE0_MIN_STEPS (or its last step);
    None when the phase is not judged (the share point comes before its first full window,
    Phase 2 before its second: its first is its line)."""
    point = math.ceil(share * planned - 1e-9)
    if phase == "phase0":
        point = min(max(point, PHASE0_MIN_STEPS), planned)
    needed = 2 * window if phase == "phase2" else window
    if planned <= 0 or point < needed or point > planned:
        return None
    return point


class NotLearning(Callback):
    """The watchdog of one phase's trainer (module docstring). `share` and `margin`:
    TrainConfig.watchdog_share and watchdog_margin; `ckpt_dir`: where the phase keeps its
    last.ckpt (named in the message; None: Phase 0, which keeps none)."""

    def __init__(self, share: float, margin: float, *, ckpt_dir: Path | None = None,
                 window: int = WINDOW_STEPS):
        self.share, self.margin, self.window = float(share), float(margin), int(window)
        self.ckpt_dir = None if ckpt_dir is None else Path(ckpt_dir)
        self._reset_sitting(0, None)

    def _reset_sitting(self, first_step: int, point: int | None) -> None:
        self.first_step, self.point, self.planned = first_step, point, 0
        self._sum: torch.Tensor | None = None  # the window's loss, summed on the device
        self._n = 0
        self._line_sum = 0.0  # Phases 0 and 1: the window's chance levels, summed on the host
        self._start: float | None = None  # Phase 2: the mean loss of its first window

    def on_train_start(self, trainer, pl_module):
        planned = trainer.estimated_stepping_batches
        planned = int(planned) if math.isfinite(planned) else 0
        point = check_point(planned, self.share, pl_module.phase, self.window)
        condition = getattr(pl_module, "condition", None)
        if condition is not None and condition.consolidation in FLOOR_CONSOLIDATIONS:
            point = None  # the floor arm: at chance by construction
        self._reset_sitting(int(trainer.global_step), point)
        self.planned = planned

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.point is None or outputs is None:  # None: a step its module skipped
            return
        n = int(trainer.global_step)  # steps done, this one included
        phase2 = pl_module.phase == "phase2"
        if phase2 and self.first_step == 0 and n <= self.window:
            self._add(outputs, 0.0)  # the start window: Phase 2's line
            if n == self.window:
                self._start = float(self._sum) / self._n
                self._sum, self._n = None, 0
            return
        if n <= self.point - self.window:
            return  # before the first judged window: nothing is read or summed
        self._add(outputs, 0.0 if phase2 else chance_loss(pl_module))
        if (n - self.point) % self.window:
            return
        whole = self._n == self.window  # a window partly before this sitting is skipped
        total, count, line_sum = self._sum, self._n, self._line_sum
        self._sum, self._n, self._line_sum = None, 0, 0.0
        if not whole:
            return
        mean = float(total) / count  # the one read back of the window
        if phase2:
            line, kind = self._start, "its own start"
            if line is None:  # a resumed Phase 2: only a loss that is not finite stops it
                if math.isfinite(mean):
                    return
                line, kind = float("nan"), "a finite loss"
        else:
            line, kind = line_sum / count, "chance"
        if mean < line - self.margin:  # learning (a nan mean or line fails this test)
            return
        raise self._error(pl_module, n, mean, line, kind)

    def _add(self, outputs, line: float) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = loss.detach().double()  # a copy: a CUDA graph's output is overwritten later
        self._sum = loss if self._sum is None else self._sum + loss
        self._n += 1
        self._line_sum += line

    def _error(self, pl_module, n: int, mean: float, line: float, kind: str
               ) -> NotLearningError:
        phase = PHASE_NUMBER.get(pl_module.phase, pl_module.phase)
        last = self.ckpt_dir / "last.ckpt" if self.ckpt_dir is not None else None
        threshold = line - self.margin
        what = {"phase0": "ln 26 per payload letter",
                "phase1": "ln 10 per answer"
                          + (f", the demonstrations' answers weighted {w:g}" if (
                              w := pl_module.cfg.phase1_aux_demo_loss) else ""),
                "phase2": "the mean loss of its first "
                          f"{self.window} steps"}.get(pl_module.phase, kind)
        if kind == "a finite loss":
            why = "not finite"
        else:
            why = (f"not below {threshold:.4f} ({kind} {line:.4f}: {what}; minus the margin "
                   f"{self.margin:g})")
        kept = (f"its last finished epoch is kept in {last}" if last is not None
                and last.is_file() else "no epoch finished, so no checkpoint is kept")
        message = (f"not learning: Phase {phase} stopped at step {n} of {self.planned}: its "
                   f"training loss averaged {mean:.4f} over steps {n - self.window + 1}-{n}, "
                   f"{why}, with {self.share:.0%} of its steps spent; {kept}. "
                   "`--set watchdog=false` turns the watchdog off")
        return NotLearningError(message, phase=phase, step=n, planned=self.planned,
                                window=(n - self.window + 1, n), mean=mean, line=line,
                                threshold=threshold, line_kind=kind,
                                last_ckpt=str(last) if last is not None and last.is_file()
                                else None)
