"""MLflow for the pipeline: the embedded store and its local server, and run bookkeeping.

Embedded default: `<root>/mlflow.db` (SQLite) + `<root>/mlartifacts`. During a pipeline the
driver serves that store with a local `mlflow server` on 127.0.0.1 and a free port, so the
driver and every trial talk HTTP to one process instead of fighting over one SQLite file.
`MLFLOW_TRACKING_URI` (or `--tracking-uri`) points at a server of your own instead; a
`sqlite:` URI is served like the embedded store (pipelines.mlflow_server).

Runs are found again by the tag `run_key` (`<name>` for the pipeline's parent run,
`<name>/stage1-phase1` ... for the stages, `<name>/<condition>-s<seed>` for trials, which
also carry it as `trial_key`): a retried or resumed trial re-attaches to its run, and params
are logged only where missing (an identical value is never sent twice; a different value
is reported, not a crash).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from pipelines.console import say
from pipelines.layout import PipelineError, check_writable, read_json, write_json
from pipelines.mlflow_server import absolute_sqlite_uri, sqlite_path
from pipelines.provenance import git_commit, package_versions

if TYPE_CHECKING:
    from pipelines.plan import Plan

log = logging.getLogger("pipelines.tracking")

EMBEDDED = "embedded"
# the MLflow UI opens an experiment in its training-runs view (not the GenAI traces view)
# when this tag says so (MLflow 3: "custom_model_development" vs "genai_development")
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000


def requested_tracking_uri(arg: str | None = None) -> str | None:
    """`--tracking-uri`, else MLFLOW_TRACKING_URI, else None (the embedded store). A
    relative `sqlite:` path is made absolute here, so the URI recorded for `resume` and
    `report` names the same file from any directory."""
    uri = arg or os.environ.get("MLFLOW_TRACKING_URI") or None
    return absolute_sqlite_uri(uri.strip()) if uri else None


def _is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast (PipelineError) when a tracking URI cannot be used."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
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
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            raise PipelineError(
                f"MLflow tracking server {uri} is unreachable ({reason}). Start it, fix "
                "MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
                "under the storage root.") from e
        return
    if parsed.scheme == "sqlite":
        check_writable(sqlite_path(uri).parent)
        return
    if parsed.scheme in ("", "file"):
        check_writable(Path(parsed.path if parsed.scheme else uri).expanduser().absolute())
        return
    # databricks, postgresql, ...: left to MLflow



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
    """MLflow handles of this pipeline (all None when tracking is off)."""

    tracker: Tracker | None = None
    uri: str | None = None
    experiment_id: str | None = None
    parent: str | None = None
    stages: dict[str, str] = field(default_factory=dict)

    def safe(self, what: str, fn, *args, **kwargs):
        if self.tracker is None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # tracking must never lose the pipeline's results
            say(f"[mlflow] {what} failed: {type(e).__name__}: {e}")
            return None

def experiment_name(plan: Plan) -> str:
    return f"pmnet/{plan.name}"


def open_tracking(plan: Plan, uri: str) -> Runs:
    """Attach the pipeline's experiment and parent run at `uri` (where the driver and the
    trials log: an http URI for a served store). tracking.json records the store the user
    asked for (`embedded`, a `sqlite:` URI or a server), which `resume` and `report` use."""
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
    tracker.log_params_once(parent, {
        **plan.cfg.flat(), "grid.name": sp.name, "grid.conditions": ",".join(sp.conditions),
        "grid.seeds": ",".join(map(str, sp.seeds)), "grid.n_trials": sp.n_trials,
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
    if runs.tracker is None:
        return None
    rid, _ = runs.tracker.attach_run(
        runs.experiment_id, f"{plan.name}/{stage}", run_name=stage, parent_run_id=runs.parent,
        tags={"pipeline": plan.name, "stage": stage, "preset": plan.cfg.preset},
        run_id=runs.stages.get(stage))
    runs.stages[stage] = rid
    known = read_json(plan.layout.tracking_json, {}) or {}
    known["stages"] = runs.stages
    write_json(plan.layout.tracking_json, known)
    return rid

