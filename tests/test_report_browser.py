"""The report a person sees first, in a real browser (issue 35): the committed issue-21 and
issue-23 runs' report.html, rebuilt from their records, laid out by headless Chromium in a
1,280-pixel window: nothing wider than the window, and every table row with a value of ours.
Issue 64: every table of the reports built from the test fixtures (the paper's six
conditions; the synthetic checkpoint store, the most columns) fits that window, and no cell is
cut or reaches outside its table.

Needs a ``chromium`` executable (``make test`` installs Debian's package when it can); the
tests skip, saying why, without one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pmnet import report, stats
from pmnet.report.page import html_page
from tests.support.browser_check import WIDTH, chromium, measure
from tests.support.checkpoint_store import synthetic_store

RESULTS = Path(__file__).resolve().parent.parent / "experiments" / "results"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "results"
#: committed runs and the records beside results/ their report reads
RUNS = {
    "issue21/pipeline-cpu-20261124": ("pipeline.json", "timing.json", "phase1-p1s0",
                                      "phase1-p1s1", "phase1-p1s2"),
    "issue23/pipeline-cpu-20261124": ("pipeline.json", "timing.json", "phase1"),
}

pytestmark = pytest.mark.skipif(
    chromium() is None,
    reason="no chromium on PATH: the report's browser check needs one (Debian: apt-get "
           "install chromium; `make test` installs it when run as root with apt-get)")


def rebuilt(name: str, into: Path) -> Path:
    """The committed run's report.html, rebuilt from its records under ``into``."""
    src = RESULTS / name
    run = into / "run"
    shutil.copytree(src / "results", run / "results")
    for record in RUNS[name]:
        if (src / record).is_dir():
            shutil.copytree(src / record, run / record)
        else:
            shutil.copy(src / record, run / record)
    return report.main_report(run)["html"]


def problems(verdict: dict) -> list[str]:
    out = []
    if verdict["scrollWidth"] > verdict["innerWidth"]:
        out.append(f"page {verdict['scrollWidth']} px wide in a {verdict['innerWidth']} px "
                   "window")
    out += [f"wider than the window: {w}" for w in verdict["wide"]]
    out += [f"row without a value of ours: {r}" for r in verdict["empty_rows"]]
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_committed_reports_fit_a_1280_pixel_window(tmp_path, name):
    page = rebuilt(name, tmp_path)
    verdict = measure(page.read_text(encoding="utf-8"))
    assert verdict["innerWidth"] == WIDTH
    assert verdict["tables"] >= 10  # the page was laid out, tables and all
    assert problems(verdict) == []


def table_problems(verdict: dict) -> list[str]:
    """Each table wider than the window, and each cell cut by its table (issue 64)."""
    out = []
    for t in verdict["table_sizes"]:
        width = max(t["width"], t["scrollWidth"])
        if width > WIDTH:
            out.append(f"{t['table']}: {width} px wide in a {WIDTH} px window")
        out += [f"{t['table']}: cell cut or outside the table: {c!r}" for c in t["cut"]]
    return out


def paper_fixture_report(into: Path) -> Path:
    """tests/test_report.py's `built` run: the fixture results of the paper's six
    conditions, with a Phase-1 curve and a pipeline record."""
    run = into / "run"
    shutil.copytree(FIXTURES, run / "results")
    (run / "phase1").mkdir()
    (run / "phase1" / "metrics.csv").write_text("epoch,step,train/loss\n0,1,2.5\n1,3,1.5\n")
    (run / "pipeline.json").write_text(json.dumps({
        "preset": "debug", "git_commit": "0123abc", "hardware": "2 CPU cores",
        "grid": {"conditions": list(stats.CONDITIONS), "seeds": [42, 43, 44]}}))
    return report.main_report(run)["html"]


def checkpoint_store_report(into: Path) -> Path:
    """tests/test_report_checkpoint_study.py's synthetic store: five Phase-1 checkpoints,
    eight arms, every checkpoint table (the widest: one column per effect)."""
    return report.main_report(synthetic_store(into / "store").root)["html"]


@pytest.mark.parametrize("build", [paper_fixture_report, checkpoint_store_report],
                         ids=["paper-fixture", "checkpoint-store"])
def test_every_table_fits_a_1280_pixel_window_without_a_cut_column(tmp_path, build):
    verdict = measure(build(tmp_path).read_text(encoding="utf-8"))
    assert verdict["innerWidth"] == WIDTH
    assert len(verdict["table_sizes"]) >= 10  # the page was laid out, tables and all
    assert table_problems(verdict) == []
    assert problems(verdict) == []


def _table(rows: list[list[str]], caption: str = "") -> str:
    body = "".join("<tr><th>r</th>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>"
                   for row in rows)
    return (f'<table id="tab:x"><caption>{caption}</caption><thead><tr><th>a</th><th>b</th>'
            f"</tr></thead><tbody>{body}</tbody></table>")


def test_the_check_catches_a_table_wider_than_the_window():
    wide = "9" * 400  # no place to break: the table is wider than the window
    page = html_page({}, [], [], [], {}, [], [])
    verdict = measure(page.replace("</body>", _table([[wide, "1.0"]]) + "</body>"))
    found = problems(verdict)
    assert verdict["scrollWidth"] > WIDTH and any("tab:x" in p for p in found), found
    fits = measure(page.replace("</body>", _table([["12.3", "1.0"]]) + "</body>"))
    assert problems(fits) == []


def test_the_check_catches_a_row_without_a_value_of_ours():
    page = html_page({}, [], [], [], {}, [], [])
    missing = ('<td class="missing">— <span class="paper">(87.02)</span></td>'
               '<td class="aside">reproduces</td>')
    verdict = measure(page.replace("</body>", _table([["12.3", "1.0"], [missing, ""]])
                                   + "</body>"))
    assert [r["table"] for r in verdict["empty_rows"]] == ["tab:x"]
    assert problems(verdict) == [f"row without a value of ours: {verdict['empty_rows'][0]}"]


def test_the_table_check_catches_a_wide_table_and_a_cut_cell():
    page = html_page({}, [], [], [], {}, [], [])
    wide = measure(page.replace("</body>", _table([["9" * 400, "1.0"]]) + "</body>"))
    assert any("tab:x" in p and "px wide" in p for p in table_problems(wide)), wide
    fixed = _table([["9" * 60, "1.0"]]).replace(
        '<table id="tab:x">', '<table id="tab:x" style="table-layout:fixed;width:300px">')
    cut = measure(page.replace("</body>", fixed + "</body>"))
    assert [p for p in table_problems(cut) if "cut" in p] == [
        f"tab:x: cell cut or outside the table: {'9' * 60!r}"], cut["table_sizes"]
    assert table_problems(measure(page.replace("</body>", _table([["12.3", "1.0"]])
                                               + "</body>"))) == []
