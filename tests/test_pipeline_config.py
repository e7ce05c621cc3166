"""Pipeline checks that need no Ray runtime: fail-fast configuration errors, preset choice,
MLflow run naming and re-attachment, the Phase-1 hash gate, the on-disk status table."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import socket
import time
from pathlib import Path

import pytest

from pipelines import plan as planning
from pipelines import run, stages
from pipelines.addresses import check_tracking_uri
from pipelines.layout import (
    Layout,
    PipelineError,
    read_json,
    trial_key,
    write_json,
)
from pipelines.phase1 import Phase1Refused, check_phase1, existing_phase1, phase1_config_hash
from pipelines.status import status_text, trial_rows
from pipelines.tracking import Tracker
from pmnet.trial_id import TrialId
from tests.support.net import free_port
from tests.support.trials import FakeTune, run_trial_here, trial_ctx
from tune_spaces import SpaceError


def _plan(tmp_path, **kw):
    kw.setdefault("preset", "debug")
    kw.setdefault("grid", "tiny")
    return planning.plan_new(root=tmp_path / "runs", name=kw.pop("name", "p"), **kw)


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
    uri = f"http://127.0.0.1:{free_port()}"
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


def test_the_preset_choice_and_the_gpu_refusal_read_the_registry(monkeypatch, tmp_path,
                                                                capsys):
    """Issue 63: which preset the pipeline takes without --preset, and which one it refuses to
    train on CPUs, are fields of the preset's entry (`default_on`, `needs_gpu`), not names in
    the pipeline: moved to other entries, the pipeline follows them."""
    from pipelines.cluster import ClusterInfo, NodeInfo
    from pmnet.config import PRESETS

    cpu_only = ClusterInfo((NodeInfo("head", 64),), where="the Ray cluster")
    for name in PRESETS:
        monkeypatch.setitem(PRESETS, name, dataclasses.replace(
            PRESETS[name], default_on=None, needs_gpu=False))
    monkeypatch.setitem(PRESETS, "debug", dataclasses.replace(
        PRESETS["debug"], default_on="cpu", needs_gpu=True))
    assert planning.choose_preset(None, cpu_only)[0] == "debug"
    with pytest.raises(PipelineError, match=r"the debug preset is built for a GPU.*choose the "
                                            r"debug preset \(PRESET=debug\)"):
        _plan(tmp_path, cluster=cpu_only)
    assert _plan(tmp_path, cluster=cpu_only, allow_cpu_paper=True).cfg.preset == "debug"
    # the help lists the registry's names and defaults as they are now
    monkeypatch.setitem(PRESETS, "paper", dataclasses.replace(PRESETS["paper"], default_on="gpu"))
    with pytest.raises(SystemExit):
        run.main(["start", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert " | ".join(PRESETS) in help_text
    assert "default: paper when a node has a GPU, debug otherwise" in help_text
    assert "built for a GPU (debug)" in help_text


# -- no pipeline code names a preset (issue 63) ----------------------------------------------

REPO = Path(__file__).resolve().parents[1]

#: "cpu" is a preset's name and also an accelerator's (`pmnet.config.ACCELERATORS`) and Tune's
#: resource key. These are the places of pipelines/ that spell it, as that word: (module,
#: function) -> (how many times, why). Any other occurrence fails: a new place spelling it
#: adds its line here with the reason, and a place that means the preset reads the preset's
#: entry instead (`pmnet.config.PRESETS`, `TrainConfig.needs_gpu`, `default_preset`).
ACCELERATOR_WORDS: dict[tuple[str, str], tuple[int, str]] = {
    ("driver.py", "_execute"): (1, "the units' accelerator: 'gpu' if the grid uses one"),
    ("plan.py", "choose_preset"): (1, "default_preset('cpu'): the default on GPU-less nodes"),
    ("plan.py", "fit_to_cluster"): (1, "default_preset('cpu'), named in the GPU refusal"),
    ("provenance.py", "device_kind"): (1, "the default of its `accelerator` argument"),
    ("run.py", "build_parser"): (1, "default_preset('cpu') in the --preset help"),
    ("stages.py", "stage1"): (1, "Tune's resource key of a Phase-1 trial: {'cpu': ...}"),
    ("trial.py", "assigned_device"): (2, "the device Ray gave a trial: 'gpu', else 'cpu'"),
}


def _string_constants(path: Path, words: set[str]) -> list[tuple[str, int, str]]:
    """(innermost enclosing function or class, line, word) of every string constant of
    `path` that is one of `words` (docstrings and other prose are whole strings: not words)."""
    import ast

    out = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Constant) and child.value in words:
                out.append((where, child.lineno, child.value))
            visit(child, where)

    visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return out


def _preset_comparisons(path: Path) -> list[str]:
    """`line: source` of every comparison in `path` between something that names a preset
    (`cfg.preset`, a `preset` variable, `result["preset"]`, `.get("preset")`) and a string
    constant or a collection of them: behaviour keyed on a preset's name."""
    import ast

    text = path.read_text(encoding="utf-8")

    def names_preset(node) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr == "preset")
                   or (isinstance(n, ast.Name) and n.id == "preset")
                   or (isinstance(n, ast.Constant) and n.value == "preset")
                   for n in ast.walk(node))

    def constant_strings(node) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(names_preset(a) for a in sides) and any(constant_strings(a) for a in sides):
                found.append(f"{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_no_pipeline_code_names_a_preset(tmp_path):
    """Issue 63: the pipeline keys nothing on a preset's name. (1) No preset name is a string
    constant anywhere in pipelines/, except "cpu" where it is the accelerator's word, in the
    exact places ACCELERATOR_WORDS lists with their reasons; (2) nowhere in pipelines/,
    tune_spaces/ or pmnet/report/ is a preset compared with a name (`cfg.preset == ...`,
    `result["preset"] in (...)`), which (1) alone would let through for "cpu"."""
    from pmnet.config import ACCELERATORS, PRESETS

    names = set(PRESETS)
    words = names & set(ACCELERATORS)  # preset names that are ordinary words here too
    assert words == {"cpu"}, "a new preset named like an accelerator: list its places here"
    named, seen = [], {}
    for path in sorted((REPO / "pipelines").rglob("*.py")):
        for where, line, word in _string_constants(path, names):
            key = (str(path.relative_to(REPO / "pipelines")), where)
            if word in words:
                seen[key] = seen.get(key, 0) + 1
            else:
                named.append(f"pipelines/{key[0]}:{line} ({where}): {word!r}")
    assert named == [], "a preset named in pipelines/ (read its entry instead):\n" + \
        "\n".join(named)
    allowed = {k: n for k, (n, _) in ACCELERATOR_WORDS.items()}
    assert seen == allowed, (
        "'cpu' spelled in pipelines/ where ACCELERATOR_WORDS does not list it (or not as "
        f"often): {sorted(set(seen.items()) ^ set(allowed.items()))}")
    compared = [f"{path.relative_to(REPO)}:{hit}"
                for d in ("pipelines", "tune_spaces", "pmnet/report")
                for path in sorted((REPO / d).rglob("*.py"))
                for hit in _preset_comparisons(path)]
    assert compared == [], "behaviour keyed on a preset's name:\n" + "\n".join(compared)
    # not vacuous: what the pipeline had before issue 63 is found by each rule
    old = tmp_path / "old.py"
    old.write_text('SMALL_PRESETS = ("debug", "cpu")\n'
                   "def fit(cfg, result):\n"
                   '    if cfg.preset == "paper":\n'
                   "        pass\n"
                   '    return result.get("preset") in ("debug", "cpu")\n')
    assert [w for _, _, w in _string_constants(old, names)] == [
        "debug", "cpu", "paper", "debug", "cpu"]
    assert [h.split(":")[0] for h in _preset_comparisons(old)] == ["3", "5"]


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
    assert existing_phase1(plan.phase1_slots[0]) is None  # nothing yet: Stage 1 must run
    lay.phase1_dir.mkdir(parents=True)
    src = Path(phase1["checkpoint"])
    lay.phase1_ckpt.write_bytes(src.read_bytes())
    Path(f"{lay.phase1_ckpt}.sha256").write_bytes(Path(f"{src}.sha256").read_bytes())
    assert existing_phase1(plan.phase1_slots[0]) is None  # no record of the config it was made for
    write_json(lay.stage1_json, {"config_hash": phase1_config_hash(plan.cfg),
                                 "sha256": phase1["sha256"]})
    assert existing_phase1(plan.phase1_slots[0]) == phase1["sha256"]  # valid: Stage 1 is skipped
    other = _plan(tmp_path, name="q", overrides={"phase1_lr": 1e-2})
    assert phase1_config_hash(other.cfg) != phase1_config_hash(plan.cfg)
    same_p1 = _plan(tmp_path, name="r", overrides={"max_epochs": 3})  # Phase-2-only change
    assert phase1_config_hash(same_p1.cfg) == phase1_config_hash(plan.cfg)
    # a lost sidecar: the checkpoint still matches what Stage 1 recorded, so the driver
    # rewrites the sidecar instead of retraining Phase 1 (planning only reads)
    sidecar = Path(f"{lay.phase1_ckpt}.sha256")
    text = sidecar.read_text()
    sidecar.unlink()
    assert existing_phase1(plan.phase1_slots[0]) == phase1["sha256"] and not sidecar.exists()
    assert existing_phase1(plan.phase1_slots[0], repair=True) == phase1["sha256"]
    assert sidecar.read_text() == text
    data = bytearray(lay.phase1_ckpt.read_bytes())
    data[-10] ^= 0x01
    lay.phase1_ckpt.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match="does not match its recorded sha256.*Delete"):
        existing_phase1(plan.phase1_slots[0])


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()} if root.exists() else {}


def test_phase1_from_imports_a_checked_checkpoint_instead_of_training(tmp_path, phase1):
    src_dir = Path(phase1["checkpoint"]).parent
    plan = _plan(tmp_path, phase1_from=src_dir)  # a directory holding phase1.pt
    assert plan.phase1_from.sha256 == phase1["sha256"]
    assert not (tmp_path / "runs").exists()  # planning wrote nothing
    have, todo = stages.phase1_on_hand(plan)  # no Ray: nothing trains
    lay = plan.layout
    assert have == {None: phase1["sha256"]} and todo == []
    assert lay.phase1_ckpt.read_bytes() == Path(phase1["checkpoint"]).read_bytes()
    assert not os.access(lay.phase1_ckpt, os.W_OK) or os.geteuid() == 0
    assert oct(lay.phase1_ckpt.stat().st_mode & 0o222) == "0o0"  # read-only, as trained
    info = read_json(lay.stage1_json)
    assert info["imported_from"] == str(Path(phase1["checkpoint"]).resolve())
    assert info["sha256"] == phase1["sha256"]
    assert info["config_hash"] == phase1_config_hash(plan.cfg)
    assert read_json(lay.phase1_dir / "phase1_metrics.json")["test"] == \
        read_json(src_dir / "phase1_metrics.json")["test"]
    assert read_json(lay.pipeline_json)["phase1_from"]["sha256"] == phase1["sha256"]
    # from now on the run's own checkpoint is the one Stage 1 finds (a resume needs no source)
    assert existing_phase1(plan.phase1_slots[0]) == phase1["sha256"]
    again = _plan(tmp_path, phase1_from=Path(phase1["checkpoint"]))  # same name, same file
    assert again.resumed and stages.phase1_on_hand(again) == (have, [])
    # the run's checkpoint removed: resume imports it again from the recorded source
    for p in (lay.phase1_ckpt, Path(f"{lay.phase1_ckpt}.sha256")):
        p.chmod(0o644)
        p.unlink()
    resumed = planning.plan_resume(root=tmp_path / "runs", name="p")
    assert resumed.phase1_from.sha256 == phase1["sha256"]
    assert stages.phase1_on_hand(resumed) == ({None: phase1["sha256"]}, [])


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
                   {"config_hash": phase1_config_hash(plan.cfg), "sha256": digest})
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
    tracker.log_metric_rows(rid, [(0, {"val/updated_ltm": 10.0, "epoch": 0})])
    tracker.client.set_terminated(rid, "FAILED")
    # a retried / resumed trial finds the same run, by its run_key tag
    again, created = tracker.attach_run(exp, key, run_name="learned_full-s42",
                                        parent_run_id=parent, tags={"seed": 42})
    assert again == rid and not created
    run_ = tracker.client.get_run(rid)
    assert run_.info.status == "RUNNING" and run_.info.run_name == "learned_full-s42"
    assert run_.data.tags["run_key"] == key and run_.data.tags["condition"] == "learned_full"
    assert run_.data.tags["mlflow.parentRunId"] == parent
    # params: only the missing ones are sent (MLflow refuses to change a logged param; a
    # pipeline resumed with another config is refused at planning)
    tracker.log_params_once(rid, {"lr": 0.5, "model.hidden": 32, "new": "x"})
    assert tracker.client.get_run(rid).data.params == {"lr": "0.001", "model.hidden": "32",
                                                       "new": "x"}
    assert {m.step for m in tracker.client.get_metric_history(rid, "epoch")} == {0}
    assert len(tracker.client.search_runs([exp], f"tags.run_key = '{key}'")) == 1
    # issue 37: a tuple from the config and the list its result file reads back are one
    # spelling, a JSON list
    tracker.log_params_once(rid, {"model.write_dims": (1, 1, 8, 8)})
    assert tracker.client.get_run(rid).data.params["model.write_dims"] == "[1, 1, 8, 8]"


# -- status from disk -----------------------------------------------------------------------


def _dead_driver_lock(lay: Layout) -> None:
    """The run lock as a SIGKILLed driver leaves it: the file, with no flock held on it."""
    lay.run_dir.mkdir(parents=True, exist_ok=True)
    (lay.run_dir / "driver.lock").touch()


def test_status_reads_the_pipelines_own_records_only(tmp_path):
    plan = _plan(tmp_path)
    lay: Layout = plan.layout
    stages.write_meta(plan, status="running")
    _dead_driver_lock(lay)
    write_json(lay.result_path(TrialId("learned_full", 42)), {
        "condition": "learned_full", "seed": 42, "select": "mean_stm",
        "val": {"updated_ltm": 55.0, "mean_stm": 61.0}, "test": {"updated_ltm": 50.5}})
    write_json(lay.trial_dir(TrialId("consolidator_only", 42)) / "trial.json",
               {"state": "RUNNING", "failures": 1, "epoch": 0, "best_select": 12.5})
    # Tune's private files are not read: a state file saying otherwise changes nothing
    write_json(lay.experiment_dir / "experiment_state-2026.json", {"trial_data": [[json.dumps(
        {"config": {"condition": "learned_full", "seed": 43}, "status": "ERROR"}), "{}"]]})
    rows = {(r["condition"], r["seed"]): r for r in trial_rows(lay)}
    assert rows[("learned_full", 42)]["state"] == "FINISHED"
    assert rows[("learned_full", 42)]["test updated_ltm"] == 50.5
    assert rows[("learned_full", 42)]["best val (select)"] == 61.0  # the result's own `select`
    # the recorded driver is gone, so a RUNNING trial was interrupted
    assert rows[("consolidator_only", 42)]["state"] == "INTERRUPTED"
    assert rows[("consolidator_only", 42)]["failures"] == 1
    assert rows[("consolidator_only", 42)]["best val (select)"] == 12.5
    assert rows[("learned_full", 43)]["state"] == "NOT STARTED"
    text = status_text(lay)
    assert "interrupted" in text and "learned_full-s" not in text.split("\n")[0]
    assert "mlflow run" not in text  # a trial's run is found in MLflow by its trial_key
    assert len(rows) == 4


def _trial_context(tmp_path, space, digests):
    from pipelines.stages import trial_context

    plan = _plan(tmp_path, preset="debug", grid="tiny")
    return trial_context(dataclasses.replace(plan, space=space), digests), plan.cfg


def test_a_trials_configuration_is_its_variants_and_unknown_phase1_seeds_are_refused(tmp_path):
    from tune_spaces import Space, Variant

    space = Space("g", ("consolidator_only",), (42,), cpus_per_trial=2.0, variants=(
        Variant(), Variant("T4-truncated", {"segments": 4, "ltm_graph": "truncated"})))
    ctx, cfg = _trial_context(tmp_path, space, {None: "a" * 64})
    assert ctx.layout.phase1_ckpt == tmp_path / "runs" / "p" / "phase1" / "phase1.pt"
    # nothing of MLflow: the driver is its only writer
    assert not any("tracking" in f.name for f in dataclasses.fields(ctx))
    got = ctx.config(TrialId("consolidator_only", 42, "T4-truncated"))
    assert (got.segments, got.ltm_graph, got.threads) == (4, "truncated", 2)
    assert got == space.trial_config(cfg, TrialId("consolidator_only", 42, "T4-truncated"),
                                     threads=2)  # built in one place
    assert ctx.config(TrialId("consolidator_only", 42)) == dataclasses.replace(cfg, threads=2)
    with pytest.raises(ValueError, match="has no variant 'T8-full'"):
        ctx.config(TrialId("consolidator_only", 42, "T8-full"))
    with pytest.raises(ValueError, match="no Phase-1 checkpoint for phase1_seed 1 .*single"):
        ctx.config(TrialId("consolidator_only", 42, phase1_seed=1))
    with pytest.raises(ValueError, match="consolidator_only-s99 is not one of the trials"):
        ctx.config(TrialId("consolidator_only", 99))
    # resolved once, where the context is made, and pickled with it: the worker's copy
    # looks its trial up and never calls Space.trial_config again
    assert set(ctx.configs) == {t.name for t in space.trials}
    worker = pickle.loads(pickle.dumps(ctx))
    object.__setattr__(worker, "space", None)  # nothing to build a config from
    assert worker.config(TrialId("consolidator_only", 42, "T4-truncated")) == got


def test_a_trial_of_phase1_seed_k_starts_from_checkpoint_k(tmp_path):
    from pipelines.trial import trial_phase1
    from tune_spaces import Space

    space = Space("g", ("consolidator_only",), (42,), phase1_seeds=(1, 2))
    ctx, _ = _trial_context(tmp_path, space, {1: "b" * 64, 2: "c" * 64})
    trial = TrialId("consolidator_only", 42, phase1_seed=2)
    path, sha = trial_phase1(ctx, trial)
    assert path == tmp_path / "runs" / "p" / "phase1-p1s2" / "phase1.pt" and sha == "c" * 64
    assert ctx.config(trial).phase1_seed == 2  # the checkpoint's own Phase-1 seed
    assert ctx.config(TrialId("consolidator_only", 42, phase1_seed=1)).phase1_seed == 1
    with pytest.raises(ValueError, match="no Phase-1 checkpoint for phase1_seed 3 .*1, 2"):
        trial_phase1(ctx, TrialId("consolidator_only", 42, phase1_seed=3))
    with pytest.raises(ValueError, match="no Phase-1 checkpoint for phase1_seed None .*1, 2"):
        trial_phase1(ctx, TrialId("consolidator_only", 42))


# -- tracking never stalls or kills a trial; what it missed is logged from the results --------


class _NoMlflow:
    """Fails the test's trials if they open MLflow: every client made is counted."""

    def __init__(self, mp):
        from mlflow.tracking import client

        self.made = []
        real = client.MlflowClient.__init__

        def counted(this, *a, **kw):
            self.made.append((a, kw))
            real(this, *a, **kw)

        mp.setattr(client.MlflowClient, "__init__", counted)


HERE_TRIALS = (("consolidator_only", 42), ("learned_full", 43))


@pytest.fixture(scope="module")
def trials_here(tmp_path_factory, phase1):
    """Two trials trained in this process (FakeTune), counting MLflow clients made."""
    root = tmp_path_factory.mktemp("here") / "runs"
    ctx = trial_ctx(root, phase1)
    out = {"root": root, "ctx": ctx, "lay": ctx.layout, "trials": {}}
    with pytest.MonkeyPatch.context() as mp:
        spy = _NoMlflow(mp)
        for c, s in HERE_TRIALS:
            fake = FakeTune(root.parent / "tune" / TrialId(c, s).name)
            out["trials"][(c, s)] = {"fake": fake, "wall": run_trial_here(ctx, c, s, fake)}
        out["mlflow_clients"] = spy.made
    return out


def test_trials_never_open_mlflow(trials_here):
    import pipelines.trial as trial_mod

    assert trials_here["mlflow_clients"] == []  # the driver is the only writer
    source = Path(trial_mod.__file__).read_text()
    assert not any(s in source for s in ("import mlflow", "from mlflow", "pipelines.tracking "
                                         "import", "from pipelines.tracking"))
    lay = trials_here["lay"]
    for (c, s), t in trials_here["trials"].items():
        res = read_json(lay.result_path(TrialId(c, s)))
        assert res["condition"] == c and "updated_ltm" in res["test"]
        assert t["fake"].reports[-1]["metrics"]["finished"] == 1
        info = read_json(lay.trial_dir(TrialId(c, s)) / "trial.json")
        assert info["state"] == "FINISHED" and not any("mlflow" in k for k in info)
        assert info["epoch"] == res["history"][-1]["epoch"]  # for `status`


def test_tune_gets_each_epoch_and_no_checkpoint(trials_here):
    """A trial reports every epoch to Tune with no Tune checkpoint: its one copy of the
    weights is its own ckpt/last.ckpt, which names the Phase-1 file it was trained from."""
    from pmnet.train import checkpoint_origin

    lay = trials_here["lay"]
    for (c, s), t in trials_here["trials"].items():
        reports = t["fake"].reports
        history = read_json(lay.result_path(TrialId(c, s)))["history"]
        epochs = [r["metrics"]["epoch"] for r in reports if "epoch" in r["metrics"]]
        assert epochs == [row["epoch"] for row in history] and len(epochs) >= 1
        assert all(r["files"] is None for r in reports) and t["fake"].latest is None
        last = lay.trial_dir(TrialId(c, s)) / "ckpt" / "last.ckpt"
        assert checkpoint_origin(last) == trials_here["ctx"].digests[None]


# -- MLflow mirrors the store: one writer of the trial runs ----------------------------------


class _TuneTrial:
    """What the callback reads of a Tune trial: its config."""

    def __init__(self, trial: TrialId):
        self.config = trial.to_config()


def _open_store(lay: Layout, uri: str) -> tuple:
    from pipelines.addresses import artifact_location
    from pipelines.records import TrackingRecord

    tracker = Tracker(uri)  # artifacts where the driver puts them, never the repo's ./mlruns
    exp = tracker.experiment("pmnet/t", artifact_location=artifact_location(uri, "t", lay.root))
    parent, _ = tracker.attach_run(exp, "t", run_name="t")
    TrackingRecord(tracking_uri=uri, experiment_name="pmnet/t", experiment_id=exp,
                   parent_run_id=parent).write(lay.tracking_json)
    return tracker, exp, parent


def _new_callback(lay: Layout):
    import pickle

    from pipelines.tracking import MirrorLanded

    return pickle.loads(pickle.dumps(MirrorLanded(lay)))  # as Tune stores it (tuner.pkl)


def test_a_trial_run_is_written_once_from_its_unit_as_the_trial_lands(trials_here, tmp_path):
    """Stage 2's callback mirrors a completed trial's unit (its whole history, test metrics,
    result artifact; FINISHED); a second driver's callback (a restore) and the wave's
    backfill add nothing; a trial whose unit did not land gets no run."""
    import shutil

    from pipelines.tracking import Runs, mirror

    lay = Layout(tmp_path / "runs", "t")
    shutil.copytree(trials_here["lay"].run_dir, lay.run_dir)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker, exp, parent = _open_store(lay, uri)
    client = tracker.client
    (c, s), (c2, s2) = HERE_TRIALS
    trial, other = TrialId(c, s), TrialId(c2, s2)
    landed = lay.result_path(other).read_bytes()
    lay.result_path(other).unlink()  # `other` has not landed (yet)
    for cb in (_new_callback(lay), _new_callback(lay)):  # the second: a resumed driver
        for t in (trial, other):
            cb.on_trial_complete(1, [], _TuneTrial(t))
    [run] = client.search_runs([exp], f"tags.trial_key = '{trial_key('t', trial)}'")
    rid = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.params["seed"] == str(s) and run.data.params["model.hidden"] == "32"
    res = read_json(lay.result_path(trial))
    steps = [m.step for m in client.get_metric_history(rid, "epoch")]
    assert sorted(steps) == [h["epoch"] for h in res["history"]]
    assert len(client.get_metric_history(rid, "val/updated_ltm")) == len(res["history"]) >= 1
    assert run.data.metrics["test/updated_ltm"] == pytest.approx(res["test"]["updated_ltm"])
    assert [a.path for a in client.list_artifacts(rid, "result")] == [
        f"result/{trial.name}.json"]
    assert client.search_runs([exp], f"tags.trial_key = '{trial_key('t', other)}'") == []
    lay.result_path(other).write_bytes(landed)  # it lands: the wave's mirror writes it
    runs = Runs.reopen(lay)
    assert mirror(lay, runs, trials=[trial, other]) == {"logged": 1, "pending": 0}
    assert mirror(lay, runs, trials=[trial, other]) == {"logged": 0, "pending": 0}
    assert len(client.search_runs([exp], "tags.trial_key != ''")) == 2


def test_a_broken_tracking_uri_neither_stalls_nor_fails_the_mirror(trials_here, tmp_path,
                                                                 monkeypatch):
    """A dead server with MLflow's own (minutes-long) retry settings: the mirror's calls are
    bounded and raise nothing; the trials' runs stay pending for the next mirror."""
    import shutil

    from pipelines.records import TrackingRecord
    from pipelines.tracking import HTTP_LIMITS, mirror

    lay = Layout(tmp_path / "runs", "t")
    shutil.copytree(trials_here["lay"].run_dir, lay.run_dir)
    uri = f"http://127.0.0.1:{free_port()}"
    TrackingRecord(tracking_uri=uri, experiment_id="1", parent_run_id="p").write(
        lay.tracking_json)
    for k, v in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "120"}.items():
        monkeypatch.setenv(k, v)
    cb = _new_callback(lay)
    t0 = time.time()
    for c, s in HERE_TRIALS:
        cb.on_trial_complete(1, [], _TuneTrial(TrialId(c, s)))
    # one failing call (refused: a few s), then nothing waits for the server; with
    # MLflow's defaults (7 retries, backoff 2) the first call alone takes minutes
    assert time.time() - t0 < 30
    assert cb.runs.failures == 1 and "listing" in cb.runs.last_error
    # nothing was written: both stay pending (the guard still cooling down, at once)
    t0 = time.time()
    assert mirror(lay, cb.runs, trials=[TrialId(c, s) for c, s in HERE_TRIALS]) == {
        "logged": 0, "pending": 2}
    assert time.time() - t0 < 1
    # the process's own bound, set by its first Tracker (monkeypatch restores the user's)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == HTTP_LIMITS[
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    # a hung server: (retries + 1) x timeout plus the backoffs, 32.5 s
    assert (int(HTTP_LIMITS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) + 1) * float(
        HTTP_LIMITS["MLFLOW_HTTP_REQUEST_TIMEOUT"]) < 40


def test_tracking_limits_bound_a_server_that_never_answers(tmp_path, monkeypatch):
    """MLflow applies the timeout and retry variables: a server that accepts connections
    but never answers costs (retries + 1) x timeout, not MLflow's 8 x 120 s."""
    from pipelines import tracking

    for k, v in {"MAX_RETRIES": "1", "BACKOFF_FACTOR": "0", "BACKOFF_JITTER": "0.0",
                 "TIMEOUT": "1"}.items():  # Tracker sets them for the process: restored after
        monkeypatch.setitem(tracking.HTTP_LIMITS, f"MLFLOW_HTTP_REQUEST_{k}", v)
        monkeypatch.setenv(f"MLFLOW_HTTP_REQUEST_{k}", v)
    with socket.socket() as hung:  # listening, never accepting: connects, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        guard = tracking.Runs()
        tracker = Tracker(uri)
        t0 = time.time()
        ok, _ = guard.call("attaching", tracker.attach_run, "1", "t/x-s1", run_name="x-s1")
        first = time.time() - t0
        for epoch in range(5):  # cooling down: skipped at once, not retried per epoch
            assert guard.call(f"epoch {epoch}", tracker.client.log_metric, "r", "x", 1.0,
                              step=epoch) == (False, None)
        total = time.time() - t0
    assert not ok and 1.5 < first < 10, first
    assert total - first < 1, total
    assert "Timeout" in guard.last_error and guard.failures == 1


def test_sqlite_lock_is_waited_for_not_fatal(tmp_path):
    """Another writer's SQLite lock is waited for (MLflow's own `busy_timeout` of 20 s,
    beyond pysqlite's 5 s), and a call that fails with "database is locked" all the same is
    a skipped call, not an exception."""
    import sqlite3
    import threading

    from pipelines import tracking

    db = tmp_path / "mlflow.db"
    tracker, guard = Tracker(f"sqlite:///{db}"), tracking.Runs()
    exp = tracker.experiment("locked")
    rid, _ = tracker.attach_run(exp, "r", run_name="r")
    other = sqlite3.connect(db, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")  # another driver's write, held for 6 s
    threading.Timer(6.0, other.rollback).start()
    t0 = time.time()
    ok, _ = guard.call("log", tracker.log_metric_rows, rid, [(0, {"x": 1.0})])
    assert ok and guard.failures == 0 and time.time() - t0 > 5
    other.close()
    assert tracker.client.get_run(rid).data.metrics == {"x": 1.0}

    def locked():
        raise RuntimeError("(sqlite3.OperationalError) database is locked")

    assert guard.call("log", locked) == (False, None) and guard.failures == 1


def test_backfill_logs_what_the_callback_could_not_from_the_result_files(trials_here,
                                                                        tmp_path):
    from pipelines.records import TrackingRecord
    from pipelines.tracking import Runs, mirror

    lay = trials_here["lay"]
    HERE_IDS = [TrialId(c, s) for c, s in HERE_TRIALS]  # noqa: N806
    # a dead server: bounded, non-fatal, everything stays pending
    dead = Runs(tracker=Tracker(f"http://127.0.0.1:{free_port()}"),
                record=TrackingRecord(experiment_id="1"))
    t0 = time.time()
    assert mirror(lay, dead, trials=HERE_IDS) == {"logged": 0, "pending": 2}
    assert time.time() - t0 < 20

    # a real store; one trial already has a RUNNING run with epoch 0 logged (the driver
    # died while the trial trained): that run is completed, not duplicated
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker, exp, parent = _open_store(lay, uri)
    c1, s1 = HERE_TRIALS[1]
    early, _ = tracker.attach_run(exp, trial_key("t", TrialId(c1, s1)),
                                  run_name=TrialId(c1, s1).name, parent_run_id=parent)
    tracker.log_metric_rows(early, [(0, {"epoch": 0, "val/updated_ltm": 1.0})])
    runs = Runs.reopen(lay)
    assert mirror(lay, runs, trials=HERE_IDS) == {"logged": 2, "pending": 0}
    client = tracker.client
    for c, s in HERE_TRIALS:
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
    assert client.search_runs([exp], f"tags.trial_key = '{trial_key('t', TrialId(c1, s1))}'")[
        0].info.run_id == early
    # nothing left: a second pass logs nothing and duplicates nothing
    assert mirror(lay, Runs.reopen(lay), trials=HERE_IDS) == {"logged": 0, "pending": 0}
    assert len(client.get_metric_history(early, "epoch")) == len(
        read_json(lay.result_path(TrialId(c1, s1)))["history"])
    # the Phase-1 unit, by the same mirror: one FINISHED run `stage1-phase1` from the store,
    # its Phase-1 params only; a slot whose unit did not land gets none
    from pipelines.layout import PHASE2_ONLY_FIELDS
    from pipelines.phase1 import Phase1Slot
    from pipelines.records import Stage1Record
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("debug", threads=1)
    slots = [Phase1Slot(None, cfg, lay.phase1_dir), Phase1Slot(7, cfg, tmp_path / "none")]
    assert mirror(lay, Runs.reopen(lay), slots, HERE_IDS) == {"logged": 1, "pending": 0}
    assert mirror(lay, Runs.reopen(lay), slots, HERE_IDS) == {"logged": 0, "pending": 0}
    [p1] = client.search_runs([exp], "tags.run_key = 't/stage1-phase1'")
    assert p1.info.status == "FINISHED" and p1.info.run_name == "stage1-phase1"
    assert p1.data.tags["phase1_sha256"] == Stage1Record.read(lay.stage1_json).sha256
    assert p1.data.tags["mlflow.parentRunId"] == parent and "trial_key" not in p1.data.tags
    assert p1.data.params and not any(k.split(".")[0] in PHASE2_ONLY_FIELDS
                                      for k in p1.data.params)
    assert client.search_runs([exp], "tags.run_key = 't/stage1-phase1-p1s7'") == []


def test_the_ui_address_opens_the_experiments_training_runs(tmp_path):
    from pipelines.addresses import ui_address

    lay = Layout(tmp_path / "runs", "t")
    tracker, exp, _ = _open_store(lay, f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert ui_address("http://127.0.0.1:5000/", exp) == (
        f"http://127.0.0.1:5000/#/experiments/{exp}/runs?workflowType=machine_learning")
    assert tracker.client.get_experiment(exp).name == "pmnet/t"


def _report_state(ckpt: Path) -> dict:
    import torch

    states = torch.load(ckpt, weights_only=True)["callbacks"]
    return next(v for k, v in states.items() if "TuneReport" in k)


def test_a_trial_resumed_from_its_last_ckpt_equals_an_uninterrupted_one(
        tmp_path, phase1, trials_here, monkeypatch):
    """The retry resumes from the trial directory's last.ckpt (Tune holds no checkpoint),
    with the report callback's and EarlyStopping's state: same result, same reported best."""
    from pipelines.trial import FAULT_ENV

    c, s = HERE_TRIALS[0]
    ref = trials_here["trials"][(c, s)]["fake"].reports  # uninterrupted, same config
    ref_result = read_json(trials_here["lay"].result_path(TrialId(c, s)))
    ctx = trial_ctx(tmp_path / "runs", phase1)
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
    run_trial_here(ctx, c, s, fake)  # the retry
    assert _report_state(last)["final"] is True
    tries = [json.loads(line) for line in
             (lay.trial_dir(TrialId(c, s)) / "attempts.jsonl").read_text().splitlines()]
    assert len(tries) == 2 and tries[0]["resume_from"] is None
    assert tries[1]["resume_from"] == str(lay.trial_dir(TrialId(c, s)) / "ckpt" / "last.ckpt")
    assert tries[1]["resume_epoch"] == 0
    got = read_json(lay.result_path(TrialId(c, s)))
    for key in ("test", "val", "best_epoch", "history"):
        assert got[key] == ref_result[key], key

    def per_epoch(reports):
        return [(r["metrics"]["epoch"], r["metrics"].get("best/select"), set(r["files"]))
                for r in reports if r["files"] is not None]

    assert per_epoch(fake.reports) == per_epoch(ref)  # epoch 0, then 1 after the resume


def test_a_trial_asked_to_stop_pauses_into_the_store_and_the_next_run_continues_it(
        tmp_path, phase1, trials_here):
    """Issue 61: with the run's stop file present (a SIGTERM to the driver) a trial stops at
    its first epoch end: its progress goes into the store's progress/<trial>/, trial.json
    says PAUSED and its last report `paused`, and it has no result. The next run's trial
    (no stop file) continues from it and lands the uninterrupted trial's result; the
    progress goes as the unit lands."""
    import dataclasses

    from pipelines.trial import PAUSED, PAUSED_STATE

    c, s = HERE_TRIALS[0]
    trial = TrialId(c, s)
    ref_result = read_json(trials_here["lay"].result_path(trial))
    stop = tmp_path / "stop.request"
    stop.touch()
    ctx = dataclasses.replace(trial_ctx(tmp_path / "runs", phase1), stop_file=str(stop))
    fake = FakeTune(tmp_path / "tune")
    run_trial_here(ctx, c, s, fake)
    paused = json.loads(fake.reports[-1]["metrics"][PAUSED])
    assert (paused["epoch"], paused["phase"], paused["reason"]) == (0, 2, "stop requested")
    lay = ctx.layout
    assert read_json(lay.trial_dir(trial) / "trial.json")["state"] == PAUSED_STATE
    assert not lay.result_path(trial).exists()
    record = read_json(lay.units.trial_progress(trial) / "progress.json")
    assert record["epoch"] == 0 and record["phase1_sha256"] == phase1["sha256"]
    stop.unlink()
    run_trial_here(dataclasses.replace(ctx, stop_file=None), c, s, FakeTune(tmp_path / "t2"))
    got = read_json(lay.result_path(trial))
    for key in ("test", "val", "best_epoch", "history"):
        assert got[key] == ref_result[key], key
    assert not lay.units.trial_progress(trial).exists()


def test_a_trial_that_starts_past_the_runs_deadline_does_not_train(tmp_path, phase1):
    """Issue 61: a trial started after the run's --max-wall has passed trains nothing: it
    reports `paused` before epoch 1 (epoch -1), writes no provenance and no progress."""
    import dataclasses
    import time

    from pipelines.trial import PAUSED

    ctx = dataclasses.replace(trial_ctx(tmp_path / "runs", phase1),
                              deadline_at=time.time() - 1)
    fake = FakeTune(tmp_path / "tune")
    assert run_trial_here(ctx, "consolidator_only", 42, fake) < 30
    [report] = fake.reports
    assert json.loads(report["metrics"][PAUSED])["epoch"] == -1
    trial = TrialId("consolidator_only", 42)
    assert not ctx.layout.units.provenance(trial).exists()
    assert not ctx.layout.units.trial_progress(trial).exists()
    assert not (ctx.layout.trial_dir(trial) / "ckpt").exists()


# -- sqlite: URIs, the storage probe ----------------


def test_sqlite_tracking_uri_is_made_absolute_and_recorded_for_resume(tmp_path, monkeypatch):
    from pipelines.addresses import store_uri

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match="does not exist"):  # nothing is created
        _plan(tmp_path, tracking_uri="sqlite:///store/user.db")
    assert not (tmp_path / "store").exists()
    (tmp_path / "store").mkdir()
    plan = _plan(tmp_path, tracking_uri="sqlite:///store/user.db")
    absolute = f"sqlite:///{tmp_path / 'store' / 'user.db'}"
    assert plan.tracking_uri == absolute  # the same file from any directory
    assert store_uri(plan.layout.root, plan.tracking_uri) == absolute  # the driver writes it
    assert store_uri(plan.layout.root, None) == f"sqlite:///{plan.layout.mlflow_db}"
    assert store_uri(plan.layout.root, "embedded") == f"sqlite:///{plan.layout.mlflow_db}"
    stages.write_meta(plan, status="running")
    monkeypatch.chdir(tmp_path / "runs")
    assert planning.plan_resume(root=tmp_path / "runs").tracking_uri == absolute
    with pytest.raises(PipelineError, match="in-memory"):
        _plan(tmp_path, name="mem", tracking_uri="sqlite://")


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


def test_status_of_a_pipeline_whose_space_record_is_damaged_lists_no_rows(tmp_path):
    """A `space` that `Space.from_dict` refuses gives no trial rows (and no gate read of an
    unknown grid's checkpoints), not a crash; an intact record still lists every trial."""
    plan = _plan(tmp_path)
    stages.write_meta(plan, status="finished")
    assert len(trial_rows(plan.layout)) == len(plan.space.trials) == 4
    meta = json.loads(plan.layout.pipeline_json.read_text())
    meta["space"]["variants"] = "not a list"
    plan.layout.pipeline_json.write_text(json.dumps(meta))
    assert trial_rows(plan.layout) == []


def test_status_shows_the_variant_of_each_trial(tmp_path):
    plan = _plan(tmp_path, grid="segments", variants="T2-full,T4-truncated", seeds="42")
    lay = plan.layout
    stages.write_meta(plan, status="running")
    _dead_driver_lock(lay)
    done = TrialId("consolidator_only", 42, "T4-truncated")
    write_json(lay.result_path(done), {**done.to_config(), "val": {"updated_ltm": 33.0},
                                       "test": {"updated_ltm": 30.5}})
    running = TrialId("consolidator_only", 42, "T2-full")
    write_json(lay.trial_dir(running) / "trial.json", {"state": "ERROR", "error": "boom",
                                                       "failures": 3})
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
    overrides = {"segments": 3, "ltm_graph": "truncated"}
    ctx = trial_ctx(tmp_path / "runs", phase1, variants={"": {}, "T3-truncated": overrides})
    lay = ctx.layout
    _, exp, _ = _open_store(lay, uri)
    trial = TrialId("consolidator_only", 42, "T3-truncated")
    fake = FakeTune(tmp_path / "tune")
    run_trial_here(ctx, trial.condition, trial.seed, fake, variant=trial.variant)
    _new_callback(lay).on_trial_complete(1, [], _TuneTrial(trial))  # it landed: mirrored
    path = lay.results_dir / "consolidator_only-T3-truncated-s42.json"
    assert path == lay.result_path(trial)
    res = read_json(path)
    assert res["variant"] == "T3-truncated" and res["variant_overrides"] == overrides
    assert res["config"]["segments"] == 3 and res["config"]["ltm_graph"] == "truncated"
    assert {"final_ltm_seg1", "final_ltm_seg2", "seg3_stm"} <= set(res["test"])  # T = 3 ran
    info = read_json(lay.trial_dir(trial) / "trial.json")
    assert info["state"] == "FINISHED" and info["variant"] == "T3-truncated"
    assert info["variant_overrides"] == overrides
    assert all(r["metrics"]["variant"] == "T3-truncated" for r in fake.reports)
    run = MlflowClient(uri).search_runs(
        [exp], "tags.trial_key = 't/consolidator_only-T3-truncated-s42'")[0]
    assert run.info.run_name == trial.name and run.data.tags["variant"] == "T3-truncated"
    params = run.data.params
    assert params["variant"] == "T3-truncated" and params["variant.segments"] == "3"
    assert params["segments"] == "3" and params["ltm_graph"] == "truncated"
    # a default trial of the same pipeline: result and params exactly as before variants
    fake = FakeTune(tmp_path / "tune2")
    run_trial_here(ctx, "consolidator_only", 42, fake)
    _new_callback(lay).on_trial_complete(1, [], _TuneTrial(TrialId("consolidator_only", 42)))
    plain = read_json(lay.results_dir / "consolidator_only-s42.json")
    assert "variant" not in plain and "variant_overrides" not in plain
    assert plain["config"]["segments"] == 2
    run = MlflowClient(uri).search_runs(
        [exp], "tags.trial_key = 't/consolidator_only-s42'")[0]
    assert "variant" not in run.data.tags and "variant" not in run.data.params


def test_timing_overhead_is_the_wall_outside_the_stages_when_tasks_run_side_by_side(tmp_path):
    """Three Phase-1 tasks and two trials at a time: the summed training times exceed the
    wall, and the overhead (wall outside Stage 1 and Stage 2) stays the
    small non-negative remainder; a second invocation appends to the history."""
    plan = _plan(tmp_path)
    plan.layout.run_dir.mkdir(parents=True)
    wall = 1_000.0
    s2 = {"wall_s": 500.0, "sum_trial_train_s": 900.0, "finished": 4}
    t = stages.timing_record(plan, time.time() - wall, s2, p1_time=1_200.0, stage1_wall=400.0)
    assert t["phase1_train_s"] + t["sum_trial_train_s"] > t["wall_s"]  # side by side
    assert t["stage1_wall_s"] == 400.0 and t["stage2_wall_s"] == 500.0
    assert 100.0 <= t["overhead_s"] < 101.0  # 1,000 - 400 - 500
    assert t["overhead_ratio"] == pytest.approx(t["wall_s"] / 900.0)
    stages.timing_record(plan, time.time() - 10.0, {**s2, "wall_s": 20.0}, 0.0, 0.0)
    rec = read_json(plan.layout.timing_json)
    assert len(rec["invocations"]) == 2 and rec["overhead_s"] == 0.0  # clipped, not negative


def test_start_help_lists_every_grid_of_tune_spaces(capsys):
    """The grid list in `start --help` is read from tune_spaces, not a copy that misses the
    grids added since (issue 47: `checkpoints` and `checkpoint_channel` were missing)."""
    from tune_spaces import SPACES

    with pytest.raises(SystemExit):
        run.build_parser().parse_args(["start", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"grid function in tune_spaces ({', '.join(SPACES)})" in text
    assert "checkpoint_channel" in SPACES


def test_a_trials_checkpoints_of_another_phase1_file_are_discarded(tmp_path):
    """A trial continues only from checkpoints that name its Phase-1 file themselves
    (`pmnet.train.checkpoint_origin`); another file's, or a checkpoint naming none, are
    removed (Phase 1 was retrained), and the reason says whose they were."""
    import torch

    from pipelines.trial import discard_foreign_checkpoints

    ours, theirs = "a" * 64, "b" * 64
    ckpt = tmp_path / "t" / "ckpt"
    assert discard_foreign_checkpoints(tmp_path / "t", ours) is None  # nothing there yet
    ckpt.mkdir(parents=True)
    for name in ("last.ckpt", "best.ckpt"):
        torch.save({"epoch": 1, "pmnet_compact": {"phase1_sha256": ours, "frozen": []}},
                   ckpt / name)
    assert discard_foreign_checkpoints(tmp_path / "t", ours) is None
    assert sorted(p.name for p in ckpt.iterdir()) == ["best.ckpt", "last.ckpt"]
    why = discard_foreign_checkpoints(tmp_path / "t", theirs)
    assert why == f"checkpoints trained from Phase-1 {ours[:12]}..., not {theirs[:12]}..."
    assert not ckpt.exists()
    ckpt.mkdir()
    torch.save({"epoch": 1, "state_dict": {}}, ckpt / "last.ckpt")  # full: no origin in it
    assert "unknown Phase-1 origin" in discard_foreign_checkpoints(tmp_path / "t", ours)
    assert not ckpt.exists()
