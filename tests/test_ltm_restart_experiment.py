"""experiments/ltm_restart.py (issue 11, part 4): LTM saved by one process and answered by
another equals the LTM never saved, bit for bit, and the refusals happen, on a debug model."""

import json
from pathlib import Path

import pytest
import torch

from pmnet.config import ModelConfig
from pmnet.model import PMNet
from pmnet.train import MODEL_FORMAT, save_model_file
from tests.support.experiments import load_experiment


@pytest.fixture(scope="module")
def script():
    return load_experiment("ltm_restart")


def _model_file(path: Path, seed: int) -> str:
    torch.manual_seed(seed)
    m = PMNet(ModelConfig.from_name("debug"))
    with torch.no_grad():  # a Consolidator off the identity
        m.consolidator.w_d.weight.normal_(0, 0.3)
    save_model_file(path, m, fmt=MODEL_FORMAT, meta={})
    return str(path)


def test_restored_answers_equal_the_never_saved_ones_and_bad_files_are_refused(script,
                                                                                tmp_path):
    model = _model_file(tmp_path / "a.pt", 0)
    other = _model_file(tmp_path / "b.pt", 1)
    out = tmp_path / "out"
    assert script.main([model, str(out), "n=24", "segments=3", f"other={other}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bit_for_bit"] is True
    live, restored = summary["never_saved"], summary["restored_in_a_new_process"]
    assert restored["logits_sha256"] == live["logits_sha256"]
    assert restored["updated_ltm"] == live["updated_ltm"] and restored["segments"] == 3
    assert [(r["case"].split(" (")[0], r["exit"]) for r in summary["refusals"]] == [
        ("another model", 2), ("one byte flipped", 2), ("cut in half", 2)]
    assert "written by another model" in summary["refusals"][0]["message"]
    assert "content sha256" in summary["refusals"][1]["message"]
    assert sorted(p.name for p in out.iterdir()) == ["ltm.pt", "summary.json"]


def test_an_unknown_key_or_condition_fails_before_any_work(script, tmp_path):
    with pytest.raises(SystemExit, match="unknown key 'seeds'"):
        script.main(["m.pt", str(tmp_path / "out"), "seeds=3"])
    with pytest.raises(ValueError, match="nope"):
        script.main(["m.pt", str(tmp_path / "out"), "condition=nope"])
    assert not (tmp_path / "out").exists()
