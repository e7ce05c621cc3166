"""The pipeline driver: Stage 1 (Phase 0/1), Stage 2 (Tune grid), Stage 3 (report).

`plan_new(...)` validates everything that can be checked without compute (preset, grid,
resources, storage root, tracking server) and raises PipelineError / SpaceError with a clear
message before any trial starts. `execute(plan)` then runs the stages:

Stage 1  a Ray task runs `pmnet.train.run_phase1` into `<run>/phase1/` unless a checkpoint
         with a valid sha256 for the same Phase-1 config is already there (idempotent).
Stage 2  a `ray.tune.Tuner` over the grid; each trial is `pipelines.trial.train_trial` with
         `tune.with_resources`; an existing experiment is continued with `Tuner.restore`
         (finished trials are kept, unfinished and errored ones resume from checkpoints).
Stage 3  `pmnet.report.main_report(<run>)`; a failure there is logged, results are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import socket
import stat
import subprocess
import sys
import time
import traceback
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
    trial_name,
    write_json,
)
from pipelines.tracking import (
    EMBEDDED,
    LocalServer,
    Tracker,
    check_tracking_uri,
    embedded_backend,
    requested_tracking_uri,
)
from tune_spaces import Space, get_space

log = logging.getLogger("pipelines.driver")
REPO = Path(__file__).resolve().parent.parent
PASS_ENV = ("PMNET_TEST_FAULT_ONCE",)  # test hooks forwarded to the Ray workers


# -----------------------------------------------------------------------------------------
# Console
# -----------------------------------------------------------------------------------------


class Console:
    """One-line progress messages on stdout, copied to `<run>/logs/driver.log`."""

    def __init__(self):
        self.log_path: Path | None = None

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        if self.log_path is not None:
            try:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                pass


say = Console()


# -----------------------------------------------------------------------------------------
# Plan: everything decided and validated before any compute
# -----------------------------------------------------------------------------------------


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
    return {"train_config": _canon(plan.cfg.to_dict()),
            "grid": {"conditions": list(plan.space.conditions),
                     "seeds": list(plan.space.seeds)}}


def _canon(obj):
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


# -----------------------------------------------------------------------------------------
# Provenance
# -----------------------------------------------------------------------------------------


def git_commit() -> dict[str, str]:
    def run(*args):
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = run("rev-parse", "HEAD")
    dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    return {"git_commit": commit or "unknown", "git_dirty": str(dirty).lower()}


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "lightning", "ray", "mlflow", "numpy", "pandas"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def phase1_config_hash(cfg) -> str:
    d = {k: v for k, v in cfg.to_dict().items() if k not in PHASE2_ONLY_FIELDS}
    return hashlib.sha256(json.dumps(_canon(d), sort_keys=True).encode()).hexdigest()


# -----------------------------------------------------------------------------------------
# Execution
# -----------------------------------------------------------------------------------------


@dataclass
class Runs:
    """MLflow handles of this pipeline (all None when tracking is off)."""

    tracker: Tracker | None = None
    uri: str | None = None
    experiment_id: str | None = None
    parent: str | None = None
    stages: dict[str, str] = field(default_factory=dict)

    def safe(self, what: str, fn, *args, **kwargs):
        if self.tracker is None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # tracking must never lose the pipeline's results
            say(f"[mlflow] {what} failed: {type(e).__name__}: {e}")
            return None


def _write_meta(plan: Plan, **extra) -> dict:
    lay = plan.layout
    meta = read_json(lay.pipeline_json, {}) or {}
    if not meta:
        meta = {
            "name": plan.name, "preset": plan.cfg.preset, "preset_reason": plan.preset_reason,
            "grid": {"conditions": list(plan.space.conditions),
                     "seeds": list(plan.space.seeds)},
            "n_trials": plan.space.n_trials, "space": plan.space.to_dict(),
            "overrides": _canon(plan.overrides), "root": str(lay.root),
            "run_dir": str(lay.run_dir), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tracking": plan.tracking_uri or EMBEDDED, **git_commit(),
            "versions": package_versions(),
        }
        write_json(lay.config_json, _canon(plan.cfg.to_dict()))
    meta.update(extra)
    write_json(lay.pipeline_json, meta)
    return meta


def _ray_env() -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    for k in PASS_ENV:
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


def init_ray(plan: Plan):
    """Local Ray by default (dashboard off, quiet); RAY_ADDRESS / --ray-address: a cluster."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's legacy reporter: silent at 0
    if plan.ray_address:
        # Ray >= 2.59 starts clusters with token authentication, and a client connecting to
        # one needs RAY_AUTH_MODE=token (read when ray is imported; the token itself comes
        # from ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH); token mode also
        # connects to clusters without authentication
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    kwargs = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                  runtime_env={"env_vars": _ray_env()}, ignore_reinit_error=True)
    if plan.ray_address:
        try:
            ray.init(address=plan.ray_address, **kwargs)
        except Exception as e:
            raise PipelineError(f"cannot connect to the Ray cluster at {plan.ray_address} "
                                f"(RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')}): {e}"
                                ) from e
    else:
        ncpu = plan.num_cpus or os.cpu_count() or 1
        # address="local": always a new local instance, never another `ray start` cluster
        # that happens to run on this machine
        ray.init(address="local", num_cpus=ncpu,
                 object_store_memory=min(2 << 30, (512 << 20) + ncpu * (128 << 20)), **kwargs)
    return ray


def _node_capacity(ray) -> tuple[float, float]:
    """(largest CPU count, largest GPU count) of any alive node."""
    cpus, gpus = 0.0, 0.0
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            cpus = max(cpus, float(res.get("CPU", 0)))
            gpus = max(gpus, float(res.get("GPU", 0)))
    return cpus, gpus


def check_cluster(plan: Plan, ray) -> tuple[float, float]:
    cpus, gpus = _node_capacity(ray)
    sp = plan.space
    if sp.gpus_per_trial > 0 and gpus == 0:
        raise PipelineError(f"the grid asks {sp.gpus_per_trial} GPU per trial but no Ray node "
                            "has a GPU; use --gpus-per-trial 0 (or a CPU preset)")
    if sp.cpus_per_trial > cpus:
        raise PipelineError(f"the grid asks {sp.cpus_per_trial:g} CPUs per trial but the "
                            f"largest Ray node has {cpus:g}; lower --cpus-per-trial")
    return cpus, gpus


def execute(plan: Plan) -> int:
    """Run (or continue) the pipeline. Returns 0 when every trial finished, 1 otherwise."""
    t_start = time.time()
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    lay = plan.layout
    lay.run_dir.mkdir(parents=True, exist_ok=True)
    lay.logs_dir.mkdir(parents=True, exist_ok=True)
    say.log_path = lay.logs_dir / "driver.log"
    _write_meta(plan, status="running",
                driver={"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    lay.last_file.write_text(plan.name + "\n")
    sp = plan.space
    say(f"[pipeline] {plan.name}: preset {plan.cfg.preset} ({plan.preset_reason}); "
        f"{'continuing' if plan.resumed else 'new'} run in {lay.run_dir}")
    say(f"[pipeline] grid {sp.name}: {len(sp.conditions)} conditions x {len(sp.seeds)} seeds "
        f"= {sp.n_trials} trials; {sp.cpus_per_trial:g} CPU"
        f"{f' + {sp.gpus_per_trial:g} GPU' if sp.gpus_per_trial else ''} per trial, "
        f"max_failures {sp.max_failures}")

    server = None
    runs = Runs()
    if plan.tracking_uri is None:  # embedded store: serve it while the pipeline runs
        server = LocalServer(embedded_backend(lay.root), lay.mlartifacts,
                             host=plan.mlflow_host, log_path=lay.logs_dir / "mlflow-server.log")
        server.start()
    ray = None
    try:
        t_ray = time.time()
        ray = init_ray(plan)
        cpus, gpus = check_cluster(plan, ray)
        where = f"Ray cluster {plan.ray_address}" if plan.ray_address else "local Ray"
        say(f"[pipeline] {where} up in {time.time() - t_ray:.1f} s "
            f"(largest node: {cpus:g} CPU, {gpus:g} GPU)")
        job = stage1_start(plan, ray, cpus, gpus)  # runs while the MLflow server starts
        uri = server.wait_ready() if server is not None else plan.tracking_uri
        runs = open_tracking(plan, uri, server is not None)
        digest, p1_time = stage1_finish(plan, ray, job, runs)
        s2 = stage2(plan, runs, digest)
        stage3(plan, runs)
        timing = _timing(plan, t_start, s2, p1_time)
        status = "finished" if s2["errored"] == 0 and s2["finished"] == sp.n_trials else "failed"
        _write_meta(plan, status=status, phase1_sha256=digest)
        if runs.parent:
            runs.safe("timing", runs.tracker.log_metrics, runs.parent,
                      {f"pipeline/{k}": v for k, v in timing.items()
                       if isinstance(v, (int, float))})
            runs.safe("finish", runs.tracker.finish, runs.parent,
                      "FINISHED" if status == "finished" else "FAILED")
        say(f"[pipeline] {status}: {s2['finished']}/{sp.n_trials} trials finished, "
            f"{s2['errored']} errored; wall {timing['wall_s']:.1f} s "
            f"(trials' own training {timing['sum_trial_train_s']:.1f} s)")
        say(f"[pipeline] results: {lay.results_dir}   report: {lay.report_dir}")
        if status != "finished":
            say("[pipeline] unfinished or errored trials continue from their checkpoints with "
                f"`make resume NAME={plan.name}` (python -m pipelines.run resume --name "
                f"{plan.name} --root {lay.root}); `make status` shows their errors")
        if plan.tracking_uri is None:
            say(f"[pipeline] MLflow: `make ui RUNS={lay.root}` then open the experiment "
                f"'{experiment_name(plan)}'")
        return 0 if status == "finished" else 1
    except BaseException:
        _write_meta(plan, status="interrupted")
        if runs.parent:
            runs.safe("finish", runs.tracker.finish, runs.parent, "FAILED")
        raise
    finally:
        if ray is not None:
            try:
                ray.shutdown()
            except Exception:
                pass
        if server is not None:
            server.stop()


def experiment_name(plan: Plan) -> str:
    return f"pmnet/{plan.name}"


def open_tracking(plan: Plan, uri: str, embedded: bool) -> Runs:
    tracker = Tracker(uri)
    lay = plan.layout
    exp_id = tracker.experiment(experiment_name(plan), tags={"pipeline": plan.name,
                                                            "storage_root": str(lay.root)})
    known = read_json(lay.tracking_json, {}) or {}
    tags = {"pipeline": plan.name, "role": "pipeline", "preset": plan.cfg.preset,
            "preset_reason": plan.preset_reason, "grid": plan.space.name,
            "run_dir": str(lay.run_dir), **git_commit(),
            **{f"version.{k}": v for k, v in package_versions().items()}}
    parent, _ = tracker.attach_run(exp_id, plan.name, run_name=plan.name, tags=tags,
                                   run_id=known.get("parent_run_id"))
    sp = plan.space
    tracker.log_params_once(parent, {
        **plan.cfg.flat(), "grid.name": sp.name, "grid.conditions": ",".join(sp.conditions),
        "grid.seeds": ",".join(map(str, sp.seeds)), "grid.n_trials": sp.n_trials,
        "resources.cpus_per_trial": sp.cpus_per_trial,
        "resources.gpus_per_trial": sp.gpus_per_trial, "max_failures": sp.max_failures})
    runs = Runs(tracker=tracker, uri=uri, experiment_id=exp_id, parent=parent,
                stages=dict(known.get("stages", {})))
    write_json(lay.tracking_json, {"tracking_uri": EMBEDDED if embedded else uri,
                                   "experiment_name": experiment_name(plan),
                                   "experiment_id": exp_id, "parent_run_id": parent,
                                   "stages": runs.stages})
    say(f"[mlflow] experiment '{experiment_name(plan)}' (id {exp_id}), parent run {parent} "
        f"at {'the embedded store ' + str(lay.mlflow_db) if embedded else uri}")
    return runs


def _stage_run(plan: Plan, runs: Runs, stage: str) -> str | None:
    if runs.tracker is None:
        return None
    rid, _ = runs.tracker.attach_run(
        runs.experiment_id, f"{plan.name}/{stage}", run_name=stage, parent_run_id=runs.parent,
        tags={"pipeline": plan.name, "stage": stage, "preset": plan.cfg.preset},
        run_id=runs.stages.get(stage))
    runs.stages[stage] = rid
    known = read_json(plan.layout.tracking_json, {}) or {}
    known["stages"] = runs.stages
    write_json(plan.layout.tracking_json, known)
    return rid


# -- Stage 1 ---------------------------------------------------------------------------------


def _phase1_task(cfg_dict: dict, out_dir: str, threads: int) -> dict:
    from pipelines.trial import quiet_training_logs

    quiet_training_logs()
    from pmnet.train import TrainConfig, run_phase1

    cfg = TrainConfig.from_dict(cfg_dict)
    if not cfg.threads:
        cfg = dataclasses.replace(cfg, threads=max(1, int(threads)))
    return run_phase1(cfg, out_dir, progress=False)


def existing_phase1(plan: Plan) -> str | None:
    """sha256 of a finished Phase-1 checkpoint for this config, None if there is none.
    PipelineError when one is there but fails its hash check (tampered: never retrained over
    silently)."""
    from pmnet.train import verify_phase1

    lay = plan.layout
    ckpt, sidecar = lay.phase1_ckpt, Path(f"{lay.phase1_ckpt}.sha256")
    if not ckpt.is_file() or not sidecar.is_file():
        return None
    try:
        digest = verify_phase1(ckpt)
    except ValueError as e:
        raise PipelineError(f"Stage 1: {e}. Delete {lay.phase1_dir} to train Phase 1 again."
                            ) from e
    info = read_json(lay.stage1_json, {}) or {}
    if info.get("config_hash") != phase1_config_hash(plan.cfg):
        return None
    if info.get("sha256") != digest:
        raise PipelineError(f"Stage 1: {ckpt} has sha256 {digest[:12]}... but Stage 1 "
                            f"recorded {str(info.get('sha256'))[:12]}...; refusing it. "
                            f"Delete {lay.phase1_dir} to train Phase 1 again.")
    return digest


@dataclass
class Stage1Job:
    digest: str | None = None  # set when a valid checkpoint was already there
    ref: Any = None  # the Ray ObjectRef of the running Phase-1 task
    t0: float = 0.0


def stage1_start(plan: Plan, ray, cpus: float, gpus: float) -> Stage1Job:
    """Skip (valid checkpoint for this config) or submit the Phase-1 task; don't wait."""
    lay = plan.layout
    digest = existing_phase1(plan)
    if digest is not None:
        say(f"[stage 1/3] skipped: {lay.phase1_ckpt} exists with a valid sha256 "
            f"{digest[:12]}... for this config")
        return Stage1Job(digest=digest)
    phases = "Phase 0 + Phase 1" if plan.cfg.phase0_steps > 0 else "Phase 1"
    n_cpu = max(1.0, min(cpus, float(plan.stage1_cpus or plan.num_cpus or cpus)))
    n_gpu = 1 if gpus >= 1 and plan.space.gpus_per_trial > 0 else 0
    say(f"[stage 1/3] {phases} as a Ray task ({n_cpu:g} CPU, {n_gpu} GPU) -> {lay.phase1_dir}")
    for p in (lay.phase1_ckpt, Path(f"{lay.phase1_ckpt}.sha256")):  # a retrain replaces them
        if p.exists():
            p.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    task = ray.remote(num_cpus=n_cpu, num_gpus=n_gpu, max_retries=1)(_phase1_task)
    return Stage1Job(ref=task.remote(plan.cfg.to_dict(), str(lay.phase1_dir), int(n_cpu)),
                     t0=time.time())


def stage1_finish(plan: Plan, ray, job: Stage1Job, runs: Runs) -> tuple[str, float]:
    """Wait for the Phase-1 task, record the checkpoint's hash, log Stage 1 to MLflow."""
    lay = plan.layout
    rid = _stage_run(plan, runs, "stage1-phase1")
    if job.digest is not None:
        if rid:
            runs.safe("stage1 tags", runs.tracker.set_tags, rid,
                      {"skipped": "true", "phase1_sha256": job.digest})
            runs.safe("stage1 finish", runs.tracker.finish, rid)
        if runs.parent:
            runs.safe("parent tags", runs.tracker.set_tags, runs.parent,
                      {"phase1_sha256": job.digest})
        return job.digest, 0.0
    try:
        res = ray.get(job.ref)
    except Exception as e:
        if rid:
            runs.safe("stage1 finish", runs.tracker.finish, rid, "FAILED")
        raise PipelineError(f"Stage 1 (Phase 1) failed: {e}") from e
    digest = res["sha256"]
    for p in (lay.phase1_ckpt, Path(f"{lay.phase1_ckpt}.sha256")):  # read-only from now on
        p.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    wall = time.time() - job.t0
    info = {"config_hash": phase1_config_hash(plan.cfg), "sha256": digest,
            "checkpoint": str(lay.phase1_ckpt), "train_time_s": res.get("train_time_s"),
            "wall_s": wall, "metrics": res.get("metrics", {})}
    write_json(lay.stage1_json, _canon(info))
    _write_meta(plan, phase1_sha256=digest)
    say(f"[stage 1/3] done in {wall:.1f} s (training {res['train_time_s']:.1f} s); "
        f"sha256 {digest[:12]}...; test mean_stm "
        f"{res.get('metrics', {}).get('mean_stm', float('nan')):.2f}")
    if rid:
        tr = runs.tracker
        runs.safe("stage1 params", tr.log_params_once, rid,
                  {k: v for k, v in plan.cfg.flat().items()
                   if k.split(".")[0] not in PHASE2_ONLY_FIELDS})
        runs.safe("stage1 tags", tr.set_tags, rid, {"phase1_sha256": digest, "skipped": "false",
                                                     "checkpoint_path": str(lay.phase1_ckpt)})
        hist = (read_json(lay.phase1_dir / "phase1_metrics.json", {}) or {}).get("history", [])
        for row in hist:
            runs.safe("stage1 metrics", tr.log_metrics, rid,
                      {k: v for k, v in row.items() if k != "epoch"}, step=row.get("epoch", 0))
        runs.safe("stage1 metrics", tr.log_metrics, rid,
                  {**{f"test/{k}": v for k, v in res.get("metrics", {}).items()},
                   "train_time_s": res.get("train_time_s", 0)})
        if (lay.phase1_dir / "phase1_metrics.json").is_file():
            runs.safe("stage1 artifact", tr.log_artifact, rid,
                      lay.phase1_dir / "phase1_metrics.json")
        if plan.cfg.preset in ("debug", "cpu"):
            runs.safe("stage1 artifact", tr.log_artifact, rid, lay.phase1_ckpt, "checkpoint")
            runs.safe("stage1 artifact", tr.log_artifact, rid,
                      f"{lay.phase1_ckpt}.sha256", "checkpoint")
        runs.safe("stage1 finish", tr.finish, rid)
    if runs.parent:
        runs.safe("parent tags", runs.tracker.set_tags, runs.parent, {"phase1_sha256": digest})
    return digest, float(res.get("train_time_s") or 0.0)


# -- Stage 2 ---------------------------------------------------------------------------------


def _progress_callback_class():
    from ray import tune

    class ConsoleProgress(tune.Callback):
        """One line per finished, failed or retried trial, with the best result so far."""

        def __init__(self, total: int, trials_dir: str):
            self.total, self.trials_dir = total, trials_dir

        def _best(self, trials, current=None):
            best = None
            for t in trials:
                v = (t.last_result or {}).get("test/updated_ltm")
                ok = t.status == "TERMINATED" or t is current
                if ok and isinstance(v, (int, float)) and v == v:
                    if best is None or v > best[1]:
                        best = (t, v)
            return best

        def on_trial_start(self, iteration, trials, trial, **info):
            n_run = 1 + sum(t.status == "RUNNING" for t in trials if t is not trial)
            say(f"[stage 2/3] started {_tname(trial)} ({n_run} running)")

        def on_trial_complete(self, iteration, trials, trial, **info):
            done = {t.trial_id for t in trials if t.status == "TERMINATED"} | {trial.trial_id}
            r = trial.last_result or {}
            v, sel = r.get("test/updated_ltm"), r.get("best/select")
            best = self._best(list(trials), trial) or (trial, v)
            best_s = (f"{best[1]:.2f} ({_tname(best[0])})"
                      if isinstance(best[1], (int, float)) else "n/a")
            say(f"[stage 2/3] {len(done)}/{self.total} done: {_tname(trial)} "
                f"test updated_ltm {_fmt(v)}, best val select {_fmt(sel)}, "
                f"train {_fmt(r.get('train_time_s'), 1)} s; best so far {best_s}")

        def on_trial_error(self, iteration, trials, trial, **info):
            err = _first_error_line(trial, self.trials_dir)
            say(f"[stage 2/3] {_tname(trial)} failed for good: {err}")

        def on_trial_recover(self, iteration, trials, trial, **info):
            err = _first_error_line(trial, self.trials_dir)
            say(f"[stage 2/3] {_tname(trial)} crashed ({err}); retrying from its last checkpoint")

    return ConsoleProgress


def _tname(trial) -> str:
    try:
        return trial_name(trial.config["condition"], trial.config["seed"])
    except Exception:
        return str(trial)


def _fmt(v, nd: int = 2) -> str:
    return f"{v:.{nd}f}" if isinstance(v, (int, float)) and v == v else "n/a"


def _first_error_line(trial, trials_dir: str) -> str:
    """The error the trial recorded in its trial.json, else the end of Tune's error.txt."""
    info = read_json(Path(trials_dir) / _tname(trial) / "trial.json", {}) or {}
    if info.get("state") == "ERROR" and info.get("error"):
        return str(info["error"]).splitlines()[0][:300]
    try:
        path = Path(trial.path) / "error.txt"
        if path.is_file():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            return lines[-1].strip()[:300] if lines else "unknown error"
    except Exception:
        pass
    return "see the trial's error.txt"


def trial_context(plan: Plan, runs: Runs, digest: str) -> dict:
    return {"root": str(plan.layout.root), "name": plan.name,
            "train_config": _canon(plan.cfg.to_dict()), "phase1_sha256": digest,
            "tracking_uri": runs.uri, "experiment_id": runs.experiment_id,
            "parent_run_id": runs.parent, "cpus_per_trial": plan.space.cpus_per_trial}


def make_trainable(plan: Plan, ctx: dict):
    from ray import tune

    from pipelines.trial import train_trial

    return tune.with_resources(tune.with_parameters(train_trial, ctx=ctx),
                               plan.space.resources())


def stage2(plan: Plan, runs: Runs, digest: str, *, precheck: bool = True) -> dict:
    from ray import tune

    from pipelines.trial import check_phase1, trial_dirname, trial_str

    lay, sp = plan.layout, plan.space
    if precheck:  # fail fast in the driver; every trial checks again before training
        try:
            check_phase1(lay.phase1_ckpt, digest)
        except Exception as e:
            raise PipelineError(str(e)) from e
    rid = _stage_run(plan, runs, "stage2-phase2")
    ctx = trial_context(plan, runs, digest)
    trainable = make_trainable(plan, ctx)
    exp_dir = lay.experiment_dir
    t0 = time.time()
    if tune.Tuner.can_restore(str(exp_dir)):
        n_done = sum(1 for c, s in sp.trials if lay.result_path(c, s).is_file())
        say(f"[stage 2/3] continuing the Tune experiment {exp_dir}: {n_done}/{sp.n_trials} "
            "results on disk; finished trials are kept, unfinished and errored ones resume "
            "from their last checkpoints")
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True,
                                   resume_errored=True)
    else:
        say(f"[stage 2/3] {sp.n_trials} trials -> {exp_dir}")
        tuner = tune.Tuner(
            trainable, param_space=sp.param_space(),
            tune_config=tune.TuneConfig(
                max_concurrent_trials=sp.max_concurrent or None, reuse_actors=True,
                trial_name_creator=trial_str, trial_dirname_creator=trial_dirname),
            run_config=tune.RunConfig(
                name=exp_dir.name, storage_path=str(exp_dir.parent), verbose=0,
                failure_config=tune.FailureConfig(max_failures=sp.max_failures),
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                callbacks=[_progress_callback_class()(sp.n_trials, str(lay.trials_dir))]))
    grid = tuner.fit()
    wall = time.time() - t0
    finished = errored = 0
    train_times = []
    for r in grid:
        c, s = r.config.get("condition"), r.config.get("seed")
        if r.error is None and lay.result_path(c, s).is_file():
            finished += 1
            t = (read_json(lay.result_path(c, s), {}) or {}).get("train_time_s")
            if isinstance(t, (int, float)):
                train_times.append(float(t))
        else:
            errored += 1
    out = {"wall_s": wall, "finished": finished, "errored": errored,
           "sum_trial_train_s": sum(train_times), "n_trials": sp.n_trials}
    say(f"[stage 2/3] {finished}/{sp.n_trials} finished, {errored} errored in {wall:.1f} s")
    if rid:
        runs.safe("stage2 metrics", runs.tracker.log_metrics, rid,
                  {"trials_finished": finished, "trials_errored": errored, "wall_s": wall,
                   "sum_trial_train_s": sum(train_times)})
        runs.safe("stage2 finish", runs.tracker.finish, rid,
                  "FINISHED" if errored == 0 else "FAILED")
    return out


# -- Stage 3 ---------------------------------------------------------------------------------


def stage3(plan: Plan, runs: Runs) -> bool:
    lay = plan.layout
    rid = _stage_run(plan, runs, "stage3-report")
    n = len(list(lay.results_dir.glob("*.json"))) if lay.results_dir.is_dir() else 0
    say(f"[stage 3/3] statistics and report from {n} result file(s) -> {lay.report_dir}")
    t0 = time.time()
    try:
        from pmnet.report import main_report

        written = main_report(lay.run_dir)
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        lay.logs_dir.mkdir(parents=True, exist_ok=True)
        (lay.logs_dir / "report-error.txt").write_text(traceback.format_exc())
        say(f"[stage 3/3] report failed ({msg}); the results are kept in {lay.results_dir}; "
            f"traceback in {lay.logs_dir / 'report-error.txt'}")
        if rid:
            runs.safe("stage3 tags", runs.tracker.set_tags, rid, {"error": msg[:5000]})
            runs.safe("stage3 finish", runs.tracker.finish, rid, "FAILED")
        return False
    say(f"[stage 3/3] report written in {time.time() - t0:.1f} s: "
        f"{', '.join(sorted(str(k) for k in (written or {}))[:6])}")
    if runs.parent and lay.report_dir.is_dir():
        runs.safe("report artifacts", runs.tracker.log_artifacts, runs.parent, lay.report_dir,
                  "report")
    if rid:
        runs.safe("stage3 finish", runs.tracker.finish, rid)
    return True


def _timing(plan: Plan, t_start: float, s2: dict, p1_time: float) -> dict:
    wall = time.time() - t_start
    sum_train = s2["sum_trial_train_s"]
    conc = plan.space.max_concurrent or None
    timing = {
        "wall_s": wall, "stage2_wall_s": s2["wall_s"], "phase1_train_s": p1_time,
        "sum_trial_train_s": sum_train, "trials_finished": s2["finished"],
        "overhead_s": wall - p1_time - sum_train,
        "overhead_ratio": wall / max(1e-9, p1_time + sum_train),
        "max_concurrent": conc or 0, "resumed": plan.resumed,
        "host": socket.gethostname(), "cpus": os.cpu_count(),
    }
    history = (read_json(plan.layout.timing_json, {}) or {}).get("invocations", [])
    write_json(plan.layout.timing_json, {**timing, "invocations": history + [timing]})
    return timing


def main_error(e: BaseException) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2
