"""One Stage-2 trial (a `TrialId`: condition x variant x seed) as a Tune function trainable:
it verifies the shared Phase-1 checkpoint first, trains with `pmnet.train.run_phase2`
(continuing from its `ckpt/last.ckpt`, the one checkpoint of its weights: Tune gets each
epoch's metrics and no checkpoint), reuses a result that already exists instead of training again,
and lands its unit in the run's store (`pipelines.store.land_trial`), once. It never
opens MLflow. docs/pipeline.md, "Stages" (step 2) and "Tests" (`PMNET_TEST_FAULT_ONCE`),
has the details.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.faults import epoch_pause
from pipelines.layout import Layout, trial_key
from pipelines.phase1 import Phase1Refused, check_phase1
from pipelines.records import TrialState, as_float
from pmnet.conditions import seed_problem
from pmnet.trial_id import TrialId

log = logging.getLogger("pipelines.trial")
FAULT_ENV = "PMNET_TEST_FAULT_ONCE"


@dataclass(frozen=True)
class TrialContext:
    """What the driver hands every Stage-2 trial (pickled once by `tune.with_parameters`:
    the one place a trial's configuration crosses a process boundary, as typed objects;
    `stages.trial_context` makes it).

    layout: the run's `Layout` (its root, name and store, where its units land).
    space: its grid (`tune_spaces.Space`): which trials are diagnosed, a variant's overrides.
    configs: {trial name: TrainConfig} of every trial of the grid, resolved once by the
        driver (`Space.trial_config`): a worker looks its trial's configuration up, it does
        not build it again.
    digests: {Phase-1 seed (None: the pipeline's single checkpoint): sha256} that Stage 1
        recorded; a trial of Phase-1 seed k loads `phase1-p1s<k>/phase1.pt` and refuses any
        checkpoint but the one of this hash.
    deadline_at, stop_file (issue 61: a Phase 2 in pieces): the wall-clock time (`time.time()`)
        by which a trial stops at an epoch end (`--max-wall`), and the run's stop file (a
        SIGTERM to the driver writes it); a trial stopped so pauses, its progress goes into
        the store (`PAUSED`), and the next run of the unit continues it.
    """

    layout: Layout
    space: Any
    configs: dict
    digests: dict
    deadline_at: float | None = None
    stop_file: str | None = None

    def config(self, trial: TrialId):
        """The trial's TrainConfig, resolved when the context was made (`configs`:
        `Space.trial_config`, threads = the trial's CPUs where the preset leaves them open);
        ValueError for a variant, Phase-1 seed or trial the pipeline does not have."""
        trial_phase1(self, trial)  # a Phase-1 seed the pipeline has no checkpoint of: refused
        if trial.name not in self.configs:
            self.space.variant(trial.variant)  # a variant the grid lacks: named as such
            raise ValueError(f"trial {trial.name} is not one of the trials of grid "
                             f"{self.space.name!r}")
        return self.configs[trial.name]

    def stopper(self):
        """The trial's `StopAtEpochEnd` (its deadline and the run's stop file), None when the
        run has neither."""
        if self.deadline_at is None and self.stop_file is None:
            return None
        from pmnet.train import StopAtEpochEnd

        left = None if self.deadline_at is None else self.deadline_at - time.time()
        return StopAtEpochEnd(left, self.stop_file)


class TrialConfigError(Exception):
    """A trial's configuration cannot run (its identity, variant, seed, Phase-1 checkpoint):
    deterministic, so retrying cannot help. The trial records it, reports it to Tune and ends
    without raising, so Tune does not retry it (`max_failures` is for crashes); it counts as
    errored, and a `resume` runs it again (a fresh Tune experiment, `stages.stage2`)."""


def assigned_device() -> str:
    """Where this Ray task or actor trains: "gpu" when Ray gave it a GPU (or a share of one:
    `ray.get_gpu_ids()`), else "cpu" -- never a GPU that Ray did not count for it (with 0
    GPUs Ray 2.60 no longer hides the machine's GPUs, so Lightning's "auto" would take one).
    Outside Ray (in-process tests): "cpu"."""
    try:
        import ray

        if ray.is_initialized():
            return "gpu" if ray.get_gpu_ids() else "cpu"
    except Exception:  # noqa: BLE001 - no Ray worker context: nothing was assigned
        pass
    return "cpu"


def assigned_gpu_share() -> float | None:
    """The fraction of a GPU Ray gave this trial (its memory cap), None without one (and
    outside Ray: `get_runtime_context` would start a local Ray instance there, minutes on a
    loaded box, e.g. for every in-process trial of the tests)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0)) or None
    except Exception:  # noqa: BLE001 - no Ray worker context: nothing was assigned
        return None


def release_device_memory() -> None:
    """Give back what a finished trial holds, in its own thread (Tune reuses the actor for
    the next trial, in a new thread): its compiled code, CUDA-graph trees and pools, and
    the allocator's cache (`pmnet.train.compiled_steps.release_compiled_steps`)."""
    from pmnet.train.compiled_steps import release_compiled_steps

    release_compiled_steps()


def quiet_training_logs() -> None:
    """Keep Lightning's banner lines and tips out of the trial logs."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", category=UserWarning, message=".*number of training batches")


def _scalar_metrics(metrics: dict) -> dict[str, float]:
    return {k: f for k, v in metrics.items() if (f := as_float(v)) is not None}


def _is_final(trainer) -> bool:
    """No epoch follows this one: EarlyStopping decided to stop, or max_epochs is reached."""
    return bool(trainer.should_stop) or trainer.current_epoch + 1 >= int(trainer.max_epochs or 0)


def make_report_callback(*, trial_dir: Path, trial: TrialId, select: str):
    """The Lightning callback that reports each epoch to Tune."""
    from lightning.pytorch.callbacks import Checkpoint
    from ray import tune

    class TuneReport(Checkpoint):
        """At each train-epoch end: `tune.report` the epoch's metrics, without a Tune
        checkpoint: the weights are written once, by `pmnet.train.LastCheckpoint`, to the
        trial's `ckpt/last.ckpt`, from which every attempt of the trial continues.

        Its own state (`best` so far, `final`) travels inside last.ckpt, which is dumped at
        train-epoch end before this callback's hook runs (it is a `Checkpoint` callback
        placed last, after EarlyStopping, ModelCheckpoint and LastCheckpoint). So `best` is
        updated earlier, at validation end, and `final` is read from the trainer when the
        checkpoint is dumped, after EarlyStopping decided. A resumed trial thus carries the
        state an uninterrupted one carries into the next epoch (and selects the same
        checkpoint), and one resumed from its final epoch goes straight to testing.
        """

        def __init__(self):
            self.best = float("-inf")
            self._trainer = None
            self._resume_final = False

        def setup(self, trainer, pl_module, stage):
            self._trainer = trainer
            cbs = trainer.callbacks
            if self in cbs:
                cbs.remove(self)
                cbs.append(self)

        def state_dict(self):
            final = self._trainer is not None and _is_final(self._trainer)
            return {"best": self.best, "final": final}

        def load_state_dict(self, state_dict):
            self.best = float(state_dict.get("best", self.best))
            self._resume_final = bool(state_dict.get("final", self._resume_final))

        def on_train_start(self, trainer, pl_module):
            if self._resume_final:  # the last epoch was already reported: go straight to testing
                trainer.should_stop = True

        def on_validation_end(self, trainer, pl_module):
            if trainer.sanity_checking:
                return
            sel = _scalar_metrics(trainer.callback_metrics).get(f"val/{select}")
            if sel is not None and sel > self.best:
                self.best = sel

        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.sanity_checking:
                return
            epoch = int(trainer.current_epoch)
            metrics = _scalar_metrics(trainer.callback_metrics)
            metrics = {k: v for k, v in metrics.items() if not k.startswith("test/")}
            metrics["epoch"] = epoch
            if self.best > float("-inf"):
                metrics["best/select"] = self.best
            TrialState.update(Path(trial_dir) / "trial.json",  # for `status`
                              epoch=epoch, best_select=metrics.get("best/select"))
            tune.report({**metrics, **trial.to_config()})
            marker = Path(os.environ[FAULT_ENV]) / trial.name if os.environ.get(FAULT_ENV) \
                else None
            if marker is not None and not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(f"fault injected after epoch {epoch}\n")
                raise RuntimeError(f"{FAULT_ENV}: injected fault after epoch {epoch} "
                                   f"of {trial.name}")
            epoch_pause()  # a test hook (pipelines.faults); nothing unless it is set

    return TuneReport()


def trial_phase1(ctx: TrialContext, trial: TrialId) -> tuple[Path, str]:
    """(the Phase-1 checkpoint the trial starts from, the sha256 Stage 1 recorded for it)."""
    if trial.phase1_seed not in ctx.digests:
        have = ", ".join(str(k) for k in ctx.digests if k is not None) or \
            "none: it has a single checkpoint"
        raise ValueError(f"trial {trial.name}: the pipeline has no Phase-1 checkpoint for "
                         f"phase1_seed {trial.phase1_seed} (its Phase-1 seeds: {have})")
    return (ctx.layout.phase1_dir_for(trial.phase1_seed) / "phase1.pt",
            ctx.digests[trial.phase1_seed])


def train_trial(config: dict, ctx: TrialContext) -> None:
    """The Tune trainable. `config`: `TrialId.to_config()`; `ctx`: set by the driver."""
    t_enter = time.time()
    quiet_training_logs()
    from pipelines import store as st
    from pmnet.train import NotLearningError, PhasePaused, get_condition, use_compile_cache

    use_compile_cache(ctx.layout.compile_cache)  # the graphs compiled under this root

    t_imported = time.time()

    trial = TrialId.from_config(config)
    layout = ctx.layout
    tdir = layout.trial_dir(trial)
    info_path = tdir / "trial.json"
    try:
        problem = seed_problem(trial.seed, "the trial's seed")  # the reason, named first
        if problem:
            raise ValueError(problem)
        cond = get_condition(trial.condition)
        cfg = ctx.config(trial)
    except ValueError as e:
        _refuse(trial, info_path, TrialConfigError(str(e)), trial.to_config())
        return
    # the keys a named variant adds to its result.json (the default's is exactly run_phase2's)
    record = {} if trial.is_default else {**trial.to_result(), "variant_overrides": dict(
        sorted(ctx.space.variant(trial.variant).as_dict().items()))}
    trial_info = {**trial.to_config(), **record, "trial_key": trial_key(layout.name, trial)}
    p1_ckpt, p1_sha = trial_phase1(ctx, trial)
    done = st.stored_result(layout.units, trial, p1_sha)  # reused, not trained again
    stopped = TrialState.read(info_path)
    if stopped.state == NOT_LEARNING and done is None:  # a resume leaves it
        _end(trial, info_path, {NOT_LEARNING: stopped.error or NOT_LEARNING})
        return
    try:
        digest = check_phase1(p1_ckpt, p1_sha)  # 1. the Phase-1 checkpoint, before anything
        setup = {"imports_s": t_imported - t_enter, "setup_s": time.time() - t_enter}
        TrialState.update(info_path, **trial_info, state="RUNNING")
        if ctx.deadline_at is not None and time.time() >= ctx.deadline_at \
                and done is None:  # issue 61: started after --max-wall
            _pause(layout, trial, cfg, digest, PhasePaused(
                epoch=-1, max_epochs=int(cfg.max_epochs), reason="max-wall, not started",
                last_ckpt="", train_time_s=0.0, phase=2), info_path, trial_info)
            return
        prov = None if done else st.start_unit(layout.units, trial, str(layout.run_dir),
                                               assigned_device(), cfg, digest)
        # 2. + 3. train (or reuse the store's result of this checkpoint), then land the unit
        # in the store: its diagnostics and provenance, then its result last (the commit
        # record)
        final = _train_and_record(layout, cfg, cond, trial, record, p1_ckpt, digest, done,
                                  setup, ctx.stopper())
        if isinstance(final, PhasePaused):  # issue 61: its progress into the store
            _pause(layout, trial, cfg, digest, final, info_path, trial_info)
            return
        if done is None:
            if ctx.space.diagnosed(trial) and (tdir / "best_model.pt").is_file():
                _diagnose(tdir, tdir / st.TRIAL_DIAGNOSTICS)
            what = st.land_trial(layout.units, trial, tdir, prov)
            if what != "landed":
                log.warning("trial %s: unit %s", trial.name, what)
    except (TrialConfigError, Phase1Refused) as e:  # deterministic: once, not retried
        _refuse(trial, info_path, e, trial_info)
        return
    except NotLearningError as e:  # the watchdog (issue 62): deterministic, not retried
        log.error("trial %s %s", trial.name, e)
        _end(trial, info_path, {NOT_LEARNING: str(e)[:2000]}, **trial_info,
             state=NOT_LEARNING, error=str(e)[:2000])
        return
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        TrialState.update(info_path, **trial_info, state="ERROR", error=error[:2000],
                          failures=TrialState.read(info_path).failures + 1)
        raise
    finally:
        release_device_memory()
    _end(trial, info_path, {k: (float("nan") if v is None else v) for k, v in final.items()},
         **trial_info, state="FINISHED", result=str(layout.result_path(trial)))


def _end(trial: TrialId, info_path: Path, report: dict, **state) -> None:
    """A trial's one way out without raising: its trial.json updated with `state` (when
    given) and its last Tune report, `report` with the trial's identity (`finished` 0 unless
    `report` says 1)."""
    from ray import tune

    if state:
        TrialState.update(info_path, **state)
    tune.report({"finished": 0} | report | trial.to_config())


def _pause(layout, trial: TrialId, cfg, digest: str, paused, info_path: Path,
           trial_info: dict) -> None:
    """The trial stopped at an epoch end (`--max-wall`, or a SIGTERM to the driver): its
    last and best checkpoints go into the store's `progress/<trial>/`, where the next run of
    the unit (`make resume`, or another machine's run on the store) continues it; its last
    report says `PAUSED` (the trial returns: Tune does not retry it). A trial that starts
    after the run's deadline pauses at once, before epoch 1 (`paused.epoch` -1)."""
    import dataclasses

    from pipelines import store as st
    from pmnet.store_progress import land_progress
    from pmnet.train import checkpoint_epoch

    if paused.epoch >= 0:  # (a trial that never started has nothing to keep)
        land_progress(layout.units,
                      st.trial_unit(trial, cfg, digest, layout.trial_dir(trial)),
                      paused.reason, checkpoint_epoch, paused.train_time_s, say=log.info)
    _end(trial, info_path, {PAUSED: json.dumps(dataclasses.asdict(paused))}, **trial_info,
         state=PAUSED_STATE)


def _diagnose(tdir: Path, out: Path) -> None:
    """`pmnet diagnose` of the trial's best model into the unit's diagnostics (once)."""
    if out.is_file():
        return
    from pmnet.diagnose import diagnose_file
    from pmnet.io import atomic_write_json

    atomic_write_json(out, diagnose_file(tdir / "best_model.pt").to_dict())


#: The key of a trial's last Tune report when it was refused for its configuration.
CONFIG_ERROR = "config_error"
#: A trial the watchdog stopped (issue 62): its trial.json `state` and the key of its last
#: Tune report. The trial ends without raising, so Tune does not retry it (the same run would
#: stop again); its last.ckpt stays, it has no result, and a resume leaves it as it is
#: (`train_trial` reads its trial.json; delete the trial's directory to train it again).
NOT_LEARNING = "NOT LEARNING"
#: The key of a unit's last Tune report when it stopped at an epoch end before its end (a
#: Phase-1 unit, issue 52, or a trial, issue 61): `PhasePaused` as JSON; its progress is in
#: the store. A paused trial's trial.json `state` is PAUSED_STATE.
PAUSED = "paused"
PAUSED_STATE = "PAUSED"


def _refuse(trial: TrialId, info_path: Path, error: Exception, info: dict) -> None:
    """End a trial whose configuration cannot run: trial.json says why (state ERROR,
    `config_error`), and its one Tune report carries the reason, so the trial ends once
    (Tune does not retry a trial that returns) and the driver counts it as errored (it has no
    result file)."""
    message = f"{type(error).__name__}: {error}"
    log.error("trial %s refused: %s", trial.name, message)
    _end(trial, info_path, {CONFIG_ERROR: message[:2000]}, **info, state="ERROR",
         error=message[:2000], config_error=True)


def discard_foreign_checkpoints(trial_dir: Path, digest: str) -> str | None:
    """Make the trial's `ckpt/` belong to Phase-1 checkpoint `digest`: Lightning checkpoints
    trained from another Phase-1 checkpoint (Phase 1 was retrained), or of unknown origin,
    are removed so the trial cannot resume from them. A checkpoint names its origin itself
    (`pmnet.train.checkpoint_origin`). Returns why something was removed."""
    from pmnet.train import checkpoint_origin

    ckpt_dir = Path(trial_dir) / "ckpt"
    if not ckpt_dir.is_dir() or not any(ckpt_dir.iterdir()):
        return None
    origins = {checkpoint_origin(p) for p in ckpt_dir.glob("*.ckpt")}
    if origins == {digest}:
        return None
    known = next((o for o in origins if o and o != digest), None)
    why = (f"checkpoints trained from Phase-1 {known[:12]}..." if known else
           "checkpoints of unknown Phase-1 origin") + f", not {digest[:12]}..."
    shutil.rmtree(ckpt_dir)
    log.warning("trial %s: removed %s", Path(trial_dir).name, why)
    return why


def _train_and_record(layout, cfg, cond, trial: TrialId, record: dict, p1_ckpt: Path,
                      digest, done: dict | None, setup, stop=None):
    """The trial's final Tune report: `done`, the store's result from this checkpoint, is
    reused, not retrained; else the trial trains (its unit is then landed by the caller).
    With `stop` (a `StopAtEpochEnd`) the training may pause: the report is then the
    `PhasePaused`."""
    from pmnet.train import checkpoint_epoch, run_phase2

    tdir = layout.trial_dir(trial)
    # one line of trials/<trial>/attempts.jsonl, every key (None too): where the attempt ran,
    # whether it trains or reuses, Lightning checkpoints it discarded (another Phase-1
    # origin), what it resumed from (its last.ckpt, the truth: the epoch it continues from)
    attempt = {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
               "node_id": _node_id(),
               "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "accelerator": assigned_device(), "kind": "reuse" if done else "train",
               "discarded": None if done else discard_foreign_checkpoints(tdir, digest),
               "resume_from": None, "resume_epoch": None, **setup}
    last = tdir / "ckpt" / "last.ckpt"
    resume_from = last if done is None and last.is_file() else None
    if resume_from is not None:
        attempt.update(resume_from=str(last), resume_epoch=checkpoint_epoch(last))
    tdir.mkdir(parents=True, exist_ok=True)
    with open(tdir / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(attempt, sort_keys=True) + "\n")
    result = done
    if done is None:
        cb = make_report_callback(trial_dir=tdir, trial=trial, select=cond.select)
        result = run_phase2(cfg, condition=trial.condition, seed=trial.seed,
                            phase1_ckpt=p1_ckpt, out_dir=tdir, callbacks=[cb],
                            resume_from=resume_from, progress=False, record=record,
                            accelerator=attempt["accelerator"],
                            gpu_share=assigned_gpu_share(), stop=stop)
        if not isinstance(result, dict):  # a PhasePaused (issue 61)
            return result

    test = result.get("test") or {}
    return {"test/updated_ltm": test.get("updated_ltm"),
            "best/select": (result.get("val") or {}).get(cond.select),
            "train_time_s": result.get("train_time_s"),
            "best_epoch": result.get("best_epoch"), "finished": 1}


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None
