"""Synthetic result files of the `segments` grid (T in 2, 4, 8; full and truncated LTM
graphs), as its trials write them, for the statistics and report tests."""

from __future__ import annotations

import json
from pathlib import Path

SEGMENT_TS = (2, 4, 8)
SEGMENT_SEEDS = (42, 43, 44, 45, 46)


def segment_value(t: int, graph: str, seed: int, metric: str) -> float:
    """A deterministic synthetic recall: falls with T, lower for truncated, seed-dependent."""
    base = {"updated_ltm": 60.0 - 5 * t - (8.0 if graph == "truncated" else 0.0),
            "forced_identity": 20.0, "fresh_ltm": 10.0}.get(metric, 15.0)
    return base + ((seed * (7 + len(graph)) + t * 3 + len(metric)) % 7) - 3.0


def write_segment_results(directory: Path, *, seeds=SEGMENT_SEEDS, ts=SEGMENT_TS,
                          graphs=("full", "truncated"), skip=()) -> Path:
    """Result files of the segments grid as trials write them (variant, variant_overrides,
    config), T > 2 with the per-position metrics; `skip`: (variant, seed) left out."""
    directory.mkdir(parents=True, exist_ok=True)
    for t in ts:
        for graph in graphs:
            variant = f"T{t}-{graph}"
            for seed in seeds:
                if (variant, seed) in skip:
                    continue
                test = {m: segment_value(t, graph, seed, m)
                        for m in ("updated_ltm", "forced_identity", "fresh_ltm", "seg2_stm",
                                  "mean_stm", "mismatched_ltm")}
                if t > 2:
                    test.update({f"final_ltm_seg{k}": segment_value(t, graph, seed,
                                                                    f"final_ltm_seg{k}")
                                 for k in range(1, t)})
                overrides = {"ltm_graph": graph, "segments": t}
                obj = {"condition": "consolidator_only", "seed": seed, "variant": variant,
                       "variant_overrides": overrides, "preset": "cpu",
                       "phase1_sha256": "a" * 64, "select": "updated_ltm", "test": test,
                       "val": {"updated_ltm": test["updated_ltm"]}, "best_epoch": 1,
                       "trainable_params": 3104, "total_params": 300_000,
                       "trainable_fraction": 0.01, "train_time_s": 5.0 * t,
                       "config": {"segments": 2, "ltm_graph": "full", "lr": 0.001,
                                  **overrides},
                       "history": [{"epoch": 0, "val/updated_ltm": test["updated_ltm"]}]}
                (directory / f"consolidator_only-{variant}-s{seed}.json").write_text(
                    json.dumps(obj))
    return directory
