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
    assert "no checkpoint has all six arms yet" in (root / "analysis" / "summary.md").read_text()

    # the channel arms on checkpoint 1, one Phase-2 seed on it before the other
    out = study("run", "--seeds", "1,2", "--arms", "core,channel", "--channel-seeds", "1",
                "--order", "seed", "--jobs", "2", tmp=tmp_path)
    assert "8 jobs to run" in out  # 4 channel arms x 2 seeds; the core arms are done
    started = [line.split()[-1] for line in out.splitlines() if " start " in line]
    assert len(started) == 8 and all(s.endswith("-s42") for s in started[:4]), started
    done = subprocess.run([sys.executable, str(ANALYZE_PY), "--study", str(root)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    channel = json.loads((root / "analysis" / "channel.json").read_text())
    assert channel["checkpoints"] == [1] and channel["phase2_seeds"] == [42, 43]
    for x in channel["interaction_vs_consolidator"]:
        assert x["k"] == 1 and x["n_pairs"] == 2 and set(x["per_checkpoint"]) == {"1"}
    labels = {d["label"] for d in channel["distribution"]}
    assert "routing on - off: updated_ltm (operator_gru)" in labels
    assert "memory_consolidator - consolidator_only, routing on: updated_ltm" in labels
    mech = {m["condition"] for m in channel["mechanism_seed42"]}
    assert mech == {"consolidator_only", "consolidator_only_routing_off", "operator_gru",
                    "operator_gru_routing_off", "memory_consolidator",
                    "memory_consolidator_routing_off"}
    assert "## Channel arms (checkpoints [1])" in (root / "analysis" / "summary.md").read_text()

    # the strict-off arms on checkpoint 1: their models' routers ignore L (strict off at
    # inference costs them exactly nothing), and the analysis reads off - strict off
    out = study("run", "--seeds", "1", "--arms", "strict", "--jobs", "2", tmp=tmp_path)
    assert "4 jobs to run" in out  # 2 strict arms x 2 seeds
    result = json.loads((root / "trials" / "memory_consolidator_strict_off-p1-s43.json")
                        .read_text())
    assert result["routing_u_ltm"] is False and result["ltm_routing"] is False
    done = subprocess.run([sys.executable, str(ANALYZE_PY), "--study", str(root)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    strict = json.loads((root / "analysis" / "strict.json").read_text())
    assert strict["checkpoints"] == {"consolidator_only": [1], "memory_consolidator": [1]}
    labels = {d["label"] for d in strict["distribution"]}
    assert labels == {
        "routing off - strict off: updated_ltm (consolidator_only_routing_off)",
        "routing off - strict off: updated_ltm (memory_consolidator_routing_off)",
        "routing on - strict off: updated_ltm (consolidator_only)",
        "routing on - strict off: updated_ltm (memory_consolidator)"}
    sanity = strict["strict_models_seed42"]
    assert {m["condition"] for m in sanity} == {"consolidator_only_strict_off",
                                               "memory_consolidator_strict_off"}
    assert all(m["strict_off_cost"] == 0 for m in sanity)
    assert "## Strict-off arms" in (root / "analysis" / "summary.md").read_text()


def _study_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("checkpoint_study_study", STUDY_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_jobs_come_whole_checkpoints_first_or_one_seed_everywhere_first():
    m = _study_module()
    by_ckpt = [j.name for j in m.jobs_for([0, 1], ["core"], {"core": [0, 1]})]
    assert by_ckpt[:6] == ["phase1 p1s0", "diagnose p1s0", "consolidator_only-p0-s42",
                           "consolidator_only_routing_off-p0-s42", "consolidator_only-p0-s43",
                           "consolidator_only_routing_off-p0-s43"]
    by_seed = [j.name for j in m.jobs_for([0, 1], ["core", "channel"],
                                          {"core": [0, 1], "channel": [0]}, "seed")]
    assert by_seed[:4] == ["phase1 p1s0", "diagnose p1s0", "phase1 p1s1", "diagnose p1s1"]
    trials = by_seed[4:]
    assert len(trials) == len(set(trials)) == 2 * (2 * 2 + 4)  # seeds x (core x 2 + channel)
    assert all(t.endswith("-s42") for t in trials[:8]) and all(t.endswith("-s43")
                                                                for t in trials[8:])
    same = [j.name for j in m.jobs_for([0, 1], ["core", "channel"],
                                       {"core": [0, 1], "channel": [0]}) if j.kind == "trial"]
    assert sorted(trials) == sorted(same)  # the same jobs, another order
    strict = [j.name for j in m.jobs_for([0], ["strict"], {"strict": [0]}) if j.kind == "trial"]
    assert strict == [f"{c}_strict_off-p0-s{s}" for s in (42, 43)
                      for c in ("consolidator_only", "memory_consolidator")]
    with pytest.raises(SystemExit, match="--order"):
        m.jobs_for([0], ["core"], {"core": [0]}, "arm")
