"""The README a newcomer reads in two minutes (issue 35): its first screen holds the two
commands, the results at a glance and the presets; one row per grid and per preset; every
file it points to exists and every `make` target it names is in the Makefile."""

from __future__ import annotations

import re
from pathlib import Path

from pmnet.train.config import TRAIN_PRESETS
from tune_spaces import SPACES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIRST_SCREEN = "\n".join(README.splitlines()[:60])


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


def test_the_first_screen_holds_the_commands_the_results_and_the_presets():
    assert "make pipeline" in FIRST_SCREEN and "make test" in FIRST_SCREEN
    results = _table_after(FIRST_SCREEN, "| paper claim |")
    assert len(results) >= 4
    assert all(len(row) == 5 and all(row[1:]) for row in results), results
    # issue 44: a comparison whose arms are both below the output-set baseline is not judged
    for row in results:
        if re.fullmatch(r"[\d.]+ / [\d.]+ vs [\d.]+%", row[3]):
            a, b, base = map(float, re.findall(r"[\d.]+", row[3]))
            if a <= base and b <= base:
                assert row[4].startswith("no verdict"), row
    presets = _table_after(FIRST_SCREEN, "| preset |")
    named = {re.match(r"`(\w+)`", row[0]).group(1) for row in presets}
    assert named == set(TRAIN_PRESETS)


def test_one_row_per_grid():
    grids = _table_after(README, "| grid |")
    assert [re.match(r"`(\w+)`", row[0]).group(1) for row in grids] == list(SPACES)


def test_every_file_the_readme_points_to_exists():
    paths = set(re.findall(r"(docs/[\w./-]+\.(?:md|png))", README))
    paths |= set(re.findall(r"\]\(([\w./-]+\.(?:md|png))\)", README))
    assert "docs/results.md" in paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"the README points to files that do not exist: {missing}"


def test_every_make_target_the_readme_names_exists():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    named = set(re.findall(r"(?:`|^)make ([\w-]+)", README, flags=re.M))
    assert {"pipeline", "test"} <= named
    assert named <= targets, f"not in the Makefile: {sorted(named - targets)}"
