"""The pipeline's tracking layer (`pipelines/tracking.py`) against a real PostgreSQL database
(issue 53): `MLFLOW_TRACKING_URI=postgresql://...` as a user sets it, MLflow's SQLAlchemy
store making its tables on first use, and the runs read back by a second client, as
another machine would read them. The cluster is `tests/support/postgres.py`'s, on
127.0.0.1; without PostgreSQL's programs the tests skip, saying so."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipelines.layout import Layout, trial_key
from pipelines.records import TrackingRecord
from pmnet.trial_id import TrialId

FIXTURES = Path(__file__).parent / "fixtures" / "results"
TRIALS = [("learned_full", 42), ("consolidator_only", 43)]


def _result(condition: str, seed: int) -> dict:
    """A debug trial's result file (tests/fixtures/results) with the keys a result of
    today's pipeline has besides (`select`, `config`)."""
    res = json.loads((FIXTURES / f"{condition}__seed{seed}.json").read_text())
    return {**res, "select": "updated_ltm", "config": {"model.hidden": 32, "seed": seed,
                                                       "phase1_seed": 0}}


def _plan(tmp_path: Path, uri: str, name: str, **kw):
    from pipelines import plan as planning

    return planning.plan_new(root=tmp_path / "runs", name=name, preset="debug", grid="tiny",
                             tracking_uri=uri, num_cpus=2, gpus_per_trial=0, **kw)


def test_tracking_layer_logs_runs_to_postgres_and_reads_them_back(postgres, tmp_path,
                                                                   monkeypatch, capsys):
    """`open_tracking` makes the experiment and the parent run in PostgreSQL (MLflow
    migrates the empty database first), `mirror` logs two trials from their
    result files; a fresh client reads one FINISHED run per trial with its params, every
    epoch and the test metrics, and the artifacts under the storage root. A second backfill
    (another driver, a resume) finds them by their tags in the database and logs nothing
    twice."""
    from mlflow import MlflowClient

    from pipelines import tracking
    from pipelines.layout import write_json

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root would be ./mlruns here
    postgres.createdb("tracking")
    uri = postgres.uri(database="tracking")
    plan = _plan(tmp_path, uri, "pg")
    lay: Layout = plan.layout
    lay.run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    runs = tracking.open_tracking(plan)  # creates MLflow's schema in the empty database
    first_open_s = time.monotonic() - t0
    lay.results_dir.mkdir(parents=True)
    for c, s in TRIALS:
        write_json(lay.result_path(TrialId(c, s)), _result(c, s))
    ids = [TrialId(c, s) for c, s in TRIALS]
    assert tracking.mirror(lay, runs, trials=ids) == {"logged": 2, "pending": 0}

    again = tracking.Runs.reopen(lay)  # a later driver of the same pipeline
    assert again.tracker.uri == uri
    assert tracking.mirror(lay, again, trials=ids) == {"logged": 0, "pending": 0}

    client = MlflowClient(uri)  # what another machine's client sees
    exp = client.get_experiment_by_name("pmnet/pg")
    assert exp.experiment_id == TrackingRecord.read(lay.tracking_json).experiment_id
    assert exp.artifact_location == (lay.root / "mlartifacts" / "pg").as_uri()
    found = client.search_runs([exp.experiment_id], max_results=100)
    by_key = {}
    for r in found:
        by_key.setdefault(r.data.tags.get("run_key"), []).append(r)
    assert sorted(by_key) == sorted(["pg", *(trial_key("pg", TrialId(c, s))
                                            for c, s in TRIALS)])
    assert all(len(v) == 1 for v in by_key.values()), {k: len(v) for k, v in by_key.items()}
    for c, s in TRIALS:
        run = by_key[trial_key("pg", TrialId(c, s))][0]
        res = _result(c, s)
        assert run.info.status == "FINISHED" and run.info.run_name == TrialId(c, s).name
        assert run.data.tags["mlflow.parentRunId"] == runs.parent
        assert (run.data.tags["condition"], run.data.tags["seed"]) == (c, str(s))
        assert run.data.params["model.hidden"] == "32" and run.data.params["seed"] == str(s)
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "epoch"))
        assert steps == [h["epoch"] for h in res["history"]]
        val = client.get_metric_history(run.info.run_id, "val/updated_ltm")
        assert sorted((m.step, m.value) for m in val) == sorted(
            (h["epoch"], h["val/updated_ltm"]) for h in res["history"])
        assert run.data.metrics["test/updated_ltm"] == pytest.approx(res["test"]["updated_ltm"])
        arts = [a.path for a in client.list_artifacts(run.info.run_id, "result")]
        assert arts == [f"result/{TrialId(c, s).name}.json"]
        assert (lay.root / "mlartifacts" / "pg" / run.info.run_id / "artifacts" / "result"
                / f"{TrialId(c, s).name}.json").is_file()
    assert not (tmp_path / "mlruns").exists()
    said = capsys.readouterr().out
    assert "postgresql://postgres:***@127.0.0.1" in said and postgres.password not in said
    print(f"first open of an empty PostgreSQL database (MLflow's migrations): "
          f"{first_open_s:.1f} s; cluster start: {postgres.start_s:.1f} s")


def test_two_drivers_find_each_others_runs_in_one_postgres_database(postgres, tmp_path):
    """Two machines of one study, each with its own storage root, logging the same pipeline
    name to one database: the second attaches to the runs the first made (by `run_key`)
    instead of making its own, so the study has one run per trial."""
    from mlflow import MlflowClient

    from pipelines import tracking
    from pipelines.layout import write_json

    postgres.createdb("two")
    uri = postgres.uri(database="two") + "?connect_timeout=10"  # as docs/pipeline.md says
    made = {}
    for machine, trials in (("a", TRIALS[:1]), ("b", TRIALS)):
        plan = _plan(tmp_path / machine, uri, "study")
        lay = plan.layout
        lay.run_dir.mkdir(parents=True)
        runs = tracking.open_tracking(plan)
        made[machine] = runs.parent
        lay.results_dir.mkdir(parents=True)
        for c, s in trials:
            write_json(lay.result_path(TrialId(c, s)), _result(c, s))
        want = {"a": {"logged": 1, "pending": 0}, "b": {"logged": 1, "pending": 0}}[machine]
        ids = [TrialId(c, s) for c, s in trials]
        assert tracking.mirror(lay, runs, trials=ids) == want, machine
    assert made["a"] == made["b"]  # one parent run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("pmnet/study")
    found = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
    keys = sorted(r.data.tags.get("trial_key") for r in found if "trial_key" in r.data.tags)
    assert keys == sorted(trial_key("study", TrialId(c, s)) for c, s in TRIALS)


def test_no_console_line_shows_a_database_password(tmp_path):
    """The URI a user gives may hold the database's password: `make status` and the
    run's closing lines (those of `make ui`, `run.ui_plan`) print it as `***` (the probe's
    refusals already did); `make ui` serves the database itself."""
    from pipelines import run
    from pipelines.records import PipelineRecord
    from pipelines.status import status_text

    uri = "postgresql://mlflow:hunter2@db.lab.example:5432/mlflow"
    plan = _plan(tmp_path, uri, "pw", check_tracking=False)  # no such server
    lay = plan.layout
    lay.run_dir.mkdir(parents=True)
    PipelineRecord(name="pw", preset="debug", n_trials=4, status="finished",
                   tracking=uri).write(lay.pipeline_json)
    record = TrackingRecord(tracking_uri=uri, experiment_name="pmnet/pw", experiment_id="7",
                            parent_run_id="abc")
    record.write(lay.tracking_json)
    text = status_text(lay)
    assert "store postgresql://mlflow:***@db.lab.example:5432/mlflow" in text, text
    args, lines = run.ui_plan(lay.root, name="pw")
    hint = "\n".join(lines)
    assert "hunter2" not in hint and "hunter2" not in text
    assert hint.startswith("MLflow UI for postgresql://mlflow:***@db"), hint
    assert "#/experiments/7/runs" in hint and "runs/abc" in hint
    assert args[args.index("--backend-store-uri") + 1] == uri


def test_a_model_file_goes_into_mlflow_by_its_size_not_its_presets_name(tmp_path):
    """Issue 63: Stage 1's checkpoint and a trial's selected model go into MLflow as artifacts
    when the file is small (the `debug` and `cpu` presets' ~1 MB; not `small`'s 3.8 MB and
    up): a size, where a list of preset names stood."""
    from pipelines.tracking import ARTIFACT_MODEL_MAX_BYTES, model_as_artifact

    small, large = tmp_path / "small.pt", tmp_path / "large.pt"
    small.write_bytes(b"\0" * 1_116_763)  # a committed `cpu` phase1.pt's size
    large.write_bytes(b"\0" * 3_812_635)  # a committed `small` phase1.pt's size
    assert model_as_artifact(small) and not model_as_artifact(large)
    assert not model_as_artifact(tmp_path / "missing.pt")
    edge = tmp_path / "edge.pt"
    edge.write_bytes(b"\0" * ARTIFACT_MODEL_MAX_BYTES)
    assert model_as_artifact(edge)
