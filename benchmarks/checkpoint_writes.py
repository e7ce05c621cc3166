"""Checkpoint bytes a Stage-2 trial writes per epoch (issue 12, item 6).

Runs one trial of the pipeline (`pipelines.trial.train_trial`, tracking off) in this process
on a fresh Phase-1 checkpoint, and counts every checkpoint write:

- each Lightning checkpoint save (`Strategy.save_checkpoint`: ModelCheckpoint's best.ckpt,
  last.ckpt, and any `trainer.save_checkpoint` of a callback), by the size of the file it
  wrote; a hard link writes nothing and is not counted;
- what Tune copies of each reported checkpoint into its storage: `tune.report` is replaced
  by a stand-in that copies the reported directory as Ray's
  `StorageContext.persist_current_checkpoint` does, and counts the bytes copied.

It then prints, per epoch, the files and bytes written, and the same arithmetic for the
paper preset from its parameter count: a checkpoint holds the fp32 weights plus AdamW's two
fp32 moments of the trainable parameters (the rest of it is a few kB).

Usage (from the repository root; PYTHONPATH picks the code to measure):

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_writes.py --epochs 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def measure(epochs: int, condition: str, seed: int) -> dict:
    """{"epochs": {epoch: [(what, bytes), ...]}, "checkpoint_bytes": size of last.ckpt}."""
    from lightning.pytorch.strategies import Strategy
    from ray import tune

    import pipelines.trial as trial_mod
    from pipelines.trial import TrialContext, quiet_training_logs
    from pmnet.train import TrainConfig, run_phase1

    quiet_training_logs()
    writes: dict[int, list[tuple[str, int]]] = defaultdict(list)
    epoch_of = {"now": -1}
    save = Strategy.save_checkpoint

    def counting_save(self, checkpoint, filepath, storage_options=None):
        save(self, checkpoint, filepath, storage_options)
        epoch_of["now"] = int(checkpoint["epoch"])
        writes[epoch_of["now"]].append((f"lightning {Path(filepath).name}",
                                        os.path.getsize(filepath)))

    with tempfile.TemporaryDirectory() as tmp:
        root, storage = Path(tmp) / "runs", Path(tmp) / "tune-storage"
        cfg = TrainConfig.from_name("debug", threads=1, max_epochs=epochs, patience=epochs)
        ctx_dir = root / "bench"
        run_phase1(dataclasses.replace(cfg, max_epochs=2), ctx_dir / "phase1", progress=False)
        digest = (ctx_dir / "phase1" / "phase1.pt.sha256").read_text().split()[0]
        ctx = TrialContext(root=str(root), name="bench", train_config=cfg.to_dict(),
                           phase1_sha256=digest)
        latest = {"ckpt": None}

        def report(metrics, checkpoint=None):
            if checkpoint is None:
                return
            dest = storage / f"checkpoint_{len(list(storage.glob('*'))):06d}"
            shutil.copytree(checkpoint.path, dest)
            size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
            writes[int(metrics["epoch"])].append(("tune copy of the reported dir", size))
            latest["ckpt"] = tune.Checkpoint.from_directory(str(dest))

        storage.mkdir(parents=True)
        Strategy.save_checkpoint = counting_save
        tune_report, tune_get = tune.report, tune.get_checkpoint
        tune.report, tune.get_checkpoint = report, lambda: latest["ckpt"]
        node_id, trial_mod._node_id = trial_mod._node_id, lambda: None
        try:
            trial_mod.train_trial({"condition": condition, "seed": seed}, ctx)
        finally:
            Strategy.save_checkpoint = save
            tune.report, tune.get_checkpoint = tune_report, tune_get
            trial_mod._node_id = node_id
        last = ctx_dir / "trials" / f"{condition}-s{seed}" / "ckpt" / "last.ckpt"
        return {"epochs": dict(writes), "checkpoint_bytes": last.stat().st_size}


def paper_arithmetic() -> dict:
    """Checkpoint size of the paper preset from its parameter count (no weights built)."""
    import torch

    from pmnet.conditions import CONDITIONS
    from pmnet.model import PMNet
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name("paper")
    with torch.device("meta"):
        model = PMNet(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    out = {"total_params": total, "conditions": {}}
    for name, cond in CONDITIONS.items():
        trainable = sum(p.numel() for _, p in model.trainable_subset(cond.subset))
        out["conditions"][name] = {"trainable": trainable,
                                   "checkpoint_bytes": 4 * (total + 2 * trainable)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--condition", default="consolidator_only")
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args(argv)
    got = measure(a.epochs, a.condition, a.seed)
    size = got["checkpoint_bytes"]
    print(f"debug preset, {a.condition}-s{a.seed}: one checkpoint = {size:,} bytes")
    total = 0
    for epoch, items in sorted(got["epochs"].items()):
        n = sum(b for _, b in items)
        total += n
        what = ", ".join(f"{w} {b:,}" for w, b in items)
        print(f"  epoch {epoch}: {n:,} bytes = {n / size:.2f} checkpoints ({what})")
    print(f"  mean per epoch: {total / len(got['epochs']) / size:.2f} checkpoints")
    paper = paper_arithmetic()
    print(f"paper preset: {paper['total_params']:,} parameters")
    for name, c in paper["conditions"].items():
        print(f"  {name}: {c['trainable']:,} trainable -> checkpoint ~"
              f"{c['checkpoint_bytes'] / 1e6:,.0f} MB")
    json.dump({"debug": got, "paper": paper}, sys.stderr)
    print(file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
