"""The documents a person reads first (issue 64): docs/results.md is a reader's page of at most
600 lines whose every question links its figures to a record that exists; every relative link
of the README, the reader's pages and the measurement log resolves, `#anchor` links to a
heading of the target (GitHub's anchor rules); the log keeps every study's record."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results.md"
LOG = DOCS / "log"
#: the files whose relative links must resolve
LINKED = [ROOT / "README.md", RESULTS, DOCS / "choices.md", DOCS / "guide.md",
          *sorted(LOG.glob("*.md"))]
#: where a figure's record may live: the log, or a committed result or benchmark file
RECORDS = ("docs/log/", "experiments/results/", "benchmarks/results/")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped (letters,
    digits, '_' and '-' kept), each space a '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out, fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = re.match(r"#{1,6} (.+)", line)
        if m and not fence:
            a = github_anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The targets of the Markdown links and images of a file, outside code."""
    return re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text(encoding="utf-8")))


def _resolve(source: Path, target: str) -> tuple[Path, str]:
    file, _, anchor = target.partition("#")
    return (source.resolve() if not file else (source.parent / file).resolve()), anchor


def _tracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "ls-files", "experiments/results", "benchmarks/results"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.splitlines())


def test_github_anchor_follows_githubs_rules():
    assert github_anchor("Model (`pmnet/model.py`, `pmnet/config.py`)") == \
        "model-pmnetmodelpy-pmnetconfigpy"
    assert github_anchor("Phase 1 on the `cpu` preset (`pmnet train phase1 --preset cpu`)") == \
        "phase-1-on-the-cpu-preset-pmnet-train-phase1---preset-cpu"
    assert github_anchor("What a unit's config hash covers") == "what-a-units-config-hash-covers"
    assert github_anchor("Routing on - off") == "routing-on---off"


def test_results_is_a_readers_page_of_at_most_600_lines():
    lines = RESULTS.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 600, f"docs/results.md has {len(lines)} lines (at most 600)"


def test_every_relative_link_resolves_to_a_file_and_its_anchor_to_a_heading():
    tracked = _tracked()
    bad = []
    for source in LINKED:
        for target in links(source):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, anchor = _resolve(source, target)
            where = f"{source.relative_to(ROOT)} -> {target}"
            if not path.is_file():
                bad.append(f"{where}: no such file")
                continue
            rel = path.relative_to(ROOT).as_posix()
            if tracked is not None and rel.startswith(RECORDS[1:]) and rel not in tracked:
                bad.append(f"{where}: not a committed file")
            if anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{where}: no heading with that anchor")
    assert not bad, "\n".join(bad)


def test_every_question_of_the_results_page_links_its_figures_to_a_record():
    """Each section of docs/results.md that states a figure links to a record that exists: a
    section of the log, or a committed result or benchmark file (resolution: the test
    above)."""
    text = RESULTS.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 6
    for section in sections:
        title = section.splitlines()[0]
        if not re.search(r"\d", _prose(section.split("\n", 1)[1])):
            continue
        targets = [(RESULTS.parent / t.partition("#")[0]).resolve() for t in
                   re.findall(r"\]\(([^)\s#]+)[^)]*\)", section)]
        records = [t for t in targets
                   if t.relative_to(ROOT).as_posix().startswith(RECORDS)]
        assert records, f"docs/results.md, {title!r}: figures without a link to their record"


def test_the_results_page_answers_the_readers_questions():
    titles = [t.lower() for t in re.findall(r"^## (.+)", RESULTS.read_text(encoding="utf-8"),
                                            flags=re.M)]
    for question in ("does the paper reproduce", "does the backbone learn", "what does scale do",
                     "operators", "what does the gpu path cost", "what failed"):
        assert any(question in t for t in titles), f"no section on {question!r}: {titles}"


def test_the_log_keeps_every_study_and_the_index_names_every_section():
    """The chronological log moved to docs/log/, one file per study: the index links every
    file and every section heading of it, so a reference to an old section title finds it."""
    index = (LOG / "README.md").read_text(encoding="utf-8")
    studies = sorted(p for p in LOG.glob("*.md") if p.name != "README.md")
    assert len(studies) >= 10
    for study in studies:
        assert f"]({study.name})" in index, f"the log's index does not link {study.name}"
        for anchor in anchors(study):
            if anchor != github_anchor(study.read_text(encoding="utf-8").splitlines()[0][2:]):
                assert f"]({study.name}#{anchor})" in index, (study.name, anchor)
    # the studies the reader's page answers from, and the failed runs
    names = {p.stem for p in studies}
    assert {"checkpoint-study", "capability-frontier", "scale-ladder", "lent-gpu",
            "first-cpu-recipes"} <= names


def test_the_l120_correction_is_the_files_own_ratio():
    """The log's L120 correction (issue 61, item 5): forced identity's initial-mapping recall
    over segment-1 STM, computed from the committed trial as the log computes the other
    checkpoints', is 0.94; the learned Consolidator's, the struck comparison's, 0.27."""
    run = ROOT / "experiments/results/issue52/phase2/L120-consolidator_only-s42.json"
    test = json.loads(run.read_text(encoding="utf-8"))["test"]
    identity = round(test["forced_identity_initial"] / test["seg1_stm"], 2)
    learned = round(test["initial_ltm"] / test["seg1_stm"], 2)
    assert (identity, learned) == (0.94, 0.27)
    ladder = (LOG / "scale-ladder.md").read_text(encoding="utf-8")
    assert "a ratio of 0.94" in ladder and "~~where the 40-epoch checkpoints" in ladder


@pytest.mark.parametrize("name", ["docs/results.md"])
def test_no_line_over_400_characters_outside_code(name):
    long = [line[:80] for line in _prose_lines(ROOT / name) if len(line) > 400]
    assert not long, f"{name}: lines over 400 characters: {long}"


def _prose_lines(path: Path) -> list[str]:
    out, fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(line)
    return out


def test_choices_opens_with_its_table():
    """docs/choices.md's first screen is the table of choices, one line and one link each."""
    lines = (DOCS / "choices.md").read_text(encoding="utf-8").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| choice"))
    assert first < 10
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) >= 20
    for row in rows:
        assert re.search(r"\]\([^)]*#[^)]+\)", row), f"a choice without a link: {row[:80]}"
