"""Trials of the pipeline trained in the test's own process: Tune's `report` and
`get_checkpoint` faked (`FakeTune`), and a trial context over a copied Phase-1 checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipelines.layout import Layout
from pmnet.trial_id import TrialId


class FakeTune:
    """`tune.report` / `tune.get_checkpoint` for a trial run in this process, doing what
    Tune does with a reported checkpoint: copy its directory into storage (here, a list of
    {file name: size}) and hand the latest one to a retried attempt."""

    def __init__(self, storage: Path):
        self.storage, self.reports, self.latest = storage, [], None

    def report(self, metrics, checkpoint=None):
        import shutil

        from ray import tune

        files = None
        if checkpoint is not None:
            dest = self.storage / f"checkpoint_{len(self.reports):06d}"
            shutil.copytree(checkpoint.path, dest)
            files = {p.name: p.stat().st_size for p in dest.rglob("*") if p.is_file()}
            self.latest = tune.Checkpoint.from_directory(str(dest))
        self.reports.append({"metrics": dict(metrics), "files": files})

    def get_checkpoint(self):
        return self.latest


def run_trial_here(ctx, condition: str, seed: int, fake: FakeTune, variant: str = "") -> float:
    """pipelines.trial.train_trial in this process with FakeTune; the seconds it took."""
    import pipelines.trial as trial_mod

    fake.storage.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        from ray import tune

        mp.setattr(tune, "report", fake.report)
        mp.setattr(tune, "get_checkpoint", fake.get_checkpoint)
        mp.setattr(trial_mod, "_node_id", lambda: None)  # would start a Ray instance
        import torch

        threads = torch.get_num_threads()
        t0 = time.time()
        try:
            trial_mod.train_trial(TrialId(condition, seed, variant).to_config(), ctx)
        finally:
            torch.set_num_threads(threads)
    return time.time() - t0


def trial_ctx(root: Path, phase1: dict, variants: dict | None = None, **overrides):
    """The TrialContext of pipeline `t` under `root` (debug preset, one thread), with a copy
    of the Phase-1 checkpoint `phase1` ({"checkpoint", "sha256"}) as its Phase 1."""
    from pipelines.trial import TrialContext
    from pmnet.train import TrainConfig

    lay = Layout(root, "t")
    lay.phase1_dir.mkdir(parents=True, exist_ok=True)
    src = Path(phase1["checkpoint"])
    lay.phase1_ckpt.write_bytes(src.read_bytes())
    Path(f"{lay.phase1_ckpt}.sha256").write_bytes(Path(f"{src}.sha256").read_bytes())
    from pipelines.records import Stage1Record

    # the unit's commit record: a trial lands only from its store's checkpoint
    Stage1Record(sha256=phase1["sha256"], checkpoint=str(lay.phase1_ckpt)).write(
        lay.stage1_json)
    from tune_spaces import Space, Variant

    cfg = TrainConfig.from_name("debug", threads=1, **overrides)
    conditions = ("consolidator_only", "learned_full", "identity_accum")
    space = Space("t", conditions, (42, 43), variants=tuple(
        Variant(name, dict(over)) for name, over in (variants or {"": {}}).items()))
    return TrialContext(lay, space, {t.name: space.trial_config(cfg, t) for t in space.trials},
                        {None: phase1["sha256"]})
