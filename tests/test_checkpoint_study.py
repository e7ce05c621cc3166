"""The checkpoint study's work queue and analysis (issue 39; `experiments/checkpoint_study/`)
at the debug preset: every unit lands as a file, a second run trains nothing, a lost
result is redone alone, and the analysis reads them with the library's statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STUDY_PY = REPO / "experiments" / "checkpoint_study" / "study.py"
ANALYZE_PY = REPO / "experiments" / "checkpoint_study" / "analyze.py"


def study(*args: str, tmp: Path) -> str:
    out = subprocess.run([sys.executable, str(STUDY_PY), *args, "--preset", "debug",
                          "--study", str(tmp / "study"), "--work", str(tmp / "work")],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_a_debug_study_grows_by_units_and_is_analysed(tmp_path):
    out = study("run", "--seeds", "1,2", "--arms", "core", "--jobs", "2", tmp=tmp_path)
    assert "12 jobs to run" in out  # 2 x (Phase 1, diagnose, 2 arms x 2 seeds)
    root = tmp_path / "study"
    for k in (1, 2):
        origin = json.loads((root / "checkpoints" / f"p1s{k}" / "origin.json").read_text())
        assert origin["phase1_seed"] == k and origin["threads"] == 1 and origin["cpu"]
        assert (root / "checkpoints" / f"p1s{k}" / "diagnose.json").is_file()
    trials = sorted(p.name for p in (root / "trials").glob("*.json"))
    assert len([t for t in trials if not t.endswith("-diagnose.json")]) == 8
    assert "consolidator_only-p1-s42-diagnose.json" in trials
    result = json.loads((root / "trials" / "consolidator_only_routing_off-p2-s43.json")
                        .read_text())
    assert result["phase1_seed"] == 2 and result["ltm_routing"] is False
    # a second run trains nothing; a lost trial result is redone, alone
    assert "0 jobs to run" in study("run", "--seeds", "1,2", tmp=tmp_path)
    (root / "trials" / "consolidator_only-p2-s43.json").unlink()
    again = study("run", "--seeds", "1,2", tmp=tmp_path)
    assert "1 jobs to run" in again and "done consolidator_only-p2-s43" in again
    # the analysis: the distribution over the two checkpoints, the predictor's file
    done = subprocess.run([sys.executable, str(ANALYZE_PY), "--study", str(root)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    dist = (root / "analysis" / "distribution.csv").read_text().splitlines()
    assert dist[0].startswith("label,k,n,") and len(dist) == 1 + 3
    assert all(",2,4," in row for row in dist[1:])  # K = 2 checkpoints, 4 pairs each
    predictor = json.loads((root / "analysis" / "predictor.json").read_text())
    assert predictor["checkpoints_with_both_arms"] == [1, 2]
    assert predictor["confirmatory"]["n"] == 0  # seeds 3..9 did not run
