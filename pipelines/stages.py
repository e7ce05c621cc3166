"""The pipeline's three stages, each one function the driver calls in order.

Stage 1  a `ray.tune.Tuner` over the Phase-1 units the store lacks; each trial
         (`train_phase1_unit`) runs `pmnet.train.run_phase1` in its training directory and
         lands its unit in the store; a unit the store holds is skipped (idempotent).
Stage 2  a new `ray.tune.Tuner` over the grid; each trial is `pipelines.trial.train_trial`
         with `tune.with_resources`; no Tune state is restored: a trial reuses its result in
         the store, or continues from its own last.ckpt.
Stage 3  `pmnet.report.main_report(<run>)`; a failure there is logged, results are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import stat
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import tune

from pipelines.addresses import EMBEDDED
from pipelines.console import say
from pipelines.faults import kill_point
from pipelines.layout import PipelineError, read_json, write_json
from pipelines.phase1 import (
    Phase1Slot,
    check_phase1,
    existing_phase1,
    install_phase1,
    phase1_config_hash,
)
from pipelines.plan import Plan, grid_record
from pipelines.provenance import git_commit, package_versions
from pipelines.records import (
    PipelineRecord,
    Progress,
    Stage1Record,
    Started,
    Timing,
    TimingRecord,
    TrialState,
    canon,
)
from pipelines.tracking import MirrorLanded, Runs, log_claims, mirror
from pipelines.trial import NOT_LEARNING, PAUSED
from pmnet.trial_id import TrialId


def write_meta(plan: Plan, **changes) -> PipelineRecord:
    """pipeline.json with `changes`; the first write also records what the pipeline is (and
    its config.json)."""
    lay = plan.layout
    meta = PipelineRecord.read(lay.pipeline_json)
    if meta.name is None:
        meta = PipelineRecord(
            name=plan.name, preset=plan.cfg.preset, preset_reason=plan.preset_reason,
            grid=grid_record(plan.space), n_trials=plan.space.n_trials,
            space=plan.space.to_dict(), overrides=canon(plan.overrides), root=str(lay.root),
            run_dir=str(lay.run_dir), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            tracking=plan.tracking_uri or EMBEDDED, **git_commit(),
            versions=package_versions())
        write_json(lay.config_json, canon(plan.cfg.to_dict()))
    meta = dataclasses.replace(meta, **changes)
    meta.write(lay.pipeline_json)
    return meta

# -- Stage 1 ---------------------------------------------------------------------------------


STARTED_FILE = "started.json"  # written by a Phase-1 trial as it starts: where it trains
STAGE1_DIRNAME = "stage1"  # the run's Stage-1 Tune experiment (`<run>/stage1/`)
LANDED = "phase1_sha256"  # ... its unit landed in the store, with this sha256


def stage1_start_timeout_s() -> float:
    """How long the driver waits for the first Phase-1 trial to start before it says why and
    stops (PMNET_STAGE1_START_TIMEOUT_S; default 600 s: worker start, runtime environment
    and imports take seconds to a few minutes on a cluster)."""
    try:
        return max(1.0, float(os.environ.get("PMNET_STAGE1_START_TIMEOUT_S", 600)))
    except ValueError:
        return 600.0


def progress_every_s() -> float:
    """Seconds between the driver's Stage-1 progress lines (PMNET_PROGRESS_EVERY_S)."""
    try:
        return max(0.5, float(os.environ.get("PMNET_PROGRESS_EVERY_S", 60)))
    except ValueError:
        return 60.0


def train_phase1_unit(config: dict, *, slots: dict, threads: int, compile_cache: str,
                      deadline_s: float | None = None, stop_file: str | None = None) -> None:
    """Stage 1's Tune trainable: trains the Phase-1 unit `config["unit"]` (a label of
    `slots`) in its training directory and lands it in the store (`store.land_phase1`), as
    a Phase-2 trial lands its own unit. It reports progress to Tune at a bounded rate and at
    every validation (`progress.Phase1Progress`), and ends with one last result: the
    landed sha256 (`LANDED`), a pause at an epoch end (`PAUSED`, issue 52: `deadline_s`,
    `stop_file`), or the watchdog's stop (`trial.NOT_LEARNING`, issue 62: not raised, so Tune
    does not retry it). Another exception is Tune's to retry (`FailureConfig`): the retry
    continues from the last epoch checkpoint in the training directory."""
    import ray

    from pipelines.progress import PROGRESS_FILE, Phase1Progress
    from pipelines.provenance import device_kind
    from pipelines.store import land_phase1
    from pipelines.trial import NOT_LEARNING, assigned_device, quiet_training_logs

    slot = slots[config["unit"]]
    slot.work.mkdir(parents=True, exist_ok=True)
    Started(time=time.time(), host=socket.gethostname(), pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id()).write(slot.work / STARTED_FILE)
    quiet_training_logs()
    from pmnet.train import NotLearningError, StopAtEpochEnd, run_phase1, use_compile_cache

    use_compile_cache(compile_cache)
    cfg = slot.cfg if slot.cfg.threads else dataclasses.replace(slot.cfg,
                                                                 threads=max(1, threads))
    stop = None
    if deadline_s is not None or stop_file is not None:  # issue 52: a Phase 1 in pieces
        stop = StopAtEpochEnd(deadline_s, stop_file)
    t0 = time.time()
    device = assigned_device()
    try:
        res = run_phase1(cfg, slot.work, progress=False, accelerator=device, stop=stop,
                         callbacks=[Phase1Progress(slot.work / PROGRESS_FILE,
                                                   report=tune.report)])
    except NotLearningError as e:
        tune.report({NOT_LEARNING: str(e)[:2000]})
        return
    if not isinstance(res, dict):  # a pmnet.train.Phase1Paused
        tune.report({PAUSED: json.dumps(dataclasses.asdict(res))})
        return
    digest = land_phase1(slot, Stage1Record(
        config_hash=phase1_config_hash(slot.cfg), sha256=res["sha256"],
        checkpoint=str(slot.ckpt), phase1_seed=slot.cfg.phase1_seed,
        train_time_s=res.get("train_time_s"), wall_s=time.time() - t0,
        metrics=canon(res.get("metrics", {})),
        routes=canon(res["routes"]) if res.get("routes") else None),
        device_kind(device), res.get("threads"))
    tune.report({LANDED: digest, "train_time_s": float(res.get("train_time_s") or 0.0),
                 "test/mean_stm": res.get("metrics", {}).get("mean_stm", float("nan"))})


class Stage1Console(tune.Callback, tune.Stopper):
    """The driver's view of Stage 1's trials: a progress line per running unit at a steady
    rate (`progress_every_s`, from the progress Tune reports), a line when a unit lands,
    pauses, stops, fails or starts again (Tune retried it after its worker or node was
    lost), and the start bound: as a Tune `Stopper` it ends the experiment when no trial
    has started within `bound` seconds (`timed_out`; the driver then says why)."""

    def __init__(self, slots: dict, bound: float, tag: bool):
        self.slots, self.bound, self.tag = slots, bound, tag
        self.t0 = time.time()
        self.last_line = 0.0
        self.started = self.timed_out = False
        self.progress: dict[str, Progress] = {}
        self.since: dict[str, float] = {}

    def _label(self, trial) -> str:
        return str((trial.config or {}).get("unit"))

    def _say(self, trial, text: str) -> None:
        say(f"[stage 1/3]{' ' + self._label(trial) + ':' if self.tag else ''} {text}")

    # Stopper
    def __call__(self, trial_id, result) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.timed_out

    # Callback
    def on_step_begin(self, iteration, trials, **info):
        from pipelines.progress import describe

        now = time.time()
        if not self.started and now - self.t0 >= self.bound:
            self.timed_out = True
        if now - self.last_line < progress_every_s() or now - self.t0 < progress_every_s():
            return
        self.last_line = now
        for trial in trials:
            if trial.status == "RUNNING":
                label = self._label(trial)
                say(describe(self.progress.get(label), now - self.since.get(label, now),
                             label=label if self.tag else ""))

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started = True
        self.since.setdefault(self._label(trial), time.time())
        kill_point("stage1-submitted")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from pipelines.progress import REPORT_KEY

        if result.get(REPORT_KEY):
            self.progress[self._label(trial)] = Progress.from_dict(json.loads(result[REPORT_KEY]))

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        if r.get(LANDED):
            self._say(trial, f"landed in the store, sha256 {r[LANDED][:12]}... (training "
                      f"{_fmt(r.get('train_time_s'), 1)} s; test mean_stm "
                      f"{_fmt(r.get('test/mean_stm'))})")
            kill_point("stage1-recorded")
        elif r.get(NOT_LEARNING):
            self._say(trial, f"stopped: {str(r[NOT_LEARNING]).splitlines()[0][:400]}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        last = self.slots[self._label(trial)].work / "phase1_ckpt" / "last.ckpt"
        self._say(trial, "the Phase-1 task started again: Tune retried it after its worker "
                  "or node was lost; it continues from "
                  + (f"its last epoch checkpoint {last}" if last.is_file() else "the start"))

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(trial, f"failed: {_first_error_line(trial, None)}")  # no trial.json


@dataclass
class Stage1Result:
    """What Stage 1 provides to Stage 2: the sha256 of every Phase-1 checkpoint, by
    Phase-1 seed (None: the pipeline's single checkpoint)."""

    digests: dict[int | None, str]
    train_time_s: float  # Phase-1 training done by this invocation (summed over units)
    #: Phase-1 seed -> pmnet.train.Phase1Paused: units stopped at an epoch end, not finished
    #: (issue 52; their digests are None)
    paused: dict = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """One sha256 that names the set (the checkpoint's own for a single checkpoint)."""
        if list(self.digests) == [None]:
            return self.digests[None]
        text = "\n".join(f"{k}:{v}" for k, v in sorted(self.digests.items()))
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Stage1Resources:
    """What each Phase-1 trial asks Ray for: a whole GPU when the trials train on GPUs, and
    the CPUs (also its torch threads) of the node it can run on."""

    cpus: float
    gpus: int


def stage1_resources(plan: Plan, cluster, n_tasks: int) -> Stage1Resources:
    """--stage1-cpus, else the CPUs of the largest node that can run the task, shared among
    the tasks (at least one each; Ray queues what does not fit): with GPU trials the largest
    GPU node (the task needs its GPU), without them the largest node. Planning checked that
    such a node exists (`pipelines.plan.fit_to_cluster`).

    One exception: on a single node without GPU trials and with fewer CPUs than tasks, every
    task gets an equal fraction of the CPUs (one torch thread each) and all of them train at
    once. Queued, the last task would train alone on one core while the others idle (the
    `cpu` preset's three checkpoints on 2 cores: two, then one); side by side, three 1-thread
    Phase-1 processes on 2 cores made 11.8 steps/s in all against 12.2 for two (docs/choices.md,
    "Stage 1 on fewer cores than checkpoints"), so the three finish in about a fifth less time.
    A cluster keeps whole CPUs, so that Ray spreads the tasks over its nodes."""
    from pipelines.plan import uses_gpu

    gpu = uses_gpu(plan)
    node_cpus = cluster.largest_cpus(gpu=gpu)
    if plan.stage1_cpus:
        cpus = max(1.0, min(node_cpus, float(plan.stage1_cpus)))
    else:
        total = min(node_cpus, float(plan.num_cpus or node_cpus))
        n = max(1, n_tasks)
        if not gpu and len(cluster.nodes) == 1 and n > total >= 1:
            cpus = total / n  # all at once, one thread each (`train_phase1_unit`: at least 1)
        else:
            cpus = max(1.0, float(int(total // n)))
    return Stage1Resources(cpus=cpus, gpus=1 if gpu else 0)


def phase1_on_hand(plan: Plan) -> tuple[dict, list[Phase1Slot]]:
    """The plan's Phase-1 units the store holds (Phase-1 seed -> sha256; a `--phase1-from`
    checkpoint is imported first), and the slots still to train."""
    slots = plan.phase1_slots
    have, todo = {}, []
    for slot in slots:
        digest = existing_phase1(slot, repair=True)
        src = plan.phase1_from
        if digest is None and src is not None and src.slot_seed == slot.seed:
            digest = install_phase1(slot, src)  # recorded: a resume imports it again if gone
            write_meta(plan, phase1_from=src.to_dict(),
                       **({"phase1_sha256": digest} if slot.seed is None else {}))
        if digest is not None:
            tag = f" {slot.label}:" if len(slots) > 1 else ""
            say(f"[stage 1/3]{tag} skipped: {slot.ckpt} exists with a valid sha256 "
                f"{digest[:12]}... for this config")
            have[slot.seed] = digest
        else:
            todo.append(slot)
    return have, todo


def stage1(plan: Plan, cluster, runs: Runs, *, deadline_s: float | None = None,
           stop_file: str | None = None) -> Stage1Result:
    """Every Phase-1 unit of the plan: skipped when the store holds it, imported
    (`--phase1-from`), else trained by a Tune experiment over the units still to train
    (`train_phase1_unit`: each lands itself in the store as it finishes, so a failure of
    one loses none that finished); then each unit's Stage-1 MLflow run, from the store.
    No Tune state is restored: a unit's own training directory (Lightning's last.ckpt) is
    what a later run continues from, here or from the store's progress (issue 52)."""
    have, todo = phase1_on_hand(plan)
    digests: dict = {**have}
    paused: dict = {}
    train_s = 0.0
    errors = []
    if todo:
        from pmnet.train import Phase1Paused

        res = stage1_resources(plan, cluster, len(todo))
        phases = "Phase 0 + Phase 1" if plan.cfg.phase0_steps > 0 else "Phase 1"
        for slot in todo:
            say(f"[stage 1/3] {phases} as a Tune trial ({res.cpus:.3g} CPU, {res.gpus} GPU) "
                f"-> {slot.work}")
            for p in (slot.work / "phase1.pt", slot.work / "phase1.pt.sha256"):  # a retrain
                if p.exists():  # replaces them
                    p.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
        by_label = {slot.label: slot for slot in todo}
        console = Stage1Console(by_label, stage1_start_timeout_s(), tag=len(plan.phase1_slots) > 1)
        exp = plan.layout.run_dir / STAGE1_DIRNAME
        shutil.rmtree(exp, ignore_errors=True)  # no state of it is continued (see above)
        trainable = tune.with_resources(tune.with_parameters(
            train_phase1_unit, slots=by_label, threads=int(res.cpus),
            compile_cache=str(plan.layout.compile_cache), deadline_s=deadline_s,
            stop_file=stop_file), {"cpu": res.cpus, "gpu": res.gpus})
        os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
        grid = tune.Tuner(
            trainable, param_space={"unit": tune.grid_search(list(by_label))},
            tune_config=tune.TuneConfig(trial_name_creator=_unit_name,
                                        trial_dirname_creator=_unit_name),
            run_config=tune.RunConfig(
                name=exp.name, storage_path=str(exp.parent), verbose=0, stop=console,
                failure_config=tune.FailureConfig(max_failures=1),
                callbacks=[console])).fit()
        if console.timed_out:
            raise PipelineError(
                f"Stage 1 did not start within {console.bound:.0f} s: its Tune trial asks "
                f"for {res.cpus:g} CPU and {res.gpus:g} GPU on one node, and no node gave "
                f"them (busy, or too small: {cluster.describe()}). Free the resources, or "
                "lower --stage1-cpus; PMNET_STAGE1_START_TIMEOUT_S sets the bound")
        for r in grid:
            slot = by_label[(r.config or {})["unit"]]
            m = r.metrics or {}
            if r.error is None and m.get(LANDED):
                digests[slot.seed] = m[LANDED]
                train_s += float(m.get("train_time_s") or 0.0)
            elif r.error is None and m.get(PAUSED):
                paused[slot.seed] = Phase1Paused(**json.loads(m[PAUSED]))
                say(f"[stage 1/3] {slot.label}: {paused[slot.seed].describe()}")
            elif r.error is None and m.get(NOT_LEARNING):
                errors.append(f"{slot.label} is {m[NOT_LEARNING]}")
            else:
                err = (str(r.error) or type(r.error).__name__) if r.error else "no result"
                errors.append(f"{slot.label}: {err.splitlines()[0][:300]}")
    mirror(plan.layout, runs, plan.phase1_slots, quiet=True)  # MLflow mirrors the store
    if errors:
        raise PipelineError(f"Stage 1 (Phase 1) failed: {'; '.join(errors)}")
    result = Stage1Result(digests={s.seed: digests.get(s.seed) for s in plan.phase1_slots},
                          train_time_s=train_s, paused=paused)
    if paused:  # issue 52: the driver publishes their progress and stops
        return result
    record_phase1(plan, result.digests)
    if runs.parent:
        single = list(result.digests) == [None]
        runs.safe("parent tags", runs.tracker.set_tags, runs.parent,
                  {"phase1_sha256": result.digests[None]} if single else
                  {f"phase1_sha256.p1s{k}": v for k, v in result.digests.items()})
    return result


def _unit_name(trial) -> str:
    return str(trial.config["unit"])


def record_phase1(plan: Plan, digests: dict) -> None:
    """pipeline.json's sha256 of the Phase-1 checkpoints (`phase1_sha256` for a grid's
    single one; `phase1_sha256s` by Phase-1 seed, beside the earlier waves')."""
    if list(digests) == [None]:
        write_meta(plan, phase1_sha256=digests[None])
    else:
        known = PipelineRecord.read(plan.layout.pipeline_json).phase1_sha256s or {}
        write_meta(plan, phase1_sha256s={**known, **{str(k): v for k, v in digests.items()}})


# -- Stage 2 ---------------------------------------------------------------------------------


class ConsoleProgress(tune.Callback):
    """One line per finished, failed or retried trial, with the best result so far."""

    def __init__(self, total: int, trials_dir: str):
        self.total, self.trials_dir = total, trials_dir

    def _best(self, trials, current=None):
        best = None
        for t in trials:
            v = (t.last_result or {}).get("test/updated_ltm")
            ok = t.status == "TERMINATED" or t is current
            if ok and isinstance(v, (int, float)) and v == v:
                if best is None or v > best[1]:
                    best = (t, v)
        return best

    def on_trial_start(self, iteration, trials, trial, **info):
        kill_point("stage2-trial-started")
        n_run = 1 + sum(t.status == "RUNNING" for t in trials if t is not trial)
        say(f"[stage 2/3] started {_tname(trial)} ({n_run} running)")

    def on_trial_complete(self, iteration, trials, trial, **info):
        from pipelines.trial import CONFIG_ERROR

        done = {t.trial_id for t in trials if t.status == "TERMINATED"} | {trial.trial_id}
        r = trial.last_result or {}
        if r.get(CONFIG_ERROR):
            say(f"[stage 2/3] {_tname(trial)} failed, not retried (its configuration "
                f"cannot run): {str(r[CONFIG_ERROR]).splitlines()[0][:300]}")
            return
        if r.get(NOT_LEARNING):  # the watchdog stopped it (issue 62): not finished
            say(f"[stage 2/3] {_tname(trial)} stopped, not retried: "
                f"{str(r[NOT_LEARNING]).splitlines()[0][:400]}")
            return
        if r.get(PAUSED):  # issue 61: --max-wall or a SIGTERM, at an epoch end
            from pmnet.train import PhasePaused

            paused = PhasePaused(**json.loads(r[PAUSED]))
            say(f"[stage 2/3] {_tname(trial)} {paused.describe()}"
                + ("; its progress is in the store" if paused.epoch >= 0 else ""))
            return
        v, sel = r.get("test/updated_ltm"), r.get("best/select")
        best = self._best(list(trials), trial) or (trial, v)
        best_s = (f"{best[1]:.2f} ({_tname(best[0])})"
                  if isinstance(best[1], (int, float)) else "n/a")
        say(f"[stage 2/3] {len(done)}/{self.total} done: {_tname(trial)} "
            f"test updated_ltm {_fmt(v)}, best val select {_fmt(sel)}, "
            f"train {_fmt(r.get('train_time_s'), 1)} s; best so far {best_s}")
        kill_point("stage2-first-result" if len(done) == 1 else "stage2-last-result"
                   if len(done) == self.total else "")

    def on_trial_error(self, iteration, trials, trial, **info):
        err = _first_error_line(trial, self.trials_dir)
        say(f"[stage 2/3] {_tname(trial)} failed for good: {err}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        err = _first_error_line(trial, self.trials_dir)
        say(f"[stage 2/3] {_tname(trial)} crashed ({err}); retrying from its last checkpoint")


def _tname(trial) -> str:
    try:
        return TrialId.from_config(trial.config).name
    except Exception:
        return str(trial)


def _fmt(v, nd: int = 2) -> str:
    return f"{v:.{nd}f}" if isinstance(v, (int, float)) and v == v else "n/a"


def _first_error_line(trial, trials_dir: str | None) -> str:
    """The error the trial recorded in its trial.json (a Phase-2 trial: `trials_dir`), else
    the first line of the last failure in Tune's error.txt (written in the trial's local
    directory first, then synced to the storage): e.g. a lost node's `The actor ... is
    unavailable: ... Socket closed`."""
    if trials_dir is not None:
        info = TrialState.read(Path(trials_dir) / _tname(trial) / "trial.json")
        if info.state == "ERROR" and info.error:
            return info.error.splitlines()[0][:300]
    for base in (getattr(trial, "local_path", None), getattr(trial, "path", None)):
        try:
            path = Path(base) / "error.txt"
            if base and path.is_file():
                lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
                last = max((i for i, ln in enumerate(lines) if ln.startswith("Failure #")),
                           default=-1)
                return (lines[last + 1:] or lines[-1:] or ["unknown error"])[0][:300]
        except Exception:
            pass
    return "see the trial's error.txt"


def trial_context(plan: Plan, p1: Stage1Result | str, *, deadline_at: float | None = None,
                  stop_file: str | None = None):
    from pipelines.trial import TrialContext

    if isinstance(p1, str):
        p1 = Stage1Result({None: p1}, 0.0)
    return TrialContext(root=str(plan.layout.root), name=plan.name, cfg=plan.cfg,
                        space=plan.space, phase1_sha256=p1.digest,
                        phase1_sha256s={str(k): v for k, v in p1.digests.items()
                                        if k is not None},
                        store=str(plan.layout.store), deadline_at=deadline_at,
                        stop_file=stop_file)


def restore_trial_progress(plan: Plan, ctx) -> None:
    """Issue 61: every trial of the plan without a result whose paused progress is in the
    store continues from it (`pmnet.store_progress.restore_progress`: into its trial
    directory, unless the run's own last.ckpt is as far)."""
    from pipelines.store import trial_unit
    from pipelines.trial import trial_phase1
    from pmnet.store_progress import restore_progress
    from pmnet.train import checkpoint_epoch

    lay = plan.layout
    for trial in plan.space.trials:
        if lay.units.result(trial).is_file() or not lay.units.trial_progress(trial).is_dir():
            continue
        tdir = lay.trial_dir(trial)
        unit = trial_unit(trial, ctx.config(trial), trial_phase1(ctx, trial)[1], tdir)
        restore_progress(lay.units, unit, checkpoint_epoch, say)


@dataclass(frozen=True)
class TrialResources:
    """Tune's resource request of a trial from its config (picklable): the grid's CPUs and
    the GPU share of the trial's arm (`Space.resources_for`)."""

    space: Any

    def __call__(self, config: dict):
        from ray.tune.execution.placement_groups import resource_dict_to_pg_factory

        return resource_dict_to_pg_factory(self.space.resources_for(TrialId.from_config(config)))


def make_trainable(plan: Plan, ctx):
    from pipelines.trial import train_trial

    sp = plan.space
    resources = TrialResources(sp) if sp.gpu_shares else sp.resources()
    return tune.with_resources(tune.with_parameters(train_trial, ctx=ctx), resources)


def _warm_task(cfg_dict: dict, condition: str, phase1_ckpt: str, compile_cache: str) -> float:
    from pipelines.trial import assigned_device, quiet_training_logs

    quiet_training_logs()
    from pmnet.train import TrainConfig, use_compile_cache, warm_compile

    use_compile_cache(compile_cache)
    return warm_compile(TrainConfig.from_dict(cfg_dict), condition=condition,
                        phase1_ckpt=phase1_ckpt, accelerator=assigned_device())


def warm_compile_cache(plan: Plan, ray, ctx) -> float:
    """Before the Tuner: compile every distinct Phase-2 step of the trials still to run
    (one per condition and variant: the graphs do not depend on the seed) into the root's
    compile cache, as Ray tasks side by side with the trials' resources, so that trials
    starting together do not each compile the same graphs. Nothing when the config does not
    compile. A failure here only costs the trials their own compile; it is reported, not
    raised. Returns the wall time."""
    from pipelines.trial import trial_phase1

    if "phase2" not in plan.cfg.compile and "eval" not in plan.cfg.compile:
        return 0.0
    lay = plan.layout
    todo = {}
    for trial in plan.space.trials:
        if not lay.result_path(trial).is_file():
            todo.setdefault((trial.condition, trial.variant), trial)
    if not todo:
        return 0.0
    t0 = time.time()
    refs = {}
    for (condition, variant), trial in todo.items():
        cfg = ctx.config(trial)
        res = plan.space.resources_for(trial)  # the trial's own CPUs and GPU share
        task = ray.remote(num_cpus=res["cpu"], num_gpus=res.get("gpu", 0),
                          max_retries=0)(_warm_task)
        refs[(condition, variant)] = task.remote(cfg.to_dict(), condition,
                                                 str(trial_phase1(ctx, trial)[0]),
                                                 str(lay.compile_cache))
    say(f"[stage 2/3] compiling {len(refs)} distinct training step(s) into "
        f"{lay.compile_cache} before the trials")
    for (condition, variant), ref in refs.items():
        arm = f"{condition}{'-' + variant if variant else ''}"
        try:
            say(f"[stage 2/3] compiled {arm} in {ray.get(ref):.0f} s")
        except Exception as e:  # the trials compile for themselves
            say(f"[stage 2/3] compiling {arm} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); its trials compile it")
    return time.time() - t0


def stage2(plan: Plan, runs: Runs, p1: Stage1Result, *, precheck: bool = True,
           deadline_at: float | None = None, stop_file: str | None = None) -> dict:
    """The plan's trials as one new Tune experiment. As in Stage 1, no Tune state is
    restored: a trial whose result the store holds reuses it, one the watchdog stopped stays
    stopped (its trial.json), and every other trial continues from its own last.ckpt (a
    paused trial from the store's progress, restored first). With `deadline_at`
    (`--max-wall`) or `stop_file` (a SIGTERM to the driver) a trial may pause at an epoch end
    into the store (issue 61). Returns the stage's counts and times."""
    from pipelines.trial import trial_name

    lay, sp = plan.layout, plan.space
    if precheck:  # fail fast in the driver; every trial checks again before training
        try:
            for slot in plan.phase1_slots:
                check_phase1(slot.ckpt, p1.digests[slot.seed])
        except Exception as e:
            raise PipelineError(str(e)) from e
    ctx = trial_context(plan, p1, deadline_at=deadline_at, stop_file=stop_file)
    restore_trial_progress(plan, ctx)
    import ray

    # one console line per crashed trial (ConsoleProgress), not Tune's traceback: the trace
    # stays in the trial's error.txt
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    warm_s = warm_compile_cache(plan, ray, ctx)
    trainable = make_trainable(plan, ctx)
    exp_dir = lay.experiment_dir
    t0 = time.time()
    n_done = sum(1 for t in sp.trials if lay.result_path(t).is_file())
    say(f"[stage 2/3] {sp.n_trials} trials -> {exp_dir}"
        + (f" ({n_done} with a result already: reused)" if n_done else ""))
    shutil.rmtree(exp_dir, ignore_errors=True)  # no state of it is continued (see above)
    grid = tune.Tuner(
        trainable, param_space=sp.param_space(),
        tune_config=tune.TuneConfig(
            max_concurrent_trials=sp.max_concurrent or None, reuse_actors=True,
            trial_name_creator=trial_name, trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(
            name=exp_dir.name, storage_path=str(exp_dir.parent), verbose=0,
            failure_config=tune.FailureConfig(max_failures=sp.max_failures),
            callbacks=[ConsoleProgress(sp.n_trials, str(lay.trials_dir)),
                       MirrorLanded(lay)])).fit()
    wall = time.time() - t0
    finished = errored = stopped = paused = 0
    train_times = []
    for r in grid:
        try:
            path = lay.result_path(TrialId.from_config(r.config or {}))
        except (KeyError, TypeError, ValueError):  # not one of our trials' configs
            path = None
        if r.error is None and path is not None and path.is_file():
            finished += 1
            t = (read_json(path, {}) or {}).get("train_time_s")
            if isinstance(t, (int, float)):
                train_times.append(float(t))
        elif r.error is None and (r.metrics or {}).get(NOT_LEARNING):
            stopped += 1  # the watchdog stopped it (issue 62): neither finished nor a crash
        elif r.error is None and (r.metrics or {}).get(PAUSED):
            paused += 1  # issue 61: at an epoch end, its progress in the store
        else:
            errored += 1
    out = {"wall_s": wall, "finished": finished, "errored": errored + stopped,
           "not_learning": stopped, "paused": paused, "sum_trial_train_s": sum(train_times),
           "n_trials": sp.n_trials, "compile_warm_s": warm_s}
    say(f"[stage 2/3] {finished}/{sp.n_trials} finished, {errored} errored"
        + (f", {stopped} not learning" if stopped else "")
        + (f", {paused} paused" if paused else "") + f" in {wall:.1f} s")
    return out


# -- Stage 3 ---------------------------------------------------------------------------------


def stage3(plan: Plan, runs: Runs) -> bool:
    """The report of the run's units (read where they landed, the run's store) into
    `<run>/report/`; a run with a `--store` also rebuilds the store's report (every unit of
    the store) in `<store>/report/`. A failure is logged, the units are kept."""
    lay = plan.layout
    units = lay.units
    n = sum(units.result(t).is_file() for t in plan.space.trials)
    if not n:  # e.g. a Phase 1 paused in the first wave (issue 52)
        say("[stage 3/3] no result file yet: no report")
        return True
    say(f"[stage 3/3] statistics and report from {n} result file(s) -> {lay.report_dir}")
    t0 = time.time()
    written = {}
    try:
        from pmnet.report import main_report

        written = main_report(lay.run_dir, units=units.root,
                              trials=[t.name for t in plan.space.trials])
        if lay.store_elsewhere:
            main_report(units.root)
            say(f"[stage 3/3] the store's report -> {units.root / 'report'}")
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        lay.logs_dir.mkdir(parents=True, exist_ok=True)
        (lay.logs_dir / "report-error.txt").write_text(traceback.format_exc())
        say(f"[stage 3/3] report failed ({msg}); the results are kept in {lay.results_dir}; "
            f"traceback in {lay.logs_dir / 'report-error.txt'}")
        return False
    kill_point("stage3-report-written")
    say(f"[stage 3/3] report written in {time.time() - t0:.1f} s: "
        f"{', '.join(sorted(str(k) for k in (written or {}))[:6])}")
    if runs.parent and lay.report_dir.is_dir():
        runs.safe("report artifacts", runs.tracker.client.log_artifacts, runs.parent,
                  str(lay.report_dir), "report")
    from pmnet.report.build import CLAIMS_FILE

    if n_claims := log_claims(runs, (written or {}).get(CLAIMS_FILE)):  # the answer, in MLflow
        say(f"[stage 3/3] {n_claims} claims (effect, 95% CI, verdict) on the parent run "
            f"{runs.parent}: its claims/* metrics and tags")
    return True


def timing_record(plan: Plan, t_start: float, s2: dict, p1_time: float,
                  stage1_wall: float) -> Timing:
    """This invocation's times, appended to timing.json's `invocations`. Phase-1 tasks train
    side by side, and so do trials: `phase1_train_s` and `sum_trial_train_s` are summed
    over them and may exceed the wall time. `overhead_s` is the wall time outside the two
    training stages (Ray's start, tracking, the result backfill), never negative: wall -
    `stage1_wall_s` - `compile_warm_s` - `stage2_wall_s`; `overhead_ratio` = wall / (those
    three)."""
    wall = time.time() - t_start
    stages = stage1_wall + s2.get("compile_warm_s", 0.0) + s2["wall_s"]
    timing = Timing(
        wall_s=wall, stage1_wall_s=stage1_wall, stage2_wall_s=s2["wall_s"],
        phase1_train_s=p1_time, sum_trial_train_s=s2["sum_trial_train_s"],
        trials_finished=s2["finished"], compile_warm_s=s2.get("compile_warm_s", 0.0),
        overhead_s=max(0.0, wall - stages), overhead_ratio=wall / max(1e-9, stages),
        max_concurrent=plan.space.max_concurrent or 0, resumed=plan.resumed,
        host=socket.gethostname(), cpus=os.cpu_count())
    history = TimingRecord.read(plan.layout.timing_json).invocations
    TimingRecord(**timing.to_dict(), invocations=history + [timing.to_dict()]).write(
        plan.layout.timing_json)
    return timing
