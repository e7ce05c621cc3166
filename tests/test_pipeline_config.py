"""Pipeline checks that need no Ray runtime: fail-fast configuration errors, preset choice,
MLflow run naming and re-attachment, the Phase-1 hash gate, the on-disk status table."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import pytest

from pipelines import plan as planning
from pipelines import run, stages
from pipelines.layout import (
    Layout,
    PipelineError,
    read_json,
    trial_key,
    write_json,
)
from pipelines.status import status_text, trial_rows
from pipelines.tracking import Tracker, check_tracking_uri
from pipelines.trial import Phase1Refused, check_phase1
from pmnet.trial_id import TrialId
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
    with pytest.raises(PipelineError, match="not a writable directory"):
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


def test_preset_choice_follows_the_gpu():
    from pipelines.cluster import ClusterInfo, GpuCard, NodeInfo

    cpu_only = ClusterInfo((NodeInfo("head", 64),), where="the Ray cluster")
    assert planning.choose_preset(None, cpu_only)[0] == "cpu"
    worker = NodeInfo("w", 8, 1, (GpuCard("H100", 80 << 30),))
    with_gpu = ClusterInfo((NodeInfo("head", 64), worker), where="the Ray cluster")
    preset, why = planning.choose_preset(None, with_gpu)
    assert preset == "paper" and "1 node(s) of the Ray cluster have a GPU" in why
    assert planning.choose_preset("debug", with_gpu) == ("debug", "given with --preset / PRESET=")


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
    # a lost sidecar: the checkpoint still matches what Stage 1 recorded, so the driver
    # rewrites the sidecar instead of retraining Phase 1 (planning only reads)
    sidecar = Path(f"{lay.phase1_ckpt}.sha256")
    text = sidecar.read_text()
    sidecar.unlink()
    assert stages.existing_phase1(plan) == phase1["sha256"] and not sidecar.exists()
    assert stages.existing_phase1(plan, repair=True) == phase1["sha256"]
    assert sidecar.read_text() == text
    data = bytearray(lay.phase1_ckpt.read_bytes())
    data[-10] ^= 0x01
    lay.phase1_ckpt.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match="does not match its recorded sha256.*Delete"):
        stages.existing_phase1(plan)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()} if root.exists() else {}


def test_phase1_from_imports_a_checked_checkpoint_instead_of_training(tmp_path, phase1):
    src_dir = Path(phase1["checkpoint"]).parent
    plan = _plan(tmp_path, phase1_from=src_dir)  # a directory holding phase1.pt
    assert plan.phase1_from.sha256 == phase1["sha256"]
    assert not (tmp_path / "runs").exists()  # planning wrote nothing
    [job] = stages.stage1_start(plan, ray=None, cluster=plan.cluster)  # no Ray: nothing trains
    lay = plan.layout
    assert job.digest == phase1["sha256"] and job.ref is None
    assert lay.phase1_ckpt.read_bytes() == Path(phase1["checkpoint"]).read_bytes()
    assert not os.access(lay.phase1_ckpt, os.W_OK) or os.geteuid() == 0
    assert oct(lay.phase1_ckpt.stat().st_mode & 0o222) == "0o0"  # read-only, as trained
    info = read_json(lay.stage1_json)
    assert info["imported_from"] == str(Path(phase1["checkpoint"]).resolve())
    assert info["sha256"] == phase1["sha256"]
    assert info["config_hash"] == planning.phase1_config_hash(plan.cfg)
    assert read_json(lay.phase1_dir / "phase1_metrics.json")["test"] == \
        read_json(src_dir / "phase1_metrics.json")["test"]
    assert read_json(lay.pipeline_json)["phase1_from"]["sha256"] == phase1["sha256"]
    # from now on the run's own checkpoint is the one Stage 1 finds (a resume needs no source)
    assert stages.existing_phase1(plan) == phase1["sha256"]
    again = _plan(tmp_path, phase1_from=Path(phase1["checkpoint"]))  # same name, same file
    assert again.resumed and stages.stage1_start(again, None, again.cluster)[0].digest == job.digest
    # the run's checkpoint removed: resume imports it again from the recorded source
    for p in (lay.phase1_ckpt, Path(f"{lay.phase1_ckpt}.sha256")):
        p.chmod(0o644)
        p.unlink()
    resumed = planning.plan_resume(root=tmp_path / "runs", name="p")
    assert resumed.phase1_from.sha256 == phase1["sha256"]
    assert stages.stage1_start(resumed, None, resumed.cluster)[0].digest == phase1["sha256"]


@pytest.mark.parametrize("case, message", [
    ("missing", "no Phase-1 checkpoint there"),
    ("tampered", "does not match its recorded sha256"),
    ("no_sidecar", "no recorded sha256"),
    ("no_metrics", "phase1_metrics.json is missing"),
    ("other_phase1_config", "different Phase-1 configuration .*phase1_lr"),
    ("run_has_another", "already has a Phase-1 checkpoint"),
])
def test_phase1_from_refuses_what_it_cannot_vouch_for(tmp_path, phase1, case, message):
    src = Path(phase1["checkpoint"])
    d = tmp_path / "src"
    d.mkdir()
    for name in (src.name, f"{src.name}.sha256", "phase1_metrics.json"):
        (d / name).write_bytes((src.parent / name).read_bytes())
    kw = {}
    if case == "missing":
        (d / src.name).unlink()
    elif case == "tampered":
        data = bytearray((d / src.name).read_bytes())
        data[len(data) // 3] ^= 0x04
        (d / src.name).write_bytes(bytes(data))
    elif case == "no_sidecar":
        (d / f"{src.name}.sha256").unlink()
    elif case == "no_metrics":
        (d / "phase1_metrics.json").unlink()
    elif case == "other_phase1_config":
        kw["overrides"] = {"phase1_lr": 1e-2}
    elif case == "run_has_another":  # the run already finished Stage 1 with other weights
        import torch

        from pmnet.train import load_model_file, save_model_file

        plan = _plan(tmp_path)
        stages.write_meta(plan)
        plan.layout.phase1_dir.mkdir(parents=True)
        model, _ = load_model_file(src)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        digest = save_model_file(plan.layout.phase1_ckpt, model, fmt="pmnet-phase1/v1", meta={})
        assert digest != phase1["sha256"]
        write_json(plan.layout.stage1_json,
                   {"config_hash": planning.phase1_config_hash(plan.cfg), "sha256": digest})
    before = _tree(tmp_path / "runs")
    with pytest.raises(PipelineError, match=message):
        _plan(tmp_path, phase1_from=d, **kw)
    assert _tree(tmp_path / "runs") == before  # refused before anything was written


# -- MLflow naming and re-attachment ----------------------------------------------------------


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    return Tracker(f"sqlite:///{db}")


def test_trial_runs_are_named_and_reattached(tracker):
    assert TrialId("learned_full", 42).name == "learned_full-s42"
    key = trial_key("pipe", TrialId("learned_full", 42))
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
    write_json(lay.result_path(TrialId("learned_full", 42)), {
        "condition": "learned_full", "seed": 42, "val": {"updated_ltm": 55.0},
        "test": {"updated_ltm": 50.5}})
    write_json(lay.trial_dir(TrialId("learned_full", 42)) / "trial.json", {"mlflow_run_id": "abc"})
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
    with pytest.raises(ValueError, match="TrialContext.variants: invalid variant name"):
        TrialContext(root=str(tmp_path), name="p", train_config=cfg, phase1_sha256="a" * 64,
                     variants={"T4-s2": {}})
    with pytest.raises(ValueError, match="overrides of 'v' must be a dict"):
        TrialContext(root=str(tmp_path), name="p", train_config=cfg, phase1_sha256="a" * 64,
                     variants={"v": [("lr", 0.1)]})


def test_a_trials_configuration_is_its_variants_and_unknown_phase1_seeds_are_refused(tmp_path):
    from pipelines.trial import TrialContext, trial_config
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug")
    ctx = TrialContext(root=str(tmp_path), name="p", train_config=cfg.to_dict(),
                       phase1_sha256="a" * 64, cpus_per_trial=2.0,
                       variants={"": {}, "T4-truncated": {"segments": 4,
                                                          "ltm_graph": "truncated"}})
    got = trial_config(ctx, TrialId("consolidator_only", 42, "T4-truncated"))
    assert (got.segments, got.ltm_graph, got.threads) == (4, "truncated", 2)
    assert trial_config(ctx, TrialId("consolidator_only", 42)) == dataclasses.replace(
        cfg, threads=2)
    with pytest.raises(ValueError, match="the grid has no variant 'T8-full'"):
        trial_config(ctx, TrialId("consolidator_only", 42, "T8-full"))
    with pytest.raises(ValueError, match="no Phase-1 checkpoint for phase1_seed 1 .*single"):
        trial_config(ctx, TrialId("consolidator_only", 42, phase1_seed=1))


def test_a_trial_of_phase1_seed_k_starts_from_checkpoint_k(tmp_path):
    from pipelines.trial import TrialContext, trial_config, trial_phase1
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug")
    ctx = TrialContext(root=str(tmp_path), name="p", train_config=cfg.to_dict(),
                       phase1_sha256="a" * 64, phase1_sha256s={"1": "b" * 64, "2": "c" * 64})
    trial = TrialId("consolidator_only", 42, phase1_seed=2)
    path, sha = trial_phase1(ctx, trial)
    assert path == tmp_path / "p" / "phase1-p1s2" / "phase1.pt" and sha == "c" * 64
    assert trial_config(ctx, trial).phase1_seed == 2  # the checkpoint's own Phase-1 seed
    assert trial_config(ctx, TrialId("consolidator_only", 42, phase1_seed=1)).phase1_seed == 1
    with pytest.raises(ValueError, match="no Phase-1 checkpoint for phase1_seed 3 .*1, 2"):
        trial_phase1(ctx, TrialId("consolidator_only", 42, phase1_seed=3))
    with pytest.raises(ValueError, match="one Phase-1 checkpoint per Phase-1 seed .*names none"):
        trial_phase1(ctx, TrialId("consolidator_only", 42))
    with pytest.raises(ValueError, match="phase1_sha256s must be"):
        TrialContext(root=str(tmp_path), name="p", train_config=cfg.to_dict(),
                     phase1_sha256="a" * 64, phase1_sha256s={1: "b" * 64})


# -- tracking never stalls or kills a trial; what it missed is logged from the results --------


class FakeTune:
    """`tune.report` / `tune.get_checkpoint` for a trial run in this process, doing what
    Tune does with a reported checkpoint: copy its directory into storage (here, a list of
    {file name: size}) and hand the latest one to a retried attempt."""

    def __init__(self, storage: Path):
        self.storage, self.reports, self.latest = storage, [], None

    def report(self, metrics, checkpoint=None):
        import shutil

        from ray import tune

        files = None
        if checkpoint is not None:
            dest = self.storage / f"checkpoint_{len(self.reports):06d}"
            shutil.copytree(checkpoint.path, dest)
            files = {p.name: p.stat().st_size for p in dest.rglob("*") if p.is_file()}
            self.latest = tune.Checkpoint.from_directory(str(dest))
        self.reports.append({"metrics": dict(metrics), "files": files})

    def get_checkpoint(self):
        return self.latest


def run_trial_here(ctx, condition: str, seed: int, fake: FakeTune, variant: str = "") -> float:
    """pipelines.trial.train_trial in this process with FakeTune; the seconds it took."""
    import pipelines.trial as trial_mod

    fake.storage.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        from ray import tune

        mp.setattr(tune, "report", fake.report)
        mp.setattr(tune, "get_checkpoint", fake.get_checkpoint)
        mp.setattr(trial_mod, "_node_id", lambda: None)  # would start a Ray instance
        import torch

        threads = torch.get_num_threads()
        t0 = time.time()
        try:
            trial_mod.train_trial(TrialId(condition, seed, variant).to_config(), ctx)
        finally:
            torch.set_num_threads(threads)
    return time.time() - t0


def _trial_ctx(root: Path, phase1: dict, tracking_uri: str | None = None,
               experiment_id: str | None = None, variants: dict | None = None, **overrides):
    from pipelines.trial import TrialContext
    from pmnet.train import TrainConfig

    lay = Layout(root, "t")
    lay.phase1_dir.mkdir(parents=True, exist_ok=True)
    src = Path(phase1["checkpoint"])
    lay.phase1_ckpt.write_bytes(src.read_bytes())
    Path(f"{lay.phase1_ckpt}.sha256").write_bytes(Path(f"{src}.sha256").read_bytes())
    cfg = TrainConfig.from_name("debug", threads=1, **overrides).to_dict()
    return TrialContext(root=str(root), name="t", train_config=cfg,
                        phase1_sha256=phase1["sha256"], tracking_uri=tracking_uri,
                        experiment_id=experiment_id, variants=variants or {"": {}})


DEAD_TRIALS = (("consolidator_only", 42), ("learned_full", 43))


@pytest.fixture(scope="module")
def dead_server_trials(tmp_path_factory, phase1):
    """Two trials trained in this process while their tracking server is unreachable, with
    MLflow's own (minutes-long) retry settings in the environment."""
    root = tmp_path_factory.mktemp("dead") / "runs"
    uri = f"http://127.0.0.1:{_closed_port()}"
    ctx = _trial_ctx(root, phase1, tracking_uri=uri, experiment_id="1")
    out = {"root": root, "uri": uri, "lay": ctx.layout, "trials": {}}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7",
                     "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
                     "MLFLOW_HTTP_REQUEST_TIMEOUT": "120"}.items():
            mp.setenv(k, v)
        for c, s in DEAD_TRIALS:
            fake = FakeTune(root.parent / "tune" / TrialId(c, s).name)
            out["trials"][(c, s)] = {"fake": fake, "wall": run_trial_here(ctx, c, s, fake)}
        out["env_after"] = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    return out


def test_a_dead_tracking_server_neither_stalls_nor_kills_a_trial(dead_server_trials):
    from pipelines.tracking import TRACKING_LIMITS

    lay = dead_server_trials["lay"]
    for (c, s), t in dead_server_trials["trials"].items():
        # trained to the end: result on disk, final report to Tune
        res = read_json(lay.result_path(TrialId(c, s)))
        assert res["condition"] == c and "updated_ltm" in res["test"]
        assert t["fake"].reports[-1]["metrics"]["finished"] == 1
        # bounded: one failing call (refused: ~2 s) and then nothing waits for the server;
        # with MLflow's defaults (7 retries, backoff 2) the first call alone takes minutes
        assert t["wall"] < 60, t["wall"]
        info = read_json(lay.trial_dir(TrialId(c, s)) / "trial.json")
        assert info["state"] == "FINISHED"
        assert info["mlflow_pending"] is True
        assert "attaching" in info["mlflow_pending_reason"]
        assert dead_server_trials["uri"].split("//")[1] in info["mlflow_pending_reason"]
        assert "mlflow_run_id" not in info
    # the limits applied to the trial's calls only; the environment is left as it was
    assert dead_server_trials["env_after"] == "7"
    assert TRACKING_LIMITS.worst_case_s() < 40


def test_tune_checkpoints_carry_no_weights_and_name_the_trials_last_ckpt(dead_server_trials):
    lay = dead_server_trials["lay"]
    for (c, s), t in dead_server_trials["trials"].items():
        epochs = [r for r in t["fake"].reports if r["files"] is not None]
        assert len(epochs) == len(read_json(lay.result_path(TrialId(c, s)))["history"]) >= 1
        for r in epochs:  # only meta.json goes through Tune: no weights copied per epoch
            assert set(r["files"]) == {"meta.json"} and r["files"]["meta.json"] < 1024
        last = t["fake"].latest
        meta = json.loads((Path(last.path) / "meta.json").read_text())
        assert meta["last_ckpt"] == str(lay.trial_dir(TrialId(c, s)) / "ckpt" / "last.ckpt")
        assert meta["final"] is True and meta["epoch"] == epochs[-1]["metrics"]["epoch"]
        assert meta["last_ckpt_size"] == Path(meta["last_ckpt"]).stat().st_size


def test_tracking_limits_bound_a_server_that_never_answers(tmp_path):
    """MLflow applies the timeout and retry variables: a server that accepts connections
    but never answers costs (retries + 1) x timeout, not MLflow's 8 x 120 s."""
    from pipelines.tracking import HttpLimits, TrialTracking

    with socket.socket() as hung:  # listening, never accepting: connects, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        limits = HttpLimits(max_retries=1, backoff_factor=0, backoff_jitter=0.0, timeout_s=1,
                            cooldown_s=3600)
        tt = TrialTracking(uri, "1", key="t/x-s1", run_name="x-s1", parent_run_id=None,
                           tags={}, params={"lr": 1}, trial_json=tmp_path / "trial.json",
                           limits=limits)
        t0 = time.time()
        assert tt.attach() is False
        first = time.time() - t0
        for epoch in range(5):  # cooling down: skipped at once, not retried per epoch
            tt.log_epoch({"val/x": 1.0}, epoch)
        assert tt.record({"condition": "x", "seed": 1}, tmp_path / "r.json") is False
        total = time.time() - t0
    assert 1.5 < first < 10, first
    assert total - first < 1, total
    info = read_json(tmp_path / "trial.json")
    assert info["mlflow_pending"] is True and "Timeout" in info["mlflow_pending_reason"]


def test_backfill_logs_what_trials_could_not_from_their_result_files(dead_server_trials,
                                                                      tmp_path):
    from mlflow import MlflowClient

    from pipelines.tracking import Runs, Tracker, backfill_results

    lay = dead_server_trials["lay"]
    # still down: bounded, non-fatal, everything stays pending
    dead = Runs(tracker=Tracker(dead_server_trials["uri"]), uri=dead_server_trials["uri"],
                experiment_id="1")
    t0 = time.time()
    assert backfill_results(lay, dead) == {"logged": 0, "pending": 2}
    assert time.time() - t0 < 20
    assert all(read_json(lay.trial_dir(TrialId(c, s)) / "trial.json")["mlflow_pending"]
               for c, s in DEAD_TRIALS)

    # a real store; one trial already has a RUNNING run with epoch 0 logged (it died
    # during its final logging): that run is completed, not duplicated
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri)
    exp = tracker.experiment("pmnet/t")
    parent, _ = tracker.attach_run(exp, "t", run_name="t")
    c1, s1 = DEAD_TRIALS[1]
    early, _ = tracker.attach_run(exp, trial_key("t", TrialId(c1, s1)),
                                  run_name=TrialId(c1, s1).name, parent_run_id=parent)
    tracker.log_metrics(early, {"epoch": 0, "val/updated_ltm": 1.0}, step=0)
    runs = Runs(tracker=tracker, uri=uri, experiment_id=exp, parent=parent)
    assert backfill_results(lay, runs) == {"logged": 2, "pending": 0}

    client = MlflowClient(uri)
    for c, s in DEAD_TRIALS:
        res = read_json(lay.result_path(TrialId(c, s)))
        found = client.search_runs([exp], f"tags.trial_key = '{trial_key('t', TrialId(c, s))}'")
        assert len(found) == 1
        run = found[0]
        assert run.info.status == "FINISHED" and run.info.run_name == TrialId(c, s).name
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.tags["phase1_sha256"] == res["phase1_sha256"]
        assert run.data.params["model.hidden"] == "32" and run.data.params["seed"] == str(s)
        assert run.data.metrics["test/updated_ltm"] == pytest.approx(res["test"]["updated_ltm"])
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "epoch"))
        assert steps == [h["epoch"] for h in res["history"]]  # each epoch once
        assert [a.path for a in client.list_artifacts(run.info.run_id, "result")] == [
            f"result/{TrialId(c, s).name}.json"]
        info = read_json(lay.trial_dir(TrialId(c, s)) / "trial.json")
        assert info["mlflow_run_id"] == run.info.run_id and info["mlflow_pending"] is False
        assert "mlflow_pending_reason" not in info
    assert client.search_runs([exp], f"tags.trial_key = '{trial_key('t', TrialId(c1, s1))}'")[
        0].info.run_id == early
    # nothing left: a second pass logs nothing and duplicates nothing
    assert backfill_results(lay, runs) == {"logged": 0, "pending": 0}
    assert len(client.get_metric_history(early, "epoch")) == len(
        read_json(lay.result_path(TrialId(c1, s1)))["history"])


def _report_state(ckpt: Path) -> dict:
    import torch

    states = torch.load(ckpt, weights_only=True)["callbacks"]
    return next(v for k, v in states.items() if "TuneReport" in k)


def test_a_trial_resumed_from_its_last_ckpt_equals_an_uninterrupted_one(
        tmp_path, phase1, dead_server_trials, monkeypatch):
    """The retry resumes from the trial directory's last.ckpt (Tune holds only meta.json),
    with the report callback's and EarlyStopping's state: same result, same reported best."""
    from pipelines.trial import FAULT_ENV

    c, s = DEAD_TRIALS[0]
    ref = dead_server_trials["trials"][(c, s)]["fake"].reports  # uninterrupted, same config
    ref_result = read_json(dead_server_trials["lay"].result_path(TrialId(c, s)))
    ctx = _trial_ctx(tmp_path / "runs", phase1)
    monkeypatch.setenv(FAULT_ENV, str(tmp_path / "markers"))
    fake = FakeTune(tmp_path / "tune")
    with pytest.raises(RuntimeError, match="injected fault after epoch 0"):
        run_trial_here(ctx, c, s, fake)
    lay = ctx.layout
    last = lay.trial_dir(TrialId(c, s)) / "ckpt" / "last.ckpt"
    # last.ckpt holds the report callback's state after epoch 0, although it is written
    # before that callback's epoch-end hook runs
    assert _report_state(last) == {"best": pytest.approx(
        ref_result["history"][0][f"val/{ref_result['select']}"], rel=1e-6), "final": False}
    run_trial_here(ctx, c, s, fake)  # the retry, handed Tune's latest checkpoint
    assert _report_state(last)["final"] is True
    tries = [json.loads(line) for line in
             (lay.trial_dir(TrialId(c, s)) / "attempts.jsonl").read_text().splitlines()]
    assert len(tries) == 2 and tries[0]["resume_from"] is None
    assert tries[1]["resume_from"] == str(lay.trial_dir(TrialId(c, s)) / "ckpt" / "last.ckpt")
    assert tries[1]["resume_epoch"] == 0 and tries[1]["tune_checkpoint_epoch"] == 0
    got = read_json(lay.result_path(TrialId(c, s)))
    for key in ("test", "val", "best_epoch", "history"):
        assert got[key] == ref_result[key], key

    def per_epoch(reports):
        return [(r["metrics"]["epoch"], r["metrics"].get("best/select"), set(r["files"]))
                for r in reports if r["files"] is not None]

    assert per_epoch(fake.reports) == per_epoch(ref)  # epoch 0, then 1 after the resume


# -- services: sqlite: URIs, the per-store server registry, the storage probe ----------------


def test_sqlite_tracking_uri_is_made_absolute_and_recorded_for_resume(tmp_path, monkeypatch):
    from pipelines.mlflow_server import served_backend

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match="does not exist"):  # nothing is created
        _plan(tmp_path, tracking_uri="sqlite:///store/user.db")
    assert not (tmp_path / "store").exists()
    (tmp_path / "store").mkdir()
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


def test_a_pipeline_recorded_before_new_config_fields_still_continues(tmp_path):
    plan = _plan(tmp_path)
    stages.write_meta(plan, status="finished")
    stored = json.loads(plan.layout.config_json.read_text())
    for key in ("segments", "ltm_graph"):  # fields added after this pipeline was recorded
        stored.pop(key)
    plan.layout.config_json.write_text(json.dumps(stored))
    assert _plan(tmp_path).resumed  # same configuration: it continues, nothing "differs"
    with pytest.raises(PipelineError, match="max_epochs differ"):
        _plan(tmp_path, overrides={"max_epochs": 5})


# -- variants: identity, records, status, a variant trial ----------------------------------


def test_a_pipeline_recorded_before_variants_resumes_with_its_trials_named_as_before(tmp_path):
    plan = _plan(tmp_path)
    stages.write_meta(plan, status="finished")
    meta = json.loads(plan.layout.pipeline_json.read_text())
    assert set(meta["grid"]) == {"conditions", "seeds"}  # a default grid is recorded as before
    del meta["space"]["variants"]  # what a pipeline.json of the previous version holds
    plan.layout.pipeline_json.write_text(json.dumps(meta))
    resumed = planning.plan_resume(root=tmp_path / "runs", name="p")
    assert resumed.space == plan.space and not resumed.space.has_variants
    assert [t.name for t in resumed.space.trials] == [
        "learned_full-s42", "consolidator_only-s42", "learned_full-s43", "consolidator_only-s43"]
    assert _plan(tmp_path).resumed  # `start` with the same configuration continues it
    assert [r["trial"] for r in trial_rows(plan.layout)] == [t.name for t in plan.space.trials]


def test_variants_are_part_of_a_pipelines_identity_and_refused_bad_in_its_record(tmp_path):
    plan = _plan(tmp_path, grid="segments", variants="T2-full", seeds="42")
    stages.write_meta(plan, status="finished")
    grid = json.loads(plan.layout.pipeline_json.read_text())["grid"]
    assert grid == {"conditions": ["consolidator_only"], "seeds": [42],
                    "variants": {"T2-full": {"ltm_graph": "full", "segments": 2}}}
    assert _plan(tmp_path, grid="segments", variants="T2-full", seeds="42").resumed
    with pytest.raises(PipelineError, match=r"\(grid differ\)"):
        _plan(tmp_path, grid="segments", variants="T2-full,T4-full", seeds="42")
    meta = json.loads(plan.layout.pipeline_json.read_text())
    meta["space"]["variants"][0]["overrides"]["phase1_lr"] = 0.1
    plan.layout.pipeline_json.write_text(json.dumps(meta))
    with pytest.raises(PipelineError, match="'space' record is not valid .*phase1_lr"):
        planning.plan_resume(root=tmp_path / "runs", name="p")


def test_status_shows_the_variant_of_each_trial(tmp_path):
    plan = _plan(tmp_path, grid="segments", variants="T2-full,T4-truncated", seeds="42")
    lay = plan.layout
    stages.write_meta(plan, status="running", driver={"pid": 2 ** 22 + 12345,
                                                       "host": socket.gethostname()})
    done = TrialId("consolidator_only", 42, "T4-truncated")
    write_json(lay.result_path(done), {**done.to_config(), "val": {"updated_ltm": 33.0},
                                       "test": {"updated_ltm": 30.5}})
    running = TrialId("consolidator_only", 42, "T2-full")
    state = {"trial_data": [[json.dumps({"config": running.to_config(), "status": "ERROR"}),
                             json.dumps({"num_failures": 3, "last_result": {}})]]}
    write_json(lay.experiment_dir / "experiment_state-2026.json", state)
    write_json(lay.trial_dir(running) / "trial.json", {"state": "ERROR", "error": "boom"})
    rows = {r["trial"]: r for r in trial_rows(lay)}
    assert list(rows) == ["consolidator_only-T2-full-s42", "consolidator_only-T4-truncated-s42"]
    assert rows[done.name]["state"] == "FINISHED" and rows[done.name]["variant"] == "T4-truncated"
    assert rows[done.name]["test updated_ltm"] == 30.5
    assert rows[running.name]["state"] == "ERROR" and rows[running.name]["failures"] == 3
    text = status_text(lay)
    header = text.split("\n\n")[1].splitlines()[0].split()
    assert header[:3] == ["condition", "variant", "seed"]
    assert "consolidator_only-T2-full-s42: boom" in text
    # a grid without variants keeps its table as it was
    plain = _plan(tmp_path, name="q")
    stages.write_meta(plain, status="finished")
    table = status_text(plain.layout).split("\n\n")[1]
    assert table.splitlines()[0].split()[:3] == ["condition", "seed", "state"]
    assert len(table.splitlines()) == 2 + 4 and "default" not in table


def test_a_variant_trial_trains_its_variants_configuration_and_records_the_variant(
        tmp_path, phase1):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = Tracker(uri).experiment("pmnet/t")
    overrides = {"segments": 3, "ltm_graph": "truncated"}
    ctx = _trial_ctx(tmp_path / "runs", phase1, tracking_uri=uri, experiment_id=exp,
                     variants={"": {}, "T3-truncated": overrides})
    trial = TrialId("consolidator_only", 42, "T3-truncated")
    fake = FakeTune(tmp_path / "tune")
    run_trial_here(ctx, trial.condition, trial.seed, fake, variant=trial.variant)
    lay = ctx.layout
    path = lay.results_dir / "consolidator_only-T3-truncated-s42.json"
    assert path == lay.result_path(trial)
    res = read_json(path)
    assert res["variant"] == "T3-truncated" and res["variant_overrides"] == overrides
    assert res["config"]["segments"] == 3 and res["config"]["ltm_graph"] == "truncated"
    assert {"final_ltm_seg1", "final_ltm_seg2", "seg3_stm"} <= set(res["test"])  # T = 3 ran
    info = read_json(lay.trial_dir(trial) / "trial.json")
    assert info["state"] == "FINISHED" and info["variant"] == "T3-truncated"
    assert info["variant_overrides"] == overrides and not info["mlflow_pending"]
    assert all(r["metrics"]["variant"] == "T3-truncated" for r in fake.reports)
    meta = json.loads((Path(fake.latest.path) / "meta.json").read_text())
    assert meta["variant"] == "T3-truncated"
    run = MlflowClient(uri).search_runs(
        [exp], "tags.trial_key = 't/consolidator_only-T3-truncated-s42'")[0]
    assert run.info.run_name == trial.name and run.data.tags["variant"] == "T3-truncated"
    params = run.data.params
    assert params["variant"] == "T3-truncated" and params["variant.segments"] == "3"
    assert params["segments"] == "3" and params["ltm_graph"] == "truncated"
    # a default trial of the same pipeline: result and params exactly as before variants
    run_trial_here(ctx, "consolidator_only", 42, FakeTune(tmp_path / "tune2"))
    plain = read_json(lay.results_dir / "consolidator_only-s42.json")
    assert "variant" not in plain and "variant_overrides" not in plain
    assert plain["config"]["segments"] == 2
    run = MlflowClient(uri).search_runs(
        [exp], "tags.trial_key = 't/consolidator_only-s42'")[0]
    assert "variant" not in run.data.tags and "variant" not in run.data.params
