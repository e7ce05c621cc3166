"""Rebuild every committed report page from its run's records (issue 35).

Each committed run under ``experiments/results`` keeps its results and pipeline records; this
script copies them to a temporary run directory, runs :func:`pmnet.report.main_report` there,
and writes the page files back where the run keeps them: ``report.md``, ``report.html``
(where committed) and ``tables/*.md|.tex`` (where committed; a table the report no longer
prints is removed). Data files (``data/``) and figures are never rewritten: the data are
whole, only the page changes with the report's layout; the tests compare the data.

    .venv/bin/python -m pmnet.report.rebuild           # rewrite the pages
    .venv/bin/python -m pmnet.report.rebuild --check   # list what would change

The runs and the records each needs are the ones the tests rebuild (tests/test_report.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


@dataclass(frozen=True)
class Run:
    """A committed run: its directory, where its report lives (``""``: the run directory
    itself), and the records beside ``results/`` its report reads."""

    path: str
    report: str = ""
    records: tuple[str, ...] = ("pipeline.json", "timing.json")
    #: its Stage-1 record and Phase-1 curves, rebuilt from the committed
    #: ``phase1_metrics.json`` (the runs of issues 11 and 20 kept that, not ``phase1/``)
    phase1_metrics: bool = False
    #: the record whose ``checkpoint`` the run imported with ``--phase1-from``
    imported_from: str = ""


RUNS: tuple[Run, ...] = (
    Run("issue9/pipeline-cpu-20261122"),
    Run("issue20/pipeline-cpu-20261123", phase1_metrics=True),
    Run("issue11/operators-grid-cpu", phase1_metrics=True),
    Run("issue11/phase1-variance-cpu"),
    Run("issue11/segments-cpu", phase1_metrics=True,
        imported_from="issue11/operators-grid-cpu/stage1.json"),
    *(Run(f"issue21/{name}", "report", ("pipeline.json", "timing.json", "phase1-p1s0",
                                         "phase1-p1s1", "phase1-p1s2"))
      for name in ("pipeline-cpu-20261123", "pipeline-cpu-20261124",
                   "pipeline-cpu-20261124-writedims")),
    Run("issue23/pipeline-cpu-20261124", "report", ("pipeline.json", "timing.json", "phase1")),
    # the README's source run: `make pipeline` at today's default on a fresh clone (issue 64)
    Run("default-run/cpu-20261128-amd", "report", ("pipeline.json", "timing.json", "provenance",
                                                   *(f"phase1-p1s{k}" for k in range(3)))),
    # a durable store (issue 45): its record, each Phase-1 unit, the trials' diagnostics
    Run("issue39/store", "report", ("store.json", "diagnostics",
                                    *(f"phase1-p1s{k}" for k in range(10)))),
)


def stage(run: Run, into: Path) -> Path:
    """A run directory under ``into`` with the committed run's results and records."""
    src = RESULTS / run.path
    dst = into / "run"
    shutil.copytree(src / "results", dst / "results")
    for name in run.records:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
        else:
            shutil.copy(src / name, dst / name)
    if run.phase1_metrics:
        _stage_phase1(run, src, dst / "phase1")
    return dst


def _stage_phase1(run: Run, src: Path, phase1: Path) -> None:
    """``phase1/stage1.json`` (checkpoint hash, test metrics, training time) and
    ``phase1/metrics.csv`` (the training history; none when the run imported its
    checkpoint) from the committed phase1_metrics.json."""
    import pandas as pd

    metrics = json.loads((src / "phase1_metrics.json").read_text())
    sha = json.loads((src / "pipeline.json").read_text())["phase1_sha256"]
    record = {"sha256": sha, "metrics": metrics["test"], "train_time_s": metrics["train_time_s"]}
    if run.imported_from:
        record["imported_from"] = json.loads(
            (RESULTS / run.imported_from).read_text())["checkpoint"]
    phase1.mkdir(parents=True)
    (phase1 / "stage1.json").write_text(json.dumps(record))
    if not run.imported_from:
        history = pd.DataFrame(metrics["history"])
        history.insert(1, "step", history["epoch"])
        history.to_csv(phase1 / "metrics.csv", index=False)


def rebuild(run: Run, check: bool) -> list[str]:
    """Rebuild one run's report; the page files that differ (written unless ``check``)."""
    from pmnet import report

    committed = RESULTS / run.path / run.report if run.report else RESULTS / run.path
    changed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage(run, Path(tmp))
        report.main_report(staged, meta={"run_dir": str(RESULTS / run.path)})
        built = staged / "report"
        pages = [Path("report.md")]
        if (committed / "report.html").exists():
            pages.append(Path("report.html"))
        if (committed / "tables").is_dir():  # the kinds of table file the run keeps
            kinds = {p.suffix for p in (committed / "tables").iterdir()}
            old = {p.relative_to(committed) for p in (committed / "tables").iterdir()}
            new = {p.relative_to(built) for p in (built / "tables").iterdir()
                   if p.suffix in kinds}
            for gone in sorted(old - new):
                changed.append(f"{gone} (removed)")
                if not check:
                    (committed / gone).unlink()
            pages += sorted(new)
        for page in pages:
            text = (built / page).read_text(encoding="utf-8")
            target = committed / page
            before = target.read_text(encoding="utf-8") if target.exists() else None
            if page.name == "report.html" and before is not None:
                same = _without_date(before) == _without_date(text)
            else:
                same = before == text
            if not same:
                changed.append(str(page))
                if not check:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text, encoding="utf-8")
    return changed


def _without_date(html: str) -> str:
    return "\n".join(line for line in html.splitlines() if not line.startswith(
        '<p class="note">Generated '))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only list what would change")
    parser.add_argument("runs", nargs="*", help="run paths under experiments/results "
                        "(default: every committed run)")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.runs or r.path in args.runs]
    for run in runs:
        changed = rebuild(run, args.check)
        print(f"{run.path}: {', '.join(changed) if changed else 'unchanged'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
