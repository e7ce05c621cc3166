"""The watchdog (issue 62, `pmnet.train.watchdog`): a phase whose training loss stays at its
line (chance; Phase 2: its own start) once `watchdog_share` of its steps are spent stops with
NotLearningError, its last finished epoch kept; `pmnet train` exits 5; a pipeline trial it
stops is "NOT LEARNING", not retried, not finished.

The rule is tested on synthetic loss sequences (a learning run's, a run at chance, at lr 0,
one that diverges, a resumed one), and end to end on runs whose learning rate is 0 (Phases 0
and 1; Phase 2 at 1e-12, since TrainConfig.lr must be > 0): the `debug` model is tiny, its
budgets raised to a few hundred steps and the share to a half so the runs stay short.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from types import SimpleNamespace

import pytest
import torch

from pmnet.config import ModelConfig
from pmnet.train import TrainConfig, run_phase1
from pmnet.train.watchdog import (
    LN10,
    LN26,
    NOT_LEARNING_EXIT,
    PHASE0_MIN_STEPS,
    WINDOW_STEPS,
    NotLearning,
    NotLearningError,
    chance_loss,
    check_point,
    not_learning,
)

EVAL = dict(val_episodes=16, test_episodes=16, eval_batch_size=16, threads=1)


# -- the rule, on synthetic losses -------------------------------------------------------------
class _Trainer(SimpleNamespace):
    pass


def _module(phase: str, *, aux: float = 0.0, demos: int = 8, consolidation="learned",
            objective="updated", initial=0.0):
    cfg = SimpleNamespace(phase1_aux_demo_loss=aux, initial_ltm_loss=initial)
    cond = SimpleNamespace(consolidation=consolidation, objective=objective)
    return SimpleNamespace(phase=phase, cfg=cfg, _demos=demos,
                           **({"condition": cond} if phase == "phase2" else {}))


def drive(losses, *, phase="phase1", planned=8000, first_step=0, share=0.15, margin=0.05,
          module=None, demos=None):
    """Feed `losses` (one per step, from step first_step + 1) to a NotLearning callback as
    Lightning would; the step it stopped at (None: it never did) and its error. A loss of
    None stands for a step whose output the watchdog must not touch (before its windows)."""
    cb = NotLearning(share, margin)
    module = module or _module(phase)
    trainer = _Trainer(estimated_stepping_batches=planned, global_step=first_step)
    cb.on_train_start(trainer, module)
    for i, loss in enumerate(losses):
        trainer.global_step = first_step + i + 1
        if demos is not None:
            module._demos = demos[i]
        outputs = {} if loss is None else {"loss": torch.tensor(float(loss))}
        try:
            cb.on_train_batch_end(trainer, module, outputs, None, i)
        except NotLearningError as e:
            return trainer.global_step, e
    return None, None


def test_chance_levels_follow_each_phases_loss():
    assert chance_loss(_module("phase0")) == pytest.approx(math.log(26)) == LN26
    assert chance_loss(_module("phase1")) == pytest.approx(math.log(10)) == LN10
    # the auxiliary loss on the demonstrations' answers adds w x ln 10 when k > 1 ...
    assert chance_loss(_module("phase1", aux=1.0, demos=3)) == pytest.approx(2 * LN10)
    assert chance_loss(_module("phase1", aux=0.5, demos=8)) == pytest.approx(1.5 * LN10)
    # ... and nothing with one demonstration (stm_loss's auxiliary term is then 0)
    assert chance_loss(_module("phase1", aux=1.0, demos=1)) == pytest.approx(LN10)
    assert chance_loss(_module("phase2")) == pytest.approx(LN10)
    assert chance_loss(_module("phase2", objective="dual")) == pytest.approx(2 * LN10)
    assert chance_loss(_module("phase2", initial=0.5)) == pytest.approx(1.5 * LN10)


def test_the_share_point_and_the_phases_too_short_to_judge():
    assert check_point(8000, 0.15, "phase1") == 1200  # the cpu preset's Phase 1
    assert check_point(4000, 0.15, "phase0") == 600  # the paper preset's Phase 0
    # Phase 0 no earlier than its plateau allows (PHASE0_MIN_STEPS), or at its last step
    assert check_point(800, 0.15, "phase0") == PHASE0_MIN_STEPS == 500
    assert check_point(120, 0.5, "phase0") == 120
    assert check_point(40, 0.5, "phase0") is None  # shorter than one window
    assert check_point(1000, 0.15, "phase2") == 150  # the cpu preset's Phase 2
    assert check_point(64, 0.15, "phase1") is None  # the debug preset: never judged
    assert check_point(600, 0.15, "phase2") is None  # 90 < two windows (its first: the line)
    assert check_point(200, 0.5, "phase2") == 100
    assert check_point(0, 0.15, "phase1") is None


def test_a_run_at_lr_0_stops_at_the_share_point_and_nothing_is_read_before_its_window():
    point, first = 1200, 1200 - WINDOW_STEPS + 1
    # an untrained model: 2 ln 256 for the query and the demonstrations' answers
    losses = [None] * (first - 1) + [11.09] * 400  # None: a step the watchdog must not read
    step, err = drive(losses, module=_module("phase1", aux=1.0), demos=[3] * 1600)
    assert step == point and err.phase == 1 and err.planned == 8000
    assert err.window == (first, point) and err.mean == pytest.approx(11.09)
    assert err.line == pytest.approx(2 * LN10) and err.threshold == pytest.approx(
        2 * LN10 - 0.05)
    assert str(err).startswith("not learning: Phase 1 stopped at step 1200 of 8000")
    assert "--set watchdog=false" in str(err)


def test_a_learning_run_is_not_stopped_and_one_within_the_margin_is():
    # the slowest of the stored cpu Phase-1 runs was 0.094 nats under chance over steps
    # 1000-1200 (its curriculum's k drawn per step): stays
    k = [1 + (i * 7) % 8 for i in range(3000)]
    chance = [LN10 * (1 + (d > 1)) for d in k]
    step, _ = drive([c - 0.09 for c in chance], module=_module("phase1", aux=1.0), demos=k,
                    planned=8000)
    assert step is None
    step, err = drive([c - 0.04 for c in chance], module=_module("phase1", aux=1.0), demos=k)
    assert step == 1200 and err.mean == pytest.approx(err.line - 0.04)
    # above chance (an untrained model over the whole vocabulary) is not learning either
    step, _ = drive([LN10 + 0.5] * 1300)
    assert step == 1200


def test_every_window_after_the_share_point_is_judged_a_nan_too():
    losses = [LN10 - 1.0] * 1500 + [float("nan")] * 100
    step, err = drive(losses)
    assert step == 1550 and math.isnan(err.mean) and "nan" in str(err)


def test_a_resumed_run_skips_a_window_it_did_not_see_whole():
    # resumed at step 1180: the window 1151-1200 is partly before this sitting
    step, err = drive([5.0] * 200, first_step=1180)
    assert step == 1250 and err.window == (1201, 1250)
    step, _ = drive([5.0] * 100, first_step=1500)  # resumed past the share point: judged
    assert step == 1550


def test_phase0_is_judged_against_ln_26():
    step, err = drive([3.24] * 700, phase="phase0", planned=4000)  # the card's 3.237-3.246
    assert step == 600 and err.phase == 0 and err.line == pytest.approx(LN26)
    assert drive([3.0] * 700, phase="phase0", planned=4000)[0] is None


def test_phase2_is_judged_against_its_own_start():
    # the cpu preset's Phase 2 starts far above ln 10 (a random Consolidator) and falls:
    # measured +1.78 (steps 1-50) and +0.75 (101-150) over ln 10; it is not stopped
    falling = [LN10 + 1.78] * 50 + [LN10 + 0.9] * 50 + [LN10 + 0.75] * 900
    assert drive(falling, phase="phase2", planned=1000)[0] is None
    step, err = drive([LN10 + 1.78] * 200, phase="phase2", planned=1000)  # flat: lr 0
    assert step == 150 and err.phase == 2 and err.line_kind == "its own start"
    assert err.line == pytest.approx(LN10 + 1.78)
    # a resumed sitting does not know the start: only a loss that is not finite stops it
    assert drive([LN10 + 1.78] * 200, phase="phase2", planned=1000, first_step=200)[0] is None
    step, err = drive([float("inf")] * 100, phase="phase2", planned=1000, first_step=200)
    assert step == 250 and "not finite" in str(err)
    # the no-memory floor is at chance by construction: never judged
    floor = _module("phase2", consolidation="no_memory")
    assert drive([LN10] * 1000, phase="phase2", planned=1000, module=floor)[0] is None


def test_the_error_survives_a_ray_task_boundary():
    err = NotLearningError("not learning: Phase 1 ...", phase=1, step=1200, mean=11.0,
                           line=4.6, threshold=4.55, last_ckpt="/x/last.ckpt")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.phase, back.step, back.last_ckpt) == (
        1, 1200, "/x/last.ckpt")

    class TaskError(Exception):  # how Ray hands a task's error to its caller
        cause = err

    assert not_learning(TaskError()) is err and not_learning(ValueError("x")) is None


# -- configuration ------------------------------------------------------------------------------
def test_config_fields_are_checked_and_parsed():
    from pmnet.train import parse_overrides

    cfg = TrainConfig.from_name("cpu")
    assert (cfg.watchdog, cfg.watchdog_share, cfg.watchdog_margin) == (True, 0.15, 0.05)
    off = TrainConfig.from_name("cpu", **parse_overrides(["watchdog=false"]))
    assert off.watchdog is False
    assert TrainConfig.from_name("cpu", phase1_lr=0).phase1_lr == 0  # the watchdog's check
    for bad, match in [({"watchdog": "no"}, "watchdog must be true or false"),
                       ({"watchdog_share": 0}, r"watchdog_share must be in \(0, 1\]"),
                       ({"watchdog_share": 1.5}, "watchdog_share"),
                       ({"watchdog_margin": -0.1}, "watchdog_margin must be >= 0"),
                       ({"watchdog_margin": "x"}, "watchdog_margin must be a number"),
                       ({"phase1_lr": -1e-3}, "phase1_lr must be >= 0"),
                       ({"lr": 0.0}, "TrainConfig.lr must be > 0")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_name("debug", **bad)


def test_the_watchdog_changes_no_config_hash():
    """A setting that decides whether a run stops, not what it computes: a Phase-1 config
    hash and a trial's unit hash are those of a config recorded before the fields existed."""
    from pipelines.phase1 import phase1_config_hash, phase1_part
    from pipelines.store import config_hash, unit_config
    from pmnet.store_layout import config_digest

    cfg = TrainConfig.from_name("cpu")
    other = dataclasses.replace(cfg, watchdog=False, watchdog_share=0.5, watchdog_margin=0.2)
    assert phase1_config_hash(cfg) == phase1_config_hash(other)
    old = {k: v for k, v in cfg.to_dict().items() if not k.startswith("watchdog")}
    assert phase1_config_hash(cfg) == config_digest(phase1_part(old))
    assert config_hash(cfg.flat()) == config_hash(other.flat())
    assert not any(k.startswith("watchdog") for k in unit_config(cfg.flat()))


# -- end to end -----------------------------------------------------------------------------------
def _phase1_cfg(**over) -> TrainConfig:
    # 64 steps per epoch, 2 epochs; judged from step 96 (a half of 128, in epoch 1)
    base = dict(phase1_episodes_per_epoch=1024, phase1_max_epochs=2, phase1_patience=2,
                watchdog_share=0.75, phase1_lr=0.0, **EVAL)
    return TrainConfig.from_name("debug", **{**base, **over})


@pytest.fixture(scope="module")
def untrained_phase1(tmp_path_factory):
    """The lr-0 Phase 1 with the watchdog off: it runs to the end (an untrained model)."""
    out = tmp_path_factory.mktemp("untrained")
    before = torch.get_num_threads()
    try:
        res = run_phase1(_phase1_cfg(watchdog=False), out, progress=False)
    finally:
        torch.set_num_threads(before)
    return out, res


def test_with_the_watchdog_off_an_lr_0_run_runs_to_the_end(untrained_phase1):
    out, res = untrained_phase1
    assert (out / "phase1.pt").is_file() and res["sha256"]
    history = json.loads((out / "phase1_metrics.json").read_text())["history"]
    assert len(history) == 2 and history[-1]["train/loss"] > LN10  # it learned nothing
    meta = torch.load(res["checkpoint"], weights_only=True)["meta"]
    assert not any(k.startswith("watchdog") for k in meta["train_config"])  # run-only


def test_pmnet_train_stops_an_lr_0_phase1_with_exit_5_keeping_its_last_epoch(tmp_path,
                                                                            capsys):
    from pmnet.cli import main

    out = tmp_path / "p1"
    before = torch.get_num_threads()
    try:
        rc = main(["train", "phase1", "--preset", "debug", "--out", str(out),
                   *(a for k, v in dict(phase1_episodes_per_epoch=1024, phase1_max_epochs=2,
                                        watchdog_share=0.75, phase1_lr=0, **EVAL).items()
                     for a in ("--set", f"{k}={v}"))])
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert rc == NOT_LEARNING_EXIT == 5
    line = next(x for x in err.splitlines() if x.startswith("pmnet: "))
    assert line.startswith("pmnet: not learning: Phase 1 stopped at step 96 of 128: its "
                           "training loss averaged ")
    assert f"its last finished epoch is kept in {out / 'phase1_ckpt' / 'last.ckpt'}" in line
    from pmnet.train import checkpoint_epoch

    assert checkpoint_epoch(out / "phase1_ckpt" / "last.ckpt") == 0  # epoch 0, kept
    for never in ("phase1.pt", "phase1_metrics.json", "route_diagnostics.json"):
        assert not (out / never).exists()


def test_an_lr_0_phase0_stops_before_phase1(tmp_path, one_thread):
    cfg = TrainConfig.from_name(  # the paper's Phase 0 on the tiny model: 120 steps
        "paper", model=ModelConfig.from_name("debug"), phase0_steps=120, phase0_copy_len=8,
        batch_size=16, warmup_steps=2, compile="off", phase1_lr=0.0, watchdog_share=0.5,
        episodes_per_epoch=32, max_epochs=1, phase1_episodes_per_epoch=32,
        phase1_max_epochs=1, **EVAL)
    with pytest.raises(NotLearningError) as info:
        run_phase1(cfg, tmp_path, progress=False)
    e = info.value
    # judged at its last step: 120 < PHASE0_MIN_STEPS
    assert (e.phase, e.step, e.line_kind) == (0, 120, "chance") and e.mean > LN26
    assert "ln 26 per payload letter" in str(e) and "no checkpoint is kept" in str(e)
    assert not (tmp_path / "phase0_metrics.json").exists()
    assert not (tmp_path / "phase1_ckpt").exists()


def test_a_pipeline_trial_at_lr_0_is_not_learning_and_not_retried(tmp_path, untrained_phase1):
    """Phase 2 at lr 1e-12 (TrainConfig.lr must be > 0) from the untrained checkpoint, as a
    pipeline trial in this process: stopped at its share point against its own start, the
    trial records NOT LEARNING and reports it once without raising (Tune does not retry a
    trial that returns), and has no result."""
    from pipelines.layout import Layout
    from pipelines.records import TrialState
    from pipelines.trial import NOT_LEARNING
    from pmnet.trial_id import TrialId
    from tests.support.trials import FakeTune, run_trial_here, trial_ctx

    _, res = untrained_phase1
    root = tmp_path / "runs"
    # 100 steps per epoch, 2 epochs: the start is steps 1-50, judged from step 100
    ctx = trial_ctx(root, res, lr=1e-12, episodes_per_epoch=1600, max_epochs=2, patience=2,
                    watchdog_share=0.5, val_episodes=16, test_episodes=16, eval_batch_size=16)
    fake = FakeTune(tmp_path / "tune")
    run_trial_here(ctx, "learned_full", 42, fake)  # returns: no exception reaches Tune
    lay = Layout(root, "t")
    trial = TrialId("learned_full", 42)
    state = TrialState.read(lay.trial_dir(trial) / "trial.json")
    assert state.state == NOT_LEARNING == "NOT LEARNING" and state.failures == 0
    assert state.error.startswith("not learning: Phase 2 stopped at step ")
    assert "its own start" in state.error
    assert fake.reports[-1]["metrics"][NOT_LEARNING] == state.error
    assert not lay.result_path(trial).exists()
    # a resume (a new Tune experiment runs every trial) leaves it stopped: no attempt
    attempts = (lay.trial_dir(trial) / "attempts.jsonl").read_text()
    again = FakeTune(tmp_path / "tune-again")
    run_trial_here(ctx, "learned_full", 42, again)
    assert [r["metrics"][NOT_LEARNING] for r in again.reports] == [state.error]
    assert (lay.trial_dir(trial) / "attempts.jsonl").read_text() == attempts


def test_status_shows_a_stopped_trial_as_not_learning(tmp_path):
    from pipelines import plan as planning
    from pipelines import stages
    from pipelines.layout import write_json
    from pipelines.status import status_text, trial_rows
    from pmnet.trial_id import TrialId

    plan = planning.plan_new(root=tmp_path / "runs", name="p", preset="debug", grid="tiny")
    lay = plan.layout
    stages.write_meta(plan, status="failed")
    trial = plan.space.trials[0]
    assert isinstance(trial, TrialId)
    message = "not learning: Phase 2 stopped at step 150 of 1000: ..."
    write_json(lay.trial_dir(trial) / "trial.json",
               {**trial.to_config(), "state": "NOT LEARNING", "error": message})
    rows = {r["trial"]: r for r in trial_rows(lay)}
    assert rows[trial.name]["state"] == "NOT LEARNING"
    text = status_text(lay)
    assert "1 not learning" in text and f"{trial.name}: {message}" in text
    assert "finished" not in text.split("\n")[1]
