"""The pipeline's run records: one typed schema per JSON file it keeps (pipelines.layout
says where each lives). Every record is a dataclass with `to_dict` / `from_dict`, read with
`read(path)` (a missing or unreadable file gives the empty record) and written atomically
with `write(path)`. Unknown keys are ignored when reading, so a record written by a newer
version still reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pmnet.io import atomic_write_json


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
    """to_dict / from_dict / read / write for a record dataclass; `_nested` names fields
    holding {key: record} maps, converted both ways."""

    _nested: ClassVar[dict[str, type]] = {}

    def to_dict(self) -> dict[str, Any]:
        """Every field, a None one left out."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in self._nested:
                value = {k: v.to_dict() for k, v in value.items()}
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any):
        if not isinstance(data, dict):
            return cls()
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name in cls._nested:
                value = {k: cls._nested[f.name].from_dict(v) for k, v in (value or {}).items()}
            kwargs[f.name] = value
        return cls(**kwargs)

    @classmethod
    def read(cls, path: str | os.PathLike):
        from pipelines.layout import read_json

        return cls.from_dict(read_json(path))

    def write(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())


@dataclass
class TrialState(Record):
    """`trials/<trial>/trial.json`: the trial's own account of itself, kept across its
    attempts. Its identity (`TrialId.to_config()`'s keys; a named variant also its
    `variant_overrides`) and `trial_key`; `state` RUNNING, ERROR, NOT LEARNING (stopped by
    the watchdog, issue 62: not retried) or FINISHED; `failures` (crashed attempts); the
    last reported `epoch` and `best_select`; the last `error` (`config_error` when its
    configuration cannot run: not retried; the watchdog's message); the `result` file."""

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
    """`tracking.json`: where the pipeline's runs are. `tracking_uri` is the store the user
    asked for (`embedded`, a `sqlite:` URI or a server) that `resume`, `report` and `ui`
    use again (a unit's run is found by its `run_key` tag)."""

    tracking_uri: str | None = None
    experiment_name: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None


@dataclass
class Stage1Record(Record):
    """`phase1[-p1s<k>]/stage1.json`: a finished Phase-1 checkpoint. `config_hash` is
    `phase1.phase1_config_hash` of the configuration it was trained with; `imported_from`
    the checkpoint `--phase1-from` copied in; `routes` Phase 1's route diagnostics."""

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
    """`pipeline.json`: what the pipeline is and how it stands. Written at the start
    (`stages.write_meta`): its name, preset (and why), the grid (`grid`: what identifies its
    trials; `space`: the whole `tune_spaces.Space` with its resources), the `--set`
    `overrides`, where it lives, the tracking store, the code's commit and package versions,
    a durable `store` it fills (with its `pieces`: Phase-1 seeds, and `max_wall_s`); then
    `status` (running, finished, failed, interrupted), the `driver`, the `ray_address` it
    ran on (each start and resume records it; a resume without one uses it), the Phase-1
    sha256 (`phase1_sha256s` by Phase-1 seed with several) and `phase1_from` (an import)."""

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
    # a run into a durable store (`pipelines.store`): the store, the Phase-1 seeds this run
    # does (its piece of the grid; None: all of them) and its wall-time bound
    store: str | None = None
    pieces: list | None = None
    max_wall_s: float | None = None
    # the Ray cluster the run last ran on (`--ray-address` / RAY_ADDRESS; None: local Ray),
    # which `resume` uses again unless given another (`plan.plan_resume`)
    ray_address: str | None = None
    # `--stage1-cpus` of its last start or resume, which `resume` uses again unless given
    # another: a Phase 1 retrained on a resume then trains with the same threads (on some
    # CPUs the thread count changes fp32 rounding, so the checkpoint's bytes)
    stage1_cpus: float | None = None


@dataclass
class Started(Record):
    """`phase1[-p1s<k>]/started.json`: a Phase-1 trial began (where, when: host, pid and
    Ray node); a retry (its node was lost) rewrites it. For a person or a test on the
    storage: the driver learns of starts and retries from Tune."""

    time: float | None = None
    host: str | None = None
    pid: int | None = None
    node_id: str | None = None


@dataclass
class Progress(Record):
    """`phase1[-p1s<k>]/progress.json`: how far Phase 1 is (`progress.Phase1Progress`
    writes it, and reports the same record to Tune for the driver): steps, epochs, elapsed
    and estimated time left, `done`, the write `time`, and the per-epoch validation
    `history`."""

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
    """A store unit's `provenance.json` (`pipelines.store`): written when the unit starts
    (`started`), completed when it lands (`landed`, `device`). `unit` is its name
    (`phase1[-p1s<k>]` or the trial's); `git_commit`/`git_dirty` the code, `device` the CPU
    kind (`pmnet.hardware.cpu_kind`) or GPU name it trained on, `torch` its version; `config` the
    configuration the unit depends on (flat `TrainConfig.flat()` keys: a trial's whole
    config after its variant's overrides, a Phase-1 unit's Phase-1 part; execution-only
    fields left out, `pipelines.store.EXECUTION_FIELDS`) and `config_hash` its sha256, which
    reuse compares; `host`, `pid`, `run` (root/name) say which run wrote it, `threads` the
    torch threads a Phase-1 unit trained with (how it ran: not in its checkpoint file)."""

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
