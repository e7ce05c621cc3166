"""`status`: the trials of a pipeline, read from disk only (no Ray, no MLflow server).

Sources, most authoritative first: `results/<trial>.json` (finished), the Tune experiment
state `stage2/experiment_state-*.json` (pending/running/errored, failures, last metrics),
and each trial's `trials/<trial>/trial.json` (MLflow run id, last error).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from pipelines.layout import Layout, read_json
from pmnet.trial_id import TrialId

COLUMNS = ("condition", "seed", "state", "failures", "best val (select)", "test updated_ltm",
           "mlflow run")
#: with named variants the table gains a `variant` column after `condition`
VARIANT_COLUMNS = ("condition", "variant", *COLUMNS[1:])


def tune_trials(experiment_dir: Path) -> dict[str, dict[str, Any]]:
    """{trial name: {"status", "num_failures", "last_result", "error_file"}} from the newest
    experiment state file, or {} when there is none yet."""
    states = sorted(Path(experiment_dir).glob("experiment_state-*.json"),
                    key=lambda p: p.stat().st_mtime)
    if not states:
        return {}
    data = read_json(states[-1], {}) or {}
    out = {}
    for item in data.get("trial_data", []):
        try:
            info = json.loads(item[0]) if isinstance(item[0], str) else item[0]
            run = json.loads(item[1]) if isinstance(item[1], str) else item[1]
            name = TrialId.from_config(info.get("config", {})).name
        except (KeyError, TypeError, ValueError, json.JSONDecodeError):
            continue
        out[name] = {"status": info.get("status"), "num_failures": run.get("num_failures", 0),
                     "last_result": run.get("last_result") or {},
                     "error_file": run.get("error_filename")}
    return out


def driver_alive(meta: dict) -> bool | None:
    """Is the driver recorded in pipeline.json still running? None: cannot tell (other host)."""
    drv = meta.get("driver") or {}
    pid, host = drv.get("pid"), drv.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def pipeline_state(meta: dict) -> str:
    status = meta.get("status", "?")
    if status == "running" and driver_alive(meta) is False:
        return "interrupted (driver gone; `make resume` continues it)"
    return status


def grid_trials(meta: dict) -> list[TrialId]:
    """The pipeline's trials from its pipeline.json: its stored space (with its variants), or
    for a record without one, its grid's conditions x seeds."""
    from tune_spaces import Space

    try:
        return Space.from_dict(meta["space"]).trials
    except (KeyError, TypeError, ValueError):
        grid = meta.get("grid") or {}
        return [TrialId(c, int(s)) for s in grid.get("seeds", [])
                for c in grid.get("conditions", [])]


def trial_rows(layout: Layout) -> list[dict[str, Any]]:
    meta = read_json(layout.pipeline_json, {}) or {}
    live = not pipeline_state(meta).startswith("interrupted") and meta.get("status") == "running"
    tune = tune_trials(layout.experiment_dir)
    from_conditions = _select_metrics()
    rows = []
    for trial in grid_trials(meta):
        cond = trial.condition
        t = tune.get(trial.name, {})
        info = read_json(layout.trial_dir(trial) / "trial.json", {}) or {}
        res = read_json(layout.result_path(trial))
        select = from_conditions.get(cond, "updated_ltm")
        if isinstance(res, dict):
            state = "FINISHED"
            best = (res.get("val") or {}).get(select)
            test = (res.get("test") or {}).get("updated_ltm")
        else:
            state = {"TERMINATED": "TERMINATED", "RUNNING": "RUNNING",
                     "PENDING": "PENDING", "PAUSED": "PAUSED",
                     "ERROR": "ERROR"}.get(t.get("status"), "NOT STARTED")
            if state in ("RUNNING", "PENDING") and not live:
                state = "INTERRUPTED"
            lr = t.get("last_result", {})
            best, test = lr.get("best/select"), None
        rows.append({
            "condition": cond, "variant": trial.variant, "seed": trial.seed,
            "trial": trial.name, "state": state,
            "failures": t.get("num_failures", 0),
            "best val (select)": _num(best), "select": select,
            "test updated_ltm": _num(test),
            "mlflow run": (info.get("mlflow_run_id") or "-")
            + (" (pending)" if info.get("mlflow_pending") else ""),
            "error": info.get("error") if state == "ERROR" else None,
            "epoch": (t.get("last_result") or {}).get("epoch"),
        })
    return rows


def _select_metrics() -> dict[str, str]:
    try:
        from pmnet.train import ALL_CONDITIONS

        return {name: c.select for name, c in ALL_CONDITIONS.items()}
    except Exception:  # status must work even if the training layer cannot be imported
        return {}


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and v == v else None


def format_table(rows: list[dict[str, Any]]) -> str:
    """The status table; a `variant` column only when some trial has a named variant."""
    columns = VARIANT_COLUMNS if any(r.get("variant") for r in rows) else COLUMNS

    def cell(row, col):
        v = row[col]
        if col == "variant" and not v:
            return "default"
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    body = [[cell(r, c) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c)
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def status_text(layout: Layout) -> str:
    meta = read_json(layout.pipeline_json, {}) or {}
    rows = trial_rows(layout)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    tracking = read_json(layout.tracking_json, {}) or {}
    head = [
        f"pipeline {layout.name} ({meta.get('preset', '?')}, {pipeline_state(meta)})"
        f" at {layout.run_dir}",
        f"trials: {len(rows)} = " + ", ".join(f"{v} {k.lower()}" for k, v in
                                            sorted(counts.items())),
    ]
    if meta.get("phase1_sha256"):
        head.append(f"phase1 sha256: {meta['phase1_sha256']}")
    if tracking.get("experiment_id"):
        head.append(f"mlflow: experiment '{tracking.get('experiment_name')}' "
                    f"(id {tracking['experiment_id']}), parent run "
                    f"{tracking.get('parent_run_id')}, store {tracking.get('tracking_uri')}")
    errors = [f"  {r['trial']}: {r['error']}" for r in rows if r.get("error")]
    text = "\n".join(head) + "\n\n" + format_table(rows)
    if errors:
        text += "\n\nerrors:\n" + "\n".join(errors)
    return text
