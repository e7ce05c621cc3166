"""Where the lines of `pipelines/` go, by concern (issue 22's 2,500-line bar).

Every top-level function and class of `pipelines/` is assigned to the promise it serves
(`CONCERN` below, by name; a name missing from it fails the script, so the table covers
everything). The lines of a definition include its docstring and comments; module
docstrings, imports, constants and the blank lines between definitions are counted apart.

    .venv/bin/python experiments/pipeline_lines/account.py
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pipelines"

ORCH = "the paper's pipeline: 3 stages, Tune trials, one checkpoint, CLI, layout"
VALID = "bad input refused before any side effect (bad-input table)"
FAULT = "faults and resume (fault table, lock, kill points, retired experiments)"
TRACK = "MLflow: one writer, re-attached runs, bounded calls, backfill"
CLUSTER = "Ray clusters and GPUs: storage probe, cards, memory shares, devices"
STUDY = "beyond one checkpoint: Phase-1 seeds, variants, --phase1-from, compile warm-up"
VIEW = "what a user watches: status, Stage-1 progress, console lines"
RECORD = "typed run records and provenance"
STORE = "the one store: pieces, waves, each unit landed once under its lock, unit provenance"

CONCERN = {
    # cluster.py
    "GpuCard": CLUSTER, "NodeInfo": CLUSTER, "ClusterInfo": CLUSTER, "local_cards": CLUSTER,
    "describe_local": CLUSTER, "probe_gpus": CLUSTER, "on_each_node": CLUSTER,
    "TorchCuda": CLUSTER, "torch_cuda": CLUSTER,
    "describe_ray": CLUSTER, "describe_cluster": CLUSTER, "runtime_env": CLUSTER,
    "_ray_kwargs": ORCH, "connect_ray": CLUSTER,
    "init_ray": ORCH, "_switched": CLUSTER, "probe_storage": CLUSTER, "node_label": CLUSTER,
    "check_storage": CLUSTER,
    "Console": VIEW,
    "cpu_days": VALID,
    "execute": FAULT, "_execute": ORCH, "check_cluster": CLUSTER,
    "kill_point": FAULT, "epoch_pause": FAULT,
    "PipelineError": VALID, "check_name": VALID, "trial_key": TRACK, "Layout": ORCH,
    "list_pipelines": ORCH, "last_pipeline": ORCH,
    "check_writable": VALID,
    "DriverRunning": FAULT, "driver_alive": FAULT, "run_lock": FAULT,
    "Phase1Refused": FAULT, "Phase1Slot": STUDY, "Phase1Source": STUDY, "check_phase1": FAULT,
    "existing_phase1": FAULT, "phase1_part": ORCH, "phase1_config_hash": ORCH,
    "check_phase1_source": STUDY, "trained_phase1_part": STUDY,
    "Plan": ORCH, "choose_preset": ORCH, "parse_overrides": VALID, "_parse_list": VALID,
    "build_space": VALID, "plan_new": VALID,
    "check_compute_flags": VALID, "uses_gpu": CLUSTER, "_arm": CLUSTER,
    "fit_to_cluster": CLUSTER, "resource_problem": CLUSTER, "grid_record": ORCH,
    "_check_existing": VALID, "plan_resume": FAULT,
    "_validate": VALID, "check_ray_address": VALID,
    "Phase1Progress": VIEW, "describe": VIEW,
    "git_commit": RECORD, "package_versions": RECORD,
    "canon": RECORD, "as_float": RECORD, "normalized_config": RECORD, "Record": RECORD,
    "TrialState": RECORD, "TrackingRecord": RECORD,
    "Stage1Record": RECORD, "PipelineRecord": RECORD,
    "Started": RECORD, "Progress": RECORD,
    "Exit": FAULT, "_common": ORCH, "_compute": ORCH, "build_parser": ORCH, "cmd_start": ORCH,
    "cmd_resume": FAULT, "run_plan": FAULT, "_save_traceback": FAULT, "cmd_status": VIEW,
    "cmd_report": ORCH, "cmd_ui": TRACK, "main": ORCH, "_flags": ORCH,
    "write_meta": RECORD, "train_phase1_unit": ORCH,
    "TrialConsole": VIEW,
    "Stage1Result": ORCH, "Stage1Resources": CLUSTER, "_trial_name": ORCH,
    "stage1_resources": CLUSTER, "phase1_on_hand": ORCH, "import_phase1": STUDY,
    "stage1": ORCH,
    "_fmt": VIEW, "trial_context": ORCH, "TrialResources": CLUSTER,
    "restore_trial_progress": STORE,
    "stage2": ORCH, "stage3": ORCH, "timing_record": RECORD,
    "pipeline_state": VIEW, "trial_rows": VIEW, "_num": VIEW,
    "format_table": VIEW, "status_text": VIEW,
    "Tracker": TRACK, "Runs": TRACK, "open_tracking": TRACK,
    "trial_run": TRACK, "phase1_run": TRACK, "_write_run": TRACK, "MirrorLanded": TRACK,
    "model_as_artifact": TRACK,
    "mirror": TRACK,
    "sqlite_path": TRACK, "store_uri": TRACK,
    "artifact_location": TRACK, "requested_tracking_uri": TRACK, "check_tracking_uri": VALID,
    "ui_address": TRACK,
    "storage_root": VALID, "database_backend": VALID, "check_database": VALID,
    "hide_password": VALID, "is_loopback": VALID, "ui_warning": VALID, "check_ui_bind": VALID,
    "TrialContext": ORCH, "TrialConfigError": FAULT, "assigned_device": CLUSTER,
    "assigned_gpu_share": CLUSTER,
    "quiet_training_logs": VIEW,
    "_scalar_metrics": ORCH, "_is_final": FAULT, "make_report_callback": ORCH,
    "_end": FAULT, "stored_result": STORE,
    "trial_phase1": STUDY, "train_trial": ORCH, "_refuse": FAULT,
    "discard_foreign_checkpoints": FAULT, "_train_and_record": ORCH,
    "_node_id": CLUSTER, "_tune": ORCH, "_outcome": ORCH,
    # the durable store (issue 45)
    "wave_size": STORE, "wave_plan": STORE,
    "_stop_at_deadline": STORE,
    "device_kind": RECORD,
    "Provenance": RECORD, "_max_wall": STORE, "report_store": STORE,
    "open_store": VALID, "flatten": STORE,
    "unit_config": STORE, "config_hash": STORE,
    "phase1_unit_config": STORE, "check_store_units": VALID,
    "start_unit": RECORD,
    "landed": RECORD, "_move": STORE, "units_left": STORE, "gated": STORE,
    # one layout, one path (issue 51)
    "finish": ORCH,
    "land_phase1": RECORD, "land_trial": RECORD,
    "run_layout": ORCH,
    # a long Phase 1 in durable pieces (issue 52): driver.sigterm_writes_stop_file, driver._pause
    # (the progress itself moved to pmnet/store_progress.py)
    "sigterm_writes_stop_file": FAULT, "_pause": STORE,
    "progress_unit": STORE, "trial_unit": STORE,
    # a store that verifies what it holds (issue 53): the unit locks' staleness and the
    # quarantine pre-pass moved to pmnet/store_lock.py and pmnet/store_repair.py
    # what a person reads and runs first (issue 64): help texts from the registries, `make
    # ui` on the run's own store, the Ray address kept for resume, the answer in MLflow
    "ui_plan": TRACK, "run_address": TRACK, "resume_ray_address": CLUSTER,
    "epoch_shown": VIEW, "claim_key": TRACK,
    "claim_entries": TRACK, "_fmt2": TRACK, "log_claims": TRACK,
}


def main() -> int:
    by = defaultdict(int)
    total = in_defs = 0
    missing = []
    for path in sorted(ROOT.glob("*.py")):
        src = path.read_text()
        total += len(src.splitlines())
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                n = node.end_lineno - start + 1
                if node.name not in CONCERN:
                    missing.append(f"{path.name}:{node.name}")
                    continue
                by[CONCERN[node.name]] += n
                in_defs += n
    if missing:
        print("not assigned: " + ", ".join(missing), file=sys.stderr)
        return 1
    print("| concern | lines in its definitions |\n|---|---:|")
    for concern, n in sorted(by.items(), key=lambda kv: -kv[1]):
        print(f"| {concern} | {n:,} |")
    print(f"| module docstrings, imports, constants, blank lines between definitions | "
          f"{total - in_defs:,} |")
    print(f"| **`pipelines/` in all** | **{total:,}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
