"""Reliability tests of the Ray pipeline with real components on loopback only.

Every test runs the `debug` preset on the `tiny` grid (learned_full, consolidator_only x
seeds 42, 43). The non-slow ones (end to end with the embedded MLflow store; a trial that
crashes once, logging to an external MLflow server; a tampered Phase-1 checkpoint) take
about two minutes together on 2 cores; the driver-SIGKILL + resume and the two-node cluster
tests are `slow`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipelines.layout import Layout, read_json, trial_key
from pmnet.trial_id import TrialId
from tests.support.pipeline import (
    BASE,
    GRID,
    REPO,
    MlflowServer,
    check_trial_runs,
    cli,
    kill_group,
    mlflow_runs,
    pipeline_env,
    processes_mentioning,
    spawn,
    trial_attempts,
    wait_gone,
)

GPU_BASE = ["--preset", "debug", "--grid", "tiny", "--stage1-cpus", "1"]


# -- helpers --------------------------------------------------------------------------------


def reference(run_dir: Path, condition: str, seed: int) -> dict:
    """The same trial trained in-process, uninterrupted, from the pipeline's checkpoint."""
    from pipelines.trial import quiet_training_logs

    quiet_training_logs()
    import torch

    from pmnet.train import TrainConfig, run_phase2

    cfg = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    cfg = dataclasses.replace(cfg, threads=1)  # what a 1-CPU trial uses
    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as out:
            return run_phase2(cfg, condition=condition, seed=seed,
                              phase1_ckpt=run_dir / "phase1" / "phase1.pt", out_dir=out,
                              progress=False, accelerator="cpu")  # as the CPU trials
    finally:
        torch.set_num_threads(threads)


def assert_same_training(got: dict, ref: dict) -> None:
    for key in ("test", "val", "best_epoch", "history", "phase1_sha256", "trainable_params"):
        assert got[key] == ref[key], f"{key} differs from the uninterrupted run"


# -- end to end, embedded MLflow store (CI) -----------------------------------------------------


def test_debug_pipeline_end_to_end_with_embedded_mlflow(tmp_path):
    root = tmp_path / "runs"
    t0 = time.time()
    rc, out = cli("start", *BASE, "--root", str(root), "--name", "e2e")
    wall = time.time() - t0
    assert rc == 0, out[-4000:]
    lay = Layout(root, "e2e")
    assert "preset: debug" in out and "[stage 1/3]" in out and "4/4 done" in out
    assert "[stage 3/3]" in out
    # results and the shared Phase-1 checkpoint
    for c, s in GRID:
        res = read_json(lay.result_path(TrialId(c, s)))
        assert res["condition"] == c and res["seed"] == s and "updated_ltm" in res["test"]
        assert len(trial_attempts(lay, c, s)) == 1
    digest = read_json(lay.pipeline_json)["phase1_sha256"]
    assert {read_json(lay.result_path(TrialId(c, s)))["phase1_sha256"] for c, s in GRID} == {digest}
    assert (lay.phase1_ckpt.stat().st_mode & 0o222) == 0  # read-only after Stage 1
    # no process is left on the store (there is no MLflow server), one run per trial
    assert wait_gone(str(root)) == []
    client, exp, runs = mlflow_runs(f"sqlite:///{lay.mlflow_db}", "e2e")
    by_key = check_trial_runs(client, runs, "e2e", lay)
    names = {r.info.run_name for r in runs}
    assert {"e2e", "stage1-phase1"} <= names and not {"stage2-phase2", "stage3-report"} & names
    parent = next(r for r in runs if r.data.tags.get("role") == "pipeline")
    assert parent.data.tags["phase1_sha256"] == digest
    # Phase-1 validation metrics in the Stage-1 run: one point per epoch, no duplicates
    stage1 = next(r for r in runs if r.info.run_name == "stage1-phase1")
    p1_hist = read_json(lay.phase1_dir / "phase1_metrics.json")["history"]
    steps = [m.step for m in client.get_metric_history(stage1.info.run_id, "val/mean_stm")]
    assert sorted(steps) == [row["epoch"] for row in p1_hist]
    assert parent.data.tags["git_commit"] and parent.data.tags["version.ray"]
    # artifacts, written by the driver into <root>/mlartifacts/<pipeline>
    art = lay.mlartifacts / "e2e"
    assert exp.artifact_location == art.as_uri()
    for c, s in GRID:
        rid = by_key[trial_key("e2e", TrialId(c, s))][0].info.run_id
        assert (art / rid / "artifacts" / "result" / f"{TrialId(c, s).name}.json").is_file()
        assert (art / rid / "artifacts" / "checkpoint" / "best_model.pt").is_file()
    assert (art / parent.info.run_id / "artifacts" / "report").is_dir()  # Stage 3's output
    md = (lay.report_dir / "report.md").read_text()
    assert "| status | finished |" in md and "| preset | debug (given with --preset" in md
    assert md.index("## Headline numbers") < md.index("## What ran") < md.index("## Raw records")
    # Tune keeps no checkpoint; the weights are the trial's last.ckpt alone
    for c, s in GRID:
        assert not list((lay.experiment_dir / TrialId(c, s).name).glob("checkpoint_*"))
        assert (lay.trial_dir(TrialId(c, s)) / "ckpt/last.ckpt").is_file()
    # status from disk
    rc, text = cli("status", "--root", str(root))
    assert rc == 0 and text.count("FINISHED") == 4, text
    # the address printed opens this experiment's training runs (not MLflow 3's GenAI home)
    assert (f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs"
            "?workflowType=machine_learning") in out
    timing = read_json(lay.timing_json)
    assert timing["trials_finished"] == 4 and timing["wall_s"] <= wall
    assert timing["sum_trial_train_s"] > 0
    assert timing["stage1_wall_s"] > 0 and 0 <= timing["overhead_s"] < timing["wall_s"]


def test_debug_pipeline_runs_two_variants_of_the_segments_grid(tmp_path):
    """`--grid segments --variants ...` end to end: variant trials named, trained with their
    own configuration, recorded (result, MLflow, status) and reported in tab:segments."""
    root = tmp_path / "runs"
    variants = {"T2-full": (2, "full"), "T4-truncated": (4, "truncated")}
    rc, out = cli("start", "--preset", "debug", "--grid", "segments", "--variants",
                  ",".join(variants), "--seeds", "42", "--stage1-cpus", "1",
                  "--root", str(root), "--name", "seg")
    assert rc == 0, out[-4000:]
    assert "2/2 done" in out and "consolidator_only-T4-truncated-s42" in out
    lay = Layout(root, "seg")
    trials = [TrialId("consolidator_only", 42, v) for v in variants]
    for t in trials:
        res = read_json(lay.result_path(t))
        assert res["variant"] == t.variant
        assert (res["config"]["segments"], res["config"]["ltm_graph"]) == variants[t.variant]
        assert res["variant_overrides"] == {"segments": variants[t.variant][0],
                                            "ltm_graph": variants[t.variant][1]}
    assert "final_ltm_seg1" in read_json(lay.result_path(trials[1]))["test"]
    assert wait_gone(str(root)) == []
    client, _, runs = mlflow_runs(f"sqlite:///{lay.mlflow_db}", "seg")
    by_key = {r.data.tags["trial_key"]: r for r in runs if "trial_key" in r.data.tags}
    assert sorted(by_key) == sorted(trial_key("seg", t) for t in trials)
    for t in trials:
        run = by_key[trial_key("seg", t)]
        assert run.info.status == "FINISHED" and run.info.run_name == t.name
        assert run.data.tags["variant"] == t.variant
        assert run.data.params["variant.segments"] == str(variants[t.variant][0])
    rc, text = cli("status", "--root", str(root))
    assert rc == 0 and text.count("FINISHED") == 2 and "variant" in text, text
    md = (lay.report_dir / "report.md").read_text()
    assert "**Table `tab:segments`.**" in md and "## Headline numbers" not in md
    assert "| 4 | truncated |" in md


def test_debug_pipeline_nests_the_grid_under_two_phase1_checkpoints(tmp_path):
    """The `checkpoints` grid (issue 39) with `--phase1-seeds 1,2` end to end: Stage 1 trains
    two checkpoints (one per Phase-1 seed, side by side), every trial starts from its own,
    and the report has the Phase-1 variance tables and the checkpoint-distribution section
    (tables, figure, data); a second start with the same name finds everything done."""
    root = tmp_path / "runs"
    conds = ("consolidator_only", "consolidator_only_routing_off")
    args = ("start", "--preset", "debug", "--grid", "checkpoints", "--phase1-seeds", "1,2",
            "--root", str(root), "--name", "p1")
    rc, out = cli(*args)
    assert rc == 0, out[-4000:]
    assert "different values for params" not in out  # issue 37: one spelling per param
    lay = Layout(root, "p1")
    shas = {}
    for k in (1, 2):
        info = read_json(lay.phase1_dir_for(k) / "stage1.json")
        assert info["phase1_seed"] == k and "imported_from" not in info
        assert info["routes"]["stm"]["recall"] >= 0  # the route diagnostics of Stage 1
        metrics = read_json(lay.phase1_dir_for(k) / "phase1_metrics.json")
        assert metrics["train_config"]["phase1_seed"] == k
        shas[k] = info["sha256"]
    assert shas[1] != shas[2] and not lay.phase1_dir.exists()  # no single-checkpoint dir
    meta = read_json(lay.pipeline_json)
    assert meta["phase1_sha256s"] == {"1": shas[1], "2": shas[2]}
    trials = [TrialId(c, s, phase1_seed=k) for k in (1, 2) for s in (42, 43) for c in conds]
    for t in trials:
        res = read_json(lay.result_path(t))
        assert res["phase1_seed"] == t.phase1_seed
        assert res["phase1_sha256"] == shas[t.phase1_seed]  # its own checkpoint, verified
        assert res["config"]["phase1_seed"] == t.phase1_seed
    assert wait_gone(str(root)) == []
    md = (lay.report_dir / "report.md").read_text()
    assert "**Table `tab:phase1-variance`.**" in md and "tab:phase1-checkpoints" in md
    assert "Phase-1 checkpoint, phase1_seed 2" in md
    assert "**Table `tab:routes`.**" in md  # a row per checkpoint
    assert len(read_csv_rows(lay.report_dir / "data" / "route_diagnostics.csv")) == 2 * 2
    assert meta["space"]["name"] == "checkpoints" and meta["space"]["seeds"] == [42, 43]
    for table in ("tab:checkpoint-distribution", "tab:checkpoint-effects"):
        assert f"**Table `{table}`.**" in md, table
    assert (lay.report_dir / "figures" / "fig-checkpoints.png").is_file()
    dist = read_csv_rows(lay.report_dir / "data" / "checkpoint_distribution.csv")
    assert {r["label"] for r in dist} == {
        "routing on - off: updated_ltm", "learned - forced identity, routing on: updated_ltm",
        "learned - forced identity, routing off: updated_ltm"}
    assert all(r["k"] == "2" and r["n"] == "4" for r in dist)
    effects = read_csv_rows(lay.report_dir / "data" / "checkpoint_effects.csv")
    assert len(effects) == 3 * 2  # one row per effect and checkpoint
    rc, out = cli(*args)  # the same pipeline again: nothing trains
    assert rc == 0, out[-4000:]
    assert out.count("skipped") >= 2 and "Phase 1 as a Tune trial" not in out
    assert "has its result from its checkpoint in the store" in out, out[-4000:]
    # one unit lost from the store, and Tune's state damaged: a third start runs Stage 2
    # as a new experiment (Tune's state is never read), the lost trial continues from its
    # own last.ckpt (its final epoch: straight to testing), the others reuse their results
    gone = trials[0]
    before = read_json(lay.result_path(gone))
    for f in lay.units.trial_files(gone):
        f.unlink(missing_ok=True)
    for state in lay.run_dir.glob("stage2*/experiment_state-*.json"):
        state.write_bytes(b"\0\0{")
    rc, out = cli(*args)
    assert rc == 0, out[-4000:]
    assert "7 with a result already: reused" in out and "8/8 finished" in out, out[-4000:]
    for t in trials:
        tries = [json.loads(a) for a in
                 (lay.trial_dir(t) / "attempts.jsonl").read_text().splitlines()]
        assert [a["kind"] for a in tries] == ["train", "train" if t == gone else "reuse"]
    assert read_json(lay.result_path(gone))["test"] == before["test"]
    last_try = json.loads((lay.trial_dir(gone) / "attempts.jsonl").read_text().splitlines()[-1])
    assert last_try["resume_epoch"] == before["history"][-1]["epoch"]


@pytest.mark.slow
def test_debug_pipeline_runs_the_channel_grid_with_each_operators_routing_effect(tmp_path):
    """The `checkpoint_channel` grid (issue 39) end to end at `debug`: every arm of it (the
    report sets aside the channel arms of a checkpoint that lacks any arm,
    `pmnet.stats.whole_checkpoints`), on one Phase-2 seed and two checkpoints: both
    checkpoints train, every trial starts from its own, and the report's distribution
    section carries each operator's routing on - off and routing off - strict off over the
    two checkpoints."""
    from tune_spaces.grids import CHECKPOINT_CHANNEL_CONDITIONS as conds

    root = tmp_path / "runs"
    rc, out = cli("start", "--preset", "debug", "--grid", "checkpoint_channel",
                  "--phase1-seeds", "1,2", "--seeds", "42",
                  "--root", str(root), "--name", "ch", timeout=1800)
    assert rc == 0, out[-4000:]
    lay = Layout(root, "ch")
    meta = read_json(lay.pipeline_json)
    assert meta["space"]["name"] == "checkpoint_channel"
    for k in (1, 2):
        for c in conds:
            res = read_json(lay.result_path(TrialId(c, 42, phase1_seed=k)))
            assert res["phase1_sha256"] == meta["phase1_sha256s"][str(k)]
            assert res["ltm_routing"] is (not c.endswith(("_routing_off", "_strict_off")))
            assert res["routing_u_ltm"] is (not c.endswith("_strict_off"))
    assert wait_gone(str(root)) == []
    md = (lay.report_dir / "report.md").read_text()
    assert "**Table `tab:checkpoint-distribution`.**" in md
    dist = read_csv_rows(lay.report_dir / "data" / "checkpoint_distribution.csv")
    labels = {r["label"] for r in dist}
    assert {"routing on - off: updated_ltm (operator_gru)",
            "routing on - off: updated_ltm (memory_consolidator)",
            "routing off - strict off: updated_ltm (memory_consolidator_routing_off)"
            } <= labels, labels
    assert all(r["k"] == "2" and r["n"] == "2" for r in dist)  # 2 checkpoints x 1 seed



def read_csv_rows(path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# -- a trial that crashes once; an external MLflow server ----------------------------------------


@pytest.fixture(scope="module")
def external_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("external-mlflow")
    server = MlflowServer(f"sqlite:///{base / 'store.db'}", base / "artifacts",
                          base / "server.log")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def crashed_once(tmp_path_factory, external_server):
    """One pipeline: learned_full-s42 raises after its first epoch; MLflow is external."""
    base = tmp_path_factory.mktemp("crash")
    markers = base / "markers"
    markers.mkdir()
    for c, s in GRID:
        if (c, s) != ("learned_full", 42):
            (markers / TrialId(c, s).name).write_text("no fault for this trial\n")
    root = base / "runs"
    rc, out = cli("start", *BASE, "--root", str(root), "--name", "crash", "--max-failures", "1",
                  env={"PMNET_TEST_FAULT_ONCE": str(markers),
                       "MLFLOW_TRACKING_URI": external_server})
    return {"rc": rc, "out": out, "root": root, "lay": Layout(root, "crash"),
            "marker": markers / "learned_full-s42"}


def test_trial_crashing_once_resumes_from_its_checkpoint(crashed_once):
    assert crashed_once["rc"] == 0, crashed_once["out"][-4000:]
    lay = crashed_once["lay"]
    assert crashed_once["marker"].is_file()  # the fault did fire
    assert "learned_full-s42 crashed" in crashed_once["out"]
    tries = trial_attempts(lay, "learned_full", 42)
    assert len(tries) == 2 and tries[0]["resume_from"] is None
    assert tries[1]["resume_epoch"] == 0 and tries[1]["resume_from"]
    from pipelines.status import trial_rows

    failures = {r["trial"]: r["failures"] for r in trial_rows(lay)}
    assert failures == {"learned_full-s42": 1, **{TrialId(c, s).name: 0 for c, s in GRID[1:]}}
    for c, s in GRID:  # every trial, the retried one included, equals an uninterrupted run
        assert_same_training(read_json(lay.result_path(TrialId(c, s))),
                             reference(lay.run_dir, c, s))


def test_external_mlflow_server_receives_the_runs(crashed_once, external_server):
    assert crashed_once["rc"] == 0, crashed_once["out"][-4000:]
    lay = crashed_once["lay"]
    assert not lay.mlflow_db.exists()  # nothing went to the embedded store
    client, _, runs = mlflow_runs(external_server, "crash")
    by_key = check_trial_runs(client, runs, "crash", lay)  # written once, as it landed
    [run] = by_key[trial_key("crash", TrialId("learned_full", 42))]
    assert run.info.status == "FINISHED"  # the crashed attempt left no run of its own


# -- PostgreSQL: MLFLOW_TRACKING_URI=postgresql://..., and a server on it (issue 53) --------------


def _check_stage_runs(runs, name: str) -> None:
    """The parent and the Stage-1 run, each once and FINISHED."""
    for key in (name, f"{name}/stage1-phase1"):
        found = [r for r in runs if r.data.tags.get("run_key") == key]
        assert [r.info.status for r in found] == ["FINISHED"], (key, len(found))


@pytest.mark.slow
def test_debug_pipeline_logs_every_trial_to_postgresql_directly(postgres, tmp_path):
    """MLFLOW_TRACKING_URI=postgresql://... (a real PostgreSQL 15, tests/support/postgres.py):
    the driver writes the database through MLflow's SQLAlchemy store (its tables made on
    first use), one FINISHED run per trial with every epoch, the artifacts under the storage
    root; the console never shows the password, and `resume` reconnects from the record."""
    postgres.createdb("direct")
    uri = postgres.uri(database="direct")
    root = tmp_path / "runs"
    t0 = time.time()
    rc, out = cli("start", *BASE, "--root", str(root), "--name", "pgdirect",
                  env={"MLFLOW_TRACKING_URI": uri})
    assert rc == 0, out[-4000:]
    wall = time.time() - t0
    assert postgres.password not in out
    assert "postgresql://postgres:***@127.0.0.1" in out
    lay = Layout(root, "pgdirect")
    assert not lay.mlflow_db.exists()  # nothing went to the embedded store
    client, exp, runs = mlflow_runs(uri, "pgdirect")
    by_key = check_trial_runs(client, runs, "pgdirect", lay)
    _check_stage_runs(runs, "pgdirect")
    art = lay.mlartifacts / "pgdirect"  # not ./mlruns of the driver's directory
    assert exp.artifact_location == art.as_uri()
    for c, s in GRID:
        rid = by_key[trial_key("pgdirect", TrialId(c, s))][0].info.run_id
        assert (art / rid / "artifacts" / "result" / f"{TrialId(c, s).name}.json").is_file()
    assert not (REPO / "mlruns").exists()
    rc, out = cli("resume", "--root", str(root), "--name", "pgdirect")  # no env: the record
    assert rc == 0, out[-4000:]
    assert postgres.password not in out
    _, _, again = mlflow_runs(uri, "pgdirect")
    assert sorted(r.info.run_id for r in again) == sorted(r.info.run_id for r in runs)
    print(f"debug pipeline into PostgreSQL: {wall:.0f} s")


@pytest.mark.slow
def test_debug_pipeline_logs_every_trial_to_a_postgres_backed_server(postgres, tmp_path):
    """A user's `mlflow server --backend-store-uri postgresql://...` (started here on a free
    loopback port; it migrates the empty database at its first start) and a debug pipeline
    logging to it over HTTP: one FINISHED run per trial, nothing missing, no duplicates; the
    runs are in PostgreSQL (read back from the database itself) and the artifacts where the
    server keeps them."""
    from mlflow import MlflowClient

    postgres.createdb("server")
    backend = postgres.uri(database="server")
    server = MlflowServer(backend, tmp_path / "artifacts", tmp_path / "server.log")
    root = tmp_path / "runs"
    try:
        url = server.start()
        t0 = time.time()
        rc, out = cli("start", *BASE, "--root", str(root), "--name", "pgserver",
                      env={"MLFLOW_TRACKING_URI": url})
        wall = time.time() - t0
    finally:
        server.stop()
    assert rc == 0, out[-4000:]
    lay = Layout(root, "pgserver")
    assert not lay.mlflow_db.exists() and not lay.mlartifacts.exists()
    client, exp, runs = mlflow_runs(backend, "pgserver")  # the database, the server stopped
    by_key = check_trial_runs(client, runs, "pgserver", lay)
    _check_stage_runs(runs, "pgserver")
    for c, s in GRID:
        rid = by_key[trial_key("pgserver", TrialId(c, s))][0].info.run_id
        kept = list((tmp_path / "artifacts").rglob(f"{rid}/artifacts/result/*.json"))
        assert [p.name for p in kept] == [f"{TrialId(c, s).name}.json"]
    assert MlflowClient(backend).get_experiment_by_name("pmnet/pgserver") is not None
    print(f"mlflow server on PostgreSQL: first start (migrations) {server.start_s:.1f} s; "
          f"debug pipeline {wall:.0f} s")


# -- a tampered Phase-1 checkpoint --------------------------------------------------------------


def test_tampered_phase1_checkpoint_is_refused_by_every_trial(tmp_path):
    from pipelines import cluster, stages, tracking
    from pipelines import plan as planning
    from pipelines.layout import PipelineError, write_json
    from pipelines.phase1 import existing_phase1, phase1_config_hash
    from pipelines.trial import quiet_training_logs

    quiet_training_logs()
    from pmnet.train import TrainConfig, run_phase1

    plan = planning.plan_new(root=tmp_path / "runs", name="tamper", preset="debug", grid="tiny",
                           max_failures=2, num_cpus=2, gpus_per_trial=0)
    lay = plan.layout
    import torch

    threads = torch.get_num_threads()
    res = run_phase1(TrainConfig.from_name("debug", threads=1), lay.phase1_dir, progress=False)
    torch.set_num_threads(threads)
    write_json(lay.stage1_json, {"config_hash": phase1_config_hash(plan.cfg),
                                 "sha256": res["sha256"]})
    data = bytearray(lay.phase1_ckpt.read_bytes())
    data[len(data) // 3] ^= 0x5A
    lay.phase1_ckpt.write_bytes(bytes(data))
    # the driver refuses it before any trial starts ...
    with pytest.raises(PipelineError, match="does not match its recorded sha256"):
        existing_phase1(plan.phase1_slots[0])
    with pytest.raises(PipelineError, match="does not match its recorded sha256"):
        stages.stage2(plan, tracking.Runs(), stages.Stage1Result({None: res["sha256"]}, 0.0))
    assert not lay.experiment_dir.exists()
    # ... and so does every trial on its own (driver check bypassed)
    ray = cluster.init_ray(plan.ray_address, plan.num_cpus, plan.cluster)
    try:
        out = stages.stage2(plan, tracking.Runs(),
                            stages.Stage1Result({None: res["sha256"]}, 0.0), precheck=False)
    finally:
        ray.shutdown()
    assert out["errored"] == 4 and out["finished"] == 0
    for c, s in GRID:
        info = read_json(lay.trial_dir(TrialId(c, s)) / "trial.json")
        assert info["state"] == "ERROR"
        assert "Phase1Refused" in info["error"]
        assert "does not match its recorded sha256" in info["error"]
        assert not lay.result_path(TrialId(c, s)).exists()
        assert not (lay.trial_dir(TrialId(c, s)) / "attempts.jsonl").exists()  # no training began
        # a configuration error is not retried (max_failures 2 would have run it 3 times):
        # Tune saw one attempt that ended with the reason, and no failure
        assert info["config_error"] is True
        tune_dir = lay.experiment_dir / TrialId(c, s).name
        assert not (tune_dir / "error.txt").exists()
        reports = [json.loads(ln) for ln in (tune_dir / "result.json").read_text().splitlines()]
        assert len(reports) == 1 and "does not match" in reports[0]["config_error"]


# -- SIGKILL of the driver in the middle of Stage 2, then resume (slow) ---------------------------


@pytest.mark.slow
def test_driver_killed_mid_stage2_then_resumed(tmp_path):
    root = tmp_path / "runs"
    lay = Layout(root, "kill")
    args = ["start", *BASE, "--root", str(root), "--name", "kill", "--max-concurrent", "1",
            "--set", "max_epochs=4", "--set", "patience=4", "--set", "episodes_per_epoch=256"]
    log = open(tmp_path / "driver.log", "w")
    proc = spawn(*args, stdout=log)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:  # into the next trial: a
            # trial without a result has reported an epoch (Tune saves its state then)
            if lay.results_dir.is_dir() and list(lay.results_dir.glob("*.json")) and any(
                    not lay.result_path(t).is_file()
                    and (read_json(lay.trial_dir(t) / "trial.json") or {}).get("epoch") is not None
                    for t in (TrialId(c, s) for c, s in GRID)):
                break
            time.sleep(0.2)
        time.sleep(1.0)
        assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: no cleanup code runs
        proc.wait(30)
        assert wait_gone(str(root), timeout=30) == []  # nothing serves the store
    finally:
        kill_group(proc.pid)  # Ray helper processes left in the driver's group
        log.close()
    finished = {p.stem: p.read_bytes() for p in lay.results_dir.glob("*.json")}
    assert 1 <= len(finished) < 4
    rc, text = cli("status", "--root", str(root))
    assert "interrupted" in text

    rc, out = cli("resume", "--root", str(root))
    assert rc == 0, out[-4000:]
    assert "skipped" in out  # Stage 1 is not redone
    for name, data in finished.items():  # finished trials were not rerun
        c, s = name.rsplit("-s", 1)
        assert lay.result_path(TrialId(c, int(s))).read_bytes() == data
        # trained once; the resumed run's Tune trial reuses the store's result (stop 67:
        # each Stage 2 is a new experiment over the whole grid), it does not train again
        assert [a["kind"] for a in trial_attempts(lay, c, int(s))] == ["train", "reuse"]
    for c, s in GRID:
        assert_same_training(read_json(lay.result_path(TrialId(c, s))),
                             reference(lay.run_dir, c, s))
    client, _, runs = mlflow_runs(f"sqlite:///{lay.mlflow_db}", "kill")
    check_trial_runs(client, runs, "kill", lay)  # one run per trial, no duplicate epochs


# -- the MLflow server dies in the middle of Stage 2 (slow) ----------------------------------------


@pytest.mark.slow
def test_mlflow_server_killed_mid_stage2_trials_finish_and_resume_logs_them(tmp_path):
    store = tmp_path / "mlflow"
    store.mkdir()
    backend = f"sqlite:///{store / 'store.db'}"

    def serve():
        server = MlflowServer(backend, store / "artifacts", store / "server.log")
        return server, server.start

    root = tmp_path / "runs"
    lay = Layout(root, "dead")
    args = ["start", *BASE, "--root", str(root), "--name", "dead", "--max-concurrent", "1",
            "--set", "max_epochs=4", "--set", "patience=4", "--set", "episodes_per_epoch=256"]
    server, ready = serve()
    log = open(tmp_path / "driver.log", "w")
    proc = None
    try:
        uri = ready()
        proc = spawn(*args, env={"MLFLOW_TRACKING_URI": uri}, stdout=log)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if lay.results_dir.is_dir() and list(lay.results_dir.glob("*.json")):
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        server.stop()  # the tracking server dies; three trials are still to train
        rc = proc.wait(420)
    finally:
        if proc is not None:
            kill_group(proc.pid)
        log.close()
        server.stop()
    out = (tmp_path / "driver.log").read_text()
    assert rc == 0, out[-4000:]  # every trial finished although tracking was gone
    for c, s in GRID:
        assert read_json(lay.result_path(TrialId(c, s)))["condition"] == c
    _, _, runs = mlflow_runs(backend, "dead")  # what the server got before it died
    closed = {r.data.tags.get("trial_key") for r in runs if r.info.status == "FINISHED"}
    pending = [(c, s) for c, s in GRID if trial_key("dead", TrialId(c, s)) not in closed]
    assert len(pending) >= 3, pending
    assert "the next `make resume` logs them" in out

    server, ready = serve()  # back, on the same store; resume logs what is pending
    try:
        rc, out = cli("resume", "--root", str(root), env={"MLFLOW_TRACKING_URI": ready()})
    finally:
        server.stop()
    assert rc == 0, out[-4000:]
    assert "written from their units in the store" in out
    client, _, runs = mlflow_runs(backend, "dead")
    check_trial_runs(client, runs, "dead", lay)  # one FINISHED run per trial, every epoch


# -- a two-node Ray cluster on this machine (slow) ----------------------------------------------


@pytest.mark.slow
def test_two_node_cluster_runs_the_debug_pipeline(tmp_path):
    from tests.support.ray_nodes import LoopbackCluster

    with LoopbackCluster() as cluster:  # each node in its own process group (see ray_nodes)
        cluster.add_node(head=True, num_cpus=1)
        cluster.add_node(num_cpus=1)
        address = cluster.address
        root = tmp_path / "runs"
        # no RAY_AUTH_MODE here: the driver retries with token auth by itself
        rc, out = cli("start", *BASE, "--root", str(root), "--name", "cluster",
                      env={"RAY_ADDRESS": address})
        assert rc == 0, out[-4000:]
        assert f"Ray cluster {address}" in out
        assert f"all 2 Ray nodes see the storage root {root}" in out  # checked before Stage 1
        lay = Layout(root, "cluster")
        used = {trial_attempts(lay, c, s)[0]["node_id"] for c, s in GRID}
        assert len(used) == 2, f"trials ran on {used}"
        for c, s in GRID:
            assert_same_training(read_json(lay.result_path(TrialId(c, s))),
                                 reference(lay.run_dir, c, s))


# -- trials sharing one GPU (needs CUDA; skipped elsewhere) ---------------------------------------


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_trials_share_one_gpu_with_fractional_resources(tmp_path):
    root = tmp_path / "runs"
    rc, out = cli("start", *GPU_BASE, "--root", str(root), "--name", "gpu",
                  "--gpus-per-trial", "0.5", "--cpus-per-trial", "1")
    assert rc == 0, out[-4000:]
    assert "0.5 GPU per trial" in out and "1 GPU)" in out  # Stage 1 takes the whole GPU
    lay = Layout(root, "gpu")
    for c, s in GRID:
        result = read_json(lay.result_path(TrialId(c, s)))
        assert result["config"]["precision"] == "auto"
        assert result["precision"] == "bf16-mixed" and "(cuda:0)" in result["device"]
        assert trial_attempts(lay, c, s)[0]["cuda_visible_devices"] not in (None, "")
        assert trial_attempts(lay, c, s)[0]["accelerator"] == "gpu"


# -- services: one MLflow server per store, loopback-only local Ray, code shipping, storage -----


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1" or ip.startswith("::ffff:127.")


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in one of `pids`."""
    import importlib

    import ray  # noqa: F401  (puts Ray's bundled psutil on sys.path)

    psutil = importlib.import_module("psutil")
    return [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="ignore").split("\0")
    except OSError:
        return []


WRITER = """
import sys
from pipelines.tracking import Runs, Tracker
tracker, guard = Tracker(sys.argv[1]), Runs()
exp = tracker.experiment("two-writers")
rid, _ = tracker.attach_run(exp, sys.argv[2], run_name=sys.argv[2])
ok = [guard.call("log", tracker.client.log_metric, rid, "x", float(i), step=i)[0]
      for i in range(int(sys.argv[3]))]
tracker.client.set_terminated(rid)
print(sum(ok), guard.failures, flush=True)
"""


def test_two_drivers_write_one_sqlite_store_at_once(tmp_path):
    """Two processes log into one SQLite file at the same time, no server between them:
    every call goes through (docs/pipeline.md measures 2 x 2,000)."""
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    uri, n = f"sqlite:///{db}", 100
    MlflowClient(uri).search_experiments()  # the schema, before the race
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, uri, key, str(n)], cwd=REPO,
                                env=pipeline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for key in ("a", "b")]
    outs = [w.communicate(timeout=300) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outs
    assert [o[0].split() for o in outs] == [[str(n), "0"]] * 2  # all logged, none failed
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("two-writers").experiment_id])
    assert sorted(r.data.tags["run_key"] for r in runs) == ["a", "b"]
    for r in runs:
        assert len(client.get_metric_history(r.info.run_id, "x")) == n
        assert r.info.status == "FINISHED"


def test_a_sqlite_tracking_uri_is_written_by_the_driver_directly(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from pipelines import plan as planning
    from pipelines.records import TrackingRecord
    from pipelines.stages import trial_context, write_meta
    from pipelines.tracking import open_tracking

    monkeypatch.chdir(tmp_path)
    plan = planning.plan_new(root=tmp_path / "runs", name="sq", preset="debug", grid="tiny",
                             tracking_uri="sqlite:///user.db")
    write_meta(plan, status="running")
    runs = open_tracking(plan)
    ctx = trial_context(plan, {None: "0" * 64})  # the trials get nothing of MLflow
    assert "user.db" not in str(ctx) and not any("tracking" in k for k in vars(ctx))
    recorded = TrackingRecord.read(plan.layout.tracking_json)
    assert recorded.tracking_uri == plan.tracking_uri == f"sqlite:///{tmp_path / 'user.db'}"
    assert recorded == runs.record and recorded.parent_run_id == runs.parent
    # `resume` writes to the same file
    assert planning.plan_resume(root=tmp_path / "runs", name="sq").tracking_uri == \
        plan.tracking_uri
    assert processes_mentioning(str(tmp_path / "user.db")) == []  # no server process
    client = MlflowClient(plan.tracking_uri)
    assert client.get_run(runs.parent).data.tags["run_key"] == "sq"  # the runs are in that file
    exp = client.get_experiment(recorded.experiment_id)
    assert exp.artifact_location == (tmp_path / "mlartifacts" / "sq").as_uri()  # beside it


class TestLocalRay:
    """One local Ray instance (as the pipeline starts it) for the checks below."""

    @pytest.fixture(scope="class")
    @classmethod
    def local_ray(cls, tmp_path_factory):
        from pipelines import cluster
        from pipelines import plan as planning

        root = tmp_path_factory.mktemp("local-ray") / "runs"
        plan = planning.plan_new(root=root, name="local", preset="debug", grid="tiny",
                                 num_cpus=1)
        ray = cluster.init_ray(plan.ray_address, plan.num_cpus, plan.cluster)
        try:
            yield plan, ray
        finally:
            ray.shutdown()

    def test_listens_on_loopback_only(self, local_ray):
        _, ray = local_ray

        @ray.remote(num_cpus=0)
        def worker_pid() -> int:
            return os.getpid()

        ray.get(worker_pid.remote())  # a worker process listens too
        session = Path(ray._private.worker._global_node.get_session_dir_path()).name
        pids = {os.getpid(), *processes_mentioning(session)}
        for pid in list(pids):  # workers are the raylet's children, renamed ray::...
            try:
                pids |= {int(c) for c in
                         Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
            except OSError:
                pass
        listening = _listening(pids)
        names = {Path(_argv(pid)[0]).name for _, _, pid in listening}
        assert {"gcs_server", "raylet"} <= names, listening  # not vacuous
        assert [x for x in listening if not _is_loopback(x[0])] == []
        # multi-node support was off only while the local node started (cluster._switched)
        from ray._private import ray_constants
        assert ray_constants.ENABLE_RAY_CLUSTER is True  # Linux's value, restored

    def test_a_switched_constant_is_restored_after_an_error(self):
        import types

        from pipelines.cluster import _switched

        mod = types.SimpleNamespace(FLAG=True)
        with pytest.raises(RuntimeError), _switched(mod, "FLAG", False):
            assert mod.FLAG is False
            raise RuntimeError("ray.init failed")
        assert mod.FLAG is True

    def test_storage_check_passes_and_names_the_nodes_that_do_not_see_the_root(
            self, local_ray, monkeypatch):
        from pipelines import cluster
        from pipelines.driver import check_cluster
        from pipelines.layout import PipelineError

        plan, ray = local_ray
        root = plan.layout.root
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert not root.exists()
        assert len(cluster.check_storage(root, ray)) == 1
        assert not root.exists()  # made for the check, then removed with the token
        # a node with its own disk at that path reads no token there
        real = cluster.probe_storage
        with monkeypatch.context() as m:
            m.setattr(cluster, "probe_storage", lambda r, *a: real(f"{r}/elsewhere", *a))
            with pytest.raises(PipelineError) as err:
                cluster.check_storage(root, ray)
        assert f"1 of 1 Ray nodes do not see the storage root {root}" in str(err.value)
        assert "cannot read" in str(err.value) and not root.exists()
        # a node that cannot run the check (here: one that is not really there) is named,
        # and the driver stops before Stage 1 with what to configure
        lost = {**nodes[0], "NodeID": "ab" * 28, "NodeName": "10.9.9.9"}
        monkeypatch.setattr(ray, "nodes", lambda: [*nodes, lost])
        with pytest.raises(PipelineError) as err:
            check_cluster(plan, ray)
        text = str(err.value)
        assert f"1 of 2 Ray nodes do not see the storage root {root}" in text
        assert "10.9.9.9 (node abababababab)" in text and nodes[0]["NodeID"][:12] not in text
        assert "shared filesystem" in text and "same path on every node" in text


SHIPPED = """
import sys
sys.path.insert(0, sys.argv[1])  # the driver finds the code; nothing tells the workers
from pipelines.cluster import init_ray
ray = init_ray(None, 1)

@ray.remote(num_cpus=0)
def where():
    import pipelines.cluster, pmnet, tune_spaces
    return [pipelines.cluster.__file__, pmnet.__file__, tune_spaces.__file__]

print(*ray.get(where.remote()))
ray.shutdown()
"""


def test_workers_get_the_code_from_the_runtime_env(tmp_path):
    env = {k: v for k, v in pipeline_env().items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", SHIPPED, str(REPO)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    files = r.stdout.split()
    assert len(files) == 3
    # unpacked from the job's py_modules, not imported from this checkout or the venv
    assert all("/runtime_resources/py_modules_files/" in f for f in files), files
