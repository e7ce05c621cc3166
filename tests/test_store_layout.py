"""pmnet.store_layout: the store's paths and its record (the contract between the pipeline,
which writes a store, and the report, which reads one)."""

import json

import pytest

from pmnet.store_layout import StoreLayout, StoreRecord, read_store_record
from pmnet.trial_id import TrialId


def test_paths_follow_a_run_directory_so_the_report_reads_a_store_as_a_run(tmp_path):
    lay = StoreLayout(tmp_path)
    trial = TrialId("consolidator_only", 42, phase1_seed=3)
    assert lay.result(trial) == tmp_path / "results" / "consolidator_only-p3-s42.json"
    assert lay.stage1_json(3) == tmp_path / "phase1-p1s3" / "stage1.json"
    assert lay.stage1_json(None) == tmp_path / "phase1" / "stage1.json"
    assert lay.diagnostics(trial).parent != lay.results_dir  # never read as a result


def test_record_round_trips_and_refuses_another_format(tmp_path):
    rec = StoreRecord(subsets={"confirmatory": [3, 4]}, notes="n")
    (tmp_path / "store.json").write_text(json.dumps(rec.to_dict()))
    assert read_store_record(tmp_path) == rec
    (tmp_path / "store.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="store.json"):
        read_store_record(tmp_path)
    with pytest.raises(ValueError, match="subset"):
        StoreRecord(subsets={"c": [-1]})
    assert read_store_record(tmp_path / "none") is None


def test_a_run_directory_lays_its_units_out_as_a_store(tmp_path):
    """Issue 51: one unit layout. A run's units (`Layout.units`) are a store's layout rooted
    at the run directory; the Phase-1 unit's name is spelled in one place."""
    from pipelines.layout import Layout
    from pipelines.phase1 import Phase1Slot
    from pmnet.store_layout import phase1_seed_of, unit_name

    run, store = Layout(tmp_path / "runs", "r"), StoreLayout(tmp_path / "store")
    trial = TrialId("consolidator_only", 42, phase1_seed=3)

    def rel(paths, root):
        return [p.relative_to(root) for p in paths]

    assert rel(run.units.trial_files(trial), run.run_dir) == rel(store.trial_files(trial),
                                                                 store.root)
    for k in (None, 3):
        assert rel(run.units.phase1_files(k), run.run_dir) == rel(store.phase1_files(k),
                                                                  store.root)
        assert run.phase1_dir_for(k).name == store.phase1_dir(k).name == unit_name(k)
        assert Phase1Slot(k, None, run.phase1_dir_for(k)).label == unit_name(k)
    assert run.result_path(trial) == run.units.result(trial)
    assert store.phase1_files(3)[-1] == store.stage1_json(3)  # the commit record last
    assert store.trial_files(trial)[-1] == store.result(trial)
    assert (phase1_seed_of("phase1-p1s12"), phase1_seed_of("phase1"),
            phase1_seed_of("phase1-p1sx")) == (12, None, None)
