"""The pipeline's run records: one typed schema per JSON file it keeps (docs/pipeline.md,
"Records"). A missing or unreadable file reads as the empty record; unknown keys are ignored,
so a record written by a newer version still reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pmnet.io import atomic_write_json, read_json


def canon(obj):
    """`obj` as JSON gives it back (sorted keys, non-JSON values as str)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def as_float(value: Any) -> float | None:
    """A number (a Python or numpy scalar, a one-element tensor) as float; None otherwise."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None


def normalized_config(cfg_d):
    """A stored TrainConfig with the defaults of fields added since it was written (so a
    pipeline recorded by an older version still matches its own configuration)."""
    from pmnet.train import TrainConfig

    try:
        return canon(TrainConfig.from_dict(cfg_d).to_dict())
    except (TypeError, ValueError, KeyError):
        return cfg_d


class Record:
    """to_dict / from_dict / read / write for a record dataclass."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, a None one left out."""
        return {
            f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None
        }

    @classmethod
    def from_dict(cls, data: Any):
        if not isinstance(data, dict):
            return cls()
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    @classmethod
    def read(cls, path: str | os.PathLike):
        return cls.from_dict(read_json(path))

    def write(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())


@dataclass
class TrialState(Record):
    """`trials/<trial>/trial.json`: the trial's own account of itself across its attempts.
    `state` RUNNING, ERROR, NOT LEARNING (stopped by the watchdog, issue 62: not retried) or
    FINISHED; `config_error` when its configuration cannot run (not retried)."""

    condition: str | None = None
    seed: int | None = None
    variant: str | None = None
    phase1_seed: int | None = None
    variant_overrides: dict | None = None
    trial_key: str | None = None
    state: str | None = None
    failures: int = 0
    epoch: int | None = None
    best_select: float | None = None
    error: str | None = None
    config_error: bool | None = None
    result: str | None = None

    @classmethod
    def update(cls, path: str | os.PathLike, **fields) -> TrialState:
        """The record at `path` with `fields` replaced, written back at once."""
        state = dataclasses.replace(cls.read(path), **fields)
        state.write(path)
        return state


@dataclass
class TrackingRecord(Record):
    """`tracking.json`: where the pipeline's runs are; `tracking_uri` (`embedded`, a `sqlite:`
    URI or a server) is used again by `resume`, `report` and `ui`."""

    tracking_uri: str | None = None
    experiment_name: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None


@dataclass
class Stage1Record(Record):
    """`phase1[-p1s<k>]/stage1.json`, a Phase-1 unit's commit record. `config_hash`:
    `phase1.phase1_config_hash`; `imported_from`: the checkpoint `--phase1-from` copied in."""

    config_hash: str | None = None
    sha256: str | None = None
    checkpoint: str | None = None
    phase1_seed: int | None = None
    train_time_s: float | None = None
    wall_s: float | None = None
    metrics: dict = field(default_factory=dict)
    imported_from: str | None = None
    routes: dict | None = None


@dataclass
class PipelineRecord(Record):
    """`pipeline.json`: what the pipeline is (written at the start, `stages.write_meta`;
    `grid`: what identifies its trials, `space`: the whole `tune_spaces.Space`) and how it
    stands (`status`: running, finished, failed, interrupted)."""

    name: str | None = None
    preset: str | None = None
    preset_reason: str | None = None
    grid: dict | None = None
    n_trials: int | None = None
    space: dict | None = None
    overrides: dict = field(default_factory=dict)
    root: str | None = None
    run_dir: str | None = None
    created: str | None = None
    tracking: str | None = None
    git_commit: str | None = None
    git_dirty: str | None = None
    versions: dict | None = None
    status: str | None = None
    driver: dict | None = None
    phase1_sha256: str | None = None
    phase1_sha256s: dict | None = None
    phase1_from: dict | None = None
    store: str | None = None
    pieces: list | None = None  # a pre-issue-51 run's Phase-1 seeds (`plan.plan_resume`)
    max_wall_s: float | None = None
    # the last start's or resume's Ray cluster (None: local Ray) and `--stage1-cpus`, which
    # `resume` uses again unless given others (docs/pipeline.md, on `resume`)
    ray_address: str | None = None
    stage1_cpus: float | None = None


@dataclass
class Started(Record):
    """`phase1[-p1s<k>]/started.json`: where and when a Phase-1 trial began (a retry rewrites
    it); for a person or a test: the driver learns of starts from Tune."""

    time: float | None = None
    host: str | None = None
    pid: int | None = None
    node_id: str | None = None


@dataclass
class Progress(Record):
    """`phase1[-p1s<k>]/progress.json`: how far Phase 1 is (`progress.Phase1Progress` writes
    it and reports the same record to Tune)."""

    phase: int = 1
    step: int = 0
    total_steps: int | None = None
    epoch: int = 0
    max_epochs: int | None = None
    elapsed_s: float = 0.0
    eta_s: float | None = None
    done: bool = False
    time: float = 0.0
    history: list = field(default_factory=list)


@dataclass
class Provenance(Record):
    """A store unit's `provenance.json`: written when the unit starts, completed when it
    lands. `config` (`store.unit_config`) and its sha256 `config_hash`, which reuse compares;
    `threads`: how a Phase-1 unit ran (not in its checkpoint file, issue 53)."""

    unit: str | None = None
    kind: str | None = None  # "phase1" | "trial"
    config_hash: str | None = None
    config: dict | None = None
    git_commit: str | None = None
    git_dirty: str | None = None
    torch: str | None = None
    device: str | None = None
    host: str | None = None
    pid: int | None = None
    run: str | None = None
    started: float | None = None
    landed: float | None = None
    landed_git_commit: str | None = None
    phase1_sha256: str | None = None
    threads: int | None = None
