"""Planning: every input of a pipeline validated before any compute and before any write.

`plan_new(...)` and `plan_resume(...)` read the command line, the presets, the grid and the
stored records of an existing pipeline and return a `Plan`, or raise PipelineError /
SpaceError with a message that names the problem. They create nothing on disk, start no
process and train nothing: the driver (`pipelines.driver.execute`) does that afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.layout import (
    PHASE2_ONLY_FIELDS,
    Layout,
    PipelineError,
    check_name,
    check_writable,
    read_json,
)
from pipelines.tracking import EMBEDDED, check_tracking_uri, requested_tracking_uri
from tune_spaces import Space, get_space


@dataclass
class Plan:
    layout: Layout
    cfg: Any  # pmnet.train.TrainConfig
    space: Space
    preset_reason: str
    overrides: dict = field(default_factory=dict)
    tracking_uri: str | None = None  # None: the embedded store
    ray_address: str | None = None
    num_cpus: int | None = None
    mlflow_host: str = "127.0.0.1"
    stage1_cpus: float | None = None  # None: every CPU of the largest node
    resumed: bool = False

    @property
    def name(self) -> str:
        return self.layout.name


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def choose_preset(preset: str | None) -> tuple[str, str]:
    """(preset, why): an explicit preset wins; else `paper` with a CUDA GPU, `cpu` without."""
    if preset:
        return preset, "given with --preset / PRESET="
    if cuda_available():
        return "paper", "a CUDA GPU is visible (torch.cuda.is_available())"
    return "cpu", "no CUDA GPU is visible (torch.cuda.is_available() is False)"


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """`KEY=VALUE` strings -> TrainConfig.from_name overrides (VALUE parsed as JSON if it can)."""
    from pmnet.train import parse_overrides as train_overrides

    try:
        return train_overrides(items)
    except ValueError as e:
        raise PipelineError(str(e)) from e


def _parse_list(value, kind=str) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip() != ""]
    else:
        parts = list(value)
    try:
        return tuple(kind(p) for p in parts)
    except ValueError as e:
        raise PipelineError(f"cannot read {value!r} as a list of {kind.__name__}: {e}") from e


def build_space(cfg, *, grid: str = "default", gpu: bool = False, conditions=None,
                seeds=None, cpus_per_trial=None, gpus_per_trial=None, max_concurrent=None,
                max_failures=None) -> Space:
    """The grid function's Space with the command line's changes, validated."""
    from pmnet.train import CONDITIONS

    space = get_space(grid)(cfg, gpu=gpu)
    changes = {k: v for k, v in {
        "conditions": _parse_list(conditions, str), "seeds": _parse_list(seeds, int),
        "cpus_per_trial": cpus_per_trial, "gpus_per_trial": gpus_per_trial,
        "max_concurrent": max_concurrent, "max_failures": max_failures,
    }.items() if v is not None}
    if changes:
        space = space.derive(**changes)
    return space.validate(CONDITIONS)


def default_name(preset: str) -> str:
    return f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def plan_new(*, root: str | os.PathLike, name: str | None = None, preset: str | None = None,
             grid: str = "default", overrides: dict | None = None, conditions=None,
             seeds=None, cpus_per_trial=None, gpus_per_trial=None, max_concurrent=None,
             max_failures=None, tracking_uri: str | None = None,
             ray_address: str | None = None, num_cpus: int | None = None,
             mlflow_host: str = "127.0.0.1", stage1_cpus: float | None = None,
             check_tracking: bool = True) -> Plan:
    """Validate a new pipeline (fast; no Ray, no training). PipelineError/SpaceError if bad."""
    from pmnet.train import TrainConfig

    preset, reason = choose_preset(preset)
    overrides = dict(overrides or {})
    try:
        cfg = TrainConfig.from_name(preset, **overrides)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"bad training configuration: {e}") from e
    gpu = cuda_available() if gpus_per_trial is None else bool(gpus_per_trial)
    space = build_space(cfg, grid=grid, gpu=gpu, conditions=conditions, seeds=seeds,
                        cpus_per_trial=cpus_per_trial, gpus_per_trial=gpus_per_trial,
                        max_concurrent=max_concurrent, max_failures=max_failures)
    if num_cpus is not None and (isinstance(num_cpus, bool) or int(num_cpus) < 1):
        raise PipelineError(f"--num-cpus must be a positive integer, got {num_cpus!r}")
    root = check_writable(root)
    name = check_name(name or default_name(cfg.preset))
    uri = requested_tracking_uri(tracking_uri)
    if uri and check_tracking:
        check_tracking_uri(uri)
    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    plan = Plan(layout=Layout(root, name), cfg=cfg, space=space, preset_reason=reason,
                overrides=overrides, tracking_uri=uri, ray_address=address,
                num_cpus=num_cpus, mlflow_host=mlflow_host, stage1_cpus=stage1_cpus)
    _check_existing(plan)
    return plan


def _stored_identity(plan: Plan) -> dict:
    return {"train_config": canon(plan.cfg.to_dict()),
            "grid": {"conditions": list(plan.space.conditions),
                     "seeds": list(plan.space.seeds)}}


def canon(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _check_existing(plan: Plan) -> None:
    """A pipeline name that exists must describe the same experiment (then it continues)."""
    lay = plan.layout
    meta = read_json(lay.pipeline_json)
    if meta is None:
        if lay.run_dir.exists() and any(lay.run_dir.iterdir()):
            raise PipelineError(f"{lay.run_dir} exists and is not a pipeline directory; "
                                "choose another --name")
        return
    stored = {"train_config": read_json(lay.config_json),
              "grid": meta.get("grid")}
    mine = _stored_identity(plan)
    if stored != mine:
        diff = []
        a, b = stored.get("train_config") or {}, mine["train_config"]
        diff += [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if stored.get("grid") != mine["grid"]:
            diff.append("grid")
        raise PipelineError(
            f"pipeline {plan.name!r} already exists under {lay.root} with a different "
            f"configuration ({', '.join(diff) or 'config'} differ); use another --name, "
            f"or `resume` to continue it as it was")
    plan.resumed = True


def plan_resume(*, root: str | os.PathLike, name: str | None = None,
                tracking_uri: str | None = None, ray_address: str | None = None,
                num_cpus: int | None = None, mlflow_host: str = "127.0.0.1",
                max_failures: int | None = None, stage1_cpus: float | None = None) -> Plan:
    """The plan of an existing pipeline, read back from its pipeline.json/config.json."""
    from pipelines.layout import last_pipeline
    from pmnet.train import CONDITIONS, TrainConfig

    root = Path(root).expanduser().absolute()
    name = name or last_pipeline(root)
    lay = Layout(root, name)
    meta = read_json(lay.pipeline_json)
    cfg_d = read_json(lay.config_json)
    if not isinstance(meta, dict) or not isinstance(cfg_d, dict):
        raise PipelineError(f"no pipeline {name!r} under {root} (missing or unreadable "
                            f"{lay.pipeline_json.name} / {lay.config_json.name})")
    check_writable(root)
    cfg = TrainConfig.from_dict(cfg_d)
    space = Space.from_dict(meta["space"])
    if max_failures is not None:
        space = space.derive(max_failures=max_failures)
    space.validate(CONDITIONS)
    stored_uri = meta.get("tracking")
    uri = requested_tracking_uri(tracking_uri)
    if uri is None and stored_uri not in (None, EMBEDDED):
        uri = stored_uri
    if uri:
        check_tracking_uri(uri)
    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    return Plan(layout=lay, cfg=cfg, space=space, preset_reason=meta.get("preset_reason", ""),
                overrides=meta.get("overrides", {}), tracking_uri=uri, ray_address=address,
                num_cpus=num_cpus, mlflow_host=mlflow_host, stage1_cpus=stage1_cpus,
                resumed=True)

def phase1_config_hash(cfg) -> str:
    d = {k: v for k, v in cfg.to_dict().items() if k not in PHASE2_ONLY_FIELDS}
    return hashlib.sha256(json.dumps(canon(d), sort_keys=True).encode()).hexdigest()

