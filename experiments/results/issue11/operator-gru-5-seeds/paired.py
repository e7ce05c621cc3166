"""operator_gru - consolidator_only, paired by seed over 42..46 (one Phase-1 checkpoint).

    .venv/bin/python experiments/results/issue11/operator-gru-5-seeds/paired.py OUT_DIR

Copies the issue-9 pipeline's consolidator_only results and this directory's operator_gru
results into OUT_DIR/results, then prints the per-trial metrics and
`pmnet.stats.compare_operators` (mean diff, SD, 95% CI, t, p, d_z).
"""

import shutil
import sys
from pathlib import Path

from pmnet import stats

HERE = Path(__file__).resolve().parent
ISSUE9 = HERE.parents[1] / "issue9" / "pipeline-cpu-20261122" / "results"
COLUMNS = ["condition", "seed", "updated_ltm", "updated_ltm_add10", "updated_ltm_affine10",
           "initial_ltm", "forced_identity", "fresh_ltm", "mismatched_ltm"]


def main(out: Path) -> None:
    res = out / "results"
    shutil.rmtree(out, ignore_errors=True)
    res.mkdir(parents=True)
    for s in (42, 43, 44, 45, 46):
        shutil.copy(ISSUE9 / f"consolidator_only-s{s}.json", res)
        shutil.copy(HERE / f"operator_gru-s{s}.json", res)
    df = stats.load_results(res)
    print(df[COLUMNS].round(2).to_string())
    cmp = stats.compare_operators(df)
    print(cmp[cmp.cond_a == "operator_gru"].T.to_string())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
