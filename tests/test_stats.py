"""Tests of pmnet.stats: loading, summaries, paired comparisons, and the paper's numbers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

from pmnet import stats
from tests.support.segments import SEGMENT_SEEDS, SEGMENT_TS, segment_value, write_segment_results

FIXTURES = Path(__file__).parent / "fixtures" / "results"


def close2(ours: float, printed: float) -> bool:
    """Equal at the printed precision (2 decimals; a printed x.xx5 tie may go either way)."""
    return abs(ours - printed) <= 0.005 + 1e-9


def p3(p: float) -> float:
    """p rounded to 3 significant digits, as the paper prints it."""
    return float(f"{p:.2e}")


def frame(rows: list[tuple[str, int, dict[str, float]]]) -> pd.DataFrame:
    records = [{"condition": c, "seed": s, **m} for c, s, m in rows]
    df = pd.DataFrame(records)
    df["seed"] = df["seed"].astype("int64")
    return df


# ------------------------------------------------------------------------------------------
# hand-computed statistics
# ------------------------------------------------------------------------------------------


@pytest.fixture
def simple() -> pd.DataFrame:
    a = [2.0, 4.0, 6.0, 8.0, 10.0]
    b = [1.0, 2.0, 3.0, 4.0, 5.0]  # differences 1, 2, 3, 4, 5
    rows = [("A", 42 + i, {"m": a[i]}) for i in range(5)]
    rows += [("B", 42 + i, {"m": b[i]}) for i in range(5)]
    return frame(rows)


def test_paired_comparison_hand_computed(simple):
    r = stats.paired_comparison(simple, "A", "m", "B", "m", "a - b")
    assert r["n"] == 5
    assert r["seeds"] == [42, 43, 44, 45, 46]
    assert r["missing_seeds"] == []
    assert r["mean_diff"] == pytest.approx(3.0)
    assert r["sd_diff"] == pytest.approx(1.5811, abs=1e-4)
    assert r["t"] == pytest.approx(4.2426, abs=1e-4)
    assert r["p"] == pytest.approx(0.01324, abs=1e-5)
    assert r["ci_low"] == pytest.approx(1.0368, abs=1e-4)
    assert r["ci_high"] == pytest.approx(4.9632, abs=1e-4)
    assert r["d_z"] == pytest.approx(3.0 / 1.5811, abs=1e-4)
    assert r["df"] == 4
    assert r["mean_a"] == pytest.approx(6.0) and r["mean_b"] == pytest.approx(3.0)
    assert r["note"] == ""


def test_paired_comparison_matches_scipy(simple):
    rng = np.random.default_rng(0)
    a, b = rng.normal(50, 5, 7), rng.normal(45, 5, 7)
    rows = [("A", i, {"x": a[i]}) for i in range(7)] + [("B", i, {"y": b[i]}) for i in range(7)]
    r = stats.paired_comparison(frame(rows), "A", "x", "B", "y")
    ref = sps.ttest_rel(a, b)
    assert r["t"] == pytest.approx(ref.statistic, rel=1e-10)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-10)
    d = a - b
    half = sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    assert r["ci_low"] == pytest.approx(d.mean() - half, rel=1e-10)
    assert r["ci_high"] == pytest.approx(d.mean() + half, rel=1e-10)
    # and the hand-computed example
    r = stats.paired_comparison(simple, "A", "m", "B", "m")
    assert r["p"] == pytest.approx(sps.ttest_rel([2, 4, 6, 8, 10], [1, 2, 3, 4, 5]).pvalue)


def test_summarize_mean_and_sample_sd(simple):
    s = stats.summarize(simple)
    row = s[(s.condition == "A") & (s.metric == "m")].iloc[0]
    assert row["n"] == 5
    assert row["mean"] == pytest.approx(6.0)
    assert row["sd"] == pytest.approx(np.std([2, 4, 6, 8, 10], ddof=1))
    one = stats.summarize(frame([("C", 1, {"m": 3.0})]))
    assert one.iloc[0]["n"] == 1 and math.isnan(one.iloc[0]["sd"])


# ------------------------------------------------------------------------------------------
# degenerate cases: explicit notes, never silent
# ------------------------------------------------------------------------------------------


def test_all_differences_equal_gives_note_not_crash():
    rows = [("X", s, {"u": 40.0 + s, "f": 40.0 + s - 21.4}) for s in range(42, 47)]
    r = stats.paired_comparison(frame(rows), "X", "u", "X", "f", "u - f")
    assert r["n"] == 5
    assert r["mean_diff"] == pytest.approx(21.4)
    assert r["sd_diff"] == 0.0
    for key in ("t", "p", "ci_low", "ci_high", "d_z"):
        assert math.isnan(r[key])
    assert "all paired differences equal (+21.40); t-test undefined" in r["note"]


def test_single_paired_seed_gives_note():
    df = frame([("A", 42, {"m": 5.0}), ("B", 42, {"m": 3.0})])
    r = stats.paired_comparison(df, "A", "m", "B", "m")
    assert r["n"] == 1
    assert r["mean_diff"] == pytest.approx(2.0)
    assert math.isnan(r["p"]) and math.isnan(r["t"]) and math.isnan(r["ci_low"])
    assert "fewer than 2 paired seeds" in r["note"]


def test_missing_seed_is_named_not_dropped():
    on, off = "consolidator_only", "consolidator_only_routing_off"
    rows = [(on, s, {"updated_ltm": 85.0 + s % 3}) for s in range(42, 47)]
    rows += [(off, s, {"updated_ltm": 44.0 + s % 2}) for s in (42, 43, 44, 46)]
    r = stats.paired_comparison(frame(rows), on, "updated_ltm", off, "updated_ltm", "on - off")
    assert r["n"] == 4
    assert r["missing_seeds"] == [45]
    assert "seed 45 missing in consolidator_only_routing_off; n=4" in r["note"]
    assert r["seeds"] == [42, 43, 44, 46]


def test_missing_metric_and_expected_seed_are_named():
    rows = [("A", 42, {"m": 1.0, "k": 0.0}), ("A", 43, {"m": 2.0}), ("A", 44, {"m": 4.0, "k": 1.0})]
    r = stats.paired_comparison(frame(rows), "A", "m", "A", "k", expected_seeds=[42, 43, 44, 45])
    assert r["missing_seeds"] == [43, 45]
    assert "seed 43 without k in A" in r["note"]
    assert "seed 45 missing in A" in r["note"]
    assert r["n"] == 2


def test_no_data_for_a_condition():
    r = stats.paired_comparison(frame([("A", 42, {"m": 1.0})]), "A", "m", "Z", "m")
    assert r["n"] == 0
    assert "no results for Z (seed 42)" in r["note"]
    assert math.isnan(r["mean_diff"])


# ------------------------------------------------------------------------------------------
# the family of comparisons
# ------------------------------------------------------------------------------------------


def test_comparison_family_covers_the_paper():
    by = {(c.cond_a, c.metric_a, c.cond_b, c.metric_b) for c in stats.COMPARISONS}
    on, off = "consolidator_only", "consolidator_only_routing_off"
    for m in ("updated_ltm", "updated_ltm_add10", "updated_ltm_affine10"):
        assert (on, m, off, m) in by
    assert (on, "updated_ltm", on, "forced_identity") in by
    assert (off, "updated_ltm", off, "forced_identity") in by
    assert ("learned_full", "updated_ltm", "identity_full", "updated_ltm") in by
    for m in ("updated_ltm", "mean_stm", "seg2_stm"):
        assert ("learned_full_dual", m, "learned_full", m) in by
    for c in stats.CONDITIONS:
        for control in ("mismatched_ltm", "fresh_ltm", "updated_ltm_baseline"):
            assert (c, "updated_ltm", c, control) in by
    labels = [c.label for c in stats.COMPARISONS]
    assert len(labels) == len(set(labels))
    assert all(len(c) == 6 for c in stats.COMPARISONS)


def test_compare_all_holm_ignores_undefined_p():
    df = stats.per_seed_frame_from_paper(_paper_long())
    out = stats.compare_all(df)
    assert list(out["label"]) == [c.label for c in stats.COMPARISONS]
    finite = np.isfinite(out["p"].to_numpy(float))
    assert finite.any() and not finite.all()
    expected = multipletests(out["p"][finite].to_numpy(float), method="holm")[1]
    np.testing.assert_allclose(out["p_holm"][finite].to_numpy(float), expected)
    assert out["p_holm"][~finite].isna().all()
    assert (out["holm_m"] == finite.sum()).all()
    # undefined tests say why
    for note in out.loc[~finite, "note"]:
        assert note


# ------------------------------------------------------------------------------------------
# loading result files
# ------------------------------------------------------------------------------------------


def test_load_results_fixture():
    df = stats.load_results(FIXTURES)
    assert len(df) == 11
    for col in stats.META_COLUMNS + ("updated_ltm", "forced_identity", "mean_stm",
                                     "updated_ltm_add10", "val_updated_ltm", "val_dual"):
        assert col in df.columns
    assert df["seed"].dtype == np.int64
    assert list(df["condition"].unique()) == [
        "learned_full", "consolidator_only", "consolidator_only_routing_off", "learned_full_dual"
    ]
    assert not df.duplicated(["condition", "seed"]).any()
    assert math.isnan(df.set_index(["condition", "seed"]).loc[("learned_full", 43), "mean_stm"])
    failed = df.attrs["failed"]
    assert [(f["condition"], f["seed"]) for f in failed] == [("memory_consolidator", 42)]
    assert "out of memory" in failed[0]["error"]
    # a list of files works the same
    same = stats.load_results(sorted(FIXTURES.glob("*.json")))
    pd.testing.assert_frame_equal(df, same)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_results_malformed_json_names_the_file(tmp_path):
    _write(tmp_path, "good.json", json.dumps({"condition": "a", "seed": 1, "test": {}}))
    _write(tmp_path, "broken_trial.json", '{"condition": "a", "seed": 2, "test": {')
    with pytest.raises(ValueError, match="broken_trial.json"):
        stats.load_results(tmp_path)


@pytest.mark.parametrize(
    "payload, message",
    [
        ("[1, 2]", "JSON object"),
        (json.dumps({"seed": 1}), "condition"),
        (json.dumps({"condition": "a"}), "seed"),
        (json.dumps({"condition": "a", "seed": "x"}), "seed"),
        (json.dumps({"condition": "a", "seed": 1, "test": [1]}), "test"),
    ],
)
def test_load_results_schema_errors(tmp_path, payload, message):
    path = _write(tmp_path, "bad.json", payload)
    with pytest.raises(ValueError, match=message) as info:
        stats.load_results(tmp_path)
    assert str(path) in str(info.value)


def test_load_results_duplicates_and_lenient_values(tmp_path):
    trial = {"condition": "a", "seed": 1, "test": {"updated_ltm": 50, "x": "n/a",
                                                   "fam": {"add10": 90.0}, "gone": None}}
    _write(tmp_path, "one.json", json.dumps(trial))
    df = stats.load_results(tmp_path)
    assert df.loc[0, "updated_ltm"] == 50.0
    assert df.loc[0, "fam_add10"] == 90.0
    assert math.isnan(df.loc[0, "gone"])
    assert "x" not in df.columns
    assert any("test.x" in w for w in df.attrs["warnings"])
    _write(tmp_path, "two.json", json.dumps(trial))
    with pytest.raises(ValueError, match="duplicate"):
        stats.load_results(tmp_path)


def test_load_results_empty_dir(tmp_path):
    df = stats.load_results(tmp_path)
    assert df.empty and "condition" in df.columns
    assert stats.summarize(df).empty
    assert stats.paired_comparison(df, "a", "m", "b", "m")["n"] == 0


def test_write_tidy_roundtrip(tmp_path):
    df = stats.load_results(FIXTURES)
    paths = stats.write_tidy(df, tmp_path / "out")
    back_csv = pd.read_csv(paths["csv"])
    back_pq = pd.read_parquet(paths["parquet"])
    assert len(back_csv) == len(df) == len(back_pq)
    assert list(back_pq.columns) == list(df.columns)
    np.testing.assert_allclose(back_pq["updated_ltm"], df["updated_ltm"])
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_load_histories_fixture():
    h = stats.load_histories(FIXTURES)
    assert set(h.columns) >= {"phase", "condition", "seed", "epoch", "metric", "value"}
    assert set(h["phase"]) == {"phase2"}
    assert set(h["metric"]) == {"train/loss", "val/updated_ltm"}
    assert len(h) == 11 * 3 * 2


def test_curves_from_metrics_csv(tmp_path):
    path = tmp_path / "phase1" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("epoch,step,train/loss,val/stm\n0,10,2.0,\n0,20,1.5,30\n")
    c = stats.curves_from_metrics_csv(path)
    assert set(c["phase"]) == {"phase1"}
    assert len(c) == 3 and set(c["metric"]) == {"train/loss", "val/stm"}


def test_add_derived_metrics_does_not_overwrite():
    df = frame([
        ("learned_full", 1, {"updated_ltm": 90.0, "mean_stm": 10.0, "forced_identity": 50.0}),
        ("identity_full", 1, {"updated_ltm": 80.0, "mean_stm": 20.0, "forced_identity": 70.0,
                              "dual": 1.0, "alternative_mode": 79.0}),
    ])
    out = stats.add_derived_metrics(df)
    assert out.loc[0, "dual"] == 50.0 and out.loc[1, "dual"] == 1.0
    assert out.loc[0, "alternative_mode"] == 50.0 and out.loc[1, "alternative_mode"] == 79.0


# ------------------------------------------------------------------------------------------
# the paper's own numbers
# ------------------------------------------------------------------------------------------


def _spec() -> Path:
    try:
        return stats.spec_dir()
    except stats.SpecNotFoundError as exc:
        pytest.skip(str(exc))


def _paper_long() -> pd.DataFrame:
    _spec()
    return stats.paper_per_seed()


@pytest.fixture(scope="module")
def paper_wide() -> pd.DataFrame:
    return stats.add_derived_metrics(stats.per_seed_frame_from_paper(_paper_long()))


@pytest.fixture(scope="module")
def paper_cmp(paper_wide) -> dict[str, dict]:
    return {r["label"]: r for r in stats.compare_all(paper_wide).to_dict("records")}


@pytest.fixture(scope="module")
def paper_summary(paper_wide) -> dict[tuple[str, str], dict]:
    s = stats.summarize(paper_wide)
    return {(r["condition"], r["metric"]): r for r in s.to_dict("records")}


def test_spec_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("PMNET_SPEC_DIR", raising=False)
    default = stats.REPO_ROOT.parent / "shared" / "spec"
    assert stats.REPO_ROOT == Path(stats.__file__).resolve().parents[2]
    if default.is_dir():
        assert stats.spec_dir() == default
    monkeypatch.setenv("PMNET_SPEC_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(stats.SpecNotFoundError, match="PMNET_SPEC_DIR"):
        stats.spec_dir()
    monkeypatch.setenv("PMNET_SPEC_DIR", str(tmp_path))
    assert stats.spec_dir() == tmp_path
    with pytest.raises(stats.SpecNotFoundError, match="paper-aggregates.csv"):
        stats.paper_aggregates()


def test_per_seed_frame_layout(paper_wide):
    raw = stats.per_seed_frame_from_paper(_paper_long())
    assert list(raw.columns[:3]) == ["condition", "seed", "preset"]
    assert len(raw) == 30 and not raw.duplicated(["condition", "seed"]).any()
    assert set(raw["condition"]) == set(stats.CONDITIONS)
    assert set(raw["seed"]) == set(stats.PAPER_SEEDS)
    assert {"updated_ltm", "forced_identity", "dual", "val_dual", "best_epoch"} <= set(raw.columns)
    assert "test_dual" not in raw.columns


def test_paper_routing_on_off(paper_cmp):
    r = paper_cmp["routing on - off: updated_ltm"]
    assert r["n"] == 5 and r["missing_seeds"] == []
    assert close2(r["mean_diff"], 42.64) and close2(r["sd_diff"], 1.10)
    assert close2(r["ci_low"], 41.27) and close2(r["ci_high"], 44.01)
    assert p3(r["p"]) == 1.07e-7


def test_paper_learned_minus_identity(paper_cmp):
    off = paper_cmp["learned - forced identity, routing off: updated_ltm"]
    on = paper_cmp["learned - forced identity, routing on: updated_ltm"]
    assert close2(off["mean_diff"], 21.40) and close2(off["sd_diff"], 1.91)
    assert close2(on["mean_diff"], 68.70) and close2(on["sd_diff"], 1.76)


def test_paper_dual_updated_ltm_and_unpaired_full(paper_cmp):
    r = paper_cmp["dual - LTM only: updated_ltm"]
    assert close2(r["mean_diff"], 1.88) and close2(r["sd_diff"], 2.69)
    assert close2(r["ci_low"], -1.46) and close2(r["ci_high"], 5.22)
    assert p3(r["p"]) == 0.193
    r = paper_cmp["learned_full - identity_full: updated_ltm"]
    assert close2(r["mean_diff"], 2.36) and close2(r["sd_diff"], 3.30)
    # the mean-STM change is not derivable: learned_full has no per-seed mean_stm
    r = paper_cmp["dual - LTM only: mean_stm"]
    assert r["n"] == 0 and "mean_stm not reported by learned_full" in r["note"]


#: paper-aggregates.csv rows that paper-per-seed.csv lets us recompute.
DERIVABLE = {
    ("consolidator_only routing on - off (paired)", "updated_ltm"),
    ("consolidator_only_routing_off learned - identity (paired)", "updated_ltm"),
    ("consolidator_only learned - identity (paired)", "updated_ltm"),
    ("consolidator_only learned", "updated_ltm"),
    ("consolidator_only forced identity", "updated_ltm"),
    ("learned_full", "updated_ltm"),
    ("identity_full", "updated_ltm"),
    ("memory_consolidator", "updated_ltm"),
    ("learned_full - identity_full (unpaired runs)", "updated_ltm"),
    ("learned_full", "seg2_stm"),
    ("learned_full_dual", "updated_ltm"),
    ("learned_full_dual", "mean_stm"),
    ("learned_full_dual - learned_full (paired)", "updated_ltm"),
}


def test_every_derivable_paper_aggregate(paper_summary, paper_cmp):
    agg = stats.paper_aggregates(_spec())
    derivable, not_derivable = set(), set()
    for row in agg.to_dict("records"):
        name, metric = row["comparison_or_condition"], row["metric"]
        key = stats.paper_aggregate_key(name, metric)
        assert key is not None, f"unmapped paper row {name!r} {metric!r}"
        if key[0] == "cond":
            ours = paper_summary.get((key[1], key[2]))
            if ours is None or ours["n"] < 5:
                not_derivable.add((name, metric))
                continue
            mean, sd = ours["mean"], ours["sd"]
            ci, p = (math.nan, math.nan), math.nan
        else:
            ours = paper_cmp[key[1]]
            if ours["n"] < 5:
                not_derivable.add((name, metric))
                continue
            mean, sd, ci, p = ours["mean_diff"], ours["sd_diff"], (
                ours["ci_low"], ours["ci_high"]), ours["p"]
        derivable.add((name, metric))
        assert close2(mean, row["mean"]), (name, metric, mean, row["mean"])
        assert close2(sd, row["sd"]), (name, metric, sd, row["sd"])
        if not math.isnan(row["ci_low"]):
            assert close2(ci[0], row["ci_low"]) and close2(ci[1], row["ci_high"]), (name, metric)
        if not math.isnan(row["p"]):
            assert p3(p) == pytest.approx(row["p"], rel=1e-9), (name, metric, p, row["p"])
    assert derivable == DERIVABLE
    assert len(not_derivable) == len(agg) - len(DERIVABLE) == 14


def test_paper_reference_maps_every_row():
    ref = stats.load_paper_reference(_spec())
    assert ref.unmapped == []
    assert ref.condition("consolidator_only", "forced_identity_initial")["mean"] == 86.86
    assert ref.condition("consolidator_only", "forced_identity_initial")["source"] == stats.PRINTED
    derived = ref.condition("consolidator_only_routing_off", "updated_ltm")
    assert derived["source"] == stats.DERIVED and close2(derived["mean"], 44.38)
    assert ref.comparison("routing on - off: updated_ltm")["p"] == 1.07e-7
    assert ref.seed_value("learned_full", 44, "updated_ltm") == 96.1
    assert ref.seed_value("learned_full", 44, "mean_stm") is None


# -- the printed LaTeX tables ---------------------------------------------------------------


def _clean(cell: str) -> str:
    cell = cell.replace(r"\(\pm\)", "±").replace("{[}", "[").replace("{]}", "]")
    cell = re.sub(r"\\\(([\d.]+)\\times10\^\{(-?\d+)\}\\\)", r"\1e\2", cell)
    cell = re.sub(r"\\textbf\{(.*)\}", r"\1", cell)
    return cell.strip()


def tex_rows(label: str) -> list[list[str]]:
    path = _spec() / "consolidator-paper.tex"
    if not path.is_file():  # the packaged copy holds the CSVs only, not the paper's source
        pytest.skip(f"the paper's source is not at {path} (shared/spec beside the repository)")
    tex = path.read_text(encoding="utf-8")
    start = tex.index(rf"\label{{{label}}}")
    body = tex[start : tex.index(r"\end{tabular}", start)]
    body = body[body.index(r"\midrule") + len(r"\midrule") : body.index(r"\bottomrule")]
    rows = []
    for raw in body.split(r"\\"):
        raw = raw.replace(r"\midrule", "").strip()
        if raw:
            rows.append([_clean(c) for c in raw.split("&")])
    return rows


def nums(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+(?:e-?\d+)?", cell)]


#: Printed cells that the (1-decimal) per-seed values miss by a hair: the paper's SD of
#: memory_consolidator mismatched LTM is 0.31, the per-seed values [9.2, 9.1, 9.4, 9.7, 9.8]
#: give 0.30496 (0.30); presumably computed from unrounded per-seed accuracies.
PER_SEED_ROUNDING = {("memory_consolidator", "mismatched_ltm", "sd"): 0.0051}


def test_tex_core_parameter_isolation(paper_summary):
    names = {"Learned full": "learned_full", "Identity full": "identity_full",
             "Consolidator only": "consolidator_only",
             "Memory + Consolidator": "memory_consolidator"}
    metrics = ["updated_ltm", "fresh_ltm", "mismatched_ltm", "seg2_stm"]
    rows = tex_rows("tab:core-parameter-isolation")
    assert len(rows) == 4
    for row in rows:
        condition = names[row[0]]
        for metric, cell in zip(metrics, row[1:]):
            mean, sd = nums(cell)
            ours = paper_summary[(condition, metric)]
            assert close2(ours["mean"], mean), (condition, metric)
            tol = PER_SEED_ROUNDING.get((condition, metric, "sd"))
            if tol is None:
                assert close2(ours["sd"], sd), (condition, metric)
            else:
                assert not close2(ours["sd"], sd) and abs(ours["sd"] - sd) <= tol


def test_tex_direct_ltm_routing(paper_summary, paper_cmp):
    conditions = {"Off": ("consolidator_only_routing_off", "off"),
                  "On": ("consolidator_only", "on")}
    rows = tex_rows("tab:direct-ltm-routing")
    for row in rows:
        condition, tag = conditions[row[0]]
        cells = dict(zip(["updated_ltm", "forced_identity", "diff", "seg2_stm",
                          "mismatched_ltm", "fresh_ltm"], row[1:]))
        for metric, cell in cells.items():
            mean, sd = nums(cell)
            if metric == "diff":
                r = paper_cmp[f"learned - forced identity, routing {tag}: updated_ltm"]
                ours_mean, ours_sd = r["mean_diff"], r["sd_diff"]
            else:
                ours_mean = paper_summary[(condition, metric)]["mean"]
                ours_sd = paper_summary[(condition, metric)]["sd"]
            assert close2(ours_mean, mean) and close2(ours_sd, sd), (row[0], metric)


def test_tex_routing_per_seed(paper_wide, paper_summary, paper_cmp):
    off, on = "consolidator_only_routing_off", "consolidator_only"
    rows = tex_rows("tab:routing-per-seed")
    assert [r[0] for r in rows] == ["42", "43", "44", "45", "46", "Mean", "SD"]
    idx = paper_wide.set_index(["condition", "seed"])
    for row in rows[:5]:
        seed = int(row[0])
        v = nums(" ".join(row[1:]))
        o = idx.loc[(off, seed)]
        assert close2(o["updated_ltm"] - o["forced_identity"], v[2])
        assert close2(idx.loc[(on, seed), "updated_ltm"] - o["updated_ltm"], v[6])
    metrics = ["updated_ltm", "forced_identity", None, "seg2_stm", "mismatched_ltm", "fresh_ltm"]
    for row, part in ((rows[5], "mean"), (rows[6], "sd")):
        values = nums(" ".join(row[1:]))
        for metric, printed in zip(metrics, values[:6]):
            if metric is None:
                r = paper_cmp["learned - forced identity, routing off: updated_ltm"]
                ours = r["mean_diff" if part == "mean" else "sd_diff"]
            else:
                ours = paper_summary[(off, metric)][part]
            assert close2(ours, printed), (part, metric)
        r = paper_cmp["routing on - off: updated_ltm"]
        assert close2(r["mean_diff" if part == "mean" else "sd_diff"], values[6])


def test_tex_same_address_update_updated_row(paper_summary):
    rows = tex_rows("tab:same-address-update")
    updated = next(r for r in rows if r[0].startswith("Updated"))
    (lm, ls), (im, isd) = nums(updated[1]), nums(updated[2])
    ours_l = paper_summary[("consolidator_only", "updated_ltm")]
    ours_i = paper_summary[("consolidator_only", "forced_identity")]
    assert close2(ours_l["mean"], lm) and close2(ours_l["sd"], ls)
    assert close2(ours_i["mean"], im) and close2(ours_i["sd"], isd)
    # the initial-mapping row is not derivable: no per-seed initial_ltm in the paper
    assert ("consolidator_only", "initial_ltm") not in paper_summary


def test_tex_dual_objective_aggregate(paper_summary, paper_cmp):
    rows = {r[0]: r[1:] for r in tex_rows("tab:dual-objective-aggregate")}
    metrics = ["updated_ltm", "mean_stm", "seg2_stm", "mismatched_ltm", "fresh_ltm"]
    checked = 0
    for name, condition in (("Updated LTM only", "learned_full"),
                            ("Updated LTM + STM", "learned_full_dual")):
        for metric, cell in zip(metrics, rows[name]):
            ours = paper_summary.get((condition, metric))
            if ours is None:
                continue
            mean, sd = nums(cell)
            assert close2(ours["mean"], mean) and close2(ours["sd"], sd), (name, metric)
            checked += 1
    assert checked == 6  # learned_full: 4 of 5 columns; dual: updated LTM and mean STM
    r = paper_cmp["dual - LTM only: updated_ltm"]
    mean, sd = nums(rows["Paired change"][0])
    assert close2(r["mean_diff"], mean) and close2(r["sd_diff"], sd)
    lo, hi = nums(rows["95\\% CI"][0])
    assert close2(r["ci_low"], lo) and close2(r["ci_high"], hi)
    assert p3(r["p"]) == nums(rows["Paired \\(p\\)"][0])[0]


def test_tex_dual_per_seed_test_dual_is_mean(paper_wide):
    rows = tex_rows("tab:dual-objective-per-seed")
    idx = paper_wide.set_index(["condition", "seed"])
    for row in rows:
        seed = int(row[0])
        _, test_dual, upd, stm, _ = nums(" ".join(row[2:]))
        assert close2((upd + stm) / 2, test_dual)
        t = idx.loc[("learned_full_dual", seed)]
        assert close2((t["updated_ltm"] + t["mean_stm"]) / 2, test_dual)
        assert close2(t["dual"], test_dual)


def test_tex_core_results_per_seed_match_csv(paper_wide):
    names = {"Learned full": "learned_full", "Identity full": "identity_full",
             "Consolidator only": "consolidator_only",
             "Memory + Consolidator": "memory_consolidator"}
    idx = paper_wide.set_index(["condition", "seed"])
    rows = tex_rows("tab:core-results-per-seed")
    assert len(rows) == 20
    for row in rows:
        t = idx.loc[(names[row[0]], int(row[1]))]
        v = nums(" ".join(row[2:]))
        ours = [t["updated_ltm"], t["alternative_mode"], t["fresh_ltm"], t["seg2_stm"],
                t["mismatched_ltm"]]
        assert all(close2(a, b) for a, b in zip(ours, v)), row


def test_packaged_paper_data_equals_the_shared_spec():
    from pmnet.stats import PACKAGED_SPEC, REPO_ROOT

    shared = REPO_ROOT.parent / "shared" / "spec"
    if not shared.is_dir():
        pytest.skip("shared/spec not beside the repository")
    for name in ("paper-aggregates.csv", "paper-per-seed.csv"):
        assert (PACKAGED_SPEC / name).read_bytes() == (shared / name).read_bytes()


# ------------------------------------------------------------------------------------------
# consolidation operators (beyond the paper)
# ------------------------------------------------------------------------------------------


def test_operator_comparisons_are_their_own_family():
    ops = ("operator_ema", "operator_overwrite", "operator_linear", "operator_gru")
    assert stats.OPERATOR_CONDITIONS == ops
    assert [(c.cond_a, c.metric_a, c.cond_b, c.metric_b) for c in stats.OPERATOR_COMPARISONS] \
        == [(o, "updated_ltm", "consolidator_only", "updated_ltm") for o in ops]
    paper_family = {c.label for c in stats.COMPARISONS}
    assert not paper_family & {c.label for c in stats.OPERATOR_COMPARISONS}
    assert not any(c.cond_a in ops or c.cond_b in ops for c in stats.COMPARISONS)
    assert stats.CONDITIONS == tuple(stats.CONDITION_LABELS)[:6]  # the paper's six first
    assert stats.condition_label("operator_gru") == "GRU operator"
    assert stats.ordered_conditions(["zzz", "operator_gru", "operator_ema", "learned_full"]) == [
        "learned_full", "operator_ema", "operator_gru", "zzz"]


def test_compare_operators_pairs_each_operator_with_the_consolidator():
    ref = [80.0, 82.0, 84.0]
    ups = {"operator_ema": [20.0, 25.0, 21.0], "operator_overwrite": [70.0, 78.0, 77.0],
           "operator_linear": [50.0, 52.0, 57.0], "operator_gru": [81.0, 80.0, 86.0]}
    rows = [("consolidator_only", 42 + i, {"updated_ltm": ref[i]}) for i in range(3)]
    rows += [(c, 42 + i, {"updated_ltm": v[i]}) for c, v in ups.items() for i in range(3)]
    rows.append(("learned_full", 42, {"updated_ltm": 90.0}))
    df = frame(rows)
    assert stats.has_operator_results(df)
    assert not stats.has_operator_results(df[~df["condition"].str.startswith("operator_")])
    out = stats.compare_operators(df)
    assert list(out["cond_a"]) == list(ups)
    for row in out.to_dict("records"):
        want = stats.paired_comparison(df, row["cond_a"], "updated_ltm", "consolidator_only",
                                       "updated_ltm")
        for k in ("n", "mean_diff", "sd_diff", "ci_low", "ci_high", "p"):
            assert row[k] == pytest.approx(want[k]), k
        assert row["mean_diff"] == pytest.approx(np.mean(ups[row["cond_a"]]) - np.mean(ref))
    assert (out["holm_m"] == 4).all()  # Holm over the four operator comparisons only
    assert np.allclose(out["p_holm"], multipletests(out["p"], method="holm")[1])
    # the paper's family ignores the operator trials entirely
    without = df[~df["condition"].str.startswith("operator_")]
    pd.testing.assert_frame_equal(stats.compare_all(df), stats.compare_all(without))


# ------------------------------------------------------------------------------------------
# variants (named Phase-2 overrides) and the segments grid
# ------------------------------------------------------------------------------------------

def test_tables_without_variants_have_an_empty_variant_column():
    df = stats.load_results(FIXTURES)
    assert list(df.columns[:3]) == ["condition", "seed", "variant"]
    assert (df["variant"] == "").all() and not stats.has_variant_results(df)
    assert df.attrs["variant_fields"] == []
    pd.testing.assert_frame_equal(stats.by_arm(df), df)
    pd.testing.assert_frame_equal(stats.default_variant(df), df)
    assert stats.segment_arms(df) == [] and stats.compare_segments(df).empty
    assert "variant" not in stats.metric_columns(df)


def test_load_results_with_variants(tmp_path):
    write_segment_results(tmp_path, seeds=(42, 43), ts=(2, 4))
    plain = {"condition": "consolidator_only", "seed": 42, "test": {"updated_ltm": 50.0},
             "config": {"segments": 2, "ltm_graph": "full"}}
    (tmp_path / "consolidator_only-s42.json").write_text(json.dumps(plain))
    df = stats.load_results(tmp_path)
    assert len(df) == 9 and stats.has_variant_results(df)
    assert df.attrs["variant_fields"] == ["ltm_graph", "segments"]
    cols = list(df.columns)
    assert cols.index("source_file") < cols.index("ltm_graph") < cols.index("updated_ltm")
    rows = df.set_index(["variant", "seed"])
    assert rows.loc[("T4-truncated", 43), "segments"] == 4
    assert rows.loc[("T4-truncated", 43), "ltm_graph"] == "truncated"
    # the default trial's values of the overridden fields come from its own config
    assert rows.loc[("", 42), "segments"] == 2 and rows.loc[("", 42), "ltm_graph"] == "full"
    assert pd.api.types.is_numeric_dtype(df["segments"]) and df["ltm_graph"].dtype == object
    assert math.isnan(rows.loc[("T2-full", 42), "final_ltm_seg1"])  # T = 2: not computed
    assert rows.loc[("T4-full", 42), "final_ltm_seg3"] == segment_value(4, "full", 42,
                                                                         "final_ltm_seg3")
    # the variant fields are not metrics; each arm is summarised on its own
    assert not {"segments", "ltm_graph", "variant"} & set(stats.metric_columns(df))
    summary = stats.summarize(stats.by_arm(df), ["updated_ltm"])
    assert list(summary["condition"]) == [
        "consolidator_only", "consolidator_only-T2-full", "consolidator_only-T2-truncated",
        "consolidator_only-T4-full", "consolidator_only-T4-truncated"]
    assert list(summary["n"]) == [1, 2, 2, 2, 2]
    assert list(stats.default_variant(df)["seed"]) == [42]
    tidy = stats.write_tidy(df, tmp_path / "out")
    assert list(pd.read_parquet(tidy["parquet"]).columns) == cols


@pytest.mark.parametrize("obj, message", [
    ({"condition": "a", "seed": 1, "variant": "T4-s3"}, "would read as a seed"),
    ({"condition": "a", "seed": 1, "variant": "4T"}, "invalid variant name"),
    ({"condition": "a-b", "seed": 1}, "condition"),
    ({"condition": "a", "seed": 1, "variant": "v", "variant_overrides": [1]},
     "variant_overrides"),
])
def test_load_results_refuses_bad_variants_naming_the_file(tmp_path, obj, message):
    path = _write(tmp_path, "bad.json", json.dumps(obj))
    with pytest.raises(ValueError, match=message) as info:
        stats.load_results(tmp_path)
    assert str(path) in str(info.value)


def test_the_same_trial_twice_is_a_duplicate_but_not_across_variants(tmp_path):
    for name, variant in (("one", "T4-full"), ("two", "T4-truncated"), ("three", "")):
        _write(tmp_path, f"{name}.json", json.dumps({"condition": "a", "seed": 1,
                                                     "variant": variant}))
    assert len(stats.load_results(tmp_path)) == 3
    _write(tmp_path, "four.json", json.dumps({"condition": "a", "seed": 1,
                                              "variant": "T4-full"}))
    with pytest.raises(ValueError, match="duplicate result for condition 'a' variant "
                                         "'T4-full' seed 1"):
        stats.load_results(tmp_path)


def test_segment_arms_and_full_minus_truncated_paired_by_seed(tmp_path):
    df = stats.load_results(write_segment_results(tmp_path,
                                                  skip={("T8-truncated", 46)}))
    arms = stats.segment_arms(df)
    assert [(a.segments, a.ltm_graph) for a in arms] == [
        (2, "full"), (2, "truncated"), (4, "full"), (4, "truncated"), (8, "full"),
        (8, "truncated")]
    assert arms[3].arm == "consolidator_only-T4-truncated"
    out = stats.compare_segments(df)
    assert list(out["label"]) == [f"T = {t}: full - truncated: updated_ltm"
                                  for t in SEGMENT_TS]
    assert list(out["segments"]) == list(SEGMENT_TS)
    for row in out.to_dict("records"):  # by hand: the seed-wise differences
        t = row["segments"]
        seeds = [s for s in SEGMENT_SEEDS if not (t == 8 and s == 46)]
        diffs = [segment_value(t, "full", s, "updated_ltm")
                 - segment_value(t, "truncated", s, "updated_ltm") for s in seeds]
        assert row["n"] == len(seeds) and row["mean_diff"] == pytest.approx(np.mean(diffs))
        assert row["sd_diff"] == pytest.approx(np.std(diffs, ddof=1))
        assert row["p"] == pytest.approx(sps.ttest_rel(
            [segment_value(t, "full", s, "updated_ltm") for s in seeds],
            [segment_value(t, "truncated", s, "updated_ltm") for s in seeds]).pvalue)
    assert out["p_holm"].tolist() == pytest.approx(
        multipletests(out["p"], method="holm")[1].tolist())
    assert (out["holm_m"] == 3).all()
    assert "seed 46 missing in consolidator_only-T8-truncated" in out["note"].iloc[2]
    # a T with only one mode has nothing to pair
    only_full = stats.load_results(write_segment_results(tmp_path / "f", graphs=("full",)))
    assert len(stats.segment_arms(only_full)) == 3 and stats.compare_segments(only_full).empty


def test_learned_minus_forced_identity_at_each_segment_count_and_mode(tmp_path):
    df = stats.load_results(write_segment_results(tmp_path,
                                                  skip={("T4-full", 44)}))
    out = stats.compare_segments_identity(df)
    assert list(out["label"]) == [f"T = {t}, {g}: learned - forced identity: updated_ltm"
                                  for t in SEGMENT_TS for g in ("full", "truncated")]
    assert list(out["segments"]) == [t for t in SEGMENT_TS for _ in range(2)]
    assert list(out["ltm_graph"]) == ["full", "truncated"] * 3
    for row in out.to_dict("records"):  # by hand: updated minus forced identity, per seed
        t, g = row["segments"], row["ltm_graph"]
        seeds = [s for s in SEGMENT_SEEDS if not (t == 4 and g == "full" and s == 44)]
        diffs = [segment_value(t, g, s, "updated_ltm") - segment_value(t, g, s,
                                                                       "forced_identity")
                 for s in seeds]
        assert row["n"] == len(seeds) and row["mean_diff"] == pytest.approx(np.mean(diffs))
        assert row["p"] == pytest.approx(sps.ttest_1samp(diffs, 0.0).pvalue)
    assert (out["holm_m"] == 6).all()  # a family of its own: Holm over these six only
    assert out["p_holm"].tolist() == pytest.approx(
        multipletests(out["p"], method="holm")[1].tolist())
    assert "seed 44 missing" in out["note"].iloc[2]
    # a frame without segment arms has nothing to compare
    plain = df[df["variant"] == "T2-full"].assign(variant="")
    assert stats.compare_segments_identity(plain).empty


# ------------------------------------------------------------------------------------------
# task-matched baselines (issue 23, beyond the paper)
# ------------------------------------------------------------------------------------------


def test_compare_baselines_pairs_each_baseline_with_both_references():
    refs = {"consolidator_only": [40.0, 44.0, 42.0], "operator_gru": [35.0, 38.0, 33.0]}
    ups = {"baseline_no_reset": [90.0, 91.0, 93.0], "baseline_memory_tokens": [20.0, 25.0, 22.0],
           "baseline_recurrent_state": [15.0, 14.0, 18.0],
           "baseline_no_memory": [10.0, 11.0, 9.0]}
    rows = [(c, 42 + i, {"updated_ltm": v[i]}) for c, v in {**refs, **ups}.items()
            for i in range(3)]
    df = frame(rows)
    assert stats.has_baseline_results(df)
    assert not stats.has_baseline_results(df[~df["condition"].str.startswith("baseline_")])
    out = stats.compare_baselines(df)
    assert [(r["cond_a"], r["cond_b"]) for r in out.to_dict("records")] == [
        (b, r) for b in ups for r in refs]
    for row in out.to_dict("records"):
        assert row["mean_diff"] == pytest.approx(np.mean(ups[row["cond_a"]])
                                                 - np.mean(refs[row["cond_b"]]))
    assert (out["holm_m"] == 8).all()  # Holm over the eight baseline comparisons only
    assert np.allclose(out["p_holm"], multipletests(out["p"], method="holm")[1])
    assert not {c.label for c in stats.COMPARISONS} & {c.label for c in
                                                       stats.BASELINE_COMPARISONS}
    assert stats.ordered_conditions(["baseline_no_memory", "operator_gru", "zzz"]) == [
        "operator_gru", "baseline_no_memory", "zzz"]


def test_a_family_beyond_the_paper_has_its_own_holm_and_its_remark():
    """`Family`: present only when one of its conditions ran; its comparisons adjusted among
    themselves (not with the paper's family) and each carrying the family's remark."""
    family = stats.Family(
        conditions=("operator_ema", "operator_gru"),
        comparisons=tuple(stats.Comparison(f"{c} - C", c, "updated_ltm", "consolidator_only",
                                           "updated_ltm", "ours:test")
                          for c in ("operator_ema", "operator_gru")),
        remark="a remark")
    values = {"consolidator_only": [40.0, 44.0, 42.0], "operator_ema": [30.0, 31.0, 35.0],
              "operator_gru": [50.0, 53.0, 52.0]}
    df = frame([(c, 42 + i, {"updated_ltm": v[i]}) for c, v in values.items() for i in range(3)])
    assert family.present(df)
    assert not family.present(df[df["condition"] == "consolidator_only"])
    out = family.compare(df)
    assert list(out["label"]) == ["operator_ema - C", "operator_gru - C"]
    assert (out["holm_m"] == 2).all()
    assert all(note.endswith("a remark") for note in out["note"])
    assert family.remarks == {"operator_ema - C": "a remark", "operator_gru - C": "a remark"}


def test_phase1_families_read_the_frozen_backbone_trials_per_checkpoint():
    """Issue 52: each rule family's Phase-1 STM (mean of its segments' STM queries) beside its
    baseline, from the trials whose backbone Phase 2 leaves frozen only, per checkpoint; a
    family is learned where STM clears the baseline by more than the margin, on every one."""
    margin = stats.LEARNED_MARGIN_PP
    assert margin == pytest.approx(100 * 1.96 * math.sqrt(0.25 / 1000)) and 3.0 < margin < 3.2
    rows = []
    for k, affine in ((0, 34.5 + margin - 0.01), (1, 34.5 + margin + 0.01)):
        for condition, shift in (("consolidator_only", 0.0), ("operator_gru", 0.0),
                                 ("memory_consolidator", -30.0)):  # its STM path trains
            row = {"condition": condition, "seed": 42, "phase1_seed": k}
            for t, d in ((1, -1.0), (2, 1.0)):
                row.update({f"seg{t}_stm_add10": 99.0 + shift, f"seg{t}_stm_add10_baseline": 50.0,
                            f"seg{t}_stm_affine10": affine + d + shift,
                            f"seg{t}_stm_affine10_baseline": 34.5})
            rows.append(row)
    fam = stats.phase1_families(pd.DataFrame(rows))
    add, aff = fam["add10"], fam["affine10"]
    assert add.learned and add.stm == pytest.approx(99.0) and add.baseline == 50.0
    assert [c.learned for c in aff.checkpoints] == [False, True]
    assert not aff.learned and aff.not_learned_on == [0]
    assert aff.status() == "not learned on 1 of 2 checkpoints (0)"
    assert aff.text() == f"{aff.stm:.1f} vs 34.5 (not learned on 1 of 2)"
    # no frozen-backbone trial, or no per-family STM: nothing to say, nothing gated
    assert stats.phase1_families(pd.DataFrame(rows).query(
        "condition == 'memory_consolidator'")) == {}
    assert stats.phase1_families(pd.DataFrame([{"condition": "consolidator_only", "seed": 42,
                                                "seg1_stm": 90.0}])) == {}
    # each comparison on updated-mapping recall, read on each family's episodes
    labels = {c.label: c for c in stats.FAMILY_COMPARISONS}
    spec = labels["learned - forced identity, routing on: updated_ltm_affine10"]
    assert (spec.metric_a, spec.metric_b) == ("updated_ltm_affine10", "forced_identity_affine10")
    paper = {c.label: c for c in stats.COMPARISONS}  # one the paper's family already has
    same = "routing on - off: updated_ltm_add10"
    assert labels[same][1:5] == paper[same][1:5]
