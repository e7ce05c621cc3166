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
