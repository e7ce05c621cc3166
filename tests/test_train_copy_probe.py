"""Phase 0's recipe and success test (issue 61, item 3): `pmnet.train.run_phase0`,
`pmnet.train.copy_probe`, the `phase0_lr` / `phase0_lr_schedule` fields."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipelines.phase1 import phase1_config_hash, phase1_part
from pmnet.evaluate import COPY_CHANCE
from pmnet.model import PMNet
from pmnet.train import TrainConfig, run_phase0
from pmnet.train.copy_probe import CopyProbe
from pmnet.train.modules import Phase0Module


def _cfg(**change) -> TrainConfig:
    base = TrainConfig.from_name("debug")
    return dataclasses.replace(base, **{"phase0_steps": 12, "phase0_copy_len": 4,
                                        "warmup_steps": 2, "threads": 1, **change})


def test_run_phase0_records_the_copy_accuracy_curve(tmp_path):
    torch.manual_seed(0)
    m = run_phase0(_cfg(), PMNet(_cfg().model), tmp_path, progress=False)
    on_disk = json.loads((tmp_path / "phase0_metrics.json").read_text())
    assert on_disk["phase0/copy_acc"] == pytest.approx(m["phase0/copy_acc"])
    curve = m["phase0/copy_curve"]
    steps = [c["step"] for c in curve]
    assert steps[0] == 1 and steps[-1] == 12 and steps == sorted(set(steps))
    assert all(len(c["by_position"]) == 4 and 0 <= c["acc"] <= 1 for c in curve)
    assert m["phase0/copy_acc"] == curve[-1]["acc"]
    assert m["phase0/copy_chance"] == pytest.approx(1 / 26) == COPY_CHANCE
    # the mean is the mean of the positions (as rounded)
    assert m["phase0/copy_acc"] == pytest.approx(sum(curve[-1]["by_position"]) / 4, abs=1e-5)


def test_the_probe_reads_a_model_that_copies_as_copying():
    """A model whose prompt logits name the next payload byte reads 100% at every position;
    one that always names letter 0 reads about chance: the probe measures the copy."""
    probe = CopyProbe(copy_len=5, steps=10, n=256, seed=3)
    labels = probe.batch.labels

    class Oracle(torch.nn.Module):
        def __init__(self, cheat: bool):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.cheat = cheat

    from pmnet import evaluate

    def fake_logits(model, batch):
        n, t = batch.prompt.shape
        out = torch.zeros(n, t, 256)
        if model.cheat:
            out.scatter_(2, batch.labels.clamp(min=0)[..., None], 1.0)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(evaluate, "copy_logits", fake_logits)
    try:
        probe.read(Oracle(True), 1)
        probe.read(Oracle(False), 2)
    finally:
        mp.undo()
    assert probe.curve[0]["acc"] == 1.0
    assert probe.curve[1]["acc"] < 0.15  # letter 0 is right about 1 time in 26
    assert labels.shape[1] == 6


def test_phase0_takes_its_own_rate_and_schedule():
    cfg = _cfg(phase1_lr=5e-3, phase0_lr=1e-3, phase0_lr_schedule="constant")
    m0 = Phase0Module(cfg, PMNet(cfg.model), cfg.phase0_lr or cfg.phase1_lr)
    assert m0.lr == 1e-3 and m0.lr_schedule == "constant"
    cos = Phase0Module(_cfg(), PMNet(cfg.model), 1e-3)
    assert cos.lr_schedule == "cosine"


def test_constant_phase0_rate_stays_after_warmup(tmp_path):
    rates = {}
    for schedule in ("constant", "cosine"):
        cfg = _cfg(phase0_lr=2e-3, phase0_lr_schedule=schedule, phase0_steps=10)
        torch.manual_seed(0)
        model = PMNet(cfg.model)
        seen = []
        orig = Phase0Module.training_step

        def spy(self, batch, batch_idx, _seen=seen, _orig=orig):
            _seen.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return _orig(self, batch, batch_idx)

        mp = pytest.MonkeyPatch()
        mp.setattr(Phase0Module, "training_step", spy)
        try:
            run_phase0(cfg, model, tmp_path / schedule, progress=False)
        finally:
            mp.undo()
        rates[schedule] = seen
    assert rates["constant"][2:] == [pytest.approx(2e-3)] * 8  # after 2 warmup steps
    assert rates["cosine"][-1] < 1e-3  # decays toward zero


@pytest.mark.parametrize("change, what", [({"phase0_lr": -1e-3}, "phase0_lr"),
                                          ({"phase0_lr_schedule": "linear"},
                                           "phase0_lr_schedule"),
                                          ({"phase0_lr": float("nan")}, "phase0_lr")])
def test_bad_phase0_recipe_is_refused_by_name(change, what):
    with pytest.raises(ValueError, match=what):
        _cfg(**change)


def test_phase0_recipe_fields_keep_stored_phase1_hashes_at_their_default():
    """Fields added after stores were written stay out of the Phase-1 hash at their
    default (every committed Phase-1 unit keeps its hash), and count once set."""
    cpu = TrainConfig.from_name("cpu")
    assert "phase0_lr" not in phase1_part(cpu.to_dict())
    assert "phase0_lr_schedule" not in phase1_part(cpu.to_dict())
    warm = dataclasses.replace(cpu, phase0_lr_schedule="constant")
    assert phase1_config_hash(warm) != phase1_config_hash(cpu)


def test_a_phase0_that_ends_below_its_success_test_stops_as_not_learning(tmp_path, monkeypatch):
    """The end-of-Phase-0 success test (the watchdog's, `run_phase0`): a Phase 0 long enough
    to be judged whose held-out copy accuracy ends below 1.5x chance raises NotLearningError
    and writes no phase0_metrics.json; with the watchdog off it writes its record."""
    from pmnet.train.watchdog import NotLearning, NotLearningError

    # the loss watchdog off, so that only the success test can stop the run
    monkeypatch.setattr(NotLearning, "on_train_batch_end", lambda *a, **k: None)
    cfg = _cfg(phase0_steps=60, phase0_lr=1e-9)  # 60 steps: judged; a rate that learns nothing
    with pytest.raises(NotLearningError) as info:
        run_phase0(cfg, PMNet(cfg.model), tmp_path / "on", progress=False)
    e = info.value
    assert (e.phase, e.line_kind) == (0, "copy accuracy") and e.mean < e.threshold
    assert "success test" in str(e) and "1.5x chance" in str(e)
    assert not (tmp_path / "on" / "phase0_metrics.json").exists()
    off = dataclasses.replace(cfg, watchdog=False)
    m = run_phase0(off, PMNet(off.model), tmp_path / "off", progress=False)
    assert m["phase0/copy_acc"] < 1.5 / 26 and (tmp_path / "off" / "phase0_metrics.json").is_file()


def test_the_success_test_and_the_learning_gate_share_their_bar():
    from pmnet.evaluate import COPY_LEARNED_X_CHANCE
    from pmnet.gpu_check.table import LEARNING

    assert LEARNING["acc_min"] == pytest.approx(COPY_LEARNED_X_CHANCE * COPY_CHANCE)
