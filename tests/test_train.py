"""Training: every phase and condition runs (fast_dev_run-sized), freezing is real, a killed
run resumes to the same result, and bad input fails before training starts."""

import dataclasses
import errno
import functools
import json
import math
import os
import pickle
import shutil
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint

from pmnet.config import ModelConfig
from pmnet.io import atomic_link
from pmnet.train import (
    CONDITIONS,
    RESULT_KEYS,
    AtomicCheckpointIO,
    Phase0Module,
    Phase1Module,
    Phase2Module,
    TrainConfig,
    checkpoint_epoch,
    init_consolidator,
    load_model_file,
    run_phase1,
    run_phase2,
    verify_phase1,
)
from tests.support.store import amd_cpu

TINY = dict(episodes_per_epoch=32, max_epochs=1, val_episodes=16, test_episodes=16,
            eval_batch_size=16, phase1_episodes_per_epoch=32, phase1_max_epochs=1)


@pytest.fixture(scope="module")
def phase1(tmp_path_factory):
    cfg = TrainConfig.from_name("debug", **TINY)
    out = tmp_path_factory.mktemp("phase1")
    res = run_phase1(cfg, out, progress=False)
    return cfg, res


def test_phase1_writes_checkpoint_with_hash(phase1):
    cfg, res = phase1
    path = Path(res["checkpoint"])
    assert verify_phase1(path) == res["sha256"]
    payload = torch.load(path, weights_only=True)  # no pickled code
    assert payload["format"] == "pmnet-phase1/v1"
    assert {"seg1_stm", "seg2_stm", "mean_stm"} <= set(res["metrics"])
    # Phase 0 ran (debug preset has it) and the Consolidator stayed at its identity init
    model, _ = load_model_file(path)
    assert torch.count_nonzero(model.consolidator.w_d.weight) == 0


@pytest.mark.xfail(amd_cpu(), strict=False,
                   reason="measured at stop 61 on the 2-core AMD EPYC VM: 1 and 2 threads "
                          "round fp32 Phase 1 differently there (MKL_CBWR=AUTO,STRICT fixes "
                          "it on Intel only), so the sha256 differs; the same test failed "
                          "with the pmnet of commit 40538cc on that machine")
def test_phase1_trained_twice_alike_is_byte_identical(phase1, tmp_path):
    """A store's two pieces and one uninterrupted run give the same Phase-1 sha256: the
    file holds what training computes, not how it ran: no wall time and no threads (a
    checkpoint trained alone has 2, one in a wave of two 1; issue 53), which stay in
    phase1_metrics.json. Trained again here with another thread count, under another
    root."""
    cfg, res = phase1
    other = dataclasses.replace(cfg, threads=(cfg.threads or torch.get_num_threads()) % 2 + 1)
    before = torch.get_num_threads()
    try:
        again = run_phase1(other, tmp_path / "another" / "root", progress=False)
    finally:
        torch.set_num_threads(before)
    assert again["threads"] == other.threads != (cfg.threads or before)
    assert again["sha256"] == res["sha256"]
    payload = torch.load(again["checkpoint"], weights_only=True)
    assert "train_time_s" not in payload["meta"]
    assert "threads" not in payload["meta"]["train_config"]
    assert str(tmp_path) not in json.dumps(payload["meta"])  # no path of its run
    metrics = json.loads((tmp_path / "another" / "root" / "phase1_metrics.json").read_text())
    assert metrics["train_time_s"] > 0 and metrics["train_config"]["threads"] == other.threads


def test_phase1_records_its_route_diagnostics_on_the_validation_stream(phase1):
    cfg, res = phase1
    routes = res["routes"]
    on_disk = json.loads((Path(res["checkpoint"]).parent / "route_diagnostics.json").read_text())
    assert on_disk == routes and routes["episodes"] == cfg.val_episodes
    assert routes["kind"] == "phase1" and len(routes["margin_median"]) == cfg.model.n_blocks
    # the diagnostics' STM recall is the validation stream's, the same as the best epoch's
    val = max(row["val/mean_stm"] for row in json.loads(
        (Path(res["checkpoint"]).parent / "phase1_metrics.json").read_text())["history"])
    assert routes["stm"]["recall"] == pytest.approx(val, abs=1e-6)


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_every_condition_trains_and_writes_a_result(phase1, condition, tmp_path):
    cfg, p1 = phase1
    res = run_phase2(cfg, condition=condition, seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, progress=False)
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert set(on_disk) == RESULT_KEYS  # no record given: exactly the result's own keys
    assert on_disk["condition"] == condition and on_disk["seed"] == 42
    assert on_disk["phase1_sha256"] == p1["sha256"]
    for k in ("updated_ltm", "forced_identity", "fresh_ltm", "mismatched_ltm", "seg2_stm",
              "mean_stm", "initial_ltm", "alternative_mode"):
        assert 0 <= on_disk["test"][k] <= 100
    assert 0 < res["trainable_fraction"] <= 1
    ref, _ = load_model_file(p1["checkpoint"])
    new, _ = load_model_file(tmp_path / "best_model.pt")
    subset = {n for n, _ in new.trainable_subset(CONDITIONS[condition].subset)}
    changed = {n for (n, a), (_, b) in zip(ref.named_parameters(), new.named_parameters())
               if not torch.equal(a, b)}
    assert changed <= subset  # frozen parameters are bitwise unchanged
    assert changed  # and something did train


def test_phase2_writes_a_callers_record_but_never_over_a_result_key(phase1, tmp_path):
    cfg, p1 = phase1
    with pytest.raises(ValueError, match=r"may not replace result key\(s\) \['seed'\]"):
        run_phase2(cfg, condition="consolidator_only", seed=42, phase1_ckpt=p1["checkpoint"],
                   out_dir=tmp_path / "refused", progress=False, record={"seed": 7})
    assert not (tmp_path / "refused").exists()  # refused before any work
    record = {"variant": "T3-full", "variant_overrides": {"segments": 3}}
    res = run_phase2(dataclasses.replace(cfg, segments=3), condition="consolidator_only",
                     seed=42, phase1_ckpt=p1["checkpoint"], out_dir=tmp_path, progress=False,
                     record=record)
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert set(on_disk) == RESULT_KEYS | set(record) and on_disk == res
    assert on_disk["variant_overrides"] == {"segments": 3} and on_disk["config"]["segments"] == 3


def test_killed_run_resumes_to_the_same_result(phase1, tmp_path):
    """Resumed equals uninterrupted, exactly: pinned to the CPU (accelerator="cpu"), where
    every kernel is deterministic; on CUDA `gather` and SDPA's backward are not, so an exact
    comparison there would fail for a reason that is not a resume bug."""
    cfg, p1 = phase1
    cfg2 = TrainConfig.from_name("debug", **{**TINY, "max_epochs": 2})

    class Crash(L.Callback):  # dies at the start of epoch 1, after epoch 0 was checkpointed
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                raise RuntimeError("injected crash in epoch 1")

    full = run_phase2(cfg2, condition="consolidator_only", seed=43,
                      phase1_ckpt=p1["checkpoint"], out_dir=tmp_path / "full", progress=False,
                      accelerator="cpu")
    with pytest.raises(RuntimeError, match="injected"):
        run_phase2(cfg2, condition="consolidator_only", seed=43, phase1_ckpt=p1["checkpoint"],
                   out_dir=tmp_path / "crash", callbacks=[Crash()], progress=False,
                   accelerator="cpu")
    assert (tmp_path / "crash" / "ckpt" / "last.ckpt").is_file()
    saved = torch.load(tmp_path / "crash" / "ckpt" / "last.ckpt", weights_only=True)
    before = saved["pmnet_train_time_s"]  # the crashed attempt's time up to its checkpoint
    t = time.time()
    resumed = run_phase2(cfg2, condition="consolidator_only", seed=43,
                         phase1_ckpt=p1["checkpoint"], out_dir=tmp_path / "crash",
                         progress=False, accelerator="cpu")
    wall = time.time() - t
    assert resumed["test"] == full["test"]
    assert len(resumed["history"]) == len(full["history"]) == 2
    # one metrics.csv history, the uninterrupted run's (Lightning's CSVLogger alone deletes
    # the file it finds and keeps only what the resumed attempt logs)
    rows = [(tmp_path / d / "logs" / "metrics.csv").read_text() for d in ("full", "crash")]
    assert rows[0] == rows[1] and rows[0].count("\n") > 3
    # train_time_s adds the crashed attempt's time: more than this attempt's wall alone
    assert before > 0 and wall < resumed["train_time_s"] <= before + wall


def test_each_epoch_writes_its_checkpoint_once(phase1, tmp_path, monkeypatch):
    """One checkpoint write per epoch: last.ckpt, or best.ckpt when the metric improved
    (last.ckpt is then a hard link to it); last.ckpt always holds the epoch just ended."""
    _, p1 = phase1
    cfg = TrainConfig.from_name("debug", **{**TINY, "max_epochs": 3, "patience": 3})
    writes = []
    save = AtomicCheckpointIO.save_checkpoint

    def counting(self, checkpoint, path, storage_options=None):
        writes.append((Path(path).name, checkpoint["epoch"]))
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counting)
    ckdir = tmp_path / "ckpt"

    seen = []

    class Probe(Checkpoint):  # a Checkpoint callback: runs after ModelCheckpoint and last.ckpt
        def on_train_epoch_end(self, trainer, module):
            seen.append((trainer.current_epoch, checkpoint_epoch(ckdir / "last.ckpt"),
                         (ckdir / "last.ckpt").samefile(ckdir / "best.ckpt")))

    res = run_phase2(cfg, condition="consolidator_only", seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, callbacks=[Probe()], progress=False)
    n = len(res["history"])
    assert n == 3
    assert [epoch for _, epoch in writes] == list(range(n))  # exactly one write per epoch
    assert [(e, e) for e, _, _ in seen] == [(e, got) for e, got, _ in seen]
    linked = [same for _, _, same in seen]
    assert linked == [name == "best.ckpt" for name, _ in writes]
    assert writes[0][0] == "best.ckpt"  # the first epoch always improves
    assert sorted(os.listdir(ckdir)) == ["best.ckpt", "last.ckpt"]  # no temporary files left


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_atomic_checkpoint_write_keeps_the_old_file_when_saving_fails(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpt" / "last.ckpt"
    io.save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="cannot pickle"):  # fails while serialising
        io.save_checkpoint({"epoch": 2, "w": torch.zeros(3), "bad": _Unpicklable()}, path)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:  # fails after the bytes went out, before the rename
        mp.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError, match="No space"):
            io.save_checkpoint({"epoch": 3, "w": torch.zeros(1000)}, path)
    assert path.read_bytes() == before and os.listdir(path.parent) == ["last.ckpt"]
    assert torch.load(path, weights_only=True)["epoch"] == 1
    # a hard link to it (last.ckpt as best.ckpt) is never written through
    assert atomic_link(path, path.parent / "best.ckpt")
    io.save_checkpoint({"epoch": 4}, path)
    assert torch.load(path.parent / "best.ckpt", weights_only=True)["epoch"] == 1
    assert torch.load(path, weights_only=True)["epoch"] == 4


class _Payload:
    """Unpickling this calls Path.write_text: proof that pickled code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "code from a checkpoint ran\n")


def test_resume_refuses_a_checkpoint_that_carries_code(phase1, tmp_path, monkeypatch):
    """Checkpoints are loaded weights-only, whatever torch's default: a pickled payload in
    last.ckpt is refused at resume, not executed."""
    _, p1 = phase1
    cfg = TrainConfig.from_name("debug", **{**TINY, "max_epochs": 2})

    class Crash(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                raise RuntimeError("injected crash in epoch 1")

    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected"):
        run_phase2(cfg, condition="consolidator_only", seed=43, phase1_ckpt=p1["checkpoint"],
                   out_dir=out, callbacks=[Crash()], progress=False)
    last = out / "ckpt" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    marker = tmp_path / "pwned"
    state["pmnet_history"].append({"epoch": 99, "note": _Payload(marker)})
    last.unlink()  # last.ckpt is a hard link to best.ckpt here: replace, don't write through
    torch.save(state, last)
    # torch < 2.6 (the project allows >= 2.4) unpickles anything by default; this variable
    # restores that default on newer torch, for any load that does not say weights_only
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        run_phase2(cfg, condition="consolidator_only", seed=43, phase1_ckpt=p1["checkpoint"],
                   out_dir=out, progress=False)
    assert not marker.exists()


def test_tampered_or_missing_checkpoint_is_refused(phase1, tmp_path):
    cfg, p1 = phase1
    bad = tmp_path / "phase1.pt"
    shutil.copy(p1["checkpoint"], bad)
    shutil.copy(p1["checkpoint"] + ".sha256", str(bad) + ".sha256")
    with open(bad, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        run_phase2(cfg, condition="learned_full", seed=42, phase1_ckpt=bad, out_dir=tmp_path)
    with pytest.raises(ValueError, match="not found"):
        run_phase2(cfg, condition="learned_full", seed=42, phase1_ckpt=tmp_path / "none.pt",
                   out_dir=tmp_path)
    assert not (tmp_path / "result.json").exists()


def test_checkpoint_from_another_model_config_is_refused(phase1, tmp_path):
    _, p1 = phase1
    other = TrainConfig.from_name("debug", **{**TINY, "model.hidden": 48})
    with pytest.raises(ValueError, match="different model config"):
        run_phase2(other, condition="learned_full", seed=42, phase1_ckpt=p1["checkpoint"],
                   out_dir=tmp_path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="huge"), "unknown preset"),
        (dict(name="debug", seeds=()), "seeds is empty"),
        (dict(name="debug", conditions=("learned_half",)), "unknown condition"),
        (dict(name="debug", lr=0.0), "TrainConfig.lr"),
        (dict(name="debug", batch_size=0), "TrainConfig.batch_size"),
        (dict(name="debug", precision="fp8"), "TrainConfig.precision"),
        (dict(name="debug", consolidator_init_std=-0.1), "consolidator_init_std"),
        (dict(name="debug", consolidator_lr="0.01"), "consolidator_lr"),
        (dict(name="debug", consolidator_weight_decay=True), "consolidator_weight_decay"),
        (dict(name="debug", segments=1), "TrainConfig.segments must be an integer in 2..8"),
        (dict(name="debug", segments=9), "TrainConfig.segments must be an integer in 2..8"),
        (dict(name="debug", segments=3.0), "TrainConfig.segments"),
        (dict(name="debug", segments=True), "TrainConfig.segments"),
        (dict(name="debug", segments="4"), "TrainConfig.segments"),
        (dict(name="debug", ltm_graph="tbptt"), "TrainConfig.ltm_graph must be one of"),
        (dict(name="debug", detach_ltm=True, ltm_graph="truncated"), "cannot be combined"),
        (dict(name="debug", detach_ltm="yes"), "TrainConfig.detach_ltm"),
    ],
)
def test_bad_config_fails_clearly(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_name(name, **kwargs)


def test_bad_condition_and_seed_fail_before_training(phase1, tmp_path):
    cfg, p1 = phase1
    with pytest.raises(ValueError, match="unknown condition"):
        run_phase2(cfg, condition="everything", seed=42, phase1_ckpt=p1["checkpoint"],
                   out_dir=tmp_path)
    with pytest.raises(ValueError, match="seed"):
        run_phase2(cfg, condition="learned_full", seed="42", phase1_ckpt=p1["checkpoint"],
                   out_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_paper_preset_is_the_papers_protocol():
    cfg = TrainConfig.from_name("paper")
    assert (cfg.lr, cfg.betas, cfg.weight_decay, cfg.warmup_steps, cfg.grad_clip) == (
        5e-4, (0.9, 0.95), 0.1, 100, 1.0)
    assert (cfg.batch_size, cfg.episodes_per_epoch, cfg.max_epochs, cfg.patience) == (
        256, 100_000, 60, 6)
    assert (cfg.val_episodes, cfg.test_episodes, cfg.seeds) == (1000, 1000, (42, 43, 44, 45, 46))
    assert cfg.detach_ltm is False and not cfg.phase1_curriculum and len(cfg.notes) == 1
    # "Backbone initialization: PMNet copy-task checkpoint": Phase 0 is on (docs/choices.md)
    assert (cfg.phase0_steps, cfg.phase0_copy_len) == (4_000, 4)  # the recipe that learned
    assert (cfg.phase0_lr, cfg.phase0_lr_schedule) == (1e-3, "constant")
    assert any("Phase 0" in n for n in cfg.notes)
    assert cfg.model.rope_theta == 1_000_000.0
    assert set(cfg.conditions) == set(CONDITIONS) and len(CONDITIONS) == 6
    flat = cfg.flat()
    assert flat["model.hidden"] == 384 and flat["seeds"] == "42,43,44,45,46"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_paper_preset_runs_phase0_before_phase1(tmp_path, monkeypatch):
    """PRESET=paper: the copy-task warm start (Phase 0) trains the model Phase 1 starts from."""
    assert TrainConfig.from_name("paper").phase0_steps > 0
    cfg = TrainConfig.from_name(  # the paper's protocol on the tiny model with tiny budgets
        "paper", model=ModelConfig.from_name("debug"), phase0_steps=3, batch_size=16,
        warmup_steps=2, compile="off", **TINY)
    calls, embed = [], {}

    def spy(phase, step):
        @functools.wraps(step)
        def wrapped(self, batch, batch_idx):
            if phase not in embed:  # the weights this phase starts from
                embed[phase] = self.model.embed.weight.detach().clone()
            calls.append(phase)
            return step(self, batch, batch_idx)
        return wrapped

    monkeypatch.setattr(Phase0Module, "training_step", spy(0, Phase0Module.training_step))
    monkeypatch.setattr(Phase1Module, "training_step", spy(1, Phase1Module.training_step))
    run_phase1(cfg, tmp_path, progress=False)
    assert calls == [0] * 3 + [1] * (TINY["phase1_episodes_per_epoch"] // 16)
    assert not torch.equal(embed[0], embed[1])  # Phase 1 starts from the Phase-0 weights
    meta = json.loads((tmp_path / "phase1_metrics.json").read_text())
    assert math.isfinite(meta["phase0"]["phase0/final_loss"])
    assert (tmp_path / "phase0_logs").is_dir() and (tmp_path / "phase1_logs").is_dir()
    assert meta["train_config"]["phase0_steps"] == 3
    # resuming Phase 1 (its last.ckpt exists) does not rerun Phase 0 and keeps its metrics
    calls.clear()
    saved = torch.load(tmp_path / "phase1_ckpt" / "last.ckpt", weights_only=True)
    run_phase1(cfg, tmp_path, progress=False)
    assert 0 not in calls
    again = json.loads((tmp_path / "phase1_metrics.json").read_text())
    assert again["phase0"] == meta["phase0"]
    # and its train_time_s keeps the first attempt's time, recorded in the checkpoint
    assert again["train_time_s"] >= saved["pmnet_train_time_s"] > 0


def test_phase2_consolidator_start_is_an_identity_drawn_from_the_seed(phase1):
    cfg, p1 = phase1
    cfg = TrainConfig.from_name("debug", **TINY, consolidator_init_std=0.3)
    S = torch.rand(64, cfg.model.phase_dim) * 2 * math.pi
    weights = {}
    for seed in (42, 43, 42):
        model, _ = load_model_file(p1["checkpoint"])
        init_consolidator(model, cfg, seed)
        C = model.consolidator
        # exact identity on the circle whatever the draw (W_d = 0, unit-phasor bias)
        diff = torch.remainder(C(S) - S + math.pi, 2 * math.pi) - math.pi
        assert diff.abs().max() < 1e-5
        assert C.w_g.weight.std().item() == pytest.approx(0.3, rel=0.2)
        weights.setdefault(seed, []).append(C.w_g.weight.clone())
    assert torch.equal(weights[42][0], weights[42][1])  # the seed decides the draw
    assert not torch.equal(weights[42][0], weights[43][0])  # seeds differ
    # std 0 (the paper preset) keeps the checkpoint's Consolidator untouched
    model, _ = load_model_file(p1["checkpoint"])
    before = {k: v.clone() for k, v in model.consolidator.state_dict().items()}
    init_consolidator(model, TrainConfig.from_name("debug", **TINY), 42)
    assert all(torch.equal(before[k], v) for k, v in model.consolidator.state_dict().items())


def test_consolidator_has_its_own_learning_rate_and_weight_decay(phase1):
    _, p1 = phase1
    cfg = TrainConfig.from_name("debug", **TINY, consolidator_lr=0.02,
                                consolidator_weight_decay=0.0)
    model, _ = load_model_file(p1["checkpoint"])
    module = Phase2Module(cfg, model, CONDITIONS["learned_full"])
    module.trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False)
    opt = module.configure_optimizers()["optimizer"]
    cons = {id(p) for p in model.consolidator.parameters()}
    for group in opt.param_groups:
        ids = {id(p) for p in group["params"]}
        if ids & cons:
            assert ids <= cons
            assert group["initial_lr"] == 0.02 and group["weight_decay"] == 0.0
        else:
            assert group["initial_lr"] == cfg.lr  # before the warmup factor
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_cpu_preset_nests_both_arms_under_three_phase1_checkpoints():
    """Issue 21: the Phase-1 checkpoint as the unit of analysis (K = 3, each with both arms
    paired over three seeds), a fresh test stream, and every departure named in the notes."""
    from pmnet import task
    from pmnet.model import PMNet
    from pmnet.train.config import CPU_TEST_SEED, RETIRED_TEST_SEEDS

    cfg = TrainConfig.from_name("cpu")
    assert cfg.conditions == ("consolidator_only", "consolidator_only_routing_off")
    assert len(cfg.phase1_seeds) >= 3 and len(cfg.seeds) >= 2 and cfg.test_episodes >= 2000
    # the final figures come from a stream no earlier preset read (validation is unchanged)
    assert cfg.test_seed == CPU_TEST_SEED not in (task.TEST_SEED, task.VAL_SEED)
    assert CPU_TEST_SEED not in RETIRED_TEST_SEEDS and task.TEST_SEED in RETIRED_TEST_SEEDS
    assert TrainConfig.from_name("paper").test_seed == task.TEST_SEED
    # the Consolidator's start is drawn from the Phase-2 seed (seeds differ beyond data)
    assert cfg.consolidator_init_std > 0
    # the routed blocks' capacity: phase dim 8 (the paper's 16 made the routes inert)
    assert cfg.model.phase_dim == 8 and cfg.model.route_gain == 4
    # the top blocks cannot hold the task: one written phase dim each (issue 21)
    assert cfg.model.write_dims == (1, 1, 8, 8)
    paper_model = ModelConfig.from_name("paper")  # the paper preset stays the paper's
    assert paper_model.route_gain == 1 and paper_model.write_dims is None
    total = sum(p.numel() for p in PMNet(cfg.model).parameters())
    text = " ".join(cfg.notes)
    assert f"{total / 1e6:.2f}M" in text  # the parameter count the notes print is the model's
    steps1 = cfg.phase1_max_epochs * cfg.phase1_episodes_per_epoch // cfg.batch_size
    steps2 = cfg.max_epochs * cfg.episodes_per_epoch // cfg.batch_size
    lr = "lr " + format(cfg.consolidator_lr, ".0e").replace("e-0", "e-")  # as "lr 3e-3"
    for word in ("phase dim 8", "route gain 4", "1 of their 8 phase dims", "curriculum",
                 "auxiliary", f"{steps1:,} steps",
                 f"{steps2:,} steps", "N(0, 0.18)", lr,
                 "2,000 episodes", f"{CPU_TEST_SEED:,}", "three Phase-1 checkpoints"):
        assert word in text, word
    paper = TrainConfig.from_name("paper")
    assert paper.consolidator_init_std == 0 and paper.initial_ltm_loss == 0
    assert paper.consolidator_lr == 0 and paper.consolidator_weight_decay is None
    assert paper.phase1_seeds == ()  # the paper's single-checkpoint design (K by option)


@pytest.mark.parametrize("name", ["small", "medium"])
def test_the_ladder_rungs_lie_between_cpu_and_paper_with_the_cpu_recipe(name, capsys):
    """Issue 52: each rung of the scale ladder has between `cpu`'s and `paper`'s parameters
    (as `pmnet info` prints them), the `cpu` preset's training recipe, a test stream of its
    own that no earlier run read, and notes naming how its model departs from the paper."""
    from pmnet import cli, task
    from pmnet.model import PMNet
    from pmnet.train.config import CPU_TEST_SEED, LADDER_TEST_SEEDS, RETIRED_TEST_SEEDS

    def total(preset):
        with torch.device("meta"):
            return PMNet(ModelConfig.from_name(preset)).parameter_counts()["total"]

    cfg, cpu = TrainConfig.from_name(name), TrainConfig.from_name("cpu")
    assert total("cpu") < total(name) < total("paper")
    assert cli.main(["info", "--preset", name, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total"] == total(name) and info["notes"] == list(cfg.notes)
    text = " ".join(cfg.notes)
    assert f"{total(name) / 1e6:.2f}M" in text and "paper" in text
    # the cpu recipe: every training field but the preset, the model, the test stream, notes
    # (and `small`'s Phase-1 budget: 60 epochs, chosen on issue 52's validation curves)
    budget = {"phase1_max_epochs", "phase1_patience"}
    same = {f.name for f in dataclasses.fields(TrainConfig)} - {"preset", "model", "test_seed",
                                                                "notes", *budget}
    assert {f: getattr(cfg, f) for f in same} == {f: getattr(cpu, f) for f in same}
    if name == "small":
        assert (cfg.phase1_max_epochs, cfg.phase1_patience) == (60, 60)
        assert "Phase 1: 12,000 steps" in text and "Phase 1: 8,000 steps" not in text
    else:
        assert {f: getattr(cfg, f) for f in budget} == {f: getattr(cpu, f) for f in budget}
    seeds = [TrainConfig.from_name(p).test_seed for p in ("cpu", "small", "medium")]
    assert len(set(seeds)) == 3 and cfg.test_seed == LADDER_TEST_SEEDS[name]
    assert cfg.test_seed not in (*RETIRED_TEST_SEEDS, CPU_TEST_SEED, task.VAL_SEED)
    assert f"{cfg.test_seed:,}" in text
    m = cfg.model
    if name == "small":  # the cpu model twice as wide, nothing else changed
        assert (m.hidden, m.ffn, m.n_head, m.head_dim) == (128, 384, 4, 32)
        assert m.differences(cpu.model) == {"hidden": (128, 64), "ffn": (384, 192),
                                            "head_dim": (32, 16)}
    else:  # toward the paper: its phase dim, Consolidator, route gain and write dims
        paper = ModelConfig.from_name("paper")
        assert (m.hidden, m.n_layer, m.write_period, m.n_blocks, m.branch) == (256, 8, 2, 4, 4)
        assert (m.phase_dim, m.consolidator_hidden) == (paper.phase_dim,
                                                        paper.consolidator_hidden)
        assert m.route_gain == paper.route_gain and m.write_dims is None
        assert m.n_head * m.head_dim == m.hidden and 683 <= m.ffn <= 768
        for word in ("phase dim 32", "route gain 1", "issue 21"):
            assert word in text, word


def _dict_literals_keyed_by_presets(root: Path, names: set[str]) -> list[str]:
    """`file:line` of every dict literal under `root` with two or more keys that are preset
    names: a second registry (`{"paper": _paper, "cpu": _cpu}`) or a table keyed by preset."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict) and sum(
                    isinstance(k, ast.Constant) and k.value in names for k in node.keys) >= 2:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_one_preset_registry_gives_the_model_and_the_training_config(monkeypatch, tmp_path):
    """Issue 63: a preset is one entry of one registry (`pmnet.config.PRESETS`) that gives its
    model and its training settings; `ModelConfig.from_name` and `TrainConfig.from_name` are
    both lookups into that same object, so they know the same names, and an entry added to
    it (or taken out) is known (or unknown) to both at once."""
    import pmnet.config as model_config
    import pmnet.train.config as train_config
    from pmnet.config import PRESETS, Preset, default_preset

    assert train_config.PRESETS is model_config.PRESETS  # one object, not a copy
    assert not hasattr(train_config, "TRAIN_PRESETS")
    assert all(isinstance(p, Preset) and p.name == name for name, p in PRESETS.items())
    for name, preset in PRESETS.items():  # both lookups give the entry's own model
        model, cfg = ModelConfig.from_name(name), TrainConfig.from_name(name)
        assert model is preset.model is cfg.model and cfg.preset == model.name == name
        assert cfg.notes == preset.notes and cfg.needs_gpu == preset.needs_gpu
        assert {k: getattr(cfg, k) for k in preset.train} == dict(preset.train)
    # the names each lookup accepts: exactly the registry's keys, for both
    probe = sorted(PRESETS) + ["huge", "Paper", "cpu ", ""]

    def accepted(lookup) -> set[str]:
        out = set()
        for name in probe:
            try:
                lookup(name)
            except ValueError:
                continue
            out.add(name)
        return out

    assert accepted(ModelConfig.from_name) == accepted(TrainConfig.from_name) == set(PRESETS)
    # the same object behind both: a new entry is one place, and both see it
    extra = Preset("extra", dataclasses.replace(PRESETS["debug"].model, name="extra"),
                   train={**PRESETS["debug"].train, "lr": 1e-3})
    order = list(PRESETS)
    monkeypatch.setitem(PRESETS, "extra", extra)
    assert ModelConfig.from_name("extra") is extra.model
    assert TrainConfig.from_name("extra").lr == 1e-3
    monkeypatch.delitem(PRESETS, "extra")
    monkeypatch.delitem(PRESETS, "small")
    for lookup in (ModelConfig.from_name, TrainConfig.from_name):
        with pytest.raises(ValueError, match="unknown (model )?preset"):
            lookup("small")
    monkeypatch.undo()
    # undo re-inserts a deleted entry last: put the registry back in its own order, which
    # `make help` and the README list (tests/test_workflow.py)
    restored = dict(PRESETS)
    PRESETS.clear()
    PRESETS.update({n: restored[n] for n in order})
    assert list(PRESETS) == order
    # what the pipeline reads of a preset is in its entry: one default per accelerator
    assert [default_preset(a) for a in ("gpu", "cpu")] == ["paper", "cpu"]
    assert [n for n, p in PRESETS.items() if p.needs_gpu] == ["paper"]
    # an entry is checked when made: its model is named after it, its train part cannot
    # set the preset or the model
    with pytest.raises(ValueError, match="named after it"):
        Preset("other", PRESETS["debug"].model)
    with pytest.raises(ValueError, match="train sets model"):
        Preset("debug", PRESETS["debug"].model, train={"model": None})
    with pytest.raises(ValueError, match="default_on"):
        Preset("debug", PRESETS["debug"].model, default_on="tpu")
    with pytest.raises(TypeError):  # read-only: an entry changes where it is written
        PRESETS["cpu"].train["lr"] = 1.0
    # no second registry (nor a table keyed by preset names) anywhere in the code
    repo = Path(__file__).resolve().parents[1]
    names = set(PRESETS)
    assert [hit for d in ("pmnet", "pipelines", "tune_spaces")
            for hit in _dict_literals_keyed_by_presets(repo / d, names)] == []
    # not vacuous: the old second registry would have been found
    old = tmp_path / "old"
    old.mkdir()
    (old / "m.py").write_text('TRAIN_PRESETS = {"paper": _paper, "cpu": _cpu}\n')
    assert _dict_literals_keyed_by_presets(old, names) == ["old/m.py:1"]


def test_the_test_seed_picks_the_test_stream_and_nothing_else(phase1, tmp_path):
    """`test_seed` changes the stream the final figures are read on (recorded in the result),
    not the Phase-1 checkpoint's identity, and can never be the validation stream's seed."""
    from pipelines.phase1 import phase1_config_hash
    from pmnet import task

    cfg, p1 = phase1
    other = dataclasses.replace(cfg, test_seed=12_345)
    assert phase1_config_hash(other) == phase1_config_hash(cfg)
    res = run_phase2(other, condition="consolidator_only", seed=42,
                     phase1_ckpt=p1["checkpoint"], out_dir=tmp_path, progress=False)
    want = task.content_hash(task.test_stream(cfg.test_episodes, seed=12_345))
    assert res["test_seed"] == 12_345 and res["test_stream_hash"] == want
    assert want != task.content_hash(task.test_stream(cfg.test_episodes))
    for bad, match in [(task.VAL_SEED, "validation stream"), (-1, "non-negative"),
                       (True, "non-negative"), (2**32, "outside 0..4294967295")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_name("debug", test_seed=bad)
    with pytest.raises(ValueError, match="validation stream"):
        task.test_stream(10, seed=task.VAL_SEED)


@pytest.mark.parametrize(
    "sets, match",
    [
        (['lr="0.001"'], "TrainConfig.lr must be a number"),
        (["lr=true"], "TrainConfig.lr must be a number"),
        (["consolidator_lr=\"3e-3\""], "TrainConfig.consolidator_lr must be a number"),
        (["model.rope_theta=\"1e6\""], "ModelConfig.rope_theta must be a number"),
        (["model.init_std=false"], "ModelConfig.init_std must be a number"),
        (["preset=paper"], "'preset' cannot be overridden"),
        (["model=paper"], "'model' takes a ModelConfig"),
        (["learning_rate=0.1"], "unknown TrainConfig field"),
        (["model.width=8"], "unknown ModelConfig field"),
        (["conditions=learned_half"], "unknown condition 'learned_half'"),
    ],
)
def test_bad_set_values_fail_clearly_before_any_work(sets, match):
    from pmnet.train import parse_overrides

    with pytest.raises(ValueError, match=match):
        TrainConfig.from_name("debug", **parse_overrides(sets))


def test_list_fields_take_one_value_or_comma_separated_values():
    from pmnet.train import parse_overrides

    cfg = TrainConfig.from_name("debug", **parse_overrides(["conditions=learned_full"]))
    assert cfg.conditions == ("learned_full",)
    cfg = TrainConfig.from_name("debug", **parse_overrides(
        ["conditions=learned_full, consolidator_only", "seeds=7"]))
    assert cfg.conditions == ("learned_full", "consolidator_only") and cfg.seeds == (7,)
    cfg = TrainConfig.from_name("debug", **parse_overrides(["seeds=[1, 2]", "lr=0.01"]))
    assert cfg.seeds == (1, 2) and cfg.lr == 0.01


# ---------------------------------------------------------------------------------------------
# T-segment episodes and truncated backpropagation (issue 11)
# ---------------------------------------------------------------------------------------------
def test_segments_and_ltm_graph_leave_every_preset_and_its_phase1_identity_unchanged():
    from pmnet.conditions import PHASE2_ONLY_FIELDS

    assert set(PHASE2_ONLY_FIELDS) <= {f.name for f in dataclasses.fields(TrainConfig)}
    for name in ("paper", "cpu", "debug"):
        cfg = TrainConfig.from_name(name)
        assert (cfg.segments, cfg.ltm_graph, cfg.detach_ltm) == (2, "full", False)
        old = {k: v for k, v in cfg.to_dict().items() if k not in ("segments", "ltm_graph")}
        assert TrainConfig.from_dict(old) == cfg  # configs stored before issue 11 still load
    # Phase-2-only: the Phase-1 config hash (and so every Phase-1 checkpoint) is unchanged
    assert {"segments", "ltm_graph"} <= set(PHASE2_ONLY_FIELDS)
    cfg = TrainConfig.from_name("debug", segments=5, ltm_graph="truncated")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.flat()["segments"] == 5 and cfg.flat()["ltm_graph"] == "truncated"


@pytest.mark.parametrize("T", [2, 3, 4])
def test_truncated_phase2_gradient_reaches_the_consolidator_only_through_the_last_boundary(T):
    """One Phase-2 training step on one batch of a tiny model: the gradient of the loss w.r.t.
    the Consolidator's parameters through each boundary (tests/support/grad_probe.py) is non-zero at
    every boundary with the full graph, zero through every earlier boundary (and non-zero
    through the last) with LTM detached between boundaries, and zero everywhere when LTM is
    detached after every boundary."""
    from pmnet import task
    from pmnet.model import PMNet
    from tests.support.grad_probe import probe

    batch = task.train_episodes(0, 0, 8, segments=T)
    norms = {}
    for graph in ("full", "truncated", "detached"):
        cfg = TrainConfig.from_name("debug", segments=T, ltm_graph=graph)
        torch.manual_seed(0)
        model = PMNet(cfg.model)
        with torch.no_grad():  # a Consolidator off the identity (W_d = 0 blocks W_g, W_u)
            model.consolidator.w_d.weight.normal_(0, 0.5)
        module = Phase2Module(cfg, model, CONDITIONS["consolidator_only"])
        p = probe(model, T)
        with pytest.warns(UserWarning, match="self.log"):  # no Trainer: logging is skipped
            loss = module.training_step(batch, 0)
        assert p.calls == T * cfg.model.n_blocks  # one consolidation per segment and block
        if graph == "detached":  # no path at all from the loss to a trainable parameter
            assert not loss.requires_grad
        else:
            loss.backward()
        norms[graph] = p.grad_norms()
    assert all(g > 0 for g in norms["full"]), norms
    assert norms["truncated"][:-1] == [0.0] * (T - 1) and norms["truncated"][-1] > 0, norms
    assert norms["detached"] == [0.0] * T, norms


def test_phase2_trains_and_tests_on_t_segment_episodes(phase1, tmp_path):
    from pmnet import task

    _, p1 = phase1
    cfg = TrainConfig.from_name("debug", **TINY, segments=3, ltm_graph="truncated")
    res = run_phase2(cfg, condition="learned_full_dual", seed=42,
                     phase1_ckpt=p1["checkpoint"], out_dir=tmp_path, progress=False)
    assert res["test_stream_hash"] == task.content_hash(task.test_stream(16, segments=3))
    test = res["test"]
    for k in ("updated_ltm", "seg3_stm", "mean_stm", "dual", "final_ltm_seg1",
              "final_ltm_seg3", "updated_ltm_follow_seg2"):
        assert 0 <= test[k] <= 100, k
    assert test["final_ltm_seg3"] == test["updated_ltm"]
    assert test["mean_stm"] == pytest.approx(sum(test[f"seg{t}_stm"] for t in (1, 2, 3)) / 3)
    assert res["config"]["segments"] == 3 and res["config"]["ltm_graph"] == "truncated"


# ------------------------------------------------------------------ consolidation operators
from pmnet.conditions import (  # noqa: E402
    ALL_CONDITIONS,
    BASELINE_CONDITIONS,
    CHANNEL_CONDITIONS,
    OPERATOR_CONDITIONS,
    ROUTING_PAIRS,
    STRICT_OFF_CONDITIONS,
    STRICT_PAIRS,
    Condition,
    get_condition,
)
from pmnet.model import OPERATOR_SUBSET, PMNet  # noqa: E402
from pmnet.operators import OPERATORS, operator_parameter_counts  # noqa: E402
from pmnet.train import init_operator  # noqa: E402


def test_operator_conditions_are_the_consolidator_only_setting_per_operator():
    assert set(OPERATOR_CONDITIONS).isdisjoint(CONDITIONS)  # the paper's six are untouched
    assert list(ALL_CONDITIONS) == (list(CONDITIONS) + list(OPERATOR_CONDITIONS)
                                    + list(BASELINE_CONDITIONS) + list(CHANNEL_CONDITIONS)
                                    + list(STRICT_OFF_CONDITIONS))
    assert [c.consolidation for c in OPERATOR_CONDITIONS.values()] == list(OPERATORS)
    ref = CONDITIONS["consolidator_only"]
    for name, c in OPERATOR_CONDITIONS.items():
        assert name == f"operator_{c.consolidation}" and get_condition(name) is c
        assert c.subset == OPERATOR_SUBSET
        assert (c.ltm_routing, c.objective, c.select) == (ref.ltm_routing, ref.objective,
                                                          ref.select)
    TrainConfig.from_name("debug", conditions=tuple(OPERATOR_CONDITIONS))  # validates


def _changed_parameters(ref, new) -> set[str]:
    """Names of `new`'s parameters that are not bitwise `ref`'s (or that `ref` lacks)."""
    old = dict(ref.named_parameters())
    return {n for n, p in new.named_parameters() if n not in old or not torch.equal(p, old[n])}


def _same_arm(a, b) -> bool:
    """Two conditions alike in everything but routing (operator, subset, objective, select)."""
    return (a.consolidation, a.subset, a.objective, a.select) == (
        b.consolidation, b.subset, b.objective, b.select)


def test_each_routing_off_twin_differs_from_its_arm_only_in_routing():
    """Issue 39: every routing-on arm of ROUTING_PAIRS has a twin that is the same condition
    with the direct L term of Eq. 9 removed, and nothing else changed."""
    assert set(ROUTING_PAIRS.values()) - {"consolidator_only_routing_off"} == set(
        CHANNEL_CONDITIONS)
    for on, off in ROUTING_PAIRS.items():
        a, b = get_condition(on), get_condition(off)
        assert a.ltm_routing is True and b.ltm_routing is False
        assert _same_arm(a, b)


@pytest.mark.parametrize("condition", list(CHANNEL_CONDITIONS))
def test_routing_off_twin_trains_its_arms_parameters_without_l_in_routing(phase1, condition,
                                                                         tmp_path):
    cfg, p1 = phase1
    res = run_phase2(cfg, condition=condition, seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, progress=False)
    twin = next(on for on, off in ROUTING_PAIRS.items() if off == condition)
    assert res["ltm_routing"] is False and res["condition"] == condition
    ref, _ = load_model_file(p1["checkpoint"])
    new, _ = load_model_file(tmp_path / "best_model.pt")
    changed = _changed_parameters(ref, new)
    subset = {n for n, _ in new.trainable_subset(get_condition(twin).subset)}
    assert changed and changed <= subset  # the twin's own trainable set, and it trained


def test_each_strict_off_twin_is_its_routing_off_arm_with_l_out_of_u_too():
    """Issue 39: a strict-off twin differs from its routing-off arm only in L leaving the
    latent state u of the routers; strict off with the direct term on is refused."""
    assert set(STRICT_PAIRS.values()) == set(STRICT_OFF_CONDITIONS)
    for off, strict in STRICT_PAIRS.items():
        a, b = get_condition(off), get_condition(strict)
        assert (a.ltm_routing, a.routing_u_ltm) == (False, True)
        assert (b.ltm_routing, b.routing_u_ltm) == (False, False)
        assert _same_arm(a, b)
    assert all(c.routing_u_ltm for n, c in ALL_CONDITIONS.items()
               if n not in STRICT_OFF_CONDITIONS)
    with pytest.raises(ValueError, match="strict routing off.*needs ltm_routing=False"):
        Condition("x", "learned", "consolidator_only", True, "updated", "updated_ltm", "x", "x",
                  routing_u_ltm=False)


@pytest.mark.parametrize("condition", list(STRICT_OFF_CONDITIONS))
def test_strict_off_twin_trains_and_its_model_file_keeps_its_routers_strict(phase1, condition,
                                                                           tmp_path):
    cfg, p1 = phase1
    res = run_phase2(cfg, condition=condition, seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, progress=False)
    assert res["routing_u_ltm"] is False and res["ltm_routing"] is False
    ref, ref_payload = load_model_file(p1["checkpoint"])
    new, payload = load_model_file(tmp_path / "best_model.pt")
    assert ref.routing_u_uses_ltm is True and "routing_u_uses_ltm" not in ref_payload
    assert new.routing_u_uses_ltm is False and payload["routing_u_uses_ltm"] is False
    changed = _changed_parameters(ref, new)
    assert changed and changed <= {n for n, _ in new.trainable_subset(
        get_condition(condition).subset)}
    # the file's routers are what was tested: re-evaluated, the loaded model gives the
    # result's test recall
    from pmnet import task
    from pmnet.evaluate import evaluate

    stream = task.test_stream(cfg.test_episodes, seed=cfg.test_seed)
    again = evaluate(new, stream, consolidation="learned", ltm_routing=False, full=False,
                     stm=False)
    assert again["updated_ltm"] == pytest.approx(res["test"]["updated_ltm"], abs=1e-9)


@pytest.mark.parametrize("condition", list(OPERATOR_CONDITIONS))
def test_operator_condition_trains_only_its_operator(phase1, condition, tmp_path):
    cfg, p1 = phase1
    name = OPERATOR_CONDITIONS[condition].consolidation
    res = run_phase2(cfg, condition=condition, seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, progress=False)
    assert res["consolidation"] == name and res["ltm_routing"] is True
    assert res["trainable_params"] == operator_parameter_counts(cfg.model)[name]
    for k in ("updated_ltm", "forced_identity", "initial_ltm", "fresh_ltm", "mismatched_ltm"):
        assert 0 <= res["test"][k] <= 100
    assert res["test"]["alternative_mode"] == res["test"]["forced_identity"]
    # the Phase-1 checkpoint (no operator) loaded strictly; best_model.pt has the operator
    ref, _ = load_model_file(p1["checkpoint"])
    new, _ = load_model_file(tmp_path / "best_model.pt")
    assert len(ref.operators) == 0 and list(new.operators) == [name]
    old = dict(ref.named_parameters())
    for n, p in new.named_parameters():
        if n in old:
            assert torch.equal(p, old[n]), n  # everything else, Consolidator included, frozen
    start = PMNet(cfg.model)
    init_operator(start, cfg, name, 42)
    trained = new.operators[name].state_dict()
    assert any(not torch.equal(v, trained[k])
               for k, v in start.operators[name].state_dict().items())  # it did train


def test_operator_start_is_seeded_like_the_consolidators(phase1):
    _, p1 = phase1

    def start(cfg, seed):
        model, _ = load_model_file(p1["checkpoint"])
        init_operator(model, cfg, "gru", seed)
        return model.operators["gru"].w_x.weight.clone()

    paper_like = TrainConfig.from_name("debug", **TINY)  # std 0: one start for every seed
    assert torch.equal(start(paper_like, 42), start(paper_like, 43))
    drawn = TrainConfig.from_name("debug", **TINY, consolidator_init_std=0.3)
    a, b = start(drawn, 42), start(drawn, 43)
    assert torch.equal(a, start(drawn, 42)) and not torch.equal(a, b)
    assert a[: 4 * drawn.model.phase_dim].std().item() == pytest.approx(0.3, rel=0.2)
    assert torch.count_nonzero(a[4 * drawn.model.phase_dim:]) == 0  # W_n = 0: identity start


def test_operator_shares_the_consolidators_learning_rate_and_weight_decay(phase1):
    _, p1 = phase1
    cfg = TrainConfig.from_name("debug", **TINY, consolidator_lr=0.02,
                                consolidator_weight_decay=0.0)
    model, _ = load_model_file(p1["checkpoint"])
    init_operator(model, cfg, "linear", 42)
    module = Phase2Module(cfg, model, OPERATOR_CONDITIONS["operator_linear"])
    assert module.trainable == sorted(n for n, _ in model.trainable_subset(OPERATOR_SUBSET))
    module.trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False)
    opt = module.configure_optimizers()["optimizer"]
    op = {id(p) for p in model.operators["linear"].parameters()}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == op
    assert all(g["initial_lr"] == 0.02 and g["weight_decay"] == 0.0 for g in opt.param_groups)


def test_an_operator_condition_trains_on_t_segment_episodes(phase1, tmp_path):
    """The two issue-11 extensions compose: an alternative operator at every boundary of a
    three-segment episode, trained with truncated backpropagation."""
    _, p1 = phase1
    cfg = TrainConfig.from_name("debug", **TINY, segments=3, ltm_graph="truncated")
    res = run_phase2(cfg, condition="operator_gru", seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, progress=False)
    assert res["trainable_params"] == operator_parameter_counts(cfg.model)["gru"]
    assert res["test"]["final_ltm_seg3"] == res["test"]["updated_ltm"]
    assert 0 <= res["test"]["final_ltm_seg1"] <= 100


def test_rng_state_of_the_training_device_only(monkeypatch):
    """A checkpoint carries the RNG state of the GPU the module trains on, not of every
    visible GPU, and a trial resumed where it sees fewer GPUs than when it saved (Ray gives
    each trial its own) restores that one state instead of failing (finding 7)."""
    cfg = TrainConfig.from_name("debug")
    module = Phase2Module(cfg, PMNet(cfg.model),
                          CONDITIONS["consolidator_only"])
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: (
        calls.append(("get", device)) or torch.tensor([7], dtype=torch.uint8)))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: calls.append(
        ("set", device, state.tolist())))

    def all_states(states=None):
        if states is not None and len(states) != torch.cuda.device_count():
            raise RuntimeError("set_rng_state_all: more states than visible GPUs")
        return [torch.tensor([1], dtype=torch.uint8)] * 2

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", all_states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", all_states)

    ckpt: dict = {}
    module.on_save_checkpoint(ckpt)  # on CPU: no CUDA state at all
    assert "cuda" not in ckpt["pmnet_rng"] and calls == []
    module._device = torch.device("cuda", 0)  # as Lightning sets it on a GPU
    module.on_save_checkpoint(ckpt)
    assert ckpt["pmnet_rng"]["cuda"].tolist() == [7]
    assert calls == [("get", torch.device("cuda", 0))]
    # a checkpoint written by get_rng_state_all on a two-GPU machine, resumed seeing one
    old = {"pmnet_rng": {"torch": torch.get_rng_state(),
                         "cuda": [torch.tensor([3], dtype=torch.uint8),
                                  torch.tensor([4], dtype=torch.uint8)]}}
    module.on_load_checkpoint(old)
    assert calls[-1] == ("set", torch.device("cuda", 0), [3])
    module._device = torch.device("cpu")  # resumed on CPU: the GPU state is not used
    n = len(calls)
    module.on_load_checkpoint(old)
    assert len(calls) == n


def test_seeds_beyond_numpys_range_are_refused_before_any_compute(tmp_path):
    """A seed above 2**32 - 1 passed validation and crashed every trial inside Lightning's
    seed_everything (numpy's seed bound); it is refused by the config and by run_phase2
    (finding 8). The bound itself is what seed_everything accepts."""
    from pmnet.conditions import MAX_SEED

    L.seed_everything(MAX_SEED, verbose=False)
    with pytest.raises(ValueError):
        L.seed_everything(MAX_SEED + 1, verbose=False)
    TrainConfig.from_name("debug", seeds=(MAX_SEED,), phase1_seed=MAX_SEED)
    for over in ({"seeds": (42, MAX_SEED + 1)}, {"phase1_seed": MAX_SEED + 1}):
        with pytest.raises(ValueError, match="outside 0..4294967295"):
            TrainConfig.from_name("debug", **over)
    with pytest.raises(ValueError, match="outside 0..4294967295"):
        run_phase2(TrainConfig.from_name("debug"), condition="consolidator_only",
                   seed=MAX_SEED + 1, phase1_ckpt=tmp_path / "none.pt", out_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_phase2_records_the_last_epochs_test_metrics_beside_the_selected_ones(phase1, tmp_path):
    """An unchanging model (a Consolidator learning rate of 1e-30) ties every epoch's
    validation score, so the first epoch stays selected while the last epoch is evaluated
    separately: the same weights, so the same test metrics by two paths."""
    cfg, p1 = phase1
    cfg = dataclasses.replace(cfg, max_epochs=3, patience=3, consolidator_lr=1e-30)
    res = run_phase2(cfg, condition="consolidator_only", seed=42,
                     phase1_ckpt=p1["checkpoint"], out_dir=tmp_path, progress=False)
    assert (res["best_epoch"], res["last_epoch"]) == (0, 2)
    assert set(res["test_last"]) == set(res["test"])
    for k in ("updated_ltm", "forced_identity", "mean_stm"):
        assert res["test_last"][k] == res["test"][k], k
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk["test_last"] == res["test_last"]


# ------------------------------------------------------------------ baselines (issue 23)
from pmnet.baselines import CARRIED_MODES, baseline_parameter_counts  # noqa: E402


@pytest.mark.parametrize("condition", list(BASELINE_CONDITIONS))
def test_baseline_condition_trains_and_reloads(phase1, condition, tmp_path):
    cfg, p1 = phase1
    cond = BASELINE_CONDITIONS[condition]
    mode = cond.consolidation
    res = run_phase2(cfg, condition=condition, seed=42, phase1_ckpt=p1["checkpoint"],
                     out_dir=tmp_path, progress=False)
    assert res["consolidation"] == mode
    for k in ("updated_ltm", "initial_ltm", "fresh_ltm", "mismatched_ltm", "seg1_stm"):
        assert 0 <= res["test"][k] <= 100
    # no consolidation to force: the result says nothing rather than a number
    assert not {"forced_identity", "alternative_mode"} & set(res["test"])
    ref, _ = load_model_file(p1["checkpoint"])
    new, _ = load_model_file(tmp_path / "best_model.pt")  # strict load, module re-created
    old = dict(ref.named_parameters())
    if mode in CARRIED_MODES:
        assert list(new.baselines) == [mode]
        assert res["trainable_params"] == baseline_parameter_counts(cfg.model)[mode]
        for n, p in new.named_parameters():
            if n in old:
                assert torch.equal(p, old[n]), n  # the backbone stayed frozen
    else:
        assert len(new.baselines) == 0 and res["trainable_params"] == res["total_params"]


@pytest.mark.parametrize("fams, lr_schedule, msg", [
    (("add10", "add10"), "cosine", "phase2_families"),
    (("mul",), "cosine", "phase2_families"),
    ((), "cosine", "phase2_families"),
    (("add10",), "linear", "lr_schedule"),
])
def test_phase2_families_and_schedule_are_checked(fams, lr_schedule, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig.from_name("debug", phase2_families=fams, lr_schedule=lr_schedule)


def test_one_training_family_selects_on_that_familys_recall():
    from pmnet.conditions import get_condition
    from pmnet.model import PMNet
    from pmnet.train.modules import Phase2Module

    both = TrainConfig.from_name("debug")
    one = TrainConfig.from_name("debug", phase2_families=("affine10",))
    assert both.phase2_families == ("add10", "affine10")
    assert (both.select_metric("updated_ltm"), one.select_metric("updated_ltm")) == (
        "updated_ltm", "updated_ltm_affine10")
    # the order given does not matter; a dual-objective condition has no per-family metric
    assert TrainConfig.from_name("debug", phase2_families=("affine10", "add10")) == both
    assert TrainConfig.from_name("debug", phase2_families="affine10") == one
    with pytest.raises(ValueError, match="train both families"):
        Phase2Module(one, PMNet(one.model), get_condition("learned_full_dual"))
