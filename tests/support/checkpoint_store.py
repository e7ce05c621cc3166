"""A synthetic durable store of the checkpoint study (issue 45), written without training:
every channel and strict arm on five Phase-1 checkpoints, each unit's diagnostics, the
store's named subsets (tests/test_report_checkpoint_study.py; issue 64's browser check of the
report with the most columns, tests/test_report_browser.py)."""

from __future__ import annotations

import json
from pathlib import Path

from pmnet.store_layout import StoreLayout, StoreRecord
from pmnet.trial_id import TrialId

REPO = Path(__file__).resolve().parents[2]
ISSUE39_STORE = REPO / "experiments" / "results" / "issue39" / "store"

ON, OFF = "consolidator_only", "consolidator_only_routing_off"
#: each arm's updated-LTM level (%); the output-set baseline is 42 for every trial
LEVEL = {ON: 20.0, OFF: 22.0, "consolidator_only_strict_off": 22.5, "operator_gru": 45.0,
         "operator_gru_routing_off": 56.0, "memory_consolidator": 57.0,
         "memory_consolidator_routing_off": 58.0, "memory_consolidator_strict_off": 59.0}


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def synthetic_store(root: Path, ks=range(5), seeds=(42, 43)) -> StoreLayout:
    """Every channel and strict arm on checkpoints `ks`; the Consolidator's routing on - off
    on checkpoint k is 1 - 2k pp on seed 42 and 1.2 - 2k on seed 43, the GRU operator's
    -11 - k / 2; the seed-42 models
    diagnosed; each Phase-1 unit's diagnostics a real one's with its root L route change
    10 + 20k; the store names the confirmatory subset 2..4."""
    lay = StoreLayout(root)
    write_json(lay.record, StoreRecord(subsets={"confirmatory": [2, 3, 4]}).to_dict())
    template = json.loads((ISSUE39_STORE / "phase1-p1s3" / "diagnose.json").read_text())
    for k in ks:
        write_json(lay.stage1_json(k), {"sha256": f"{k:02d}" * 32, "phase1_seed": k,
                                        "metrics": {"mean_stm": 60.0}})
        write_json(lay.phase1_diagnose(k), {
            **template, "ltm_route_change": [10.0 + 20 * k, 5.0, 6.0, 7.0],
            "stm_random_routes": {"drop": 9.0 + k, "recall": 50.0, "agreement": 50.0},
            "margin_median": [0.1 * (k % 3), 0.2, 0.2, 0.2], "stm": {"recall": 60.0 + k % 2}})
        for i, seed in enumerate(seeds):
            for cond, level in LEVEL.items():
                value = (level + (3.0 - 2.0 * k + 0.2 * i if cond == ON else 0.0)
                         - (0.5 * k if cond == "operator_gru" else 0.0) + 0.3 * i + 0.1 * k)
                test = {"updated_ltm": value, "updated_ltm_baseline": 42.0,
                        "forced_identity": value - 1.0, "seg2_stm": 68.0}
                trial = TrialId(cond, seed, phase1_seed=k)
                write_json(lay.result(trial), {"condition": cond, "seed": seed,
                                               "phase1_seed": k, "preset": "debug",
                                               "test": test, "val": test})
                if seed == 42:
                    write_json(lay.diagnostics(trial), {
                        "updated_ltm": {"recall": value},
                        "updated_strict_off": {"recall": value - 1.0, "drop": 1.0},
                        "ltm_route_change": [12.5, 30.0]})
    return lay
