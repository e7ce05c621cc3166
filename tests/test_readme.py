"""The README a newcomer reads in two minutes (issues 35 and 64): its first screen holds what
the project is, the commands, what a machine gets and how long it takes, and a short result
table whose `cpu` figures are the committed run's, each beside its rerun on another CPU kind;
one row per grid and per preset; every wall time says where it was measured or what an
estimate assumes; every file it points to exists and every `make` target it names is in the
Makefile."""

from __future__ import annotations

import re
from pathlib import Path

from pmnet.config import PRESETS
from tune_spaces import SPACES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: one screen: what a reader sees before scrolling
FIRST_SCREEN = "\n".join(README.splitlines()[:50])
#: the committed run the README's `cpu` column comes from (`make pipeline` on a fresh clone
#: at today's default, issue 64), and its report's tables
SOURCE_RUN = "experiments/results/default-run/cpu-20261128-amd"
#: the figures a fresh run at 40538cc on a 2-core Intel VM gave (issue 64): the README shows
#: each `cpu` figure beside its rerun on another CPU kind
RERUN = {"routing on - off": "-7.68 pp (CI -30.15 to +14.78)",
         "Learned > forced identity, routing on": "+0.00 pp",
         "The capability": "14.4%",
         "Phase 1 learns each rule family": "not learned on 2 of 3"}


def _table_after(text: str, header_start: str) -> list[list[str]]:
    """Body rows (cells stripped) of the Markdown table whose header row starts so."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _results() -> list[list[str]]:
    return _table_after(README, "| paper claim |")


def test_the_first_screen_holds_the_commands_the_machines_and_the_results():
    for command in ("make test", "make pipeline", "make ui"):
        assert command in FIRST_SCREEN, command
    machines = _table_after(FIRST_SCREEN, "| your machine |")
    assert len(machines) >= 2 and any("`cpu`" in row[1] for row in machines)
    assert any("`paper`" in row[1] for row in machines)
    assert "| paper claim |" in FIRST_SCREEN
    assert "docs/results.md" in FIRST_SCREEN


def test_the_first_result_table_is_short_and_its_cells_are_short():
    """Issue 64: at most about 8 rows (the bar: 10), each cell a number or a few words."""
    results = _results()
    assert 4 <= len(results) <= 8
    for row in results:
        assert len(row) == 6 and all(row), row
        for cell in row:
            assert len(cell) <= 80, f"a cell is a paragraph: {cell!r}"


def test_a_comparison_of_two_arms_below_the_baseline_gets_no_verdict():
    """Issue 44: a comparison whose arms are both at or below the output-set baseline is not
    judged; issue 52: a family Phase 1 did not learn is named."""
    for row in _results():
        m = re.fullmatch(r"([\d.]+) / ([\d.]+) vs ([\d.]+)%", row[4])
        if m:
            a, b, base = map(float, m.groups())
            if a <= base and b <= base:
                assert row[5].startswith("no verdict"), row
    family = next(row for row in _results() if row[0].startswith("Phase 1 learns"))
    assert "AFFINE10 not learned" in family[5] and "vs 50.0%" in family[4]


def test_the_capability_row_states_the_verdict_of_today():
    capability = next(row for row in _results() if row[0].startswith("The capability"))
    assert capability[1] == "87.02%" and capability[4] == "20.1 vs 42.0%"
    assert capability[5].startswith("not reached")
    assert "**Does the paper reproduce?**" in README
    assert "capability gate" in README and "baseline + 10 pp" in README


def test_the_cpu_figures_are_the_committed_runs():
    """Every `cpu` figure of the result table is in the committed run's own report tables
    (tab:headline, tab:claims), so the README cannot drift from its source."""
    tables = ROOT / SOURCE_RUN / "report" / "tables"
    source = "\n".join((tables / f"tab-{t}.md").read_text(encoding="utf-8")
                       for t in ("headline", "claims"))
    assert SOURCE_RUN in README
    for row in _results():
        committed = row[2]
        for figure in re.findall(r"[+-]?\d+\.\d+", committed):
            if row[0].startswith("Fresh"):
                continue  # the controls' means: 10.30, 9.23 in tab:claims
            assert any(s.startswith(figure.lstrip("+")) or s.startswith(figure)
                       for s in re.findall(r"[+-]?\d+\.\d+", source)), (row[0], figure)
    assert "not learned on 1 of 3" in source
    assert "| 10.30 ± 0.19 |" in source and "| 9.23 ± 1.52 |" in source


def test_the_readme_source_run_was_made_with_todays_default_configuration():
    """Issue 64: the README's `cpu` figures come from a finished `make pipeline` of a clean
    checkout made with today's default: the preset chosen without a GPU, no `--set`, the
    default grid as `tune_spaces` builds it today, and every trial unit's recorded
    configuration equal to today's `cpu` TrainConfig (field for field; `threads` is how many
    CPUs the machine gave it, not what it computes). A change to the default (a preset
    field, the grid) fails here until the README's source run is made again."""
    import json

    from pmnet.config import default_preset
    from pmnet.train import TrainConfig
    from tune_spaces import get_space

    run = json.loads((ROOT / SOURCE_RUN / "pipeline.json").read_text(encoding="utf-8"))
    assert (run["status"], run["git_dirty"], run["overrides"]) == ("finished", "false", {})
    assert run["preset"] == default_preset("cpu") and run["grid"] is not None
    cfg = TrainConfig.from_name(run["preset"])
    space = get_space("default")(cfg, gpu=False)
    assert run["space"] == json.loads(json.dumps(space.to_dict()))
    units = sorted((ROOT / SOURCE_RUN / "results").glob("*.json"))
    assert len(units) == space.n_trials
    for path in units:
        unit = json.loads(path.read_text(encoding="utf-8"))
        want = json.loads(json.dumps(TrainConfig.from_name(
            run["preset"], phase1_seed=unit["phase1_seed"]).flat()))
        got = unit["config"]
        assert set(got) == set(want), (path.name, sorted(set(got) ^ set(want)))
        diff = {k: (got[k], want[k]) for k in want if k != "threads" and got[k] != want[k]}
        assert not diff, (path.name, diff)


def test_each_cpu_figure_stands_beside_its_rerun_on_another_cpu_kind():
    """Issue 64: each headline `cpu` figure shows how far a rerun on another CPU kind moved
    it, and the README says so."""
    rows = {row[0]: row for row in _results()}
    for claim, rerun in RERUN.items():
        row = next(r for name, r in rows.items() if claim in name)
        assert rerun in row[3], (claim, row[3])
    assert "another CPU kind" in README and "40538cc" in README


def test_one_row_per_grid():
    grids = _table_after(README, "| grid |")
    assert [re.match(r"`(\w+)`", row[0]).group(1) for row in grids] == list(SPACES)


def test_one_row_per_preset():
    presets = _table_after(README, "| preset |")
    named = {re.match(r"`(\w+)`", row[0]).group(1) for row in presets}
    assert named == set(PRESETS)


def test_every_file_the_readme_points_to_exists():
    paths = set(re.findall(r"(docs/[\w./-]+\.(?:md|png))", README))
    paths |= set(re.findall(r"\]\(([\w./-]+\.(?:md|png))(?:#[\w-]*)?\)", README))
    assert "docs/results.md" in paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"the README points to files that do not exist: {missing}"


def test_every_make_target_the_readme_names_exists():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    named = set(re.findall(r"(?:`|^)make ([\w-]+)", README, flags=re.M))
    assert {"pipeline", "test", "ui"} <= named
    assert named <= targets, f"not in the Makefile: {sorted(named - targets)}"


def test_trial_counts_are_what_each_grid_runs_at_the_cpu_preset():
    """The grids table's trials: `n_trials` of the grid's Space at the `cpu` preset (issue 47:
    a count copied from a run of an older grid, or of a narrowed one, is not the grid's)."""
    from pmnet.train import TrainConfig
    from tune_spaces import get_space

    cfg = TrainConfig.from_name("cpu")
    listed = {re.match(r"`(\w+)`", row[0]).group(1): int(row[2])
              for row in _table_after(README, "| grid |")}
    runs = {name: get_space(name)(cfg, gpu=False).n_trials for name in SPACES}
    assert listed == runs


#: the machines the tables' measured figures ran on (the VMs differ between sessions)
WHERE = ("2-core AMD EPYC VM", "2-core Intel Xeon VM")


def _wall_cells() -> list[str]:
    machines = [row[2] for row in _table_after(README, "| your machine |")]
    presets = [row[2] for row in _table_after(README, "| preset |")]
    grids = [row[3] for row in _table_after(README, "| grid |")]
    return machines + presets + grids


def test_every_wall_time_says_measured_where_or_estimated_from_what():
    """Issue 47: each wall-time cell says whether it was measured (and where, on what) or
    estimated (and under which assumption), never a bare figure."""
    cells = _wall_cells()
    machines = len(_table_after(README, "| your machine |"))
    assert len(cells) == machines + len(PRESETS) + len(SPACES)
    for cell in cells:
        assert re.match(r"(measured|estimated)\b", cell), f"neither measured nor estimated: {cell}"
        for part in re.split(r"; (?=estimated)", cell):
            if part.startswith("measured"):
                assert any(w in part for w in WHERE), f"measured where? {part}"
            if part.startswith("estimated"):
                assert "(" in part, f"estimated under which assumption? {part}"


def test_the_gpu_estimate_is_the_range_docs_results_gives():
    """The `paper` preset's time on one RTX 4090: 18.9 h at the assumed 40% of the card's bf16
    peak, about 50 h at 15% (the log's speed record; docs/results.md states the same): a
    range, not "at most" one end, in the presets table and on the first screen."""
    paper = next(row[2] for row in _table_after(README, "| preset |") if "`paper`" in row[0])
    machine = next(row[2] for row in _table_after(FIRST_SCREEN, "| your machine |")
                   if "`paper`" in row[1])
    record = (ROOT / "docs" / "log" / "speed.md").read_text(encoding="utf-8")
    assert "**18.9 h**" in record and "about 50 h instead of" in record
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert "18.9 h on one RTX 4090" in results and "about 50 h at 15%" in results
    for cell in (paper, machine):
        assert "19-50 h on one RTX 4090" in cell and "at most" not in cell


def test_no_line_over_400_characters_outside_code_blocks():
    fence, long = False, []
    for line in README.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and len(line) > 400:
            long.append(line[:80])
    assert not long, f"lines over 400 characters: {long}"


def test_studies_are_named_not_numbered():
    """Issue 64: an issue number is not the index a reader needs: it may stay in the
    footnote at the end, not in the text above it or the tables' cells."""
    body = README.split("*Issue numbers, for this repository's tracker only:*")[0]
    prose = re.sub(r"`[^`]*`|\]\([^)]*\)", "", body)  # paths and link targets may name one
    assert not re.search(r"\bissues? \d+", prose, flags=re.I), \
        re.findall(r".{40}\bissues? \d+.{20}", prose, flags=re.I)
