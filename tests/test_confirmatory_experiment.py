"""experiments/confirmatory.py (issue 61): the pre-registered claims read from a store, on
fabricated stores whose verdicts are known: which checkpoints are taken and replaced, when a
claim is pending, holds or fails, and the paired test against scipy's."""

import json

import pytest
from scipy import stats as sps

from pmnet.store_layout import StoreLayout, init_store
from pmnet.trial_id import TrialId
from tests.support.experiments import load_experiment


@pytest.fixture(scope="module")
def conf():
    return load_experiment("confirmatory")


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _checkpoint(store: StoreLayout, k: int, stm: float = 100.0) -> None:
    hist = [{"epoch": e, "val/mean_stm_add10": stm - 20 + 10 * e} for e in range(3)]
    _write(store.phase1_dir(k) / "phase1_metrics.json", {"best_epoch": 2, "history": hist})
    _write(store.stage1_json(k), {"sha256": "0" * 64})


def _trial(store: StoreLayout, cond: str, variant: str, k: int, add10: float,
           affine10: float = 10.0, drop: float | None = None) -> None:
    t = TrialId(cond, 42, variant, k)
    test = {"updated_ltm_add10": add10, "updated_ltm_add10_baseline": 50.0,
            "updated_ltm_affine10": affine10, "updated_ltm_affine10_baseline": 34.0,
            "updated_ltm": (add10 + affine10) / 2, "updated_ltm_baseline": 42.0}
    _write(store.result(t), {"condition": cond, "seed": 42, "test": test})
    if drop is not None:
        _write(store.diagnostics(t), {"updated_routing_off_by_family": {
            "add10": {"recall": add10 - drop, "drop": drop, "agreement": 20.0}}})


def _store(tmp_path, on=(99.0, 97.0, 95.0, 99.5, 90.0), off=(45.0, 50.0, 40.0, 52.0, 48.0),
           drop=30.0, stm=None):
    store = StoreLayout(tmp_path / "s")
    init_store(store)
    for i, k in enumerate(range(3, 3 + len(on))):
        _checkpoint(store, k, (stm or {}).get(k, 100.0))
        _trial(store, "consolidator_only", "add10-long", k, on[i], drop=drop)
        _trial(store, "consolidator_only_routing_off", "add10-long", k, off[i])
    return store


def test_five_passing_checkpoints_hold_claims_1_to_3_and_leave_4_pending(conf, tmp_path):
    store = _store(tmp_path)
    cps = conf.choose(store)
    assert [c.seed for c in cps] == [3, 4, 5, 6, 7] and {c.state for c in cps} == {"taken"}
    v = conf.judge(cps)
    assert [x.verdict for x in v] == ["holds", "holds", "holds", "pending"]
    diffs = [a - b for a, b in zip((99.0, 97.0, 95.0, 99.5, 90.0), (45.0, 50.0, 40.0, 52.0,
                                                                     48.0))]
    ref = sps.ttest_1samp(diffs, 0.0, alternative="greater")
    r = conf.paired_test(diffs)
    assert r["p"] == pytest.approx(ref.pvalue) and r["t"] == pytest.approx(ref.statistic)
    lo, hi = r["ci"]
    assert lo > 0 and "excludes 0" in v[1].detail and f"{lo:+.1f}" in v[1].detail


def test_one_checkpoint_below_the_gate_fails_claim_1_and_claim_2_gets_no_verdict(conf,
                                                                                 tmp_path):
    store = _store(tmp_path, on=(99.0, 97.0, 59.9, 99.5, 90.0))
    v = conf.judge(conf.choose(store))
    assert v[0].verdict == "does not hold" and "59.9" in v[0].detail
    assert v[1].verdict == "not judged"


def test_a_weak_mechanism_on_one_checkpoint_fails_claim_3(conf, tmp_path):
    store = _store(tmp_path)
    _trial(store, "consolidator_only", "add10-long", 5, 95.0, drop=9.9)
    assert conf.judge(conf.choose(store))[2].verdict == "does not hold"


def test_a_checkpoint_below_99_percent_stm_is_replaced_by_the_next_seed(conf, tmp_path):
    store = _store(tmp_path, on=(99.0,) * 6, off=(50.0,) * 6, stm={4: 98.9})
    cps = conf.choose(store)
    assert [(c.seed, c.state) for c in cps] == [(3, "taken"), (4, "replaced"), (5, "taken"),
                                              (6, "taken"), (7, "taken"), (8, "taken")]
    v = conf.judge(cps)
    assert v[0].verdict == "holds"
    assert v[1].verdict == "not judged" and "SD 0" in v[1].detail  # every difference +49.0
    assert "PHASE1_SEEDS=3,5,6,7,8 " in conf.next_command(cps, store.root)  # 4 left out


def test_the_claims_read_the_pipelines_phase1_gate(conf):
    """One bar in one place: the checkpoints the claims take are those the confirmatory
    grids train arms on (`tune_spaces.grids.CONFIRMATORY_PHASE1_GATE`)."""
    from tune_spaces.grids import CONFIRMATORY_PHASE1_GATE

    assert conf.GATE_P1 is CONFIRMATORY_PHASE1_GATE and conf.STM_MIN == 99.0


def test_unlanded_checkpoints_keep_every_claim_pending(conf, tmp_path):
    store = _store(tmp_path, on=(99.0, 97.0), off=(45.0, 50.0))
    cps = conf.choose(store)
    assert [c.state for c in cps] == ["taken", "taken", "pending", "pending", "pending"]
    v = conf.judge(cps)
    assert [x.verdict for x in v] == ["pending"] * 4 and "2 of 5" in v[0].detail


def test_claim_4_reads_both_families_against_their_baselines(conf, tmp_path):
    store = _store(tmp_path)
    for k in range(3, 8):
        _trial(store, "consolidator_only", "both-long", k, 99.0, affine10=20.0)
    v = conf.judge(conf.choose(store))
    assert v[3].verdict == "holds"  # (99 + 20) / 2 = 59.5 >= 42 + 10
    _trial(store, "consolidator_only", "both-long", 7, 60.0, affine10=20.0)  # 40 < 52
    assert conf.judge(conf.choose(store))[3].verdict == "does not hold"


def test_the_command_writes_the_claims_beside_the_store_and_refuses_a_non_store(conf,
                                                                              tmp_path,
                                                                              capsys):
    store = _store(tmp_path)
    assert conf.main(["--store", str(store.root)]) == 0
    text = (tmp_path / "s-claims.md").read_text()
    assert text == capsys.readouterr().out and "| 3 | taken | 100.0 | 99.0 | 45.0 | +54.0 |" \
        in text and "**holds**" in text
    assert conf.main(["--store", str(tmp_path / "nothing")]) == 2
