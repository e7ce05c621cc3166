"""MLflow for the pipeline, a mirror of the run's store with the driver as its only writer
(trials never open MLflow): runs found again by their `run_key` tag, each unit's run written
from the store by `mirror`, every call bounded and non-fatal (`Runs.call`).
docs/pipeline.md, "MLflow layout", has the details.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray import tune

from pipelines.addresses import EMBEDDED, HTTP_LIMITS, artifact_location, hide_password, store_uri
from pipelines.console import say
from pipelines.layout import PHASE2_ONLY_FIELDS, Layout, read_json, trial_key
from pipelines.provenance import git_commit, package_versions
from pipelines.records import Stage1Record, TrackingRecord, as_float
from pmnet.trial_id import TrialId

if TYPE_CHECKING:
    from pipelines.phase1 import Phase1Slot
    from pipelines.plan import Plan

log = logging.getLogger("pipelines.tracking")

# the experiment's kind: model training, not GenAI. MLflow 3.17's UI does not act on it in a
# fresh browser (a headless-Chromium check found the GenAI overview at #/experiments/<id>);
# the printed address names the runs page and the sidebar's workflow instead (ui_address)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN, TAG_MAX = 6000, 5000  # param and tag values are cut there
#: A model file at most this large goes into MLflow as an artifact (Stage 1's checkpoint, a
#: trial's selected one); a larger one stays on disk, its path a tag (docs/pipeline.md)
ARTIFACT_MODEL_MAX_BYTES = 2 * 2**20
#: after a failed call MLflow calls are skipped for this long, so a dead server costs one
#: bounded call, not one per epoch
COOLDOWN_S = 120.0


def model_as_artifact(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_file() and p.stat().st_size <= ARTIFACT_MODEL_MAX_BYTES


# -- the client ----------------------------------------------------------------------------


class Tracker:
    """A thin layer over `MlflowClient` with idempotent run creation and param logging."""

    def __init__(self, uri: str):
        from mlflow import MlflowClient

        os.environ.update(HTTP_LIMITS)  # every MLflow call of this process is bounded
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def experiment(self, name: str, tags: dict[str, str] | None = None,
                   artifact_location: str | None = None) -> str:
        """The experiment's id (created, or restored if deleted), tagged as model training."""
        from mlflow.exceptions import MlflowException

        tags = {**(tags or {}), EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, artifact_location=artifact_location,
                                                     tags=tags)
            except MlflowException:  # created concurrently
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def attach_run(self, experiment_id: str, key: str, *, run_name: str,
                   tags: dict[str, Any] | None = None,
                   parent_run_id: str | None = None) -> tuple[str, bool]:
        """(run_id, created): the first run with tag run_key=key, else a new one; an attached
        run is RUNNING again."""
        tags = {k: str(v) for k, v in (tags or {}).items()}
        tags["run_key"] = key
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.run_key = '{key}'",
            order_by=["attributes.start_time ASC"], max_results=1)
        if not found:
            run = self.client.create_run(experiment_id, tags=tags, run_name=run_name)
            return run.info.run_id, True
        run, rid = found[0], found[0].info.run_id
        if run.info.status != "RUNNING":
            self.client.update_run(rid, status="RUNNING")
        self.set_tags(rid, {k: v for k, v in tags.items() if run.data.tags.get(k) != v})
        return rid, False

    def log_params_once(self, run_id: str, params: dict[str, Any]) -> None:
        """Log the params the run lacks (a logged one is immutable; a resume with another
        config is refused at planning). A list or tuple is spelled as JSON (`[1, 1, 8, 8]`),
        so a config's tuple and its result file's list are one value (issue 37)."""
        from mlflow.entities import Param

        existing = self.client.get_run(run_id).data.params
        todo = [Param(k, (json.dumps(v) if isinstance(v, (list, tuple)) else str(v))
                      [:MAX_PARAM_LEN]) for k, v in params.items() if k not in existing]
        for i in range(0, len(todo), 100):
            self.client.log_batch(run_id, params=todo[i:i + 100])

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metric_rows(self, run_id: str, rows: list[tuple[int, dict[str, Any]]]) -> None:
        """Several steps' metrics in as few requests as possible (1000 values per batch)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, f, now, int(step)) for step, metrics in rows
                 for k, v in metrics.items() if (f := as_float(v)) is not None]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])


# -- the pipeline's runs ---------------------------------------------------------------------


@dataclass
class Runs:
    """MLflow handles of one pipeline (tracker None: tracking off), and the guard every call
    goes through so that none can stall or fail the driver. MLflow bounds each HTTP call
    (HTTP_LIMITS); a SQLite store waits for another writer's lock itself (MLflow's `PRAGMA
    busy_timeout = 20000`, `mlflow.store.db.utils._get_managed_session_maker`). A failed call
    is `last_error`, a console line the first time, and a cooldown of COOLDOWN_S."""

    tracker: Tracker | None = None
    record: TrackingRecord = field(default_factory=TrackingRecord)
    last_error: str | None = None
    failures: int = 0
    retry_at: float = float("-inf")

    @property
    def parent(self) -> str | None:
        return self.record.parent_run_id

    def call(self, what: str, fn: Callable[..., Any], *args, **kwargs) -> tuple[bool, Any]:
        """(True, fn's value), or (False, None) when it failed or was skipped (cooling down)."""
        if time.monotonic() < self.retry_at:
            return False, None
        try:
            return True, fn(*args, **kwargs)
        except Exception as e:  # tracking must never take training or results down
            self.retry_at = time.monotonic() + COOLDOWN_S
            self.last_error = f"{what} failed: {type(e).__name__}: {e}"[:1000]
            self.failures += 1
            log.warning("MLflow: %s; MLflow calls are skipped for %.0f s", self.last_error,
                        COOLDOWN_S)
            if self.failures == 1:
                say(f"[mlflow] {self.last_error}; training goes on, the runs are completed "
                    "from the result files later")
            return False, None

    def safe(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None when tracking is off, failed, or is cooling down."""
        if self.tracker is None:
            return None
        return self.call(what, fn, *args, **kwargs)[1]

    @classmethod
    def reopen(cls, layout: Layout, uri: str | None = None) -> Runs:
        """The runs tracking.json records, in its store (or `uri`), for a later process;
        tracking off when there is no record."""
        record = TrackingRecord.read(layout.tracking_json)
        if record.experiment_id is None:
            return cls(record=record)
        return cls(tracker=Tracker(store_uri(layout.root, uri or record.tracking_uri)),
                   record=record)


def open_tracking(plan: Plan) -> Runs:
    """Attach the pipeline's experiment and parent run, and record them in tracking.json.
    Bounded by HTTP_LIMITS, but fatal: it runs before any trial starts, and a server
    was checked reachable while planning."""
    lay, name = plan.layout, f"pmnet/{plan.name}"
    uri = store_uri(lay.root, plan.tracking_uri)
    tracker = Tracker(uri)
    exp_id = tracker.experiment(name, tags={"pipeline": plan.name, "storage_root": str(lay.root)},
                                artifact_location=artifact_location(uri, plan.name, lay.root))
    tags = {"pipeline": plan.name, "role": "pipeline", "preset": plan.cfg.preset,
            "preset_reason": plan.preset_reason, "grid": plan.space.name,
            "run_dir": str(lay.run_dir), **git_commit(),
            **{f"version.{k}": v for k, v in package_versions().items()}}
    parent, _ = tracker.attach_run(exp_id, plan.name, run_name=plan.name, tags=tags)
    sp = plan.space
    grid_params = {"grid.name": sp.name, "grid.conditions": ",".join(sp.conditions),
                   "grid.seeds": ",".join(map(str, sp.seeds)), "grid.n_trials": sp.n_trials}
    if sp.has_variants:
        grid_params["grid.variants"] = "; ".join(v.describe() for v in sp.variants)
    tracker.log_params_once(parent, {
        **plan.cfg.flat(), **grid_params,
        "resources.cpus_per_trial": sp.cpus_per_trial,
        "resources.gpus_per_trial": sp.gpus_per_trial, "max_failures": sp.max_failures})
    record = TrackingRecord(tracking_uri=plan.tracking_uri or EMBEDDED,
                            experiment_name=name, experiment_id=exp_id, parent_run_id=parent)
    record.write(lay.tracking_json)
    where = hide_password(uri) + (" (the embedded store)" if plan.tracking_uri is None else "")
    say(f"[mlflow] experiment '{name}' (id {exp_id}), parent run {parent}; "
        f"tracking URI {where}")
    return Runs(tracker=tracker, record=record)


# -- the answer on the parent run ------------------------------------------------------------

#: the prefix of the parent run's claim metrics and tags: `claims/<key>/estimate`, ...
CLAIMS_PREFIX = "claims/"
NOTE_TAG = "mlflow.note.content"  # a run's description in the MLflow UI


def claim_key(claim: str) -> str:
    """A claim's text as a part of an MLflow key (letters, digits and '_' only): lower case,
    each run of other characters one '_' ("Routing on > off (updated LTM, pp)" ->
    "routing_on_off_updated_ltm_pp")."""
    return re.sub(r"[^a-z0-9]+", "_", claim.lower()).strip("_")[:180] or "claim"


def claim_entries(records: list[dict]) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) of the claims (`pmnet.report.build.claim_records`) on the parent run,
    as docs/pipeline.md, "MLflow layout", lists them."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    rows = ["| claim | ours | 95% CI | p | verdict |", "|---|---:|---:|---:|---|"]
    seen: set[str] = set()
    for rec in records:
        key = claim_key(str(rec.get("claim") or ""))
        base, i = key, 2
        while key in seen:
            key, i = f"{base}_{i}", i + 1
        seen.add(key)
        at = f"{CLAIMS_PREFIX}{key}/"
        got = {k: as_float(rec.get(k)) for k in ("estimate", "ci_low", "ci_high", "p", "n")}
        metrics.update({at + k: v for k, v in got.items() if v is not None and math.isfinite(v)})
        verdict = str(rec.get("verdict") or "")
        if verdict.startswith(("reproduces", "does not reproduce")):
            metrics[at + "reproduces"] = float(verdict.startswith("reproduces"))
        tags[at + "claim"] = str(rec.get("claim") or "")[:TAG_MAX]
        tags[at + "verdict"] = verdict[:TAG_MAX]
        est, lo, hi, p = (got[k] for k in ("estimate", "ci_low", "ci_high", "p"))
        rows.append(f"| {rec.get('claim')} | {_fmt2(est)} | "
                    f"{f'[{_fmt2(lo)}, {_fmt2(hi)}]' if lo is not None else ''} | "
                    f"{'' if p is None else f'{p:.3g}'} | {verdict} |")
    tags[NOTE_TAG] = ("Which claims reproduce (the report's tab:claims; the whole report is "
                      "this run's artifact report/report.html):\n\n" + "\n".join(rows))[:TAG_MAX]
    return metrics, tags


def _fmt2(v: float | None) -> str:
    return "" if v is None or not math.isfinite(v) else f"{v:+.2f}"


def log_claims(runs: Runs, claims_file: str | os.PathLike | None) -> int:
    """Log the report's claims (its `data/claims.json`) to the pipeline's parent run:
    bounded and non-fatal like every call; returns how many claims were logged."""
    records = read_json(claims_file) if claims_file else None
    if runs.parent is None or not isinstance(records, list) or not records:
        return 0
    metrics, tags = claim_entries(records)
    ok, _ = runs.call("logging the claims", lambda: (
        runs.tracker.log_metric_rows(runs.parent, [(0, metrics)]),
        runs.tracker.set_tags(runs.parent, tags)))
    return len(records) if ok else 0


# -- the units' runs: MLflow mirrors the store ------------------------------------------------


def trial_run(name: str, path: Path) -> dict | None:
    """The run of a trial's unit, from its result file at `path` (None: none there); its
    content is docs/pipeline.md's "MLflow layout"."""
    result = read_json(path)
    try:
        trial = TrialId.from_result(result)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    select, rows, best = result.get("select"), [], float("-inf")
    for row in result.get("history") or []:
        value = as_float(row.get(f"val/{select}"))
        best = value if value is not None and value > best else best
        step = int(row.get("epoch", len(rows)))
        rows.append((step, {**row, "epoch": step}
                     | ({"best/select": best} if best > float("-inf") else {})))
    model = result.get("best_model")
    model = model if model and Path(model).is_file() else None
    return {"key": trial_key(name, trial), "run_name": trial.name, "tags": {
        "trial_key": trial_key(name, trial), "pipeline": name, "stage": "phase2",
        **trial.to_config(), "phase1_sha256": result.get("phase1_sha256"),
        "preset": result.get("preset"), "select_metric": select,
        **{k: result[k] for k in ("device", "precision") if result.get(k)},  # trained_on
        **({"best_model_path": model} if model else {})},
        "params": {**(result.get("config") or {}), **trial.to_config(), **{
            f"variant.{k}": v for k, v in sorted((result.get("variant_overrides") or {}).items())}},
        "rows": rows, "step": int(result.get("best_epoch") or 0), "final": {
            **{f"test/{k}": v for k, v in (result.get("test") or {}).items()},
            "train_time_s": result.get("train_time_s") or 0,
            "trainable_params": result.get("trainable_params") or 0},
        "files": [(path, "result")]
        + ([(model, "checkpoint")] if model and model_as_artifact(model) else [])}


def phase1_run(name: str, slot: Phase1Slot) -> dict | None:
    """The run `stage1-<unit>` of a Phase-1 unit the store holds (None: not landed)."""
    info = Stage1Record.read(slot.stage1_json)
    if not info.sha256:
        return None
    stage = f"stage1-{slot.label}"
    history = (read_json(slot.metrics_json, {}) or {}).get("history", [])
    return {"key": f"{name}/{stage}", "run_name": stage, "tags": {
        "pipeline": name, "stage": stage, "preset": slot.cfg.preset,
        "phase1_sha256": info.sha256, "checkpoint_path": str(slot.ckpt),
        **({"imported_from": info.imported_from} if info.imported_from else {})},
        "params": {k: v for k, v in slot.cfg.flat().items()
                   if k.split(".")[0] not in PHASE2_ONLY_FIELDS},
        "rows": [(row["epoch"], row) for row in history if isinstance(row.get("epoch"), int)],
        "step": 0, "final": {
            **{f"test/{k}": v for k, v in (info.metrics or {}).items()},
            "train_time_s": info.train_time_s or 0, **({"val/random_route_drop": info.routes[
                "stm_random_routes"]["drop"]} if info.routes else {})},
        "files": [(f, None) for f in [slot.metrics_json] if f.is_file()]
        + ([(slot.ckpt, "checkpoint"), (slot.sidecar, "checkpoint")]
           if model_as_artifact(slot.ckpt) else [])}


def _write_run(runs: Runs, unit: dict) -> None:
    """A unit's run attached by its key (created if missing) and written completely: params,
    the epochs it lacks (an `epoch` step already logged is not sent again), the final
    metrics, the artifacts; FINISHED."""
    tracker = runs.tracker
    rid, _ = tracker.attach_run(runs.record.experiment_id, unit["key"], run_name=unit["run_name"],
                                parent_run_id=runs.parent, tags=unit["tags"])
    tracker.log_params_once(rid, unit["params"])
    logged = {m.step for m in tracker.client.get_metric_history(rid, "epoch")}
    tracker.log_metric_rows(rid, [(s, row) for s, row in unit["rows"] if s not in logged]
                            + [(unit["step"], unit["final"])])
    for path, where in unit["files"]:
        tracker.client.log_artifact(rid, str(path), where)
    tracker.client.set_terminated(rid, "FINISHED")


def mirror(layout: Layout, runs: Runs, slots: Iterable[Phase1Slot] = (),
           trials: Iterable[TrialId] = (), *, quiet: bool = False) -> dict[str, int]:
    """MLflow as a mirror of the store: each unit of `slots` and `trials` that the store holds
    and whose run is not FINISHED gets its run written completely; a unit that did not land
    has none. Idempotent, bounded and non-fatal (what failed stays for the next call).
    Returns {"logged": n, "pending": m}."""
    out = {"logged": 0, "pending": 0}
    if runs.tracker is None:
        return out
    units = [u for u in [*(phase1_run(layout.name, slot) for slot in slots),
                         *(trial_run(layout.name, layout.units.result(t)) for t in trials)]
             if u]
    if not units:
        return out
    ok, found = runs.call(
        "listing the finished runs", runs.tracker.client.search_runs,
        [runs.record.experiment_id], max_results=50000,
        filter_string=f"tags.pipeline = '{layout.name}' and attributes.status = 'FINISHED'")
    finished = {r.data.tags.get("run_key") for r in found or ()}
    for unit in units:
        if ok and unit["key"] in finished:
            continue
        done = ok and runs.call(f"logging {unit['run_name']} from the store", _write_run,
                                      runs, unit)[0]
        out["logged" if done else "pending"] += 1
    if (out["logged"] and not quiet) or out["pending"]:
        say(f"[mlflow] {out['logged']} run(s) written from their units in the store"
            + (f"; {out['pending']} left pending (MLflow failed: {runs.last_error}); "
               "the next `make resume` logs them" if out["pending"] else ""))
    return out


class MirrorLanded(tune.Callback):
    """Stage 2's Tune callback: as a trial completes, its unit (if it landed) is mirrored to
    MLflow, so a run's trials appear in the UI as they finish rather than at the wave's end."""

    def __init__(self, layout: Layout):
        self.layout, self.runs = layout, None

    def __getstate__(self):  # Tune pickles its callbacks with the experiment (tuner.pkl)
        return {"layout": self.layout}

    def __setstate__(self, state):
        self.__init__(state["layout"])

    def on_trial_complete(self, iteration, trials, trial, **info):
        if self.runs is None:
            self.runs = Runs.reopen(self.layout)
        try:
            tid = TrialId.from_config(trial.config)
        except (KeyError, TypeError, ValueError):
            return
        mirror(self.layout, self.runs, trials=[tid], quiet=True)
