"""Tests of pmnet.stats' Phase-1 variance analysis (issue 11): ``phase1_seed`` in the tidy
table, and each headline effect with the Phase-1 checkpoint as a random factor (REML mixed
model) beside the paper's fixed-checkpoint paired test per checkpoint."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from pmnet import stats

FIXTURES = Path(__file__).parent / "fixtures" / "results"
ON = "consolidator_only"
LABEL = "learned - forced identity, routing on: updated_ltm"
SPEC = next(c for c in stats.COMPARISONS if c.label == LABEL)


def simulate(
    rng: np.random.Generator,
    k: int,
    n: int,
    *,
    mu: float = 10.0,
    tau: float = 3.0,
    sigma: float = 2.0,
    seeds_per_checkpoint: dict[int, int] | None = None,
) -> pd.DataFrame:
    """Trials of consolidator_only from ``k`` Phase-1 checkpoints x ``n`` Phase-2 seeds whose
    learned - forced identity difference is ``mu + u_i + e_ij`` (u ~ N(0, tau^2), e ~ N(0,
    sigma^2)); forced identity itself varies freely (it cancels in the pair)."""
    u = rng.normal(0.0, tau, k)
    rows = []
    for i in range(k):
        for j in range((seeds_per_checkpoint or {}).get(i, n)):
            base = rng.normal(40.0, 8.0)
            rows.append({"condition": ON, "seed": 42 + j, "phase1_seed": i,
                         "updated_ltm": base + mu + u[i] + rng.normal(0.0, sigma),
                         "forced_identity": base})
    df = pd.DataFrame(rows)
    df["phase1_seed"] = df["phase1_seed"].astype("Int64")
    df.attrs["u"] = tuple(float(x) for x in u)  # the drawn checkpoint effects
    return df


def one(df: pd.DataFrame) -> tuple[stats.Phase1Effect, list[stats.CheckpointTest]]:
    analysis = stats.phase1_variance(df, [SPEC])
    assert len(analysis.effects) == 1
    return analysis.effects[0], list(analysis.checkpoints)


def pairs(df: pd.DataFrame) -> np.ndarray:
    return (df["updated_ltm"] - df["forced_identity"]).to_numpy(dtype=float)


def pooled_naive(df: pd.DataFrame) -> dict:
    """The paired t-test that ignores the checkpoints (every pair independent)."""
    flat = df.drop(columns="phase1_seed").copy()
    flat["seed"] = flat["seed"] + 1000 * df["phase1_seed"].astype(int)
    return stats.paired_comparison(flat, ON, "updated_ltm", ON, "forced_identity")


# ------------------------------------------------------------------------------------------
# phase1_seed in the tidy table
# ------------------------------------------------------------------------------------------


def _trial(path: Path, condition: str, seed: int, phase1_seed=None, **extra) -> None:
    obj = {"condition": condition, "seed": seed, "test": {"updated_ltm": 50.0 + seed}, **extra}
    if phase1_seed is not None:
        obj["phase1_seed"] = phase1_seed
    name = f"{condition}-s{seed}" + ("" if phase1_seed is None else f"-p{phase1_seed}")
    (path / f"{name}.json").write_text(json.dumps(obj))


def test_load_results_reads_phase1_seed(tmp_path):
    for p1 in (1, 0):
        for seed in (43, 42):
            _trial(tmp_path, ON, seed, p1)
    _trial(tmp_path, ON, 44)  # a file without it: missing, not an error
    _trial(tmp_path, ON, 45, 1, status="failed", error="oom")
    df = stats.load_results(tmp_path)
    assert list(df.columns[:3]) == ["condition", "seed", "phase1_seed"]
    assert str(df["phase1_seed"].dtype) == "Int64"
    # ordered by condition, Phase-1 seed, seed; the file without one last
    assert df["phase1_seed"].tolist()[:4] == [0, 0, 1, 1] and df["seed"].tolist()[:4] == [
        42, 43, 42, 43]
    assert df["phase1_seed"].isna().tolist() == [False] * 4 + [True]
    assert df.attrs["failed"][0]["phase1_seed"] == 1
    assert "phase1_seed" not in stats.metric_columns(df)  # never summarised as a metric
    assert stats.phase1_seeds(df) == [0, 1] and stats.has_phase1_variance(df)
    assert stats.reference_phase1_seed(df) == 0
    assert stats.at_phase1_seed(df, 1)["seed"].tolist() == [42, 43]


def test_load_results_phase1_duplicates_and_bad_values(tmp_path):
    _trial(tmp_path, ON, 42, 3)
    (tmp_path / "copy.json").write_text((tmp_path / f"{ON}-s42-p3.json").read_text())
    with pytest.raises(ValueError, match="duplicate result .* seed 42 phase1_seed 3"):
        stats.load_results(tmp_path)
    (tmp_path / "copy.json").unlink()
    _trial(tmp_path, ON, 43, "x")
    with pytest.raises(ValueError, match="phase1_seed'? must be an integer"):
        stats.load_results(tmp_path)


def test_load_results_without_phase1_seed_is_unchanged():
    df = stats.load_results(FIXTURES)
    assert "phase1_seed" not in df.columns
    assert list(df.columns[:len(stats.META_COLUMNS)]) == list(stats.META_COLUMNS)
    assert stats.phase1_seeds(df) == [] and not stats.has_phase1_variance(df)
    assert "phase1_seed" not in df.attrs["failed"][0]
    with pytest.raises(ValueError, match="no 'phase1_seed' column"):
        stats.phase1_variance(df)


# ------------------------------------------------------------------------------------------
# the mixed model recovers what was simulated
# ------------------------------------------------------------------------------------------


def test_mixed_model_recovers_between_and_residual_variance():
    """K = 300 checkpoints x 5 seeds: the between variance matches the spread of the drawn
    checkpoint effects, the residual variance the simulated one, the estimate mu."""
    df = simulate(np.random.default_rng(1), k=300, n=5, mu=10.0, tau=3.0, sigma=2.0)
    effect, tests = one(df)
    assert effect.fitted and effect.converged and not effect.singular
    assert (effect.k, effect.n) == (300, 1500) and len(tests) == 300
    drawn = float(np.var(df.attrs["u"], ddof=1))  # about 9 = tau^2
    assert effect.var_between == pytest.approx(drawn, rel=0.1)
    assert effect.var_between == pytest.approx(9.0, rel=0.25)
    assert effect.var_residual == pytest.approx(4.0, rel=0.08)
    assert effect.icc == pytest.approx(drawn / (drawn + 4.0), abs=0.03)
    assert abs(effect.estimate - 10.0) < 3 * effect.se
    assert effect.sd_between == pytest.approx(math.sqrt(effect.var_between))
    assert effect.df_t == 299 and effect.fit_warnings == "" and effect.optimizer == "default"


def test_se_is_statsmodels_bse_for_an_interior_fit():
    from statsmodels.regression.mixed_linear_model import MixedLM

    df = simulate(np.random.default_rng(17), k=6, n=4, tau=4.0, seeds_per_checkpoint={0: 2})
    effect, _ = one(df)
    direct = MixedLM(pairs(df), np.ones((len(df), 1)),
                     groups=df["phase1_seed"].astype(int).to_numpy()).fit(reml=True)
    assert effect.fitted and not effect.singular and direct.converged
    assert effect.estimate == pytest.approx(float(direct.fe_params[0]), rel=1e-6)
    assert effect.se == pytest.approx(float(direct.bse_fe[0]), rel=1e-3)
    assert effect.var_between == pytest.approx(float(direct.cov_re.iloc[0, 0]
                                                     if hasattr(direct.cov_re, "iloc")
                                                     else direct.cov_re[0, 0]), rel=1e-4)


def test_t_reference_covers_at_its_level_for_eight_checkpoints():
    """K = 8 checkpoints x 5 seeds, 120 replicates: the K - 1 df interval covers mu about 95%
    of the time, the narrower Wald z interval less often; the variance estimates average near
    the truth (REML)."""
    rng = np.random.default_rng(7)
    reps, cover_t, cover_z = 120, 0, 0
    between, residual = [], []
    for _ in range(reps):
        effect, _ = one(simulate(rng, k=8, n=5, mu=10.0, tau=3.0, sigma=2.0))
        assert effect.fitted
        cover_t += effect.ci_low_t <= 10.0 <= effect.ci_high_t
        cover_z += effect.ci_low_wald <= 10.0 <= effect.ci_high_wald
        between.append(effect.var_between)
        residual.append(effect.var_residual)
    assert 0.9 <= cover_t / reps and cover_z < cover_t
    assert np.mean(between) == pytest.approx(9.0, rel=0.2)
    assert np.mean(residual) == pytest.approx(4.0, rel=0.08)


def test_balanced_fit_equals_the_t_test_on_checkpoint_means():
    """In a balanced design the REML estimate is the grand mean and its SE the SD of the K
    checkpoint means / sqrt(K), so p_t is the one-sample t-test of those means."""
    df = simulate(np.random.default_rng(3), k=6, n=5, tau=4.0)
    effect, _ = one(df)
    means = (df.assign(d=pairs(df)).groupby("phase1_seed")["d"].mean()).to_numpy(dtype=float)
    ref = sps.ttest_1samp(means, 0.0)
    assert effect.estimate == pytest.approx(means.mean(), rel=1e-6)
    assert effect.se == pytest.approx(means.std(ddof=1) / math.sqrt(6), rel=1e-3)
    assert effect.p_t == pytest.approx(ref.pvalue, rel=1e-2)
    assert effect.p_wald < effect.p_t  # the normal reference is the anticonservative one


def test_zero_between_variance_is_close_to_the_pooled_paired_test():
    df = simulate(np.random.default_rng(11), k=40, n=5, tau=0.0, sigma=2.0)
    effect, _ = one(df)
    naive = pooled_naive(df)
    pooled_se = naive["sd_diff"] / math.sqrt(naive["n"])
    assert effect.fitted and effect.icc < 0.1
    assert abs(effect.estimate - naive["mean_diff"]) < 0.25 * pooled_se
    assert 0.95 < effect.se / pooled_se < 1.3
    assert effect.mean_diff == pytest.approx(naive["mean_diff"])
    assert effect.sd_diff == pytest.approx(naive["sd_diff"])


def test_exactly_singular_fit_is_reported_flagged_and_equals_the_pooled_test():
    """Checkpoint means of the differences all equal: the between variance is estimated 0
    (statsmodels warns and may call it unconverged); the row is kept, flagged singular, and
    its estimate and SE are the pooled paired mean and SE."""
    rng = np.random.default_rng(5)
    df = simulate(rng, k=4, n=5, tau=0.0)
    d = pairs(df)
    groups = df["phase1_seed"].astype(int).to_numpy()
    centred = d - pd.Series(d).groupby(groups).transform("mean").to_numpy() + d.mean()
    df["updated_ltm"] = df["forced_identity"] + centred
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        effect, _ = one(df)
    assert not escaped  # the fit's warnings are captured into the row, never printed
    naive = pooled_naive(df)
    assert effect.fitted and effect.singular and effect.var_between < 1e-3
    assert "singular fit" in effect.note and "boundary" in effect.fit_warnings
    assert effect.estimate == pytest.approx(naive["mean_diff"], rel=1e-6)
    assert effect.se == pytest.approx(naive["sd_diff"] / math.sqrt(20), rel=1e-3)
    assert effect.p_wald == pytest.approx(2 * sps.norm.sf(abs(naive["t"])), rel=1e-2)


def test_large_between_variance_widens_the_interval_over_the_naive_pooled_test():
    df = simulate(np.random.default_rng(2), k=8, n=5, tau=10.0, sigma=2.0)
    effect, _ = one(df)
    naive = pooled_naive(df)
    assert effect.fitted and effect.icc > 0.8
    width = effect.ci_high_t - effect.ci_low_t
    assert width > 1.5 * (naive["ci_high"] - naive["ci_low"])
    assert effect.p_t > naive["p"]


# ------------------------------------------------------------------------------------------
# the fixed-checkpoint analysis and the edge cases
# ------------------------------------------------------------------------------------------


def test_each_checkpoint_gets_the_papers_paired_test():
    df = simulate(np.random.default_rng(4), k=3, n=5)
    _, tests = one(df)
    assert [t.phase1_seed for t in tests] == [0, 1, 2]
    for t in tests:
        want = stats.paired_comparison(stats.at_phase1_seed(df, t.phase1_seed), ON,
                                       "updated_ltm", ON, "forced_identity")
        assert t.label == LABEL and t.n == 5 and t.seeds == (42, 43, 44, 45, 46)
        for key in ("mean_diff", "sd_diff", "ci_low", "ci_high", "t", "p", "d_z"):
            assert getattr(t, key) == pytest.approx(want[key]), key


def test_one_checkpoint_gives_a_row_that_says_why():
    df = simulate(np.random.default_rng(6), k=1, n=5)
    effect, tests = one(df)
    assert not effect.fitted and effect.k == 1 and effect.n == 5
    assert effect.note.startswith("K = 1 Phase-1 checkpoint (phase1_seed 0)")
    assert math.isnan(effect.estimate) and math.isnan(effect.p_t) and effect.converged is None
    assert len(tests) == 1 and math.isfinite(tests[0].p)  # the paper's test is still there


def test_checkpoint_with_a_single_seed_still_informs_the_model():
    df = simulate(np.random.default_rng(8), k=4, n=5, seeds_per_checkpoint={3: 1})
    effect, tests = one(df)
    assert effect.fitted and (effect.k, effect.n) == (4, 16)
    assert effect.pairs_per_checkpoint == (5, 5, 5, 1)
    assert "one pair from phase1_seed 3" in effect.note
    last = tests[-1]
    assert last.n == 1 and math.isnan(last.p) and "fewer than 2 paired seeds" in last.note
    assert last.missing_seeds == (43, 44, 45, 46)


def test_one_pair_per_checkpoint_is_not_fitted():
    df = simulate(np.random.default_rng(9), k=5, n=1)
    effect, _ = one(df)
    assert not effect.fitted and "cannot be separated" in effect.note
    assert effect.mean_diff == pytest.approx(pairs(df).mean())


def test_unpaired_and_nan_trials_are_dropped_with_a_note():
    df = simulate(np.random.default_rng(10), k=3, n=5)
    full, _ = one(df)
    # seed 44 of checkpoint 1: no forced identity (NaN); seed 46 of checkpoint 2: no trial
    df.loc[(df["phase1_seed"] == 1) & (df["seed"] == 44), "forced_identity"] = np.nan
    df = df[~((df["phase1_seed"] == 2) & (df["seed"] == 46))]
    effect, tests = one(df)
    assert effect.fitted and effect.n == full.n - 2 and effect.pairs_per_checkpoint == (5, 4, 4)
    assert "unpaired trials dropped: phase1_seed 1 (seed 44); phase1_seed 2 (seed 46)" in (
        effect.note)
    assert tests[1].missing_seeds == (44,) and "without forced_identity" in tests[1].note
    assert tests[2].missing_seeds == (46,) and "missing in consolidator_only" in tests[2].note


def test_trials_without_a_phase1_seed_are_left_out_and_counted():
    df = simulate(np.random.default_rng(12), k=3, n=4)
    df.loc[df.index[:2], "phase1_seed"] = pd.NA
    analysis = stats.phase1_variance(df, [SPEC])
    assert analysis.notes == ("2 trial(s) without a phase1_seed left out",)
    assert analysis.effects[0].n == 10


def test_equal_differences_and_a_failed_fit_give_explained_rows(monkeypatch):
    df = simulate(np.random.default_rng(13), k=3, n=4)
    df["updated_ltm"] = df["forced_identity"] + 5.0
    effect, _ = one(df)
    assert not effect.fitted and "all paired differences equal (+5.00)" in effect.note

    from statsmodels.regression.mixed_linear_model import MixedLM

    def broken(self, *args, **kwargs):
        raise np.linalg.LinAlgError("Singular matrix")

    monkeypatch.setattr(MixedLM, "fit", broken)
    effect, tests = one(simulate(np.random.default_rng(14), k=3, n=4))
    assert not effect.fitted
    assert effect.note.startswith("mixed model fit failed (default: LinAlgError")
    assert math.isnan(effect.estimate) and math.isnan(effect.var_between)
    assert all(math.isfinite(t.p) for t in tests)  # the per-checkpoint tests do not need it


def test_unconverged_interior_fit_is_rejected(monkeypatch):
    from statsmodels.regression.mixed_linear_model import MixedLM

    original = MixedLM.fit

    def unconverged(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        result.converged = False
        return result

    monkeypatch.setattr(MixedLM, "fit", unconverged)
    effect, _ = one(simulate(np.random.default_rng(15), k=5, n=4, tau=5.0))
    assert not effect.fitted and effect.converged is False
    assert "did not converge" in effect.note and math.isnan(effect.p_t)


def test_default_comparisons_are_the_headline_pairs_and_frames_are_typed():
    df = simulate(np.random.default_rng(16), k=3, n=4)
    analysis = stats.phase1_variance(df)
    assert [e.label for e in analysis.effects] == list(stats.PHASE1_COMPARISON_LABELS)
    frame = analysis.effects_frame()
    assert list(frame["label"]) == list(stats.PHASE1_COMPARISON_LABELS)
    assert frame.set_index("label").loc[LABEL, "fitted"]
    others = frame[frame["label"] != LABEL]
    assert (others["n"] == 0).all() and others["note"].str.startswith("no paired").all()
    checkpoints = analysis.checkpoints_frame()
    # a checkpoint with trials of one side gets a row (n = 0, the note says which side)
    assert checkpoints.groupby("label")["n"].sum().to_dict() == {
        LABEL: 12, "routing on - off: updated_ltm": 0}
    off = checkpoints[checkpoints["label"] == "routing on - off: updated_ltm"]
    assert off["note"].str.contains("no results for consolidator_only_routing_off").all()
    dup = pd.concat([df, df.iloc[:1]])
    with pytest.raises(ValueError, match="cannot pair them"):
        stats.phase1_variance(dup)
