"""Tests of pmnet.stats.checkpoint_study (issues 39, 45) on synthetic trials: whole
checkpoints, the channel interaction, the strict-off contrasts, the diagnostics, the
pre-registered predictor and the sensitivity rows with the capability gate."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from pmnet import stats
from pmnet.trial_id import TrialId

ON, OFF, STRICT = ("consolidator_only", "consolidator_only_routing_off",
                   "consolidator_only_strict_off")
GRU, GRU_OFF = "operator_gru", "operator_gru_routing_off"
MEM, MEM_OFF, MEM_STRICT = ("memory_consolidator", "memory_consolidator_routing_off",
                            "memory_consolidator_strict_off")
#: a condition's updated-LTM level, and per checkpoint k what is added
LEVEL = {ON: 20.0, OFF: 21.0, STRICT: 22.0, GRU: 40.0, GRU_OFF: 55.0, MEM: 56.0,
         MEM_OFF: 58.0, MEM_STRICT: 59.0}


def trials(ks=range(5), seeds=(42, 43), conditions=tuple(LEVEL), *, noise=0.5, rng_seed=0,
           per_k=None) -> pd.DataFrame:
    """`conditions` x `seeds` x Phase-1 checkpoints `ks`; updated_ltm = LEVEL + per_k(cond,
    k) + N(0, noise^2); the output-set baseline is 42 for every trial."""
    rng = np.random.default_rng(rng_seed)
    per_k = per_k or (lambda cond, k: 0.0)
    rows = [{"condition": c, "seed": s, "phase1_seed": k,
             "updated_ltm": LEVEL[c] + per_k(c, k) + rng.normal(0, noise),
             "updated_ltm_baseline": 42.0}
            for k in ks for s in seeds for c in conditions]
    df = pd.DataFrame(rows)
    df["phase1_seed"] = df["phase1_seed"].astype("Int64")
    return df


def test_a_checkpoint_without_every_channel_arm_is_set_aside_not_averaged_in():
    whole = trials(ks=range(3))
    partial = trials(ks=[3], seeds=(42,), conditions=(ON, OFF, GRU, GRU_OFF), rng_seed=1)
    df = pd.concat([whole, partial], ignore_index=True)
    assert stats.checkpoints_with(df, stats.CHANNEL_CONDITIONS) == [0, 1, 2]
    kept, aside = stats.whole_checkpoints(df)
    assert sorted(aside["condition"]) == [GRU, GRU_OFF]
    assert set(aside["phase1_seed"]) == {3}
    # the Consolidator's own arms of checkpoint 3 stay: they are the core study's
    assert {ON, OFF} <= set(kept[kept.phase1_seed == 3].condition)
    assert len(kept) + len(aside) == len(df)


def test_the_interaction_is_a_one_sample_t_over_checkpoint_means():
    # GRU: routing costs it 15 pp plus 2 k; the Consolidator: 1 pp
    df = trials(per_k=lambda c, k: 2.0 * k if c == GRU_OFF else 0.0)
    inter = stats.routing_interaction(df, GRU, [0, 1, 2, 3, 4])
    v = df.pivot_table(index=["phase1_seed", "seed"], columns="condition",
                       values="updated_ltm")
    per = (((v[GRU] - v[GRU_OFF]) - (v[ON] - v[OFF]))
           .groupby(level="phase1_seed").mean())
    t = sps.ttest_1samp(per, 0.0)
    assert inter.n_pairs == 10 and inter.test.k == 5
    assert inter.test.mean == pytest.approx(per.mean())
    assert inter.test.mean == pytest.approx(-14.0 - 4.0, abs=1.0)  # -15 + 1 - 2 x mean(k)
    assert inter.test.p == pytest.approx(t.pvalue)
    assert inter.test.se == pytest.approx(per.std(ddof=1) / math.sqrt(5))
    assert inter.per_checkpoint == pytest.approx(per.to_dict())
    assert inter.label == "(operator_gru on - off) - (Consolidator on - off)"


def test_channel_analysis_reads_levels_agreement_and_the_diagnosed_models():
    swing = {0: 6.0, 1: 3.0, 2: 0.0, 3: -3.0, 4: -6.0}
    # both arms' routing effects follow the checkpoint: rho = +1
    df = trials(per_k=lambda c, k: swing[k] if c in (ON, GRU, MEM) else 0.0)
    diags = stats.diagnostics_frame({
        TrialId(GRU, 42, phase1_seed=1): {
            "updated_ltm": {"recall": 46.3}, "updated_routing_off": {"drop": -1.6},
            "updated_without_ltm_route": [{"drop": 0.4}],
            "updated_strict_off": {"recall": 48.4, "drop": -2.1},
            "ltm_route_change": [17.4, 35.6]},
        TrialId(GRU_OFF, 42, phase1_seed=1): {"updated_strict_off": {"recall": 50.9,
                                                                     "drop": 2.0}}})
    got = stats.channel_analysis(df, diags)
    assert got.checkpoints == [0, 1, 2, 3, 4] and got.phase2_seeds == [42, 43]
    assert got.agreement[GRU].rho == pytest.approx(1.0)
    assert got.agreement[GRU].alternative == "two-sided"
    assert got.levels.loc[GRU, "updated_ltm"] == pytest.approx(40.0, abs=0.5)
    level = next(d for d in got.distributions
                 if d.label == "operator_gru - consolidator_only, routing off: updated_ltm")
    assert level.estimate == pytest.approx(34.0, abs=0.5)
    mech = got.mechanism.set_index("condition")
    assert mech.loc[GRU, "root_l_removed_cost"] == pytest.approx(0.4)
    assert mech.loc[GRU, "l_route_change"] == [17.4, 35.6]
    # a routing-off model has no updated_ltm entry: strict-off recall + its cost
    assert mech.loc[GRU_OFF, "updated_ltm"] == pytest.approx(52.9)
    assert stats.channel_analysis(trials(conditions=(ON, OFF)), diags) is None


def test_strict_analysis_gives_both_contrasts_and_the_probe_against_the_trained_effect():
    # L through u is worth 3 k pp to the Consolidator's routing-off arm
    df = trials(per_k=lambda c, k: 3.0 * k if c == OFF else 0.0)
    diags = stats.diagnostics_frame({
        **{TrialId(OFF, 42, phase1_seed=k): {"updated_strict_off": {"recall": 20.0,
                                                                    "drop": float(k)}}
           for k in range(5)},
        TrialId(STRICT, 42, phase1_seed=0): {"updated_strict_off": {"recall": 22.0,
                                                                    "drop": 0.0}}})
    got = stats.strict_analysis(df, diags)
    assert got.checkpoints == {ON: [0, 1, 2, 3, 4], MEM: [0, 1, 2, 3, 4]}
    by = {d.label: d for d in got.distributions}
    off_strict = by[f"routing off - strict off: updated_ltm ({OFF})"]
    assert off_strict.estimate == pytest.approx(21.0 + 6.0 - 22.0, abs=0.5)
    assert by[f"routing on - strict off: updated_ltm ({ON})"].estimate == pytest.approx(
        -2.0, abs=0.5)
    probe = next(p for p in got.probe_vs_trained if p.arm == ON)
    assert probe.probe == {k: float(k) for k in range(5)}
    assert probe.correlation.rho == pytest.approx(1.0)
    assert list(got.strict_models["condition"]) == [STRICT]
    assert stats.strict_analysis(trials(conditions=(ON, OFF)), diags) is None


def test_the_predictor_is_one_sided_on_the_confirmatory_subset_only():
    routes = {k: {"ltm_route_change": [x, 1.0], "stm_random_routes": {"drop": 10.0 + k},
                  "margin_median": [0.1], "stm": {"recall": 60.0}}
              for k, x in enumerate([90.0, 80.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0])}
    features = stats.checkpoint_features(routes)
    # on 2..7 the effect falls as X rises: rho = -1; 0 and 1 (not confirmatory) disagree
    effect = pd.Series({0: 10.0, 1: 9.0, 2: 6.0, 3: 5.0, 4: 4.0, 5: 3.0, 6: 2.0, 7: 1.0})
    test = stats.predictor_test(features, effect, [2, 3, 4, 5, 6, 7])
    assert test.confirmatory.n == 6 and test.confirmatory.rho == pytest.approx(-1.0)
    assert test.confirmatory.alternative == "less" and test.holds
    assert test.all_checkpoints.n == 8 and test.all_checkpoints.rho > -1.0
    assert [k for k, _, _ in test.sign_rule] == [0, 1, 6, 7]  # X >= 50
    assert test.secondary["random_route_cost"].alternative == "two-sided"
    assert test.secondary["root_margin"].rho is None  # constant: rho is not defined
    assert "on_root_l_removed_cost" not in test.secondary  # no diagnosed model
    rising = stats.predictor_test(features, -effect, [2, 3, 4, 5, 6, 7])
    assert rising.confirmatory.rho == pytest.approx(1.0) and not rising.holds


def test_sensitivity_gates_each_row_and_reads_the_named_subset_and_the_last_epoch():
    df = trials(ks=range(6), conditions=(ON, OFF))
    df["forced_identity"] = df["updated_ltm"] - 1.0
    df["last_updated_ltm"] = df["updated_ltm"] + np.where(df["condition"] == ON, 5.0, 0.0)
    rows = stats.sensitivity(df, {"confirmatory": [3, 4, 5]})
    routing = [r for r in rows if r.distribution.label == "routing on - off: updated_ltm"]
    assert [r.analysis for r in routing] == ["all checkpoints, selected epoch",
                                             "confirmatory 3..5, selected epoch",
                                             "all checkpoints, last epoch"]
    assert routing[1].distribution.k == 3
    assert routing[0].distribution.estimate == pytest.approx(-1.0, abs=0.5)
    assert routing[2].distribution.estimate == pytest.approx(4.0, abs=0.5)
    # both arms (about 20 and 21) are below the baseline of 42: no verdict
    assert routing[0].gate.both_below and "(both below)" in routing[0].gate.text()
    frame = stats.sensitivity_frame(rows)
    assert list(frame.columns[:2]) == ["analysis", "label"]
    gated = frame[frame["label"] == "routing on - off: updated_ltm"]["arms_vs_baseline"]
    assert len(gated) == 3 and gated.str.endswith("vs 42.0 (both below)").all()


def test_load_diagnostics_reads_a_store_directory_and_refuses_a_stray_file(tmp_path):
    import json

    (tmp_path / "consolidator_only-p3-s42.json").write_text(json.dumps(
        {"updated_ltm": {"recall": 24.7}, "updated_strict_off": {"recall": 21.8, "drop": 2.9}}))
    got = stats.load_diagnostics(tmp_path)
    assert got.to_dict("records")[0] | {"l_route_change": None} == {
        "condition": ON, "seed": 42, "variant": "", "phase1_seed": 3, "updated_ltm": 24.7,
        "routing_off_cost": None, "root_l_removed_cost": None, "strict_off_cost": 2.9,
        "l_route_change": None, "seg2_path_change": [], "routing_grad_share": None}
    # a diagnosis made since issue 61 carries the mechanism's two readings
    (tmp_path / "consolidator_only-p4-s42.json").write_text(json.dumps(
        {"seg2_path_change": {"all": [1.0, 9.0], "shared_prefix": [0.0, 12.5]},
         "consolidator_gradient": {"routing_share": 37.5}}))
    row = stats.load_diagnostics(tmp_path).to_dict("records")[1]
    assert (row["seg2_path_change"], row["routing_grad_share"]) == ([0.0, 12.5], 37.5)
    assert stats.load_diagnostics(tmp_path / "absent").empty
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(ValueError, match="notes.json"):
        stats.load_diagnostics(tmp_path)
