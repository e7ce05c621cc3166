"""MLflow for the pipeline: the embedded store and its local server, and run bookkeeping.

Embedded default: `<root>/mlflow.db` (SQLite) + `<root>/mlartifacts`. During a pipeline the
driver serves that store with a local `mlflow server` on 127.0.0.1 and a free port, so the
driver and every trial talk HTTP to one process instead of fighting over one SQLite file.
`MLFLOW_TRACKING_URI` (or `--tracking-uri`) points at a server of your own instead; a
`sqlite:` URI is served like the embedded store (pipelines.mlflow_server).

Runs are found again by the tag `run_key` (`<name>` for the pipeline's parent run,
`<name>/stage1-phase1` ... for the stages, `<name>/<trial>` for trials, `<trial>` being the
TrialId's name such as `<condition>-s<seed>`; trials also carry it as `trial_key`): a retried
or resumed trial re-attaches to its run, and params are logged only where missing (an
identical value is never sent twice; a different value is reported, not a crash).

Tracking never stalls or kills training: every MLflow call of a trial or of the driver runs
under `TRACKING_LIMITS` (bounded retries and timeouts) through a `TrackingGuard`, which turns
a failure into a warning and skips further calls for a while. A trial records in its
trial.json what it could not log (`mlflow_pending`), and `backfill_results` logs it from the
result files on disk, which are the truth, at the next driver run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from pipelines.console import say
from pipelines.layout import (
    Layout,
    PipelineError,
    read_json,
    trial_key,
    update_json,
    write_json,
)
from pipelines.mlflow_server import absolute_sqlite_uri, sqlite_path
from pipelines.provenance import git_commit, package_versions
from pmnet.trial_id import TrialId

if TYPE_CHECKING:
    from pipelines.plan import Plan

log = logging.getLogger("pipelines.tracking")

EMBEDDED = "embedded"
# the MLflow UI opens an experiment in its training-runs view (not the GenAI traces view)
# when this tag says so (MLflow 3: "custom_model_development" vs "genai_development")
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000
SMALL_PRESETS = ("debug", "cpu")  # their selected checkpoint goes into MLflow as an artifact


@dataclass(frozen=True)
class HttpLimits:
    """How long one MLflow call may take, and how long to leave a failing server alone.

    MLflow's REST client reads these environment variables at every request
    (`mlflow.utils.rest_utils.http_request`, mlflow 3.17). Its defaults, 7 retries with
    backoff factor 2 and a 120 s timeout per attempt, keep one call against a dead or hung
    server busy for minutes, and a trial logs every epoch. Here one call takes at most
    `worst_case_s()` (32.5 s against a server that accepts but never answers, about 3 s
    against a refused connection).

    max_retries: retries after the first attempt (urllib3 `Retry(total=...)`: refused
        connections, read errors and 429/5xx answers alike).
    backoff_factor: urllib3 sleeps 0 s before the first retry, then factor*2, factor*4, ...
        (+ up to `backoff_jitter` s); an integer, as MLflow parses it.
    timeout_s: connect and read timeout of each attempt (an integer for MLflow).
    cooldown_s: after a failed call, a `TrackingGuard` skips the next calls for this long,
        so a dead server costs one bounded call, not one per epoch.
    """

    max_retries: int = 2
    backoff_factor: int = 1
    backoff_jitter: float = 0.5
    timeout_s: int = 10
    cooldown_s: float = 120.0

    def env(self) -> dict[str, str]:
        return {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(self.max_retries),
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(self.backoff_factor),
                "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": str(self.backoff_jitter),
                "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.timeout_s)}

    def worst_case_s(self) -> float:
        """Upper bound of one MLflow call under these limits (every attempt times out)."""
        sleeps = sum(self.backoff_factor * 2 ** k + self.backoff_jitter
                     for k in range(1, self.max_retries))
        return (self.max_retries + 1) * self.timeout_s + sleeps

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """These limits for the MLflow calls inside the block (the previous values after)."""
        new = self.env()
        old = {k: os.environ.get(k) for k in new}
        os.environ.update(new)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


#: the one place where the pipeline's MLflow limits are set (trials and driver alike)
TRACKING_LIMITS = HttpLimits()


class TrackingGuard:
    """Runs MLflow calls so that none can stall or kill its caller.

    Each call runs under `limits` (bounded retries and timeouts); an exception becomes a
    warning, `last_error`, and `on_failure(reason)`; and after a failure the calls of the
    next `limits.cooldown_s` seconds are skipped at once (reported as not done), so a dead
    server costs the caller one bounded call, not one per epoch or per trial.
    """

    def __init__(self, limits: HttpLimits = TRACKING_LIMITS,
                 on_failure: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits, self.on_failure, self.clock = limits, on_failure, clock
        self.last_error: str | None = None
        self._retry_at = float("-inf")

    @property
    def cooling_down(self) -> bool:
        return self.clock() < self._retry_at

    def call(self, what: str, fn: Callable[..., Any], *args, **kwargs) -> tuple[bool, Any]:
        """(True, fn's value), or (False, None) when it failed or was skipped."""
        if self.cooling_down:
            return False, None
        try:
            with self.limits.applied():
                return True, fn(*args, **kwargs)
        except Exception as e:  # tracking must never take training or results down
            self._retry_at = self.clock() + self.limits.cooldown_s
            self.last_error = f"{what} failed: {type(e).__name__}: {e}"[:1000]
            log.warning("MLflow: %s; MLflow calls are skipped for %.0f s", self.last_error,
                        self.limits.cooldown_s)
            if self.on_failure is not None:
                self.on_failure(self.last_error)
            return False, None


def requested_tracking_uri(arg: str | None = None) -> str | None:
    """`--tracking-uri`, else MLFLOW_TRACKING_URI, else None (the embedded store). A
    relative `sqlite:` path is made absolute here, so the URI recorded for `resume` and
    `report` names the same file from any directory."""
    uri = arg or os.environ.get("MLFLOW_TRACKING_URI") or None
    return absolute_sqlite_uri(uri.strip()) if uri else None


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast (PipelineError) when a tracking URI cannot be used; create nothing.

    http(s): the server must answer (`/health`, else its REST API). Other schemes must be one
    MLflow's own store registry knows (so a typo such as "not a uri" is refused, not taken
    as a directory). `file:` stores and bare paths are refused as MLflow 3 refuses them (the
    file backend is in maintenance mode) - before Ray starts rather than after. A `sqlite:`
    database's directory must exist and be writable (a relative path is taken from the
    current directory by `requested_tracking_uri`).
    """
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        if not parsed.netloc:
            raise PipelineError(f"tracking URI {uri!r} has no host: use http://HOST:PORT")
        _check_server(uri, timeout)
        return
    if parsed.scheme in ("", "file"):
        raise PipelineError(
            f"tracking URI {uri!r} is a path / file: store, which MLflow 3 no longer accepts "
            "for tracking (its file backend is in maintenance mode). Use an MLflow server "
            "(http://HOST:PORT), a database (sqlite:////abs/path/mlflow.db), or unset "
            "MLFLOW_TRACKING_URI / --tracking-uri for the embedded store under the root.")
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        _tracking_store_registry.get_store_builder(uri)
    except Exception as e:
        raise PipelineError(f"tracking URI {uri!r} is not one MLflow can use "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    if parsed.scheme == "sqlite":
        parent = sqlite_path(uri).parent  # relative paths were made absolute already
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise PipelineError(f"tracking URI {uri!r}: directory {parent} does not exist "
                                "or is not writable")
    # postgresql, mysql, databricks, ...: MLflow knows the scheme; its server checks the rest


def _check_server(uri: str, timeout: float) -> None:
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as r:
            if r.status == 200:
                return
    except urllib.error.HTTPError as e:  # a server answered: try the REST API itself
        try:
            url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
            with urllib.request.urlopen(url, timeout=timeout):
                return
        except (OSError, urllib.error.URLError) as e2:
            raise PipelineError(f"MLflow tracking server {uri} answered /health with "
                                f"HTTP {e.code} and its API failed ({e2})") from e2
    except (OSError, ValueError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", e)
        raise PipelineError(
            f"MLflow tracking server {uri} is unreachable ({reason}). Start it, fix "
            "MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
            "under the storage root.") from e



# -----------------------------------------------------------------------------------------
# Run bookkeeping
# -----------------------------------------------------------------------------------------


def _param_str(value: Any) -> str:
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


def _float(value: Any) -> float | None:
    try:
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool):
            return float(value)
        return float(value)
    except (TypeError, ValueError):
        return None


class Tracker:
    """A thin layer over `MlflowClient` with idempotent run creation and param logging."""

    def __init__(self, uri: str):
        from mlflow import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def experiment(self, name: str, tags: dict[str, str] | None = None) -> str:
        """The experiment's id (created, or restored if deleted), tagged as model training so
        the MLflow UI opens on its runs rather than on its GenAI (traces) view."""
        from mlflow.exceptions import MlflowException

        tags = {**(tags or {}), EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, tags=tags)
            except MlflowException:  # created concurrently
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # made by an older version
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG,
                                           EXPERIMENT_KIND)
        return exp.experiment_id

    def find_run(self, experiment_id: str, key: str):
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.run_key = '{key}'",
            order_by=["attributes.start_time ASC"], max_results=10)
        return runs[0] if runs else None

    def attach_run(self, experiment_id: str, key: str, *, run_name: str,
                   tags: dict[str, Any] | None = None, parent_run_id: str | None = None,
                   run_id: str | None = None) -> tuple[str, bool]:
        """(run_id, created): the run with tag run_key=key (or `run_id`), else a new one."""
        from mlflow.entities import RunTag
        from mlflow.exceptions import MlflowException

        tags = {k: str(v) for k, v in (tags or {}).items()}
        tags["run_key"] = key
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = None
        if run_id:
            try:
                run = self.client.get_run(run_id)
                if run.info.lifecycle_stage == "deleted":
                    run = None
            except MlflowException:
                run = None
        if run is None:
            run = self.find_run(experiment_id, key)
        if run is not None:
            rid = run.info.run_id
            if run.info.status != "RUNNING":
                self.client.update_run(rid, status="RUNNING")
            new = {k: v for k, v in tags.items() if run.data.tags.get(k) != v}
            if new:
                self.client.log_batch(rid, tags=[RunTag(k, v) for k, v in new.items()])
            return rid, False
        run = self.client.create_run(experiment_id, tags=tags, run_name=run_name)
        return run.info.run_id, True

    def log_params_once(self, run_id: str, params: dict[str, Any]) -> list[str]:
        """Log the params the run lacks; return the keys whose logged value differs."""
        from mlflow.entities import Param

        existing = self.client.get_run(run_id).data.params
        todo, differ = [], []
        for k, v in params.items():
            s = _param_str(v)
            if k not in existing:
                todo.append(Param(k, s))
            elif existing[k] != s:
                differ.append(k)
        for i in range(0, len(todo), 100):
            self.client.log_batch(run_id, params=todo[i:i + 100])
        if differ:
            log.warning("run %s already has different values for params %s; kept the logged "
                        "ones", run_id, differ)
        return differ

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            f = _float(v)
            if f is not None:
                items.append(Metric(k, f, now, int(step or 0)))
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def log_metric_rows(self, run_id: str, rows: list[tuple[int, dict[str, Any]]]) -> None:
        """Several steps' metrics in as few requests as possible (1000 values per batch)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, f, now, int(step)) for step, metrics in rows
                 for k, v in metrics.items() if (f := _float(v)) is not None]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, key)}

    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None):
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, path: str | os.PathLike,
                      artifact_path: str | None = None):
        self.client.log_artifacts(run_id, str(path), artifact_path)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


@dataclass
class Runs:
    """MLflow handles of this pipeline (all None when tracking is off). The driver's calls go
    through `safe`, bounded and non-fatal like a trial's (one TrackingGuard)."""

    tracker: Tracker | None = None
    uri: str | None = None
    experiment_id: str | None = None
    parent: str | None = None
    stages: dict[str, str] = field(default_factory=dict)
    guard: TrackingGuard = field(default_factory=lambda: TrackingGuard(
        on_failure=lambda reason: say(f"[mlflow] {reason}")))

    def safe(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None when tracking is off, failed, or is cooling down."""
        if self.tracker is None:
            return None
        return self.guard.call(what, fn, *args, **kwargs)[1]


def experiment_name(plan: Plan) -> str:
    return f"pmnet/{plan.name}"


def open_tracking(plan: Plan, uri: str) -> Runs:
    """Attach the pipeline's experiment and parent run at `uri` (where the driver and the
    trials log: an http URI for a served store). tracking.json records the store the user
    asked for (`embedded`, a `sqlite:` URI or a server), which `resume` and `report` use.
    Bounded by TRACKING_LIMITS but fatal: the driver calls it before any trial starts, and
    the server was checked reachable when planning."""
    with TRACKING_LIMITS.applied():
        return _open_tracking(plan, uri)


def _open_tracking(plan: Plan, uri: str) -> Runs:
    tracker = Tracker(uri)
    lay = plan.layout
    exp_id = tracker.experiment(experiment_name(plan), tags={"pipeline": plan.name,
                                                            "storage_root": str(lay.root)})
    known = read_json(lay.tracking_json, {}) or {}
    tags = {"pipeline": plan.name, "role": "pipeline", "preset": plan.cfg.preset,
            "preset_reason": plan.preset_reason, "grid": plan.space.name,
            "run_dir": str(lay.run_dir), **git_commit(),
            **{f"version.{k}": v for k, v in package_versions().items()}}
    parent, _ = tracker.attach_run(exp_id, plan.name, run_name=plan.name, tags=tags,
                                   run_id=known.get("parent_run_id"))
    sp = plan.space
    grid_params = {"grid.name": sp.name, "grid.conditions": ",".join(sp.conditions),
                   "grid.seeds": ",".join(map(str, sp.seeds)), "grid.n_trials": sp.n_trials}
    if sp.has_variants:
        grid_params["grid.variants"] = "; ".join(v.describe() for v in sp.variants)
    tracker.log_params_once(parent, {
        **plan.cfg.flat(), **grid_params,
        "resources.cpus_per_trial": sp.cpus_per_trial,
        "resources.gpus_per_trial": sp.gpus_per_trial, "max_failures": sp.max_failures})
    runs = Runs(tracker=tracker, uri=uri, experiment_id=exp_id, parent=parent,
                stages=dict(known.get("stages", {})))
    write_json(lay.tracking_json, {"tracking_uri": plan.tracking_uri or EMBEDDED,
                                   "experiment_name": experiment_name(plan),
                                   "experiment_id": exp_id, "parent_run_id": parent,
                                   "stages": runs.stages})
    if plan.tracking_uri is None:
        where = f"the embedded store {lay.mlflow_db}, served at {uri}"
    elif plan.tracking_uri != uri:
        where = f"{plan.tracking_uri}, served at {uri}"
    else:
        where = uri
    say(f"[mlflow] experiment '{experiment_name(plan)}' (id {exp_id}), parent run {parent} "
        f"at {where}")
    return runs


def stage_run(plan: Plan, runs: Runs, stage: str) -> str | None:
    """The stage's run id (re-attached by its run_key), or None when tracking is off or the
    server failed (the stage then runs untracked)."""
    if runs.tracker is None:
        return None
    got = runs.safe(f"attaching the {stage} run", runs.tracker.attach_run,
                    runs.experiment_id, f"{plan.name}/{stage}", run_name=stage,
                    parent_run_id=runs.parent,
                    tags={"pipeline": plan.name, "stage": stage, "preset": plan.cfg.preset},
                    run_id=runs.stages.get(stage))
    if got is None:
        return None
    rid = got[0]
    runs.stages[stage] = rid
    known = read_json(plan.layout.tracking_json, {}) or {}
    known["stages"] = runs.stages
    write_json(plan.layout.tracking_json, known)
    return rid


# -----------------------------------------------------------------------------------------
# Trial runs: non-fatal while training, completed from the result files afterwards
# -----------------------------------------------------------------------------------------


def trial_run_tags(name: str, trial: TrialId, phase1_sha256: str, preset: str,
                   select: str) -> dict[str, Any]:
    """The tags of a trial's run (the trial and the backfill create it alike): its key, its
    identity (`TrialId.to_config`: condition, seed, and the variant when it has one) and
    provenance."""
    return {"trial_key": trial_key(name, trial), "pipeline": name, "stage": "phase2",
            **trial.to_config(), "phase1_sha256": phase1_sha256, "preset": preset,
            "select_metric": select}


def trial_params(flat_config: dict[str, Any], trial: TrialId,
                 variant_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The params of a trial's run: its flat TrainConfig (the variant's overrides applied)
    and its identity; a named variant adds `variant` and its overrides as `variant.<field>`."""
    overrides = variant_overrides or {}
    return {**flat_config, **trial.to_config(),
            **{f"variant.{k}": v for k, v in sorted(overrides.items())}}


def record_result(tracker: Tracker, run_id: str, result: dict, result_path: str | os.PathLike,
                  ) -> None:
    """Log a finished trial completely from its result file and finish its run: params, the
    epochs the run lacks (from the result's history, with the running best at `best/select`),
    the test metrics, the result file (and the selected checkpoint for small presets) as
    artifacts. Idempotent: params and epochs already logged are not sent again."""
    trial, select = TrialId.from_result(result), result["select"]
    tracker.log_params_once(run_id, trial_params(result.get("config") or {}, trial,
                                                 result.get("variant_overrides")))
    logged = tracker.logged_steps(run_id, "epoch")
    rows, best = [], float("-inf")
    for row in result.get("history") or []:
        value = _float(row.get(f"val/{select}"))
        if value is not None and value > best:
            best = value
        step = int(row.get("epoch", len(rows)))
        if step not in logged:
            rows.append((step, {**row, "epoch": step}
                         | ({"best/select": best} if best > float("-inf") else {})))
    tracker.log_metric_rows(run_id, rows)
    test = {f"test/{k}": v for k, v in (result.get("test") or {}).items()
            if isinstance(v, (int, float))}
    tracker.log_metrics(run_id, {**test, "train_time_s": result.get("train_time_s") or 0,
                                 "trainable_params": result.get("trainable_params") or 0},
                        step=int(result.get("best_epoch") or 0))
    tracker.log_artifact(run_id, result_path, "result")
    trained_on = {k: result[k] for k in ("device", "precision") if result.get(k)}
    if trained_on:  # where the trial actually trained (pmnet.train.trained_on)
        tracker.set_tags(run_id, trained_on)
    best_model = result.get("best_model")
    if best_model and Path(best_model).is_file():
        if result.get("preset") in SMALL_PRESETS:
            tracker.log_artifact(run_id, best_model, "checkpoint")
        tracker.set_tags(run_id, {"best_model_path": best_model})
    tracker.finish(run_id, "FINISHED")


class TrialTracking:
    """A trial's MLflow run, kept off the trial's critical path.

    Every call (attaching the run with its params, each epoch's metrics, the final
    `record_result`, marking a crash) goes through a TrackingGuard: bounded by
    TRACKING_LIMITS, never raising, and skipped for `cooldown_s` after a failure. The first
    call that fails or is skipped writes `mlflow_pending: true` and the reason into the
    trial's trial.json at once (so the flag survives a later crash); only a complete
    `record_result` clears it. `backfill_results` logs what is still pending. The run is
    attached at the first call that goes through, so a trial that started while the server
    was down joins its run (found by trial_key, never duplicated) once the server is back.
    """

    def __init__(self, uri: str, experiment_id: str, *, key: str, run_name: str,
                 parent_run_id: str | None, tags: dict[str, Any], params: dict[str, Any],
                 trial_json: str | os.PathLike, limits: HttpLimits = TRACKING_LIMITS):
        self.uri, self.experiment_id, self.key, self.run_name = uri, experiment_id, key, run_name
        self.parent_run_id, self.tags, self.params = parent_run_id, tags, params
        self.trial_json = Path(trial_json)
        self.guard = TrackingGuard(limits)
        self.tracker: Tracker | None = None
        self.run_id: str | None = None
        self.skip_steps: set[int] = set()  # epochs an earlier attempt already logged
        self.pending: str | None = None  # why this attempt left something unlogged

    def _attach(self) -> None:
        if self.tracker is None:
            self.tracker = Tracker(self.uri)
        known = (read_json(self.trial_json, {}) or {}).get("mlflow_run_id")
        rid, created = self.tracker.attach_run(
            self.experiment_id, self.key, run_name=self.run_name, tags=self.tags,
            parent_run_id=self.parent_run_id, run_id=known)
        self.tracker.log_params_once(rid, self.params)
        self.skip_steps = set() if created else self.tracker.logged_steps(rid, "epoch")
        self.run_id = rid
        update_json(self.trial_json, {"mlflow_run_id": rid})

    def _run(self, what: str, fn: Callable[[], None] | None = None) -> bool:
        def attach_then_call():
            if self.run_id is None:
                self._attach()
            if fn is not None:
                fn()

        ok, _ = self.guard.call(what, attach_then_call)
        if not ok and self.pending is None:
            self.pending = self.guard.last_error or f"{what} skipped"
            update_json(self.trial_json, {"mlflow_pending": True,
                                          "mlflow_pending_reason": self.pending})
        return ok

    def attach(self) -> bool:
        return self._run("attaching the trial's MLflow run")

    def log_epoch(self, metrics: dict[str, Any], step: int) -> None:
        def log():
            if step not in self.skip_steps:
                self.tracker.log_metrics(self.run_id, metrics, step=step)

        self._run(f"logging epoch {step}", log)

    def record(self, result: dict, result_path: str | os.PathLike) -> bool:
        """The trial's final logging (see record_result); True when it all went through."""
        ok = self._run("logging the result",
                       lambda: record_result(self.tracker, self.run_id, result, result_path))
        if ok:
            self.pending = None
            update_json(self.trial_json, {"mlflow_pending": False,
                                          "mlflow_pending_reason": None})
        return ok

    def fail(self, error: str) -> None:
        """Mark the run FAILED with the error as its `last_error` tag (the retry reopens it)."""
        if self.run_id is None:  # nothing to mark, and no reason to wait for a server now
            return
        self._run("marking the run failed", lambda: (
            self.tracker.set_tags(self.run_id, {"last_error": error[:5000]}),
            self.tracker.finish(self.run_id, "FAILED")))


def _run_finished(tracker: Tracker, run_id: str | None) -> bool:
    """Is this run there and FINISHED? (A run missing from the server counts as not.)"""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return False
    try:
        run = tracker.client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return run.info.status == "FINISHED" and run.info.lifecycle_stage != "deleted"


def _backfill_one(layout: Layout, runs: Runs, result: dict, result_path: Path) -> str:
    trial = TrialId.from_result(result)
    trial_json = layout.trial_dir(trial) / "trial.json"
    known = (read_json(trial_json, {}) or {}).get("mlflow_run_id")
    rid, _ = runs.tracker.attach_run(
        runs.experiment_id, trial_key(layout.name, trial),
        run_name=trial.name, parent_run_id=runs.parent, run_id=known,
        tags=trial_run_tags(layout.name, trial, result["phase1_sha256"], result["preset"],
                            result["select"]))
    record_result(runs.tracker, rid, result, result_path)
    update_json(trial_json, {"mlflow_run_id": rid, "mlflow_pending": False,
                             "mlflow_pending_reason": None})
    return rid


def backfill_results(layout: Layout, runs: Runs) -> dict[str, int]:
    """Log to MLflow what finished trials could not: the result files are the truth.

    For every `results/<trial>.json` whose trial.json says `mlflow_pending`, has
    no run id, or whose run is missing or not FINISHED, attach the trial's run (by run id or
    trial_key; created if missing), log it completely with `record_result`, and clear the
    pending flag. Bounded and non-fatal like every driver call (`runs.safe`): when the server
    fails, the rest is skipped at once and stays pending for the next run of the driver.
    Returns {"logged": n, "pending": m}.
    """
    out = {"logged": 0, "pending": 0}
    if runs.tracker is None or not layout.results_dir.is_dir():
        return out
    for path in sorted(layout.results_dir.glob("*.json")):
        result = read_json(path)
        if not isinstance(result, dict) or not {"condition", "seed", "select"} <= set(result):
            continue
        try:
            trial = TrialId.from_result(result)
        except ValueError:  # not a trial's result file
            continue
        name = trial.name
        info = read_json(layout.trial_dir(trial) / "trial.json", {}) or {}
        if not info.get("mlflow_pending"):
            ok, finished = runs.guard.call(f"checking the MLflow run of {name}", _run_finished,
                                           runs.tracker, info.get("mlflow_run_id"))
            if ok and finished:
                continue
        ok, _ = runs.guard.call(f"logging {name} from its result file", _backfill_one, layout,
                                runs, result, path)
        out["logged" if ok else "pending"] += 1
    if out["logged"] or out["pending"]:
        say(f"[mlflow] completed {out['logged']} trial run(s) from their result files"
            + (f"; {out['pending']} left unchecked or pending (MLflow failed: "
               f"{runs.guard.last_error}); the next `make resume` logs them"
               if out["pending"] else ""))
    return out
