"""pmnet.trial_id: trial names, their parsing, Tune configs and result keys (fast)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmnet.conditions import ALL_CONDITIONS
from pmnet.trial_id import TrialId, variant_name_problem


def test_default_trials_keep_their_names_configs_and_result_keys():
    for condition in ALL_CONDITIONS:
        t = TrialId(condition, 42)
        assert t.name == f"{condition}-s42" == str(t) and t.arm == condition
        assert t.is_default
        assert t.to_config() == {"condition": condition, "seed": 42}  # Tune configs as before
        assert t.to_result() == {}  # result files as before
        assert TrialId.parse(t.name) == t


def test_variant_and_phase1_seed_segments():
    t = TrialId("consolidator_only", 43, "T4-truncated")
    assert t.name == "consolidator_only-T4-truncated-s43"
    assert t.arm == "consolidator_only-T4-truncated" and not t.is_default
    assert t.to_config() == {"condition": "consolidator_only", "seed": 43,
                             "variant": "T4-truncated"}
    assert t.to_result() == {"variant": "T4-truncated"}
    p = TrialId("consolidator_only", 43, "T4-full", phase1_seed=2)
    assert p.name == "consolidator_only-T4-full-p2-s43"
    assert TrialId("learned_full", 7, phase1_seed=0).name == "learned_full-p0-s7"
    assert TrialId.parse(p.name) == p
    # configs written before variants existed, and numbers as Tune / JSON may give them
    assert TrialId.from_config({"condition": "learned_full", "seed": 42.0}) == TrialId(
        "learned_full", 42)
    assert TrialId.from_result({"condition": "a", "seed": "3", "variant": "v"}) == TrialId(
        "a", 3, "v")


@pytest.mark.parametrize("kwargs, message", [
    ({"condition": "learned-full", "seed": 1}, "condition"),
    ({"condition": "", "seed": 1}, "condition"),
    ({"condition": None, "seed": 1}, "condition"),
    ({"condition": "a", "seed": -1}, "seed"),
    ({"condition": "a", "seed": True}, "seed"),
    ({"condition": "a", "seed": 1.5}, "seed"),
    ({"condition": "a", "seed": 1, "variant": "T4-s3"}, "would read as a seed"),
    ({"condition": "a", "seed": 1, "variant": "p2"}, "Phase-1 seed"),
    ({"condition": "a", "seed": 1, "variant": "4T"}, "starting with a letter"),
    ({"condition": "a", "seed": 1, "variant": "T4--full"}, "single '-'"),
    ({"condition": "a", "seed": 1, "variant": "T4-full-"}, "invalid variant name"),
    ({"condition": "a", "seed": 1, "variant": "T4/full"}, "invalid variant name"),
    ({"condition": "a", "seed": 1, "variant": "x" * 49}, "longer than 48"),
    ({"condition": "a", "seed": 1, "variant": 4}, "must be a string"),
    ({"condition": "a", "seed": 1, "phase1_seed": -2}, "phase1_seed"),
])
def test_bad_fields_are_refused_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrialId(**kwargs)


@pytest.mark.parametrize("name", ["learned_full", "learned_full-s", "learned_full-s04",
                                  "-s4", "a-T4--full-s1", "a-s1-", "a-p01-s1"])
def test_parse_refuses_what_no_trial_is_named(name):
    with pytest.raises(ValueError, match="not a trial name"):
        TrialId.parse(name)


_part = st.from_regex(r"[A-Za-z0-9_]{1,6}", fullmatch=True)
_variants = st.one_of(
    st.just(""),
    st.builds(lambda head, tail: "-".join([head, *tail]),
              st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,5}", fullmatch=True),
              st.lists(_part, max_size=4)),
).filter(lambda v: variant_name_problem(v) is None)
_trials = st.builds(TrialId, st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True),
                    st.integers(0, 10**6), _variants,
                    st.one_of(st.none(), st.integers(0, 99)))


@settings(max_examples=300, deadline=None)
@given(_trials)
def test_names_configs_and_result_keys_round_trip(trial):
    assert TrialId.parse(trial.name) == trial
    assert TrialId.from_config(trial.to_config()) == trial
    keys = {"condition": trial.condition, "seed": trial.seed, **trial.to_result()}
    assert TrialId.from_result(keys) == trial
    assert trial.name == f"{trial.arm}-s{trial.seed}"


@settings(max_examples=300, deadline=None)
@given(_trials, _trials)
def test_different_trials_have_different_names(a, b):
    assert (a == b) == (a.name == b.name)


def test_grid_size_names_only_the_factors_a_grid_has():
    from pmnet.trial_id import grid_size

    assert grid_size(6, 5) == "6 conditions x 5 seeds = 30 trials"
    assert grid_size(1, 3, variants=6) == "1 conditions x 6 variants x 3 seeds = 18 trials"
    assert grid_size(2, 3, phase1_checkpoints=3) == (
        "2 conditions x 3 seeds x 3 Phase-1 checkpoints = 18 trials")
    assert grid_size(2, 2, 2, 2).endswith("= 16 trials")
