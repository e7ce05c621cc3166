"""Experiment grids in tune_spaces/: shapes, derivation, validation (fast, no Ray runtime)."""

from __future__ import annotations

import pytest

from pmnet.train import CONDITIONS, TrainConfig
from pmnet.trial_id import TrialId
from tune_spaces import (
    PAPER_CONDITIONS,
    PAPER_SEEDS,
    SPACES,
    Space,
    SpaceError,
    default,
    get_space,
    paper,
    tiny,
)


def test_paper_grid_is_six_conditions_by_five_seeds():
    sp = paper(TrainConfig.from_name("paper"))
    assert sp.conditions == PAPER_CONDITIONS == tuple(CONDITIONS)
    assert sp.seeds == PAPER_SEEDS == (42, 43, 44, 45, 46)
    assert sp.n_trials == 30 and len(set(sp.trials)) == 30
    sp.validate(CONDITIONS)


@pytest.mark.parametrize("preset", ["debug", "cpu", "paper"])
def test_default_grid_comes_from_the_preset(preset):
    cfg = TrainConfig.from_name(preset)
    sp = default(cfg)
    assert sp.conditions == tuple(cfg.conditions)
    assert sp.seeds == tuple(cfg.seeds)
    assert sp.resources() == {"cpu": 1.0}
    gpu = default(cfg, gpu=True)
    assert 0 < gpu.gpus_per_trial <= 1 and gpu.resources()["gpu"] == gpu.gpus_per_trial
    sp.validate(CONDITIONS)


def test_tiny_grid_derives_from_default():
    cfg = TrainConfig.from_name("debug")
    sp = tiny(cfg)
    assert sp.name == "tiny" and sp.n_trials == 4
    assert sp.seeds == tuple(cfg.seeds)[:2]
    assert sp.cpus_per_trial == default(cfg).cpus_per_trial
    assert sp.trials == [TrialId("learned_full", 42), TrialId("consolidator_only", 42),
                         TrialId("learned_full", 43), TrialId("consolidator_only", 43)]
    assert [t.name for t in sp.trials][:2] == ["learned_full-s42", "consolidator_only-s42"]


def test_registry_and_derive():
    assert set(SPACES) >= {"default", "paper", "tiny"}
    assert get_space("paper") is paper
    with pytest.raises(SpaceError, match="unknown grid 'nope'"):
        get_space("nope")
    sp = default(TrainConfig.from_name("debug")).derive(seeds=[7, 8, 9], conditions="learned_full")
    assert sp.seeds == (7, 8, 9) and sp.conditions == ("learned_full",)
    assert Space.from_dict(sp.to_dict()) == sp


def test_param_space_is_a_full_grid():
    from ray.tune.search.variant_generator import generate_variants

    sp = tiny(TrainConfig.from_name("debug"))
    variants = [cfg for _, cfg in generate_variants(sp.param_space())]
    assert [TrialId.from_config(v) for v in variants] == sp.trials
    assert set(sp.param_space()) == {"condition", "seed"}  # no variant key: configs as before


@pytest.mark.parametrize("changes, message", [
    ({"conditions": ("learned_full", "no_such_condition")}, "unknown condition"),
    ({"conditions": ()}, "condition list is empty"),
    ({"conditions": ("learned_full", "learned_full")}, "listed twice"),
    ({"seeds": ()}, "seed list is empty"),
    ({"seeds": (42, -1)}, "non-negative integers"),
    ({"seeds": (42, True)}, "non-negative integers"),
    ({"seeds": (42, 42)}, "listed twice"),
    ({"gpus_per_trial": 1.5}, "fraction of one GPU"),
    ({"gpus_per_trial": -0.1}, "fraction of one GPU"),
    ({"gpus_per_trial": float("nan")}, "finite number"),
    ({"cpus_per_trial": 0}, "cpus_per_trial must be > 0"),
    ({"max_failures": -1}, "max_failures"),
    ({"max_concurrent": 1.5}, "max_concurrent"),
])
def test_bad_spaces_fail_with_a_clear_message(changes, message):
    sp = tiny(TrainConfig.from_name("debug")).derive(**changes)
    with pytest.raises(SpaceError, match=message):
        sp.validate(CONDITIONS)


@pytest.mark.parametrize("preset", ["debug", "cpu", "paper"])
def test_operators_grid_is_the_consolidator_and_four_operators_by_the_presets_seeds(preset):
    from pmnet.conditions import ALL_CONDITIONS, OPERATOR_CONDITIONS
    from tune_spaces import OPERATOR_GRID_CONDITIONS, operators

    cfg = TrainConfig.from_name(preset)
    sp = get_space("operators")(cfg)
    assert get_space("operators") is operators and sp.name == "operators"
    assert sp.conditions == OPERATOR_GRID_CONDITIONS == (
        "consolidator_only", "operator_ema", "operator_overwrite", "operator_linear",
        "operator_gru")
    assert set(sp.conditions[1:]) == set(OPERATOR_CONDITIONS)
    assert sp.seeds == tuple(cfg.seeds) and sp.n_trials == 5 * len(cfg.seeds)
    assert sp.resources() == default(cfg).resources()
    sp.validate(ALL_CONDITIONS)
    with pytest.raises(SpaceError, match="unknown condition"):  # not among the paper's six
        sp.validate(CONDITIONS)
    # the paper's grid is unchanged by the operator conditions
    assert paper(cfg).conditions == PAPER_CONDITIONS == tuple(CONDITIONS)
    assert len(PAPER_CONDITIONS) == 6


def test_the_pipeline_accepts_the_operators_grid():
    from pipelines.plan import build_space

    sp = build_space(TrainConfig.from_name("debug"), grid="operators")
    assert sp.name == "operators" and "operator_gru" in sp.conditions
    assert build_space(TrainConfig.from_name("debug"), grid="operators",
                       conditions="operator_ema").conditions == ("operator_ema",)
