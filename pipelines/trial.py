"""One Stage-2 trial (a `TrialId`) as a Tune function trainable, which never opens MLflow:
docs/pipeline.md, "Stages" (step 2) and "Tests" (`PMNET_TEST_FAULT_ONCE`).
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
    """What the driver hands every Stage-2 trial (`stages.trial_context`; pickled once by
    `tune.with_parameters`: the one place a trial's configuration crosses a process boundary).

    configs: {trial name: TrainConfig}, resolved once by the driver (`Space.trial_config`).
    digests: {Phase-1 seed (None: the single checkpoint): the sha256 Stage 1 recorded}.
    deadline_at (`time.time()`, `--max-wall`), stop_file (a SIGTERM to the driver writes it):
        a trial pauses at an epoch end by then (issue 61).
    """

    layout: Layout
    space: Any
    configs: dict
    digests: dict
    deadline_at: float | None = None
    stop_file: str | None = None

    def config(self, trial: TrialId):
        """The trial's TrainConfig; ValueError for a variant, Phase-1 seed or trial the
        pipeline does not have."""
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
    deterministic, so the trial ends without raising (`_refuse`) and Tune does not retry it."""


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
        """At each train-epoch end: `tune.report` the epoch's metrics, with no Tune
        checkpoint. Placed last; its state (`best`, `final`) travels in last.ckpt:
        docs/pipeline.md, "Stages", `TuneReport`'s state."""

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
    from pmnet.diagnose import diagnose_file
    from pmnet.io import atomic_write_json
    from pmnet.train import NotLearningError, PhasePaused, get_condition, use_compile_cache
    from pmnet.train.compiled_steps import release_compiled_steps

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
            best, out = tdir / "best_model.pt", tdir / st.TRIAL_DIAGNOSTICS
            if ctx.space.diagnosed(trial) and best.is_file() and not out.is_file():
                atomic_write_json(out, diagnose_file(best).to_dict())
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
    finally:  # in the trial's own thread: Tune reuses the actor, in a new thread
        release_compiled_steps()
    _end(trial, info_path, {k: (float("nan") if v is None else v) for k, v in final.items()},
         **trial_info, state="FINISHED", result=str(layout.result_path(trial)))


def _end(trial: TrialId, info_path: Path, report: dict, **state) -> None:
    """A trial's one way out without raising: trial.json updated with `state`, and its last
    Tune report (`finished` 0 unless `report` says 1)."""
    from ray import tune

    if state:
        TrialState.update(info_path, **state)
    tune.report({"finished": 0} | report | trial.to_config())


def _pause(layout, trial: TrialId, cfg, digest: str, paused, info_path: Path,
           trial_info: dict) -> None:
    """The trial stopped at an epoch end (issue 61): its last and best checkpoints go into
    the store's `progress/<trial>/` (none when it paused before epoch 1, `paused.epoch` -1);
    its last report says `PAUSED`."""
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


#: Keys of a unit's last Tune report when it ends without a result and without raising (so
#: Tune does not retry it): refused for its configuration; stopped by the watchdog (issue 62,
#: also its trial.json `state`: a resume leaves it); paused at an epoch end (issues 52, 61:
#: `PhasePaused` as JSON, its progress in the store; a trial's `state` PAUSED_STATE).
CONFIG_ERROR = "config_error"
NOT_LEARNING = "NOT LEARNING"
PAUSED = "paused"
PAUSED_STATE = "PAUSED"


def _refuse(trial: TrialId, info_path: Path, error: Exception, info: dict) -> None:
    """End a trial whose configuration cannot run, once: trial.json (state ERROR,
    `config_error`) and its last Tune report say why."""
    message = f"{type(error).__name__}: {error}"
    log.error("trial %s refused: %s", trial.name, message)
    _end(trial, info_path, {CONFIG_ERROR: message[:2000]}, **info, state="ERROR",
         error=message[:2000], config_error=True)


def discard_foreign_checkpoints(trial_dir: Path, digest: str) -> str | None:
    """Remove the trial's `ckpt/` when a checkpoint there was trained from another Phase-1
    checkpoint than `digest`, or names none (`pmnet.train.checkpoint_origin`); why, or None."""
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
    """The trial's final Tune report: from `done` (the store's result of this Phase-1
    checkpoint, reused) or from training; a `PhasePaused` when `stop` paused it."""
    from pmnet.train import checkpoint_epoch, run_phase2

    tdir = layout.trial_dir(trial)
    # one line of trials/<trial>/attempts.jsonl, every key (None too)
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
