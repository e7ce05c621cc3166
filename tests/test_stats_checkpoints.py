"""Tests of pmnet.stats.checkpoints (issue 39): an effect's distribution over Phase-1
checkpoints (pooled within-checkpoint CIs, the random-factor mean, the fraction of
significant checkpoints) and the number of checkpoints a study needs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from pmnet import stats

ON, OFF = "consolidator_only", "consolidator_only_routing_off"
ROUTING = "routing on - off: updated_ltm"


def routing_trials(effects: list[float], seeds: int = 2, *, sigma: float = 1.0,
                   seed: int = 0) -> pd.DataFrame:
    """Both Consolidator-only arms from len(effects) checkpoints x ``seeds`` Phase-2 seeds;
    the routing effect of checkpoint k is effects[k] plus N(0, sigma^2) per seed."""
    rng = np.random.default_rng(seed)
    rows = []
    for k, eff in enumerate(effects):
        for j in range(seeds):
            off = rng.normal(30.0, 5.0)
            on = off + eff + rng.normal(0.0, sigma)
            rows += [{"condition": ON, "seed": 42 + j, "phase1_seed": k, "updated_ltm": on,
                      "forced_identity": on - 3.0},
                     {"condition": OFF, "seed": 42 + j, "phase1_seed": k, "updated_ltm": off,
                      "forced_identity": off - 1.0}]
    df = pd.DataFrame(rows)
    df["phase1_seed"] = df["phase1_seed"].astype("Int64")
    return df


def test_each_checkpoint_gets_the_pooled_within_sd_interval():
    df = routing_trials([12.0, 0.0, -12.0, 6.0], seeds=3, sigma=1.0)
    dists, points = stats.checkpoint_distribution(df, [next(
        c for c in stats.CHECKPOINT_COMPARISONS if c.label == ROUTING)])
    (dist,) = dists
    # the pooled SD by hand: deviations of each pair from its checkpoint's mean
    on = df[df.condition == ON].set_index(["phase1_seed", "seed"])["updated_ltm"]
    off = df[df.condition == OFF].set_index(["phase1_seed", "seed"])["updated_ltm"]
    diff = (on - off).rename("d").reset_index()
    dev = diff["d"] - diff.groupby("phase1_seed")["d"].transform("mean")
    sd = math.sqrt(float((dev ** 2).sum()) / (4 * (3 - 1)))
    assert dist.sd_within == pytest.approx(sd)
    assert dist.df_within == 8
    q = sps.t.ppf(0.975, 8)
    for pt in points:
        m = diff[diff.phase1_seed == pt.phase1_seed]["d"].mean()
        assert pt.mean_diff == pytest.approx(m)
        assert pt.ci_high - pt.ci_low == pytest.approx(2 * q * sd / math.sqrt(3))
    # +12 and +6 are positive and significant, -12 negative, 0 neither
    assert [pt.verdict for pt in points] == ["+", "0", "-", "+"]
    assert (dist.positive_significant, dist.negative_significant) == (2, 1)
    assert dist.k == 4 and dist.n == 12 and dist.seeds_per_checkpoint == 3


def test_the_mean_is_the_random_factor_estimate_and_the_between_sd_is_seen():
    effects = [12.0, 0.5, -13.0, 8.0, -4.0, 2.0]
    df = routing_trials(effects, seeds=2, sigma=0.5, seed=3)
    dists, _ = stats.checkpoint_distribution(df)
    dist = next(d for d in dists if d.label == ROUTING)
    ref = next(e for e in stats.phase1_variance(df).effects if e.label == ROUTING)
    assert dist.estimate == pytest.approx(ref.estimate)
    assert dist.p == pytest.approx(ref.p_t)
    # balanced: the REML mean is the mean of the checkpoint means
    assert dist.estimate == pytest.approx(np.mean(effects), abs=0.5)
    assert dist.sd_between == pytest.approx(np.std(effects, ddof=1), rel=0.1)
    # a mean near 0 with an SD of ~9: 5 pp needs many checkpoints, 10 pp fewer, never < 2
    assert dist.k_needed_5 > dist.k_needed_10 >= 2


def test_comparisons_without_pairs_are_left_out():
    df = routing_trials([1.0, 2.0])
    dists, points = stats.checkpoint_distribution(df, stats.CHANNEL_COMPARISONS)
    assert [d.label for d in dists] == [ROUTING]  # no GRU or memory arms ran
    assert {p.label for p in points} == {ROUTING}


def test_strict_comparisons_read_routing_off_minus_strict_off_per_arm():
    """What L through u is worth (issue 39): for each routing-off arm with a strict-off
    twin, off - strict off paired by seed within each checkpoint; no twin, no row."""
    from pmnet.conditions import STRICT_PAIRS

    off, strict = "memory_consolidator_routing_off", "memory_consolidator_strict_off"
    assert STRICT_PAIRS[off] == strict
    df = routing_trials([4.0, 6.0, 8.0], seeds=2, sigma=0.5, seed=1)
    df = df.assign(condition=df.condition.map({ON: off, OFF: strict}))
    dists, points = stats.checkpoint_distribution(df, stats.STRICT_COMPARISONS)
    (dist,) = dists
    assert dist.label == f"routing off - strict off: updated_ltm ({off})"
    assert dist.k == 3 and dist.estimate == pytest.approx(6.0, abs=1.0)
    assert [p.mean_diff > 0 for p in points] == [True] * 3


def test_checkpoints_needed_agrees_with_the_t_test_it_claims():
    """At the K it returns, a simulated one-sample t-test over checkpoint means reaches 80%
    power; at K - 1 it does not (Monte Carlo, 20,000 studies each)."""
    tau_b, sigma, seeds, effect = 6.0, 3.0, 2, 5.0
    k = stats.checkpoints_needed(effect, tau_b, sigma, seeds)
    assert k is not None and k > 3
    rng = np.random.default_rng(0)

    def power(kk: int) -> float:
        sims = 20_000
        means = (effect + rng.normal(0, tau_b, (sims, kk))
                 + rng.normal(0, sigma, (sims, kk, seeds)).mean(-1))
        t = means.mean(1) / (means.std(1, ddof=1) / math.sqrt(kk))
        return float((np.abs(t) > sps.t.ppf(0.975, kk - 1)).mean())

    assert power(k) >= 0.79
    assert power(k - 1) < 0.80


def test_checkpoints_needed_edges():
    assert stats.checkpoints_needed(5.0, math.nan, 1.0, 2) is None
    assert stats.checkpoints_needed(5.0, 0.0, 0.0, 2) == 2
    assert stats.checkpoints_needed(0.01, 50.0, 1.0, 2, k_max=1000) is None
    # more seeds per checkpoint cannot remove the between-checkpoint part
    many = stats.checkpoints_needed(5.0, 7.0, 3.0, 1000)
    assert many == stats.checkpoints_needed(5.0, 7.0, 0.0, 2)
