"""What a person runs and reads first (issue 64's workflow gaps): the make variables reach
the run's configuration, the image can log to PostgreSQL, `make ui` serves the run's own
tracking store, `resume` keeps the Ray address, `make status` tells the Phase-1 checkpoints
apart, the progress line never counts past the last epoch, the parent MLflow run holds the
answer (each claim's effect, CI and verdict) and no empty experiment, and the help texts and
docs/pipeline.md name every preset and grid the code has.

No test here starts Ray, a server or a browser: `make -n`, the planning layer, an embedded
SQLite MLflow store in tmp_path, and `pipelines.run.main` up to its `execv`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import tomllib
from pathlib import Path

import pytest

from pipelines import plan as planning
from pipelines import run, stages
from pipelines.layout import PipelineError, write_json
from pipelines.records import PipelineRecord, Progress, TrackingRecord
from pmnet.trial_id import TrialId
from tests.support.make import make_dry_run, make_output

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "results"
#: an MLflow metric or tag key (mlflow.utils.validation: alphanumerics, _ - . / and spaces)
MLFLOW_KEY = re.compile(r"^[\w\-./ ]+$")


@pytest.fixture(autouse=True)
def _no_cluster_or_server(monkeypatch):
    for k in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)


def _plan(tmp_path: Path, name: str = "p", **kw):
    kw.setdefault("preset", "debug")
    kw.setdefault("grid", "tiny")
    kw.setdefault("gpus_per_trial", 0)
    kw.setdefault("num_cpus", 2)
    return planning.plan_new(root=tmp_path / "runs", name=name, **kw)


def _local():
    from pipelines.cluster import describe_cluster

    return describe_cluster(None, 2)  # this machine, without starting Ray


def _run_main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = run.main(argv)
        except SystemExit as e:  # argparse (--help)
            rc = int(e.code or 0)
    return rc, out.getvalue()


# -- 1. make variables: SET, the per-trial resources, MAX_FAILURES --------------------------


def _pipeline_argv(*make_args: str) -> list[str]:
    out = make_dry_run("-o", ".venv/.installed", "pipeline", *make_args)
    line = next(ln for ln in out.splitlines() if "pipelines.run start" in ln)
    words = shlex.split(line)
    return words[words.index("pipelines.run") + 1:]


def test_make_pipeline_set_and_resources_reach_the_runs_configuration(tmp_path, monkeypatch):
    """`make pipeline SET='compile=off lr=1e-3' CPUS_PER_TRIAL=... MAX_FAILURES=...` gives
    one `--set` per space-separated item and the resource flags, and `pipelines.run start`
    resolves them into the plan's TrainConfig and grid (`make pipeline SET=compile=off`
    dropped the setting silently before)."""
    argv = _pipeline_argv("PRESET=debug", "GRID=tiny", "SET=compile=off lr=1e-3",
                          "CPUS_PER_TRIAL=2", "GPUS_PER_TRIAL=0", "MAX_FAILURES=0",
                          "MAX_CONCURRENT=1", "STAGE1_CPUS=1", f"RUNS={tmp_path / 'runs'}")
    assert argv[:1] == ["start"]
    joined = " ".join(argv)
    assert "--set compile=off --set lr=1e-3" in joined, joined
    for flag in ("--cpus-per-trial 2", "--gpus-per-trial 0", "--max-failures 0",
                 "--max-concurrent 1", "--stage1-cpus 1"):
        assert flag in joined, (flag, joined)
    got = []
    monkeypatch.setattr(run, "run_plan", lambda plan: got.append(plan) or run.Exit.DONE)
    rc, text = _run_main([*argv, "--name", "made", "--num-cpus", "2"])
    assert rc == 0, text
    plan = got[0]
    assert plan.cfg.compile == () and plan.cfg.lr == pytest.approx(1e-3)
    assert plan.overrides == {"compile": ("off",), "lr": 1e-3}
    sp = plan.space
    assert (sp.cpus_per_trial, sp.gpus_per_trial, sp.max_failures, sp.max_concurrent) == \
        (2.0, 0.0, 0, 1)
    assert plan.stage1_cpus == 1.0
    # without them, nothing is passed: the grid's and the preset's own values
    plain = " ".join(_pipeline_argv("PRESET=debug"))
    assert "--set" not in plain and "--cpus-per-trial" not in plain
    assert "--max-failures" not in plain and "--stage1-cpus" not in plain


def test_make_help_names_every_preset_and_grid_and_the_new_variables():
    """`make help` lists the presets as the registry has them (issue 63: the Makefile names
    none itself, `{presets}` is filled in from `pmnet.config.PRESETS`)."""
    from pmnet.config import PRESETS
    from tune_spaces import SPACES

    source = next(ln for ln in (REPO / "Makefile").read_text().splitlines()
                  if ln.startswith("pipeline:"))
    assert "PRESET={presets}," in source  # filled in by `make help`, never typed out
    line = next(ln for ln in make_output("help").splitlines() if "run the whole pipeline" in ln)
    presets = re.search(r"PRESET=([\w|]+)", line)[1].split("|")
    grids = re.search(r"GRID=([\w|]+)", line)[1].split("|")
    assert presets == list(PRESETS) and sorted(grids) == sorted(SPACES)
    for var in ("SET=", "CPUS_PER_TRIAL=", "GPUS_PER_TRIAL=", "MAX_FAILURES=", "STAGE1_CPUS="):
        assert var in line, var


# -- 2. the image's PostgreSQL driver ---------------------------------------------------------


def test_the_image_installs_the_postgres_extra():
    """docker/Dockerfile installs the project with the `postgres` extra (psycopg, the driver
    of `postgresql://` tracking URIs), as `make install` does."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    installs = re.findall(r'pip install -c docker/constraints\.txt -e "\.\[([\w,]+)\]"',
                          dockerfile)
    assert installs and all("postgres" in extras.split(",") for extras in installs), installs
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(dep.startswith("psycopg") for dep in extras["postgres"]), extras
    assert '".[dev,postgres]"' in (REPO / "Makefile").read_text()  # make install: the same


# -- 3. `make ui`: the run's own tracking store -----------------------------------------------


def _pipeline_logged_to(root: Path, name: str, uri: str | None) -> None:
    lay = root / name
    lay.mkdir(parents=True)
    PipelineRecord(name=name, preset="debug", status="finished",
                   tracking=uri or "embedded").write(lay / "pipeline.json")
    TrackingRecord(tracking_uri=uri or "embedded", experiment_name=f"pmnet/{name}",
                   experiment_id="7", parent_run_id="abc123").write(lay / "tracking.json")
    (root / "LAST").write_text(name + "\n")


def _args(args, option: str) -> str:
    return args[args.index(option) + 1]


def test_ui_serves_the_store_the_run_logged_to(tmp_path):
    """The embedded store, another `sqlite:` file (artifacts beside it) and a database
    (`postgresql://`, artifacts under the root) are each served as the UI's backend store;
    the first line printed says which store (its password hidden), the next where to look
    first: the parent run, which holds the verdicts."""
    root = tmp_path / "runs"
    _pipeline_logged_to(root, "emb", None)
    args, lines = run.ui_plan(root, "127.0.0.1", 5123)
    assert _args(args, "--backend-store-uri") == f"sqlite:///{root / 'mlflow.db'}"
    assert _args(args, "--artifacts-destination") == str(root / "mlartifacts")
    assert _args(args, "--port") == "5123" and _args(args, "--host") == "127.0.0.1"
    assert lines[0].startswith(f"MLflow UI for the embedded store sqlite:///{root}")
    assert "http://127.0.0.1:5123/#/experiments/7/runs?workflowType=machine_learning" \
        in lines[0]
    first = lines[1]
    assert first.startswith("look first at the pipeline's parent run 'emb'")
    assert "verdict" in first
    assert "http://127.0.0.1:5123/#/experiments/7/runs/abc123" in first

    db = tmp_path / "elsewhere" / "x.db"
    _pipeline_logged_to(root, "lite", f"sqlite:///{db}")
    args, lines = run.ui_plan(root, "127.0.0.1", 5123, name="lite")
    assert _args(args, "--backend-store-uri") == f"sqlite:///{db}"
    assert _args(args, "--artifacts-destination") == str(db.parent / "mlartifacts")

    pg = "postgresql://mlflow:hunter2@db.lab.example:5432/mlflow"
    _pipeline_logged_to(root, "pg", pg)
    args, lines = run.ui_plan(root, "0.0.0.0", 5123, allowed_hosts="box.example")  # the LAST one
    assert _args(args, "--backend-store-uri") == pg
    assert _args(args, "--artifacts-destination") == str(root / "mlartifacts")
    assert _args(args, "--allowed-hosts") == "box.example"
    shown = "\n".join(lines)
    assert "postgresql://mlflow:***@db.lab.example:5432/mlflow" in shown
    assert "hunter2" not in shown and "http://127.0.0.1:5123/" in shown


def test_ui_of_a_run_on_a_tracking_server_prints_the_servers_address(tmp_path, monkeypatch):
    """A run that logged to an MLflow server: `make ui` starts nothing (not even on a busy
    port) and prints the server's own pages of the pipeline's runs and parent run."""
    root = tmp_path / "runs"
    _pipeline_logged_to(root, "remote", "http://mlflow.lab.example:5000")

    def execv(*_):
        raise AssertionError("no UI may start for a tracking server")

    monkeypatch.setattr(os, "execv", execv)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, text = _run_main(["ui", "--root", str(root), "--port",
                              str(busy.getsockname()[1])])
    assert rc == 0, text
    assert "MLflow tracking server http://mlflow.lab.example:5000" in text
    assert "http://mlflow.lab.example:5000/#/experiments/7/runs?workflowType=" in text
    assert "http://mlflow.lab.example:5000/#/experiments/7/runs/abc123" in text
    assert "no UI started here" in text


def test_ui_of_an_unknown_pipeline_is_refused_and_make_ui_passes_name(tmp_path):
    rc, text = _run_main(["ui", "--root", str(tmp_path / "runs"), "--name", "nope"])
    assert rc == run.Exit.BAD_INPUT and "no pipeline 'nope'" in text, text
    out = make_dry_run("-o", ".venv/.installed", "ui", "NAME=mine")
    line = next(ln for ln in out.splitlines() if "pipelines.run ui" in ln)
    assert "--name mine" in line, line


# -- 4. resume on the recorded Ray address ------------------------------------------------------


@pytest.fixture
def listener():
    """A TCP port that accepts connections (what `check_ray_address` probes), no Ray."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        yield f"127.0.0.1:{srv.getsockname()[1]}"


def _execute_until_ray(plan, monkeypatch) -> None:
    """`driver.execute(plan)` up to the point where it would start Ray: the run's records
    are written, Ray is not started."""
    from pipelines import driver
    from pipelines.console import say

    monkeypatch.setattr(say, "log_path", None)  # the driver points it at its run's log

    class Stop(Exception):
        pass

    def init_ray(*_a, **_k):
        raise Stop

    monkeypatch.setattr(driver, "init_ray", init_ray)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(Stop):
        driver.execute(plan)


def test_the_driver_records_the_ray_address_it_runs_on(tmp_path, listener, monkeypatch):
    plan = _plan(tmp_path, ray_address=listener, cluster=_local())
    assert plan.ray_address == listener
    _execute_until_ray(plan, monkeypatch)
    assert PipelineRecord.read(plan.layout.pipeline_json).ray_address == listener


def test_resume_uses_the_recorded_stage1_cpus_unless_given_another(tmp_path, monkeypatch):
    """A run's `--stage1-cpus` is in its pipeline.json from its start, and a resume takes it
    again (a Phase 1 trained again then trains with the same threads), unless given
    another."""
    plan = _plan(tmp_path, stage1_cpus=1)
    _execute_until_ray(plan, monkeypatch)
    assert PipelineRecord.read(plan.layout.pipeline_json).stage1_cpus == 1
    root = tmp_path / "runs"
    assert planning.plan_resume(root=root, name="p", cluster=_local()).stage1_cpus == 1
    assert planning.plan_resume(root=root, name="p", stage1_cpus=2,
                                cluster=_local()).stage1_cpus == 2


def test_resume_uses_the_recorded_ray_address_unless_given_another(tmp_path, listener,
                                                                   monkeypatch):
    plan = _plan(tmp_path)
    stages.write_meta(plan, status="interrupted", ray_address=listener)
    root = tmp_path / "runs"
    again = planning.plan_resume(root=root, name="p", cluster=_local())
    assert again.ray_address == listener and again.ray_address_recorded
    mine = planning.plan_resume(root=root, name="p", ray_address="local", cluster=_local())
    assert mine.ray_address is None and not mine.ray_address_recorded
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert planning.plan_resume(root=root, name="p", cluster=_local()).ray_address is None
    monkeypatch.delenv("RAY_ADDRESS")
    # `report` computes nothing: it never asks the recorded cluster
    assert planning.plan_resume(root=root, name="p", check_resources=False).ray_address is None

    with socket.socket() as s:  # a cluster that is gone: refused, saying how to go on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    stages.write_meta(plan, ray_address=dead)
    with pytest.raises(PipelineError, match=r"last ran on the Ray cluster .*--ray-address "
                                            r"local \(RAY_ADDRESS=local\)"):
        planning.plan_resume(root=root, name="p", cluster=_local())
    assert planning.plan_resume(root=root, name="p", ray_address="local",
                                cluster=_local()).ray_address is None


# -- 5. `make status`: which Phase-1 checkpoint ---------------------------------------------------


def test_status_has_a_phase1_column_for_several_checkpoints(tmp_path):
    from pipelines.status import status_text, trial_rows

    plan = _plan(tmp_path, phase1_seeds="1,2", conditions="consolidator_only", seeds="42")
    lay = plan.layout
    stages.write_meta(plan, status="finished", phase1_sha256s={"1": "a" * 64, "2": "b" * 64})
    done = TrialId("consolidator_only", 42, phase1_seed=2)
    write_json(lay.result_path(done), {**done.to_config(), "val": {"updated_ltm": 30.0},
                                       "test": {"updated_ltm": 25.5}})
    rows = trial_rows(lay)
    assert [(r["phase1"], r["state"]) for r in rows] == [("p1s1", "NOT STARTED"),
                                                          ("p1s2", "FINISHED")]
    text = status_text(lay)
    table = text.split("\n\n")[1].splitlines()
    assert table[0].split()[:3] == ["condition", "phase1", "seed"]
    assert table[2].split()[:3] == ["consolidator_only", "p1s1", "42"]
    assert table[3].split()[:3] == ["consolidator_only", "p1s2", "42"]
    assert "phase1 sha256s: p1s1 aaaaaaaaaaaa, p1s2 bbbbbbbbbbbb" in text
    plain = _plan(tmp_path, name="q")  # one checkpoint: the table as it was
    stages.write_meta(plain, status="finished")
    assert "phase1" not in status_text(plain.layout).split("\n\n")[1]


# -- 6. the Stage-1 progress line ------------------------------------------------------------------


def test_the_progress_line_never_counts_past_the_last_epoch():
    """Lightning's `current_epoch` is the number of completed epochs once training ends
    (measured: a debug Phase 1 of 2 epochs writes epoch 2 with done), so the last line said
    "epoch 41/40"; it says the epochs run, and the epoch in progress before."""
    from pipelines.progress import describe, epoch_shown

    def line(epoch, done, max_epochs=40):
        return describe(Progress(epoch=epoch, max_epochs=max_epochs, done=done, step=10,
                                 total_steps=100 if not done else 10))

    assert "epoch 1/40," in line(0, False) and "epoch 40/40," in line(39, False)
    end = line(40, True)
    assert "epoch 40/40," in end and "41/40" not in end and "training done" in end
    assert "epoch 12/40," in line(12, True)  # stopped early after 12 epochs
    assert epoch_shown(Progress(epoch=45, max_epochs=40)) == 40  # never past the maximum
    assert epoch_shown(Progress(epoch=0, max_epochs=None)) == 1


# -- 7. the answer in MLflow --------------------------------------------------------------------


def _results_into(lay) -> None:
    for path in sorted(FIXTURES.glob("*.json")):
        res = json.loads(path.read_text())
        trial = TrialId(res["condition"], res["seed"])
        write_json(lay.result_path(trial), {**res, "select": "updated_ltm"})


def test_the_parent_run_holds_each_claims_effect_ci_and_verdict(tmp_path, capsys):
    """Stage 3 on an embedded store in tmp_path: the report's claims table
    (`data/claims.json`) becomes metrics and tags of the pipeline's parent run, with valid
    MLflow keys and the run's description a table of them; the log names the tracking URI;
    the store holds the pipeline's experiment and MLflow's own empty "Default"."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from pipelines import tracking
    from pipelines.addresses import store_uri

    # the grid of the fixtures' trials: the run's report reads the run's grid's units
    plan = _plan(tmp_path, name="answer", grid="default", seeds="42,43,44")
    lay = plan.layout
    lay.run_dir.mkdir(parents=True)
    stages.write_meta(plan, status="finished")
    runs = tracking.open_tracking(plan)
    said = capsys.readouterr().out
    uri = store_uri(lay.root, None)
    assert f"tracking URI {uri} (the embedded store)" in said, said

    client = MlflowClient(uri)
    active = client.search_experiments(view_type=ViewType.ACTIVE_ONLY)
    assert sorted(e.name for e in active) == ["Default", "pmnet/answer"]
    assert client.search_runs(["0"], run_view_type=ViewType.ALL) == []  # never logged to

    _results_into(lay)
    assert stages.stage3(plan, runs)
    claims = json.loads((lay.report_dir / "data" / "claims.json").read_text())
    assert len(claims) >= 5
    run_ = client.get_run(runs.parent)
    metrics, tags = run_.data.metrics, run_.data.tags
    assert all(MLFLOW_KEY.match(k) for k in [*metrics, *tags]), \
        [k for k in [*metrics, *tags] if not MLFLOW_KEY.match(k)]
    seen = set()
    for rec in claims:
        key = tracking.claim_key(rec["claim"])
        assert key not in seen and MLFLOW_KEY.match(key)
        seen.add(key)
        at = f"claims/{key}/"
        assert tags[at + "verdict"] == rec["verdict"] and tags[at + "claim"] == rec["claim"]
        assert metrics[at + "estimate"] == pytest.approx(rec["estimate"])
        if rec["ci_low"] is not None:
            assert metrics[at + "ci_low"] == pytest.approx(rec["ci_low"])
            assert metrics[at + "ci_high"] == pytest.approx(rec["ci_high"])
            assert metrics[at + "p"] == pytest.approx(rec["p"])
        if rec["verdict"] == "reproduces":
            assert metrics[at + "reproduces"] == 1.0
    routing = "claims/routing_on_off_updated_ltm_pp/"
    assert routing + "ci_low" in metrics and tags[routing + "verdict"]
    assert tags["mlflow.note.content"].startswith("Which claims reproduce")
    assert "Routing on > off (updated LTM, pp)" in tags["mlflow.note.content"]
    said = capsys.readouterr().out
    assert f"[stage 3/3] {len(claims)} claims (effect, 95% CI, verdict) on the parent run " \
        f"{runs.parent}" in said, said


def test_claim_keys_are_mlflow_keys():
    from pipelines.tracking import claim_entries, claim_key

    assert claim_key("Routing on > off (updated LTM, pp)") == "routing_on_off_updated_ltm_pp"
    metrics, tags = claim_entries([
        {"claim": "A > b (x, pp)", "estimate": 1.5, "ci_low": -1.0, "ci_high": 4.0,
         "p": 0.2, "n": 2, "verdict": "does not reproduce (> 0 but p = 0.2 >= 0.05)"},
        {"claim": "A > b (x; pp)", "estimate": float("nan"), "ci_low": None, "ci_high": None,
         "p": None, "n": None, "verdict": "no verdict: both arms at or below"}])
    assert metrics["claims/a_b_x_pp/reproduces"] == 0.0
    assert "claims/a_b_x_pp_2/estimate" not in metrics  # NaN is not logged
    assert "claims/a_b_x_pp_2/reproduces" not in metrics  # no verdict either way
    assert tags["claims/a_b_x_pp_2/verdict"].startswith("no verdict")
    assert all(MLFLOW_KEY.match(k) for k in [*metrics, *tags])


# -- 8. the docs and --help name every preset and grid --------------------------------------------


def test_help_lists_every_preset_and_grid_from_the_registries():
    from pmnet.config import PRESETS, default_preset
    from tune_spaces import SPACES

    rc, text = _run_main(["start", "--help"])
    assert rc == 0
    flat = " ".join(text.split("options:", 1)[1].split())  # the options, not the usage
    preset_help = flat.split("--preset PRESET", 1)[1].split("--grid GRID", 1)[0]
    grid_help = flat.split("--grid GRID", 1)[1].split("--conditions", 1)[0]
    assert set(PRESETS) <= set(re.findall(r"\w+", preset_help)), preset_help
    assert f"default: {default_preset('gpu')} when a node has a GPU" in preset_help, preset_help
    assert set(SPACES) <= set(re.findall(r"\w+", grid_help)), grid_help


def test_docs_pipeline_names_every_preset_and_grid():
    from pmnet.config import PRESETS
    from tune_spaces import SPACES

    text = (REPO / "docs" / "pipeline.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `(--\w+) [A-Z]` \|.*$", text, re.M)}
    assert set(re.findall(r"`(\w+)`", rows["--preset"])) >= set(PRESETS)
    assert set(re.findall(r"`(\w+)`", rows["--grid"])) >= set(SPACES)
    grids = text.split("## Grids", 1)[1].split("\n## ", 1)[0]
    assert set(SPACES) <= set(re.findall(r"`(\w+)`", grids)), set(SPACES) - set(
        re.findall(r"`(\w+)`", grids))
