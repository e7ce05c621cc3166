"""Pipeline checks that need no Ray runtime: fail-fast configuration errors, preset choice,
MLflow run naming and re-attachment, the Phase-1 hash gate, the on-disk status table."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from pipelines import plan as planning
from pipelines import run, stages
from pipelines.layout import Layout, PipelineError, trial_key, trial_name, write_json
from pipelines.status import status_text, trial_rows
from pipelines.tracking import Tracker, check_tracking_uri
from pipelines.trial import Phase1Refused, check_phase1
from tune_spaces import SpaceError


def _plan(tmp_path, **kw):
    kw.setdefault("preset", "debug")
    kw.setdefault("grid", "tiny")
    return planning.plan_new(root=tmp_path / "runs", name=kw.pop("name", "p"), **kw)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- fail fast ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, error, message", [
    ({"conditions": "learned_full,not_a_condition"}, SpaceError, "unknown condition"),
    ({"seeds": ""}, SpaceError, "seed list is empty"),
    ({"gpus_per_trial": 1.5}, SpaceError, "fraction of one GPU"),
    ({"cpus_per_trial": 0}, SpaceError, "cpus_per_trial"),
    ({"preset": "huge"}, PipelineError, "unknown preset"),
    ({"overrides": {"no_such_field": 1}}, PipelineError, "bad training configuration"),
    ({"overrides": {"max_epochs": 0}}, PipelineError, "max_epochs"),
    ({"grid": "nope"}, SpaceError, "unknown grid"),
    ({"name": "../escape"}, PipelineError, "invalid pipeline name"),
])
def test_bad_configuration_fails_before_anything_starts(tmp_path, kw, error, message):
    with pytest.raises(error, match=message):
        _plan(tmp_path, **kw)
    assert not (tmp_path / "runs" / "p").exists()


def test_storage_root_that_is_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PipelineError, match="not writable"):
        planning.plan_new(root=blocker / "runs", preset="debug", grid="tiny")


def test_unreachable_tracking_server_fails_fast(tmp_path, monkeypatch):
    uri = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.time()
    with pytest.raises(PipelineError, match="unreachable"):
        _plan(tmp_path, tracking_uri=uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(PipelineError, match="unreachable"):
        _plan(tmp_path)
    assert time.time() - t0 < 20
    check_tracking_uri(f"sqlite:///{tmp_path}/ok.db")  # a writable local store is fine


def test_cli_reports_configuration_errors_with_exit_code_2(tmp_path, capsys):
    rc = run.main(["start", "--preset", "debug", "--root", str(tmp_path), "--seeds", "",
                   "--name", "x"])
    assert rc == 2
    assert "seed list is empty" in capsys.readouterr().err
    rc = run.main(["start", "--preset", "debug", "--root", str(tmp_path), "--name", "y",
                   "--gpus-per-trial", "2"])
    assert rc == 2 and "fraction of one GPU" in capsys.readouterr().err
    rc = run.main(["status", "--root", str(tmp_path / "empty")])
    assert rc == 2 and "no pipeline" in capsys.readouterr().err


def test_preset_choice_follows_the_gpu(monkeypatch):
    monkeypatch.setattr(planning, "cuda_available", lambda: False)
    assert planning.choose_preset(None)[0] == "cpu"
    monkeypatch.setattr(planning, "cuda_available", lambda: True)
    preset, why = planning.choose_preset(None)
    assert preset == "paper" and "CUDA" in why
    assert planning.choose_preset("debug") == ("debug", "given with --preset / PRESET=")


def test_overrides_and_lists_are_parsed():
    assert planning.parse_overrides(["max_epochs=3", "model.hidden=32", "precision=32-true",
                                   "betas=[0.9, 0.99]"]) == {
        "max_epochs": 3, "model.hidden": 32, "precision": "32-true", "betas": (0.9, 0.99)}
    with pytest.raises(PipelineError, match="KEY=VALUE"):
        planning.parse_overrides(["oops"])


def test_same_name_same_config_continues_different_config_refuses(tmp_path):
    plan = _plan(tmp_path)
    assert not plan.resumed
    stages.write_meta(plan, status="finished")
    again = _plan(tmp_path)
    assert again.resumed
    with pytest.raises(PipelineError, match="different configuration.*max_epochs"):
        _plan(tmp_path, overrides={"max_epochs": 5})
    with pytest.raises(PipelineError, match="grid"):
        _plan(tmp_path, seeds="42")
    resumed = planning.plan_resume(root=tmp_path / "runs")
    assert resumed.name == "p" and resumed.cfg == plan.cfg and resumed.space == plan.space


# -- the Phase-1 hash gate --------------------------------------------------------------------


@pytest.fixture(scope="module")
def phase1(tmp_path_factory):
    from pipelines.trial import quiet_training_logs

    quiet_training_logs()
    import torch

    from pmnet.train import TrainConfig, run_phase1

    out = tmp_path_factory.mktemp("phase1")
    cfg = TrainConfig.from_name("debug", threads=1)
    threads = torch.get_num_threads()
    try:
        return run_phase1(cfg, out, progress=False)
    finally:
        torch.set_num_threads(threads)


def test_phase1_gate_refuses_tampered_or_foreign_checkpoints(tmp_path, phase1):
    src = Path(phase1["checkpoint"])
    ck = tmp_path / "phase1.pt"
    ck.write_bytes(src.read_bytes())
    Path(f"{ck}.sha256").write_bytes(Path(f"{src}.sha256").read_bytes())
    assert check_phase1(ck, phase1["sha256"]) == phase1["sha256"]
    with pytest.raises(Phase1Refused, match="not the .* that Stage 1 recorded"):
        check_phase1(ck, "0" * 64)
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ck.write_bytes(bytes(data))
    with pytest.raises(Phase1Refused, match="does not match its recorded sha256"):
        check_phase1(ck, phase1["sha256"])
    with pytest.raises(Phase1Refused, match="not found"):
        check_phase1(tmp_path / "missing.pt", None)


def test_stage1_is_idempotent_and_never_retrains_over_a_tampered_checkpoint(tmp_path, phase1):
    plan = _plan(tmp_path)
    lay = plan.layout
    assert stages.existing_phase1(plan) is None  # nothing yet: Stage 1 must run
    lay.phase1_dir.mkdir(parents=True)
    src = Path(phase1["checkpoint"])
    lay.phase1_ckpt.write_bytes(src.read_bytes())
    Path(f"{lay.phase1_ckpt}.sha256").write_bytes(Path(f"{src}.sha256").read_bytes())
    assert stages.existing_phase1(plan) is None  # no record of the config it was made for
    write_json(lay.stage1_json, {"config_hash": planning.phase1_config_hash(plan.cfg),
                                 "sha256": phase1["sha256"]})
    assert stages.existing_phase1(plan) == phase1["sha256"]  # valid: Stage 1 is skipped
    other = _plan(tmp_path, name="q", overrides={"phase1_lr": 1e-2})
    assert planning.phase1_config_hash(other.cfg) != planning.phase1_config_hash(plan.cfg)
    same_p1 = _plan(tmp_path, name="r", overrides={"max_epochs": 3})  # Phase-2-only change
    assert planning.phase1_config_hash(same_p1.cfg) == planning.phase1_config_hash(plan.cfg)
    data = bytearray(lay.phase1_ckpt.read_bytes())
    data[-10] ^= 0x01
    lay.phase1_ckpt.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match="does not match its recorded sha256.*Delete"):
        stages.existing_phase1(plan)


# -- MLflow naming and re-attachment ----------------------------------------------------------


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    return Tracker(f"sqlite:///{db}")


def test_trial_runs_are_named_and_reattached(tracker):
    assert trial_name("learned_full", 42) == "learned_full-s42"
    key = trial_key("pipe", "learned_full", 42)
    assert key == "pipe/learned_full-s42"
    exp = tracker.experiment("pmnet/pipe")
    assert tracker.experiment("pmnet/pipe") == exp  # get, not create twice
    parent, created = tracker.attach_run(exp, "pipe", run_name="pipe")
    assert created
    rid, created = tracker.attach_run(exp, key, run_name="learned_full-s42",
                                      parent_run_id=parent,
                                      tags={"condition": "learned_full", "seed": 42})
    assert created
    tracker.log_params_once(rid, {"lr": 0.001, "model.hidden": 32})
    tracker.log_metrics(rid, {"val/updated_ltm": 10.0, "epoch": 0}, step=0)
    tracker.finish(rid, "FAILED")
    # a retried / resumed trial finds the same run, by tag or by id
    again, created = tracker.attach_run(exp, key, run_name="learned_full-s42",
                                        parent_run_id=parent, tags={"seed": 42})
    assert again == rid and not created
    assert tracker.attach_run(exp, key, run_name="x", run_id=rid) == (rid, False)
    run_ = tracker.client.get_run(rid)
    assert run_.info.status == "RUNNING" and run_.info.run_name == "learned_full-s42"
    assert run_.data.tags["run_key"] == key and run_.data.tags["condition"] == "learned_full"
    assert run_.data.tags["mlflow.parentRunId"] == parent
    # params: identical values are not re-sent; a different value is reported, not a crash
    assert tracker.log_params_once(rid, {"lr": 0.001, "model.hidden": 32, "new": "x"}) == []
    assert tracker.log_params_once(rid, {"lr": 0.5}) == ["lr"]
    assert tracker.client.get_run(rid).data.params == {"lr": "0.001", "model.hidden": "32",
                                                       "new": "x"}
    assert tracker.logged_steps(rid, "epoch") == {0}
    assert len(tracker.client.search_runs([exp], f"tags.run_key = '{key}'")) == 1


# -- status from disk -----------------------------------------------------------------------


def test_status_reads_results_and_tune_state_from_disk(tmp_path):
    plan = _plan(tmp_path)
    lay: Layout = plan.layout
    stages.write_meta(plan, status="running", driver={"pid": 2 ** 22 + 12345,
                                                       "host": socket.gethostname()})
    write_json(lay.result_path("learned_full", 42), {
        "condition": "learned_full", "seed": 42, "val": {"updated_ltm": 55.0},
        "test": {"updated_ltm": 50.5}})
    write_json(lay.trial_dir("learned_full", 42) / "trial.json", {"mlflow_run_id": "abc"})
    state = {"trial_data": [[json.dumps({"config": {"condition": "consolidator_only",
                                                    "seed": 42}, "status": "RUNNING"}),
                             json.dumps({"num_failures": 1,
                                         "last_result": {"best/select": 12.5, "epoch": 0}})]]}
    write_json(lay.experiment_dir / "experiment_state-2026.json", state)
    rows = {(r["condition"], r["seed"]): r for r in trial_rows(lay)}
    assert rows[("learned_full", 42)]["state"] == "FINISHED"
    assert rows[("learned_full", 42)]["test updated_ltm"] == 50.5
    assert rows[("learned_full", 42)]["mlflow run"] == "abc"
    # the recorded driver is gone, so a RUNNING trial was interrupted
    assert rows[("consolidator_only", 42)]["state"] == "INTERRUPTED"
    assert rows[("consolidator_only", 42)]["failures"] == 1
    assert rows[("learned_full", 43)]["state"] == "NOT STARTED"
    text = status_text(lay)
    assert "interrupted" in text and "learned_full-s" not in text.split("\n")[0]
    assert len(rows) == 4


def test_trial_context_is_typed_and_validated(tmp_path):
    from pipelines.trial import TrialContext
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug").to_dict()
    ok = TrialContext(root=str(tmp_path), name="p", train_config=cfg, phase1_sha256="a" * 64,
                      cpus_per_trial=2.0)
    assert ok.layout.phase1_ckpt == tmp_path / "p" / "phase1" / "phase1.pt"
    assert ok.threads == 2 and not ok.tracking
    with pytest.raises(ValueError, match="absolute"):
        TrialContext(root="runs", name="p", train_config=cfg, phase1_sha256="a" * 64)
    with pytest.raises(ValueError, match="sha256"):
        TrialContext(root=str(tmp_path), name="p", train_config=cfg, phase1_sha256="abc")
    with pytest.raises(ValueError, match="go together"):
        TrialContext(root=str(tmp_path), name="p", train_config=cfg, phase1_sha256="a" * 64,
                     tracking_uri="http://127.0.0.1:5000")
    with pytest.raises(PipelineError, match="invalid pipeline name"):
        TrialContext(root=str(tmp_path), name="../x", train_config=cfg, phase1_sha256="a" * 64)


# -- services: sqlite: URIs, the per-store server registry, the storage probe ----------------


def test_sqlite_tracking_uri_is_made_absolute_and_recorded_for_resume(tmp_path, monkeypatch):
    from pipelines.mlflow_server import served_backend

    monkeypatch.chdir(tmp_path)
    plan = _plan(tmp_path, tracking_uri="sqlite:///store/user.db")
    absolute = f"sqlite:///{tmp_path / 'store' / 'user.db'}"
    assert plan.tracking_uri == absolute  # the same file from any directory
    assert served_backend(plan.tracking_uri, plan.layout.root) == absolute  # served, not shared
    assert served_backend(None, plan.layout.root) == f"sqlite:///{plan.layout.mlflow_db}"
    assert served_backend("http://127.0.0.1:5000", plan.layout.root) is None
    stages.write_meta(plan, status="running")
    monkeypatch.chdir(tmp_path / "runs")
    assert planning.plan_resume(root=tmp_path / "runs").tracking_uri == absolute
    with pytest.raises(PipelineError, match="in-memory"):
        _plan(tmp_path, name="mem", tracking_uri="sqlite://")


def test_store_registry_counts_only_live_clients(tmp_path):
    import subprocess
    import sys

    from pipelines.mlflow_guard import (
        StoreFiles,
        add_client,
        live_clients,
        registered_guard_alive,
        remove_client,
    )

    store = StoreFiles(tmp_path / "mlflow.db")
    mine = add_client(store)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = add_client(store, dead.pid)
    assert live_clients(store) == [os.getpid()]
    assert not gone.exists()  # a dead client's file is dropped
    remove_client(mine)
    assert live_clients(store) == []
    assert registered_guard_alive({"pid": os.getpid(), "hostname": socket.gethostname(),
                                   "start": None})
    assert not registered_guard_alive({"pid": dead.pid, "hostname": socket.gethostname()})
    assert not registered_guard_alive({"pid": os.getpid(), "hostname": "another-host"})


def test_storage_probe_says_why_a_node_does_not_see_the_root(tmp_path):
    from pipelines.cluster import probe_storage

    root = tmp_path / "shared"
    root.mkdir()
    (root / ".token").write_text("abc\n")
    assert probe_storage(str(root), ".token", "abc\n") is None
    assert sorted(p.name for p in root.iterdir()) == [".token"]  # its own write is removed
    local = tmp_path / "local-disk"  # what a node without the shared mount has at that path
    local.mkdir()
    assert "cannot read" in probe_storage(str(local), ".token", "abc\n")
    (local / ".token").write_text("another driver's token\n")
    assert "different filesystem" in probe_storage(str(local), ".token", "abc\n")
    assert "cannot read" in probe_storage(str(tmp_path / "not-mounted"), ".token", "abc\n")
