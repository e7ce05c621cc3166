"""Migrate issue 39's checkpoint study into the durable store format, once (issue 45).

    python experiments/migrate_issue39_store.py

`experiments/results/issue39/study/` (written by the retired `checkpoint_study/study.py`)
becomes `experiments/results/issue39/store/` (`pmnet.store_layout`):

    checkpoints/p1s<k>/phase1.pt, .sha256, diagnose.json,
                       phase1_metrics.json                -> phase1-p1s<k>/ (git mv)
    checkpoints/p1s<k>/origin.json + phase1_metrics.json  -> phase1-p1s<k>/stage1.json and
                                                             provenance.json (migrated)
    trials/<trial>.json                                   -> results/<trial>.json (git mv)
    trials/<trial>-diagnose.json                          -> diagnostics/<trial>.json (git mv)
    the result's own `study` block                        -> provenance/<trial>.json (migrated)
    the pre-registered confirmatory Phase-1 seeds 3..9    -> store.json subsets["confirmatory"]

Files are moved with `git mv` so their history follows them. This script lives in the
history, not in the tree: it is committed, run once, and deleted in the next commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pmnet.store_layout import StoreLayout, StoreRecord  # noqa: E402
from pmnet.trial_id import TrialId  # noqa: E402

STUDY = ROOT / "experiments" / "results" / "issue39" / "study"
STORE = ROOT / "experiments" / "results" / "issue39" / "store"
#: docs/results.md, "Pre-registration", second amendment: Phase-1 seeds 0..2 were trained
#: (and looked at) before the pre-registration, so the confirmatory checkpoints are 3..9
CONFIRMATORY = list(range(3, 10))
MIGRATED = "issue39 study (experiments/checkpoint_study/study.py), migrated (issue 45)"


def git_mv(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT))],
                   cwd=ROOT, check=True)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def migrate_checkpoint(store: StoreLayout, src: Path) -> None:
    k = int(src.name.removeprefix("p1s"))
    origin = json.loads((src / "origin.json").read_text())
    metrics = json.loads((src / "phase1_metrics.json").read_text())
    git_mv(src / "phase1.pt", store.phase1_ckpt(k))
    git_mv(src / "phase1.pt.sha256", store.phase1_ckpt(k).with_name("phase1.pt.sha256"))
    if (src / "diagnose.json").is_file():
        git_mv(src / "diagnose.json", store.phase1_diagnose(k))
    write_json(store.phase1_provenance(k), {
        "unit": f"phase1-p1s{k}", "migrated": MIGRATED, "command": origin["command"],
        "commit": origin["commit"], "cpu": origin["cpu"], "threads": origin["threads"],
        "finished": origin["finished"], "wall_s": origin["wall_s"],
        "device": metrics.get("device"), "precision": metrics.get("precision"),
        "train_config": metrics.get("train_config")})
    git_mv(src / "phase1_metrics.json", store.phase1_dir(k) / "phase1_metrics.json")
    # the Stage-1 record (`pipelines.records.Stage1Record`), last: the unit's commit record
    write_json(store.stage1_json(k), {
        "config_hash": None, "sha256": origin["sha256"], "checkpoint": "phase1.pt",
        "phase1_seed": k, "train_time_s": metrics.get("train_time_s"),
        "wall_s": origin["wall_s"], "metrics": metrics.get("test", {}),
        "best_epoch": metrics.get("best_epoch"), "migrated": MIGRATED})
    git_rm(src / "origin.json")


def git_rm(*paths: Path) -> None:
    subprocess.run(["git", "rm", "-q", *(str(p.relative_to(ROOT)) for p in paths)],
                   cwd=ROOT, check=True)


def migrate_trial(store: StoreLayout, src: Path) -> None:
    result = json.loads(src.read_text())
    trial = TrialId.from_result(result)
    if trial.name != src.stem:
        raise SystemExit(f"{src}: names trial {trial.name}, not {src.stem}")
    diag = src.with_name(f"{src.stem}-diagnose.json")
    if diag.is_file():
        git_mv(diag, store.diagnostics(trial))
    own = result.get("study") or {}
    write_json(store.provenance(trial), {
        "unit": trial.name, "migrated": MIGRATED, "commit": own.get("commit"),
        "cpu": own.get("cpu"), "threads": 1, "wall_s": own.get("wall_s"),
        "device": result.get("device"), "preset": result.get("preset"),
        "phase1_sha256": result.get("phase1_sha256"),
        "test_stream_hash": result.get("test_stream_hash")})
    git_mv(src, store.result(trial))  # the commit record, last


def main() -> int:
    store = StoreLayout(STORE)
    if store.record.exists():
        raise SystemExit(f"{store.record} exists: the store was migrated already")
    write_json(store.record, StoreRecord(
        subsets={"confirmatory": CONFIRMATORY},
        notes="issue 39's checkpoint study, migrated from experiments/results/issue39/study/ "
              "(issue 45). confirmatory: the Phase-1 seeds of the pre-registered predictor "
              "test and the confirmatory routing effect (docs/results.md, Pre-registration, "
              "second amendment: seeds 0..2 ran before it).").to_dict())
    for src in sorted((STUDY / "checkpoints").glob("p1s*"), key=lambda p: int(p.name[3:])):
        migrate_checkpoint(store, src)
    for src in sorted((STUDY / "trials").glob("*.json")):
        if not src.stem.endswith("-diagnose"):
            migrate_trial(store, src)
    left = sorted(p for p in (STUDY / "trials").glob("*") if p.is_file())
    if left:
        raise SystemExit(f"not migrated: {[p.name for p in left]}")
    subprocess.run(["git", "add", str(STORE.relative_to(ROOT))], cwd=ROOT, check=True)
    print(f"migrated to {STORE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
