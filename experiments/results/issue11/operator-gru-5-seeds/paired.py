"""Paired operator_gru - consolidator_only over seeds 42..46 (same Phase-1 checkpoint, cpu recipe)."""
import json, shutil, sys
from pathlib import Path
import pandas as pd
from pmnet import stats
out = Path(sys.argv[1]); res = out / "results"
shutil.rmtree(out, ignore_errors=True); res.mkdir(parents=True)
issue9 = Path(__file__).resolve().parents[2] / "issue9/pipeline-cpu-20261122/results"
for s in (42, 43, 44, 45, 46):
    shutil.copy(issue9 / f"consolidator_only-s{s}.json", res)
    src = Path(__file__).resolve().parent / f"operator_gru-s{s}.json"
    if src.is_file():
        shutil.copy(src, res / f"operator_gru-s{s}.json")
df = stats.load_results(res)
cmp = stats.compare_operators(df) if hasattr(stats, "compare_operators") else None
print(df[["condition", "seed", "updated_ltm", "updated_ltm_add10", "updated_ltm_affine10", "initial_ltm", "forced_identity", "fresh_ltm", "mismatched_ltm"]].to_string())
if cmp is not None:
    print(cmp.to_string())
