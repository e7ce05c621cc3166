"""experiments/issue52_ladder.py (issue 52): how the ladder words where each trend meets the
capability gate (the output-set baseline + 10 pp) and what its slope's CI excludes."""

import math

import pytest

from tests.support.experiments import load_experiment


@pytest.fixture(scope="module")
def ladder():
    return load_experiment("issue52_ladder")


def test_a_rising_trend_below_the_gate_reaches_it_where_the_line_does(ladder):
    # recall = 10 + 20 * log10(params): 30 at 10 (below 52), 52 at 10 ** 2.1
    above, cross = ladder._gate_crossing(10.0, 20.0, 52.0, 10.0)
    assert not above and cross == pytest.approx(10 ** 2.1)
    assert ladder._where_gate(above, cross) == f"the trend reaches it at {cross:,.0f} parameters"


def test_a_falling_trend_above_the_gate_says_where_it_drops_below(ladder):
    # recall = 160 - 20 * log10(params): 60 at 1e5 (above 52), 52 at 10 ** 5.4
    above, cross = ladder._gate_crossing(160.0, -20.0, 52.0, 1e5)
    assert above and cross == pytest.approx(10 ** 5.4)
    words = ladder._where_gate(above, cross)
    assert "falling" in words and f"{cross:,.0f}" in words


def test_trends_that_never_meet_the_gate(ladder):
    assert ladder._gate_crossing(10.0, -1.0, 52.0, 1e5) == (False, None)   # below, falling
    assert ladder._gate_crossing(60.0, 1.0, 52.0, 1e5) == (True, None)     # above, rising
    above, cross = ladder._gate_crossing(10.0, 1e-9, 52.0, 1e5)           # below, flat
    assert not above and cross == math.inf
    assert "too flat" in ladder._where_gate(above, cross)
    assert "never reaches" in ladder._where_gate(False, None)


def test_what_a_slope_ci_excludes(ladder):
    assert ladder._what_ci_excludes(1.0, 5.0) == "the CI excludes a flat or falling trend"
    assert ladder._what_ci_excludes(-5.0, -1.0) == "the CI excludes a flat or rising trend"
    both = ladder._what_ci_excludes(-6.3, 10.2)
    assert "does not exclude a flat trend" in both and "+10.2" in both and "-6.3" in both


def test_a_trend_line_fits_the_points_it_is_given_against_their_own_gate(ladder):
    # ADD10 points on recall = 20 + 10 * log10(params): the fit recovers slope 10, and its
    # gate is the family's baseline + 10 pp (60 for a 50% baseline), met at 10 ** 4
    pts = [(p, 20.0 + 10.0 * math.log10(p) + e)
           for p in (1e2, 1e3) for e in (-0.5, 0.5)]
    line, summary, fit = ladder._trend_line("consolidator_only", pts, 50.0)
    assert summary["slope_per_decade"] == pytest.approx(10.0)
    assert summary["gate"] == 60.0 and not summary["above_gate_at_smallest"]
    assert summary["crosses_gate_at"] == pytest.approx(1e4)
    assert "+10.0 pp per 10x" in line and "60.0%" in line
    # one size, or no baseline: no trend is fitted, and the line says why
    line, summary, fit = ladder._trend_line("consolidator_only", pts[:2], 50.0)
    assert summary is None and fit is None and "needs two" in line
    assert ladder._trend_line("consolidator_only", pts, None)[1] is None


def test_summarise_keeps_each_checkpoints_family_recall(ladder):
    def trial(seed, add10, affine10):
        val = {"updated_ltm": (add10 + affine10) / 2, "updated_ltm_add10": add10,
               "updated_ltm_affine10": affine10, "updated_ltm_baseline": 42.0}
        test = {**val, "forced_identity_initial": 40.0, "seg1_stm": 40.0,
                "updated_ltm_add10_baseline": 50.0, "updated_ltm_affine10_baseline": 33.6}
        return {"condition": "consolidator_only", "phase1_seed": seed, "val": val,
                "test": test, "history": [{"val/updated_ltm": 1.0}]}
    data = {"phase1": {1: {"mean_stm": 60.0}, 2: {"mean_stm": 70.0}},
            "trials": [trial(1, 30.0, 10.0), trial(2, 70.0, 20.0), trial(2, 50.0, 20.0)]}
    a = ladder.summarise("medium", data)["arms"]["consolidator_only"]
    assert a["val_per_checkpoint_family"]["add10"] == {1: 30.0, 2: 60.0}
    assert a["val_per_checkpoint_family"]["affine10"] == {1: 10.0, 2: 20.0}
    assert a["val_per_checkpoint"] == {1: 20.0, 2: 40.0}


def test_a_crossing_past_the_papers_size_is_written_in_powers_of_ten(ladder):
    # a slowly falling trend above the gate leaves it far past the paper's 29.95M: the
    # words give the size as 1.2e+20-style and its multiple of the paper's, not 21 digits
    words = ladder._where_gate(True, 1.2e20)
    assert "1.2e+20 parameters" in words and "times the paper's size" in words
    assert ladder._where_gate(False, 4.4e8) == (
        "the trend reaches it at 4.4e+08 parameters, 15 times the paper's size")
    assert ladder._where_gate(False, 2e6) == "the trend reaches it at 2,000,000 parameters"


def test_the_phase1_stm_baseline_is_the_two_segments_mean(ladder):
    """mean_stm_<fam> averages the two segments, so its baseline does too (the ladder printed
    segment 1's alone)."""
    m = {"seg1_stm_affine10_baseline": 34.0, "seg2_stm_affine10_baseline": 35.0}
    assert ladder._stm_baseline(m, "affine10") == 34.5
    assert ladder._stm_baseline({**m, "mean_stm_affine10_baseline": 33.0}, "affine10") == 33.0
    assert ladder._stm_baseline({"seg1_stm_add10_baseline": 50.0}, "add10") is None
