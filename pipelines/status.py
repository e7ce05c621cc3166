"""`status`: the trials of a pipeline, read from its own records only (no Ray, no MLflow,
none of Tune's files): `results/<trial>.json` first, then each `trials/<trial>/trial.json`,
the run lock (is the driver alive?) and `tracking.json`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pipelines.addresses import hide_password
from pipelines.layout import Layout, PipelineError, read_json
from pipelines.lock import driver_alive
from pipelines.records import PipelineRecord, TrackingRecord, TrialState
from pipelines.store import gated

COLUMNS = ("condition", "seed", "state", "failures", "best val (select)", "test updated_ltm")
#: with named variants the table gains a `variant` column after `condition`
VARIANT_COLUMNS = ("condition", "variant", *COLUMNS[1:])
#: with several Phase-1 checkpoints (`Space.phase1_seeds`) a `phase1` column before `seed`:
#: the checkpoint the trial starts from, `p1s<k>` (its directory `phase1-p1s<k>`)
PHASE1_COLUMN = "phase1"


def pipeline_state(layout: Layout, meta: PipelineRecord) -> str:
    if meta.status == "running" and not driver_alive(layout.run_dir):
        return "interrupted (driver gone; `make resume` continues it)"
    return meta.status or "?"


def trial_rows(layout: Layout) -> list[dict[str, Any]]:
    from tune_spaces import Space

    meta = PipelineRecord.read(layout.pipeline_json)
    live = meta.status == "running" and driver_alive(layout.run_dir)
    trials, held, unread = [], {}, {}
    try:
        space = Space.from_dict(meta.space)
    except (KeyError, TypeError, ValueError):  # damaged: no rows, the head says
        pass
    else:
        trials = space.trials
        for k in space.phase1_keys:  # one unreadable record blanks no other row
            try:
                held |= gated(layout.units, space.phase1_gate, [k])
            except PipelineError as e:
                unread[k] = str(e)
    rows = []
    for trial in trials:
        cond = trial.condition
        info = TrialState.read(layout.trial_dir(trial) / "trial.json")
        res = read_json(layout.result_path(trial))
        if isinstance(res, dict):
            state = "FINISHED"
            best = (res.get("val") or {}).get(res.get("select") or "updated_ltm")
            test = (res.get("test") or {}).get("updated_ltm")
        elif trial.phase1_seed in held:  # its checkpoint is below the grid's Phase-1 gate
            state, best, test = "HELD BACK", None, None
        elif trial.phase1_seed in unread:  # the gate cannot read its checkpoint's record
            state, best, test = "GATE UNREADABLE", None, None
        else:
            state = info.state or "NOT STARTED"
            if state == "RUNNING" and not live:
                state = "INTERRUPTED"
            best, test = info.best_select, None
        rows.append({
            "condition": cond, "variant": trial.variant, "seed": trial.seed,
            PHASE1_COLUMN: None if trial.phase1_seed is None else f"p1s{trial.phase1_seed}",
            "trial": trial.name, "state": state, "failures": info.failures,
            "best val (select)": _num(best), "test updated_ltm": _num(test),
            # a trial the watchdog stopped (state NOT LEARNING, issue 62) says why, as an error
            "error": unread.get(trial.phase1_seed) if state == "GATE UNREADABLE" else
            info.error if state in ("ERROR", "NOT LEARNING") else None,
            "epoch": info.epoch,
        })
    return rows


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and v == v else None


def format_table(rows: list[dict[str, Any]]) -> str:
    """The status table; a `variant` column only when some trial has a named variant, a
    `phase1` column only when the trials start from several Phase-1 checkpoints."""
    columns = list(VARIANT_COLUMNS if any(r.get("variant") for r in rows) else COLUMNS)
    if any(r.get(PHASE1_COLUMN) for r in rows):
        columns.insert(columns.index("seed"), PHASE1_COLUMN)

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
    meta = PipelineRecord.read(layout.pipeline_json)
    rows = trial_rows(layout)
    counts = Counter(r["state"] for r in rows)
    tracking = TrackingRecord.read(layout.tracking_json)
    head = [
        f"pipeline {layout.name} ({meta.preset or '?'}, {pipeline_state(layout, meta)})"
        f" at {layout.run_dir}",
        f"trials: {len(rows)} = " + ", ".join(f"{v} {k.lower()}" for k, v in
                                            sorted(counts.items())),
    ]
    if meta.phase1_sha256:
        head.append(f"phase1 sha256: {meta.phase1_sha256}")
    if meta.phase1_sha256s:
        head.append("phase1 sha256s: " + ", ".join(
            f"p1s{k} {str(v)[:12]}" for k, v in sorted(
                meta.phase1_sha256s.items(), key=lambda kv: (len(str(kv[0])), str(kv[0])))))
    if tracking.experiment_id:
        head.append(f"mlflow: experiment '{tracking.experiment_name}' "
                    f"(id {tracking.experiment_id}), parent run {tracking.parent_run_id}, "
                    f"store {hide_password(tracking.tracking_uri or '')}")
    errors = [f"  {r['trial']}: {r['error']}" for r in rows if r.get("error")]
    text = "\n".join(head) + "\n\n" + format_table(rows)
    if errors:
        text += "\n\nerrors:\n" + "\n".join(errors)
    return text
