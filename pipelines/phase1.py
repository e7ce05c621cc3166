"""A pipeline's Phase-1 checkpoints (`phase1.pt`, its sidecar `phase1.pt.sha256`, and
`stage1.json`), and every check of one, in one place: planning's (PipelineError: exit 2), the
driver's, and every trial's before it trains (Phase1Refused: the trial ends, not retried).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.layout import PipelineError, read_json
from pipelines.records import Stage1Record, canon, normalized_config
from pmnet.conditions import LATE_FIELD_DEFAULTS, PHASE2_ONLY_FIELDS
from pmnet.store_layout import config_digest, unit_name


class Phase1Refused(ValueError):
    """The Phase-1 checkpoint is missing, tampered with, or not the one Stage 1 produced."""


@dataclass(frozen=True)
class Phase1Slot:
    """One Phase-1 checkpoint of a pipeline: the single shared one (`seed` None, in
    `phase1/`, trained with the pipeline's own `phase1_seed`), or that of Phase-1 seed k in a
    grid with several (`phase1-p1s<k>/`, the pipeline's config with `phase1_seed = k`)."""

    seed: int | None
    cfg: Any  # the TrainConfig this checkpoint is trained with
    dir: Path  # the unit in the run's store
    scratch: Path | None = None  # where it trains (`Layout.phase1_scratch`); None: `dir`

    @property
    def work(self) -> Path:
        """Phase 1's training directory: Lightning's `phase1_ckpt/`, `started.json`,
        `progress.json`, and the files the unit lands from."""
        return self.scratch or self.dir

    @property
    def ckpt(self) -> Path:
        return self.dir / "phase1.pt"

    @property
    def sidecar(self) -> Path:
        return self.dir / "phase1.pt.sha256"

    @property
    def stage1_json(self) -> Path:
        return self.dir / "stage1.json"

    @property
    def metrics_json(self) -> Path:
        return self.dir / "phase1_metrics.json"

    @property
    def label(self) -> str:
        """`phase1` or `phase1-p1s<k>` (directory, MLflow run and console name)."""
        return unit_name(self.seed)


@dataclass(frozen=True)
class Phase1Source:
    """A verified Phase-1 checkpoint from elsewhere (`start --phase1-from PATH`)."""

    checkpoint: Path  # the .pt file; its `.sha256` sidecar and phase1_metrics.json beside it
    sha256: str
    metrics: dict  # the source's phase1_metrics.json (train_config, test, history, ...)
    slot_seed: int | None = None  # the Phase1Slot it stands in for

    def to_dict(self) -> dict:
        return {"checkpoint": str(self.checkpoint), "sha256": self.sha256,
                "slot_seed": self.slot_seed}


def check_phase1(path: str | os.PathLike, expected_sha256: str | None) -> str:
    """verify_phase1 plus the hash recorded by Stage 1; Phase1Refused with the reason."""
    from pmnet.train import verify_phase1

    try:
        digest = verify_phase1(path)
    except ValueError as e:
        raise Phase1Refused(f"refusing the Phase-1 checkpoint: {e}") from e
    if expected_sha256 and digest != expected_sha256:
        raise Phase1Refused(
            f"refusing the Phase-1 checkpoint {path}: its sha256 {digest[:12]}... is not the "
            f"{expected_sha256[:12]}... that Stage 1 recorded for this pipeline")
    return digest


def existing_phase1(slot: Phase1Slot, *, repair: bool = False) -> str | None:
    """sha256 of a finished Phase-1 checkpoint for this config, None if there is none.

    PipelineError when one is there but fails its sha256 or does not load as a model file of
    this config: never retrained over silently. A missing sidecar whose checkpoint matches
    the sha256 Stage 1 recorded is rewritten (`repair`) or accepted as rewritable."""
    from pmnet.train import load_model_file, sha256_file, verify_phase1, write_sha256

    ckpt, sidecar = slot.ckpt, slot.sidecar
    if not ckpt.is_file():
        return None
    hint = f"Delete {slot.dir} to train Phase 1 again."
    digest = None
    if sidecar.is_file():
        try:
            digest = verify_phase1(ckpt)
        except ValueError as e:
            raise PipelineError(f"Stage 1: {e}. {hint}") from e
    info = Stage1Record.read(slot.stage1_json)
    if info.config_hash != phase1_config_hash(slot.cfg):
        return None
    if digest is None:  # the sidecar is gone: the record of Stage 1 vouches for the file
        digest = sha256_file(ckpt)
        if digest != info.sha256:
            return None  # not the checkpoint Stage 1 finished: it runs again
        if repair:
            write_sha256(ckpt, digest)
    elif info.sha256 != digest:
        raise PipelineError(f"Stage 1: {ckpt} has sha256 {digest[:12]}... but Stage 1 "
                            f"recorded {str(info.sha256)[:12]}...; refusing it. {hint}")
    try:
        load_model_file(ckpt, expect_config=slot.cfg.model)
    except Exception as e:
        raise PipelineError(f"Stage 1: {ckpt} matches its sha256 but is not a loadable "
                            f"Phase-1 model file for this config ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}). {hint}") from e
    return digest


def phase1_part(cfg_d: dict) -> dict:
    """The Phase-1 part of a TrainConfig dict (what the Phase-1 checkpoint depends on); a field
    added since stores were written is left out while at its default (`LATE_FIELD_DEFAULTS`:
    stored Phase-1 units keep their hash)."""
    return {k: v for k, v in canon(cfg_d).items() if k not in PHASE2_ONLY_FIELDS
            and not (k in LATE_FIELD_DEFAULTS and v == LATE_FIELD_DEFAULTS[k])}


def phase1_config_hash(cfg) -> str:
    """sha256 of the Phase-1 part of a TrainConfig (Phase-2-only fields left out)."""
    return config_digest(phase1_part(cfg.to_dict()))


def trained_phase1_part(metrics: Any) -> dict | None:
    """The Phase-1 part of the configuration a checkpoint was trained with, from its
    `phase1_metrics.json` (the defaults of fields added since filled in); None when the file
    holds no train_config."""
    if not isinstance(metrics, dict) or not isinstance(metrics.get("train_config"), dict):
        return None
    return phase1_part(normalized_config(metrics["train_config"]))


def check_phase1_source(path: str | os.PathLike, slots: list[Phase1Slot]) -> Phase1Source:
    """A Phase-1 checkpoint to import (a `phase1.pt`, or a directory holding one), checked:
    its sha256 sidecar, the Phase-1 configuration its `phase1_metrics.json` names (that of
    one of `slots`: its `phase1_seed` picks the slot), and that it loads as a model of this
    config. PipelineError naming the problem otherwise. Reads only."""
    from pmnet.train import load_model_file, verify_phase1

    src = Path(path).expanduser()
    ckpt = src / "phase1.pt" if src.is_dir() else src
    if not ckpt.is_file():
        raise PipelineError(f"--phase1-from {path}: no Phase-1 checkpoint there (give a "
                            "phase1.pt, or the directory of a pipeline's or `pmnet train "
                            "phase1`'s Phase 1 that holds one)")
    ckpt = ckpt.resolve()
    try:
        digest = verify_phase1(ckpt)
    except ValueError as e:
        raise PipelineError(f"--phase1-from: {e}") from e
    metrics_path = ckpt.parent / "phase1_metrics.json"
    metrics = read_json(metrics_path) if metrics_path.is_file() else None
    theirs = trained_phase1_part(metrics)
    if theirs is None:
        raise PipelineError(f"--phase1-from {ckpt}: {metrics_path} is missing or has no "
                            "train_config, so the configuration it was trained with cannot "
                            "be checked; import only checkpoints written by Phase 1 "
                            "(`pmnet train phase1` or a pipeline's Stage 1)")
    diffs = []
    for slot in slots:
        mine = phase1_part(slot.cfg.to_dict())
        diff = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
        if not diff:
            break
        diffs.append(diff)
    else:
        diff = min(diffs, key=len)
        shown = "; ".join(f"{k}: {theirs.get(k)!r} there vs {mine.get(k)!r} here"
                          for k in diff[:4])
        raise PipelineError(f"--phase1-from {ckpt} was trained with a different Phase-1 "
                            f"configuration ({shown}{'; ...' if len(diff) > 4 else ''}); "
                            "use the same preset and Phase-1 --set overrides, or let "
                            "Stage 1 train its own")
    try:
        load_model_file(ckpt, expect_config=slot.cfg.model)
    except Exception as e:
        raise PipelineError(f"--phase1-from {ckpt} matches its sha256 but is not a loadable "
                            f"Phase-1 model file for this config ({type(e).__name__})") from e
    return Phase1Source(checkpoint=ckpt, sha256=digest, metrics=metrics, slot_seed=slot.seed)
