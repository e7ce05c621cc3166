"""The pipeline's three stages, each one function the driver calls in order: docs/pipeline.md,
"Stages", and docs/design.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import tune

from pipelines.addresses import EMBEDDED
from pipelines.console import say
from pipelines.faults import kill_point
from pipelines.layout import PipelineError, read_json, write_json
from pipelines.phase1 import Phase1Slot, check_phase1, existing_phase1, phase1_config_hash
from pipelines.plan import Plan, grid_record
from pipelines.provenance import git_commit, package_versions
from pipelines.records import PipelineRecord, Progress, Stage1Record, Started, TrialState, canon
from pipelines.tracking import MirrorLanded, Runs, log_claims, mirror
from pipelines.trial import CONFIG_ERROR, NOT_LEARNING, PAUSED, train_trial
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


def train_phase1_unit(config: dict, *, slots: dict, threads: int, compile_cache: str,
                      deadline_s: float | None = None, stop_file: str | None = None) -> None:
    """Stage 1's Tune trainable: trains the Phase-1 unit `config["unit"]` (a label of
    `slots`) in its training directory and lands it in the store. Its last report says how it
    ended: `LANDED`, `PAUSED` (issue 52) or `NOT_LEARNING` (issue 62); another exception is
    Tune's to retry, from the last epoch checkpoint."""
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


class TrialConsole(tune.Callback):
    """The driver's view of a stage's Tune trials, keyed on what they report: a line when a
    Phase-2 trial starts, when a trial ends (by its last report: `LANDED`, `NOT_LEARNING`,
    `PAUSED`, `CONFIG_ERROR`, else its result and the best so far), fails for good or starts
    again (Tune retried it after a crash or a lost worker); in Stage 1 a progress line per
    unit at each of its validations (its `progress.REPORT_KEY` reports). `slots`: Stage 1's
    units by label; `trials_dir`: Stage 2's, whose trial.json names its error."""

    def __init__(self, stage: int, total: int, *, tag: bool = True, slots: dict | None = None,
                 trials_dir: Path | None = None):
        self.stage, self.total, self.tag = stage, total, tag
        self.slots, self.trials_dir = slots or {}, trials_dir
        self.done, self.best = 0, None

    def _say(self, trial, text: str) -> None:
        name = f" {_trial_name(trial)}{':' if self.stage == 1 else ''}" if self.tag else ""
        say(f"[stage {self.stage}/3]{name} {text}")

    def _error(self, trial) -> str:
        """The error the trial recorded in its trial.json (a Phase-2 trial), else the first
        line of the last failure in Tune's error.txt (`Trial.error_file`)."""
        if self.trials_dir is not None:
            info = TrialState.read(self.trials_dir / _trial_name(trial) / "trial.json")
            if info.state == "ERROR" and info.error:
                return info.error.splitlines()[0][:300]
        try:
            text = Path(trial.error_file).read_text().split("Failure #")[-1]
            return next(ln.strip() for ln in text.splitlines()[1:] if ln.strip())[:300]
        except Exception:  # noqa: BLE001 - no error file (yet), or an empty one
            return "see the trial's error.txt"

    def on_trial_start(self, iteration, trials, trial, **info):
        if self.stage == 1:
            kill_point("stage1-submitted")
            return
        kill_point("stage2-trial-started")
        n_run = 1 + sum(t.status == "RUNNING" for t in trials if t is not trial)
        self._say(trial, f"started ({n_run} running)")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from pipelines.progress import REPORT_KEY, describe

        if result.get(REPORT_KEY):
            self._say(trial, describe(Progress.from_dict(json.loads(result[REPORT_KEY]))))

    def on_trial_complete(self, iteration, trials, trial, **info):
        from pmnet.train import PhasePaused

        r = trial.last_result or {}
        kind, said = _outcome(None, r)
        self.done += 1
        if kind == PAUSED:  # --max-wall or a SIGTERM, at an epoch end (issues 52, 61)
            paused = PhasePaused(**json.loads(said))
            self._say(trial, paused.describe() + ("; its progress is in the store"
                                                  if self.stage == 2 and paused.epoch >= 0
                                                  else ""))
        elif kind != "done":
            self._say(trial, {
                LANDED: f"landed in the store, sha256 {str(said)[:12]}... (training "
                        f"{_fmt(r.get('train_time_s'), 1)} s; test mean_stm "
                        f"{_fmt(r.get('test/mean_stm'))})",
                NOT_LEARNING: f"stopped, not retried: {str(said).splitlines()[0][:400]}",
                CONFIG_ERROR: "failed, not retried (its configuration cannot run): "
                              f"{str(said).splitlines()[0][:300]}"}[kind])
            kill_point("stage1-recorded" if kind == LANDED else "")
        elif self.stage == 2:
            v = r.get("test/updated_ltm")
            if isinstance(v, (int, float)) and v == v and (self.best is None
                                                           or v > self.best[1]):
                self.best = (_trial_name(trial), v)
            best_s = f"{self.best[1]:.2f} ({self.best[0]})" if self.best else "n/a"
            say(f"[stage 2/3] {self.done}/{self.total} done: {_trial_name(trial)} "
                f"test updated_ltm {_fmt(v)}, best val select {_fmt(r.get('best/select'))}, "
                f"train {_fmt(r.get('train_time_s'), 1)} s; best so far {best_s}")
            kill_point("stage2-first-result" if self.done == 1 else "stage2-last-result"
                       if self.done == self.total else "")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._say(trial, f"failed for good: {self._error(trial)}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        if self.stage == 2:
            self._say(trial, f"crashed ({self._error(trial)}); retrying from its last "
                      "checkpoint")
            return
        last = self.slots[_trial_name(trial)].work / "phase1_ckpt" / "last.ckpt"
        self._say(trial, "the Phase-1 task started again: Tune retried it after its worker "
                  "or node was lost; it continues from "
                  + (f"its last epoch checkpoint {last}" if last.is_file() else "the start"))


@dataclass
class Stage1Result:
    """What Stage 1 provides to Stage 2."""

    digests: dict[int | None, str]  # Phase-1 seed (None: the single checkpoint) -> sha256
    train_time_s: float  # Phase-1 training done by this invocation (summed over units)
    paused: dict = field(default_factory=dict)  # Phase-1 seed -> Phase1Paused (issue 52)


@dataclass(frozen=True)
class Stage1Resources:
    """What each Phase-1 trial asks Ray for (its CPUs are also its torch threads)."""

    cpus: float
    gpus: int


def stage1_resources(plan: Plan, cluster, n_tasks: int) -> Stage1Resources:
    """--stage1-cpus, else the CPUs of the largest node that can run the task (the largest
    GPU node with GPU trials, each task then taking a whole GPU), shared among the tasks, at
    least one each. On a single node without GPU trials and with fewer CPUs than tasks, each
    gets an equal fraction so that all train at once (docs/choices.md, "Stage 1 on fewer
    cores than checkpoints"); a cluster keeps whole CPUs, so Ray spreads the tasks."""
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
    from pipelines.store import land_phase1
    from pmnet.io import atomic_copy, sha256_file
    from pmnet.train import write_sha256

    slots = plan.phase1_slots
    have, todo = {}, []
    for slot in slots:
        digest = existing_phase1(slot, repair=True)
        src = plan.phase1_from
        if digest is None and src is not None and src.slot_seed == slot.seed:
            # `--phase1-from`: copied in and landed as a trained unit lands (recorded: a
            # resume imports it again if gone)
            say(f"[stage 1/3] {slot.label}: importing the Phase-1 checkpoint "
                f"{src.checkpoint} (sha256 {src.sha256[:12]}...)")
            atomic_copy(src.checkpoint, slot.work / "phase1.pt")
            if sha256_file(slot.work / "phase1.pt") != src.sha256:  # changed since planning
                raise PipelineError(f"Phase-1 checkpoint {src.checkpoint} changed since it "
                                    "was checked (its sha256 differs now); start again")
            write_sha256(slot.work / "phase1.pt", src.sha256)
            write_json(slot.work / "phase1_metrics.json", src.metrics)
            digest = land_phase1(slot, Stage1Record(
                config_hash=phase1_config_hash(slot.cfg), sha256=src.sha256,
                checkpoint=str(slot.ckpt), imported_from=str(src.checkpoint),
                phase1_seed=slot.cfg.phase1_seed, train_time_s=src.metrics.get("train_time_s"),
                wall_s=0.0, metrics=canon(src.metrics.get("test", {}))), None)
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
    (`--phase1-from`), else trained by a new Tune experiment over the units still to train,
    each landing itself as it finishes; then each unit's MLflow run, from the store."""
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
        console = TrialConsole(1, len(todo), tag=len(plan.phase1_slots) > 1, slots=by_label)
        trainable = tune.with_resources(tune.with_parameters(
            train_phase1_unit, slots=by_label, threads=int(res.cpus),
            compile_cache=str(plan.layout.compile_cache), deadline_s=deadline_s,
            stop_file=stop_file), {"cpu": res.cpus, "gpu": res.gpus})
        grid = _tune(trainable, {"unit": tune.grid_search(list(by_label))},
                     plan.layout.run_dir / STAGE1_DIRNAME, 1, [console])
        for r in grid:
            slot = by_label[r.config["unit"]]
            kind, said = _outcome(r.error, r.metrics)
            if kind == LANDED:
                digests[slot.seed] = said
                train_s += float(r.metrics.get("train_time_s") or 0.0)
            elif kind == PAUSED:  # (the console said so)
                paused[slot.seed] = Phase1Paused(**json.loads(said))
            elif kind == NOT_LEARNING:
                errors.append(f"{slot.label} is {said}")
            else:
                errors.append(f"{slot.label}: {said or 'no result'}")
    mirror(plan.layout, runs, plan.phase1_slots, quiet=True)  # MLflow mirrors the store
    if errors:
        raise PipelineError(f"Stage 1 (Phase 1) failed: {'; '.join(errors)}")
    result = Stage1Result(digests={s.seed: digests.get(s.seed) for s in plan.phase1_slots},
                          train_time_s=train_s, paused=paused)
    if paused:  # issue 52: the driver publishes their progress and stops
        return result
    single = list(result.digests) == [None]  # else pipeline.json keeps the earlier waves'
    if single:
        write_meta(plan, phase1_sha256=result.digests[None])
    else:
        known = PipelineRecord.read(plan.layout.pipeline_json).phase1_sha256s or {}
        write_meta(plan, phase1_sha256s={**known, **{str(k): v for k, v in result.digests.items()}})
    if runs.parent:
        runs.safe("parent tags", runs.tracker.set_tags, runs.parent,
                  {"phase1_sha256": result.digests[None]} if single else
                  {f"phase1_sha256.p1s{k}": v for k, v in result.digests.items()})
    return result


def _trial_name(trial) -> str:
    """A Tune trial's name and directory name: its Phase-1 unit's label, or its TrialId's
    (module level: picklable)."""
    return str(trial.config.get("unit") or TrialId.from_config(trial.config).name)


def _tune(trainable, param_space: dict, exp: Path, max_failures: int, callbacks: list,
          **tune_config):
    """A new Tune experiment in `exp` (an earlier one's state is removed), run to its end; a
    crashed trial's traceback stays in its error.txt (the callbacks say a line)."""
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    shutil.rmtree(exp, ignore_errors=True)
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune.TuneConfig(
        trial_name_creator=_trial_name, trial_dirname_creator=_trial_name, **tune_config),
        run_config=tune.RunConfig(
            name=exp.name, storage_path=str(exp.parent), verbose=0,
            failure_config=tune.FailureConfig(max_failures=max_failures),
            callbacks=callbacks)).fit()


def _outcome(error, metrics) -> tuple[str, Any]:
    """How a Tune trial ended, and what it said: ("error", its first error line) when it
    raised; else the key of its last report that says how (LANDED, NOT_LEARNING, PAUSED,
    CONFIG_ERROR) and its value; else ("done", None)."""
    if error is not None:
        return "error", (str(error) or type(error).__name__).splitlines()[0][:300]
    m = metrics or {}
    return next(((k, m[k]) for k in (LANDED, NOT_LEARNING, PAUSED, CONFIG_ERROR) if m.get(k)),
                ("done", None))


# -- Stage 2 ---------------------------------------------------------------------------------


def _fmt(v, nd: int = 2) -> str:
    return f"{v:.{nd}f}" if isinstance(v, (int, float)) and v == v else "n/a"


def trial_context(plan: Plan, digests: dict, *, deadline_at: float | None = None,
                  stop_file: str | None = None):
    """The trials' context: the plan's TrainConfig of every trial, resolved once here
    (threads = the trial's CPUs where the preset leaves them open), and Stage 1's `digests`."""
    from pipelines.trial import TrialContext

    sp, threads = plan.space, max(1, int(plan.space.cpus_per_trial))
    return TrialContext(plan.layout, sp, {t.name: sp.trial_config(plan.cfg, t, threads=threads)
                                          for t in sp.trials}, digests, deadline_at, stop_file)


def restore_trial_progress(plan: Plan, ctx) -> None:
    """Issue 61: every trial without a result whose paused progress is in the store
    continues from it (unless its own last.ckpt is as far)."""
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


def stage2(plan: Plan, runs: Runs, p1: Stage1Result, *, precheck: bool = True,
           deadline_at: float | None = None, stop_file: str | None = None) -> dict:
    """The plan's trials as one new Tune experiment (a paused trial's progress restored
    first); with `deadline_at` or `stop_file` a trial may pause (issue 61). Returns the
    stage's counts and times."""
    lay, sp = plan.layout, plan.space
    if precheck:  # fail fast in the driver; every trial checks again before training
        try:
            for slot in plan.phase1_slots:
                check_phase1(slot.ckpt, p1.digests[slot.seed])
        except Exception as e:
            raise PipelineError(str(e)) from e
    ctx = trial_context(plan, p1.digests, deadline_at=deadline_at, stop_file=stop_file)
    restore_trial_progress(plan, ctx)
    trainable = tune.with_resources(tune.with_parameters(train_trial, ctx=ctx),
                                    TrialResources(sp) if sp.gpu_shares else sp.resources())
    exp_dir = lay.experiment_dir
    t0 = time.time()
    n_done = sum(1 for t in sp.trials if lay.result_path(t).is_file())
    say(f"[stage 2/3] {sp.n_trials} trials -> {exp_dir}"
        + (f" ({n_done} with a result already: reused)" if n_done else ""))
    grid = _tune(trainable, sp.param_space(), exp_dir, sp.max_failures,
                 [TrialConsole(2, sp.n_trials, trials_dir=lay.trials_dir), MirrorLanded(lay)],
                 max_concurrent_trials=sp.max_concurrent or None, reuse_actors=True)
    wall = time.time() - t0
    n, train_s = Counter(), 0.0
    for r in grid:
        kind, _ = _outcome(r.error, r.metrics)
        res = read_json(lay.result_path(TrialId.from_config(r.config)))
        if kind == "done" and isinstance(res, dict):
            kind, train_s = "finished", train_s + float(res.get("train_time_s") or 0.0)
        n[kind if kind in ("finished", NOT_LEARNING, PAUSED) else "error"] += 1
    finished, stopped, paused, errored = n["finished"], n[NOT_LEARNING], n[PAUSED], n["error"]
    out = {"wall_s": wall, "finished": finished, "errored": errored + stopped,
           "not_learning": stopped, "paused": paused, "sum_trial_train_s": train_s,
           "n_trials": sp.n_trials}
    say(f"[stage 2/3] {finished}/{sp.n_trials} finished, {errored} errored"
        + (f", {stopped} not learning" if stopped else "")
        + (f", {paused} paused" if paused else "") + f" in {wall:.1f} s")
    return out


# -- Stage 3 ---------------------------------------------------------------------------------


def stage3(plan: Plan, runs: Runs) -> bool:
    """The report of the run's units into `<run>/report/`, and with a `--store` the store's
    report of all its units in `<store>/report/`. A failure is logged, the units are kept."""
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
                  stage1_wall: float) -> dict:
    """This invocation's times, written to timing.json with every invocation's in
    `invocations`. `phase1_train_s` and `sum_trial_train_s` are summed over units that train
    side by side, so they may exceed the wall; `overhead_s` is the wall outside Stages 1-2."""
    wall = time.time() - t_start
    stages = stage1_wall + s2["wall_s"]
    timing = {"wall_s": wall, "stage1_wall_s": stage1_wall, "stage2_wall_s": s2["wall_s"],
              "phase1_train_s": p1_time,
              "sum_trial_train_s": s2["sum_trial_train_s"], "trials_finished": s2["finished"],
              "overhead_s": max(0.0, wall - stages), "overhead_ratio": wall / max(1e-9, stages),
              "max_concurrent": plan.space.max_concurrent or 0, "resumed": plan.resumed,
              "host": socket.gethostname(), "cpus": os.cpu_count()}
    history = (read_json(plan.layout.timing_json, {}) or {}).get("invocations") or []
    write_json(plan.layout.timing_json, {**timing, "invocations": history + [timing]})
    return timing
