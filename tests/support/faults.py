"""The fault tests' reference run and checks (tests/test_faults.py, the clusters' faults in
tests/test_cluster_faults.py): the final tables of one uninterrupted debug pipeline, and
the check that a pipeline hit by a fault lost nothing against it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipelines.layout import Layout, read_json
from pmnet.trial_id import TrialId
from tests.support.pipeline import BASE, GRID, REPO, check_trial_runs, cli, mlflow_runs, wait_gone

DOCS = REPO / "docs" / "pipeline.md"


def final_tables(run_dir: Path) -> dict[str, str]:
    """What a researcher reads: the report's tables, its comparisons and the test metrics."""
    rep = run_dir / "report"
    out = {p.name: p.read_text() for p in sorted((rep / "tables").glob("*.md"))}
    out["comparisons.csv"] = (rep / "data" / "comparisons.csv").read_text()
    for c, s in GRID:
        res = read_json(Layout(run_dir.parent, run_dir.name).result_path(TrialId(c, s)))
        out[f"test {c}-s{s}"] = json.dumps(res["test"], sort_keys=True)
    assert len(out) > 2 + len(GRID), "the report wrote no tables"
    return out


def reference_run(root: Path) -> Reference:
    """One uninterrupted debug pipeline under `root` (the `reference` fixture of
    tests/conftest.py): its final tables, and where it is."""
    rc, out = cli("start", *BASE, "--root", str(root), "--name", "ref")
    assert rc == 0, out[-3000:]
    ref = Reference(final_tables(root / "ref"))
    ref.run_dir = root / "ref"
    return ref


class Reference(dict):
    """The final tables of the uninterrupted run (`final_tables`), and where it is."""

    run_dir: Path


def assert_nothing_lost(run_dir: Path, reference: dict[str, str]) -> None:
    tables = final_tables(run_dir)
    if tables != reference and isinstance(reference, Reference):
        # the report's code may have changed since the reference was made (another session
        # edits pmnet/report while a long slow suite runs): its report is made again from its
        # results by the code of now, and the trials' test metrics compare as they were
        rc, out = cli("report", "--root", str(reference.run_dir.parent), "--name",
                      reference.run_dir.name, "--no-mlflow")
        assert rc == 0, out[-3000:]
        reference.update(final_tables(reference.run_dir))
    assert tables == reference
    lay = Layout(run_dir.parent, run_dir.name)
    assert wait_gone(str(lay.root)) == []  # no MLflow server left behind
    client, _, runs = mlflow_runs(f"sqlite:///{lay.mlflow_db}", lay.name)
    check_trial_runs(client, runs, lay.name, lay)


def write_doc_rows(begin: str, end: str, header: list[str], columns: tuple[str, ...],
                   scenarios: dict[str, tuple[str, str]], observed: dict[str, dict]) -> None:
    """With PMNET_WRITE_FAULT_TABLE=1: the rows observed (`columns` of each) replace their
    rows in docs/pipeline.md between the `begin` and `end` markers; rows of scenarios not run
    this time are kept. Shared by the fault table and the clusters' fault table."""
    if not (os.environ.get("PMNET_WRITE_FAULT_TABLE") and observed):
        return
    text = DOCS.read_text()
    head, rest = text.split(begin, 1)
    block, tail = rest.split(end, 1)
    old = {ln.split(" | ", 1)[0][2:]: ln for ln in block.strip().splitlines()[2:]}
    rows = list(header)
    for sid, (fault, _) in scenarios.items():
        if sid in observed:
            r = {k: v.replace("|", "\\|") for k, v in observed[sid].items()}
            rows.append("| " + " | ".join(r[c] for c in columns) + " |")
        elif fault in old:
            rows.append(old[fault])
    DOCS.write_text(f"{head}{begin}\n" + "\n".join(rows) + f"\n{end}{tail}")
