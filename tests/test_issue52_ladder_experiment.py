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
