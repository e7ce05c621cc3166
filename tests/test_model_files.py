"""Tests of pmnet.model_files: weights-only model files, their sha256 sidecars and the one
Phase-1 check (moved here from tests/test_train.py with the module, issue 51). The files are
an untrained model's, written by `save_model_file` as `run_phase1` writes a checkpoint:
these tests check the files, not training (tests/test_train.py trains and reloads)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from pmnet.config import ModelConfig
from pmnet.model import PMNet
from pmnet.model_files import (
    PHASE1_FORMAT,
    load_model_file,
    save_model_file,
    sha256_file,
    verify_phase1,
    write_sha256,
)


@dataclasses.dataclass
class _Cfg:
    model: ModelConfig


@pytest.fixture
def phase1(tmp_path):
    """(config, {"checkpoint", "sha256"}) of a Phase-1 file, as `run_phase1` returns them."""
    cfg = _Cfg(ModelConfig.from_name("debug"))
    torch.manual_seed(0)
    path = tmp_path / "p1" / "phase1.pt"
    path.parent.mkdir()
    digest = save_model_file(path, PMNet(cfg.model), fmt=PHASE1_FORMAT, meta={"phase": 1})
    return cfg, {"checkpoint": str(path), "sha256": digest}


def test_a_saved_model_file_loads_as_the_same_model_with_its_hash_beside_it(phase1):
    cfg, p1 = phase1
    assert sha256_file(p1["checkpoint"]) == p1["sha256"]
    assert open(p1["checkpoint"] + ".sha256").read() == f"{p1['sha256']}  phase1.pt\n"
    model, payload = load_model_file(p1["checkpoint"], expect_config=cfg.model)
    assert payload["format"] == PHASE1_FORMAT and payload["meta"] == {"phase": 1}
    torch.manual_seed(0)
    ref = PMNet(cfg.model).state_dict()
    assert ref.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ref.items())
    assert model.routing_u_uses_ltm is True and "routing_u_uses_ltm" not in payload


def test_verify_phase1_checks_the_recorded_hash_and_the_model_config(phase1, tmp_path):
    """The one Phase-1 check: the sidecar, then the hash a pipeline recorded, then (with a
    model config) that the bytes load as a model of that config."""
    cfg, p1 = phase1
    assert verify_phase1(p1["checkpoint"], expected_sha256=p1["sha256"],
                         model_config=cfg.model) == p1["sha256"]
    with pytest.raises(ValueError, match="not the 000000000000... recorded"):
        verify_phase1(p1["checkpoint"], expected_sha256="0" * 64)
    other = dataclasses.replace(cfg.model, hidden=2 * cfg.model.hidden)
    with pytest.raises(ValueError, match="not a loadable Phase-1 model file"):
        verify_phase1(p1["checkpoint"], model_config=other)
    garbage = tmp_path / "phase1.pt"  # garbage with a matching sidecar
    garbage.write_bytes(b"not a checkpoint")
    write_sha256(garbage, sha256_file(garbage))
    assert verify_phase1(garbage) == sha256_file(garbage)
    with pytest.raises(ValueError, match="not a loadable Phase-1 model file"):
        verify_phase1(garbage, model_config=cfg.model)
    (tmp_path / "phase1.pt.sha256").unlink()
    with pytest.raises(ValueError, match="no recorded sha256"):
        verify_phase1(garbage)


def test_a_model_file_with_a_bad_strict_flag_is_refused(phase1, tmp_path):
    _, p1 = phase1
    payload = torch.load(p1["checkpoint"], weights_only=True)
    payload["routing_u_uses_ltm"] = "no"
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="routing_u_uses_ltm must be true or false"):
        load_model_file(tmp_path / "bad.pt")


def test_model_files_load_strictly_with_or_without_an_operator(phase1, tmp_path):
    _, p1 = phase1
    payload = torch.load(p1["checkpoint"], weights_only=True)
    assert not any(k.startswith("operators.") for k in payload["state_dict"])
    for extra, match in (({"foo.bar": torch.zeros(1)}, "Unexpected key"),
                         ({"operators.lstm.w": torch.zeros(1)}, "unknown consolidation operator"),
                         ({"operators.ema.beta": torch.zeros(1)}, "Missing key|Unexpected key")):
        bad = {**payload, "state_dict": {**payload["state_dict"], **extra}}
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises((RuntimeError, ValueError), match=match):
            load_model_file(tmp_path / "bad.pt")


def test_a_paused_phase2_units_model_is_its_phase1_file_plus_its_trainable_weights(tmp_path):
    """`load_phase2_progress` on a compact checkpoint gives the weights the unit trained: the
    frozen ones the Phase-1 file's, the Consolidator the checkpoint's; another Phase-1 file is
    refused."""
    import torch

    from pmnet.model_files import load_phase2_progress
    from pmnet.train import StopAtEpochEnd, TrainConfig, run_phase1, run_phase2

    small = dict(phase1_max_epochs=1, phase1_episodes_per_epoch=32, val_episodes=16,
                 test_episodes=16, eval_batch_size=16, batch_size=16, episodes_per_epoch=32,
                 max_epochs=2, patience=2, consolidator_init_std=0.18)
    cfg = TrainConfig.from_name("debug", **small)
    p1 = Path(run_phase1(cfg, tmp_path / "p1", progress=False)["checkpoint"])
    stop = StopAtEpochEnd()
    stop.request()
    run_phase2(cfg, condition="consolidator_only", seed=42, phase1_ckpt=p1,
               out_dir=tmp_path / "p2", progress=False, stop=stop)
    ckpt = tmp_path / "p2" / "ckpt" / "last.ckpt"
    model = load_phase2_progress(p1, ckpt)
    base, _ = load_model_file(p1)
    held = torch.load(ckpt, weights_only=True)["state_dict"]
    for name, p in model.named_parameters():
        want = held[f"model.{name}"] if f"model.{name}" in held else dict(
            base.named_parameters())[name]
        assert torch.equal(p, want), name
    assert any(not torch.equal(p, dict(base.named_parameters())[n])
               for n, p in model.named_parameters() if n.startswith("consolidator."))
    other = TrainConfig.from_name("debug", **{**small, "phase1_seed": 1})
    p1b = Path(run_phase1(other, tmp_path / "p1b", progress=False)["checkpoint"])
    with pytest.raises(ValueError, match="continues Phase-1 file"):
        load_phase2_progress(p1b, ckpt)
