"""The checkpoint study's report from a durable store (issue 45): `main_report(store)` reads
the store's results, its trials' diagnostics, each Phase-1 unit's diagnostics and the
store's named subsets, and prints the checkpoint section (distribution, sensitivity,
predictor, channel, strict off), each effect beside the capability gate. A small synthetic
store (tests/support/checkpoint_store.py); issue 39's committed store reproduces
docs/results.md's figures (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pmnet.report.build import main_report
from pmnet.trial_id import TrialId
from tests.support.checkpoint_store import synthetic_store, write_json

REPO = Path(__file__).resolve().parent.parent
ISSUE39_STORE = REPO / "experiments" / "results" / "issue39" / "store"


def md_rows(path: Path) -> list[list[str]]:
    """A markdown table's rows, the header first (the alignment line left out)."""
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in path.read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| :--", "| ---"))]


def test_a_store_report_has_the_whole_checkpoint_section(tmp_path):
    lay = synthetic_store(tmp_path / "store")
    paths = main_report(lay.root)
    tables = lay.root / "report" / "tables"
    md = paths["markdown"].read_text()
    # one section: the Phase-1 variance tables, then the study's
    order = [md.index(f"**Table `tab:{t}`.**") for t in (
        "phase1-variance", "phase1-checkpoints", "checkpoint-distribution", "checkpoint-effects",
        "checkpoint-sensitivity", "checkpoint-predictor", "checkpoint-channel",
        "checkpoint-mechanism", "checkpoint-strict", "checkpoint-strict-models")]
    assert order == sorted(order)
    assert "confirmatory: phase1_seed 2, 3, 4" in md  # the store's record, in "What ran"
    # the routing effect: 1.1 - 2k over k = 0..4 is -2.90 (SE: SD of 2k / sqrt 5), both
    # arms below the baseline
    dist = {r[0]: r for r in md_rows(tables / "tab-checkpoint-distribution.md")[1:]}
    routing = dist["routing on - off"]
    assert routing[1:4] == ["5", "10", "-2.90 ± 1.41"]
    assert routing[12].endswith("vs 42.0 (both below)") and routing[13] == "[1]"
    # the confirmatory subset the store names: 1.1 - 2k over k = 2..4 is -4.90
    sens = md_rows(tables / "tab-checkpoint-sensitivity.md")[1:]
    conf = next(r for r in sens if r[0] == "confirmatory 2..4, selected epoch"
                and r[1] == "routing on - off")
    assert conf[2] == "3" and conf[4].startswith("-4.90")
    # the predictor: X = 10 + 20k rises as the effect falls: rho = -1 on 2..4
    pred = md_rows(tables / "tab-checkpoint-predictor.md")[1]
    assert pred[0].startswith("root L route change, confirmatory checkpoints (2, 3, 4)")
    assert pred[1:3] == ["3", "-1.00"] and pred[-1] == "holds"  # scipy: t-approximated p
    # the channel interaction: -11 - k / 2 - (1.1 - 2k) = -12.1 + 1.5k, over k = 0..4
    channel = {r[0]: r for r in md_rows(tables / "tab-checkpoint-channel.md")[1:]}
    inter = channel["(operator_gru on - off) - (Consolidator on - off)"]
    assert inter[3] == "-9.10 ± 1.06" and inter[1:3] == ["5", "10"]
    assert channel["routing on - off (operator_gru)"][-1] == "< 0"  # capable arms: a verdict
    mech = md_rows(tables / "tab-checkpoint-mechanism.md")[1:]
    assert len(mech) == 5 * 6 and mech[0][-3] == "12.5 / 30.0"
    assert mech[0][-2:] == ["", ""]  # diagnostics made before the mechanism's two readings
    strict = {r[0]: r for r in md_rows(tables / "tab-checkpoint-strict.md")[1:]}
    # routing on - strict off: 20 + 3 - 2k + 0.2i - 22.5, over k and i
    assert strict["routing on - strict off (consolidator_only)"][3] == "-3.40 ± 1.41"
    assert (lay.root / "report" / "data" / "checkpoint_sensitivity.csv").is_file()


def test_a_partial_checkpoint_is_named_not_averaged_in(tmp_path):
    lay = synthetic_store(tmp_path / "store")
    for cond in ("operator_gru", "operator_gru_routing_off"):  # checkpoint 5: GRU only
        write_json(lay.result(TrialId(cond, 42, phase1_seed=5)), {
            "condition": cond, "seed": 42, "phase1_seed": 5,
            "test": {"updated_ltm": 11.0, "updated_ltm_baseline": 42.0}})
    main_report(lay.root)
    text = (lay.root / "report" / "tables" / "tab-checkpoint-distribution.md").read_text()
    assert "operator_gru p5 s42 11.00, operator_gru_routing_off p5 s42 11.00" in text
    gru = next(r for r in md_rows(lay.root / "report" / "tables" /
                                  "tab-checkpoint-distribution.md")
               if r[0] == "routing on - off (operator_gru)")
    assert gru[1] == "5"  # K = 5: checkpoint 5 is not in


@pytest.mark.slow
def test_the_issue39_store_reproduces_the_published_figures(tmp_path):
    """docs/results.md, the issue-39 sections: the 10-checkpoint routing effect, the
    confirmatory subset, the channel arms and their interaction, the strict-off contrasts
    and the predictor, to the printed precision, from the committed store."""
    import shutil

    store = tmp_path / "store"
    shutil.copytree(ISSUE39_STORE, store, ignore=shutil.ignore_patterns("report", "*.pt"))
    main_report(store)
    tables = store / "report" / "tables"

    def rows(name):
        return {tuple(r[:2]) if name == "sensitivity" else r[0]: r
                for r in md_rows(tables / f"tab-checkpoint-{name}.md")[1:]}

    dist = rows("distribution")
    assert dist["routing on - off"][1:6] == ["10", "20", "-1.36 ± 1.94", "[-5.75, +3.04]",
                                             "0.502"]
    assert dist["routing on - off"][6:12] == ["6.04", "1.59", "3 / 10", "1 / 3", "14", "6"]
    assert dist["routing on - off"][12] == "18.9 / 20.3 vs 42.0 (both below)"
    assert dist["learned - forced identity, routing on"][3] == "+1.32 ± 2.53"
    assert dist["learned - forced identity, routing off"][3] == "+2.36 ± 2.55"
    sens = rows("sensitivity")
    conf = sens[("confirmatory 3..9, selected epoch", "routing on - off")]
    assert conf[2:7] == ["7", "14", "-1.87 ± 0.68", "[-3.53, -0.21]", "0.033"]
    last = sens[("all checkpoints, last epoch", "routing on - off")]
    assert last[4:6] == ["-1.82 ± 1.14", "[-4.39, +0.75]"]
    channel = rows("channel")
    assert channel["routing on - off (operator_gru)"][3:6] == [
        "-15.02 ± 4.60", "[-27.81, -2.24]", "0.031"]
    assert channel["routing on - off (memory_consolidator)"][3:5] == [
        "-1.55 ± 3.27", "[-10.63, +7.52]"]
    assert channel["routing on - off"][3] == "-1.19 ± 4.01"
    assert channel["(operator_gru on - off) - (Consolidator on - off)"][3:6] == [
        "-13.84 ± 2.84", "[-21.74, -5.94]", "0.00824"]
    assert channel["(memory_consolidator on - off) - (Consolidator on - off)"][3] == (
        "-0.37 ± 2.76")
    assert channel["operator_gru - consolidator_only, routing on"][3] == "+23.54 ± 3.20"
    levels = rows("channel-levels")
    assert levels["operator_gru_routing_off"][1:] == ["57.25", "81.80", "34.17", "68.61"]
    strict = rows("strict")
    assert strict["routing off - strict off (consolidator_only_routing_off)"][3:5] == [
        "-0.54 ± 1.79", "[-5.52, +4.44]"]
    assert strict["routing on - strict off (consolidator_only)"][3] == "-1.73 ± 3.54"
    assert strict["routing off - strict off (memory_consolidator_routing_off)"][3:5] == [
        "-0.70 ± 0.81", "[-2.96, +1.56]"]
    pred = md_rows(tables / "tab-checkpoint-predictor.md")[1]
    assert pred[1:4] == ["7", "+0.25", "0.706"] and pred[-1] == "fails"
    effects = {r[0]: r for r in md_rows(tables / "tab-checkpoint-effects.md")[1:]}
    assert effects["0"][1] == "+12.12 [+9.6, +14.6] +"
    assert effects["2"][8] == "92.42"  # the root L route change of checkpoint 2
