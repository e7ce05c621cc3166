"""Planning: `plan_new` and `plan_resume` validate every input of a pipeline (the command
line, the presets, the grid, an existing pipeline's records) into a `Plan`, or raise
PipelineError / SpaceError naming the problem, before any compute and before any write.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from pipelines.addresses import EMBEDDED, check_tracking_uri, requested_tracking_uri, storage_root
from pipelines.cluster import ClusterInfo, check_storage, describe_cluster
from pipelines.layout import (
    Layout,
    PipelineError,
    check_name,
    check_writable,
    read_json,
    run_layout,
)
from pipelines.phase1 import Phase1Slot, Phase1Source, check_phase1_source, existing_phase1
from pipelines.records import PipelineRecord, Stage1Record, canon, normalized_config
from pipelines.store import check_store_units, open_store, progress_unit, trial_unit
from pmnet.store_progress import check_progress
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
    # the Ray address the run recorded (pipeline.json), not --ray-address / RAY_ADDRESS
    ray_address_recorded: bool = False
    num_cpus: int | None = None
    stage1_cpus: float | None = None  # None: every CPU of the largest node
    resumed: bool = False
    # `--phase1-from`'s checkpoint, which Stage 1 copies in instead of training
    phase1_from: Phase1Source | None = None
    # the nodes the pipeline runs on, as planning saw them (`pipelines.cluster`)
    cluster: ClusterInfo | None = None
    memory: dict = field(default_factory=dict)  # per arm, its GPU peak (for the log)
    # the Ray nodes (NodeIDs) that saw the storage root when planning checked it (a cluster)
    storage_nodes: frozenset = frozenset()
    max_wall_s: float | None = None  # --max-wall (stop between waves)

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def phase1_slots(self) -> list[Phase1Slot]:
        """The Phase-1 checkpoints Stage 1 provides: one, or one per Phase-1 seed of the
        grid (`Space.phase1_seeds`)."""
        return [Phase1Slot(k, self.cfg if k is None else dataclasses.replace(
            self.cfg, phase1_seed=k), self.layout.phase1_dir_for(k),
            self.layout.phase1_scratch(k)) for k in self.space.phase1_keys]


def choose_preset(preset: str | None, cluster: ClusterInfo) -> tuple[str, str]:
    """(preset, why): an explicit preset wins; else `default_preset` for GPU nodes when a node
    of the cluster has a GPU (Ray's resources, not the driver's own torch), else for CPUs."""
    from pmnet.config import default_preset

    if preset:
        return preset, "given with --preset / PRESET="
    if cluster.has_gpu:
        return default_preset("gpu"), (f"{len(cluster.gpu_nodes)} node(s) of {cluster.where} "
                                       "have a GPU")
    return default_preset("cpu"), f"no node of {cluster.where} has a GPU"


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
    parts = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    try:
        return tuple(kind(p) for p in parts)
    except ValueError as e:
        raise PipelineError(f"cannot read {value!r} as a list of {kind.__name__}: {e}") from e


def build_space(cfg, *, grid: str = "default", gpu: bool = False, conditions=None,
                seeds=None, variants=None, cpus_per_trial=None, gpus_per_trial=None,
                max_concurrent=None, max_failures=None, overrides=None,
                phase1_seeds=None) -> Space:
    """The grid function's Space with the command line's changes, validated (each variant's
    TrainConfig built from `cfg`). `variants` narrows the grid's variants by name;
    `overrides` (the `--set` fields) must not be fields that the grid's variants set."""
    from pmnet.train import ALL_CONDITIONS

    space = get_space(grid)(cfg, gpu=gpu)
    if variants is not None:
        space = space.only_variants(_parse_list(variants, str))
    changes = {k: v for k, v in {
        "conditions": _parse_list(conditions, str), "seeds": _parse_list(seeds, int),
        "phase1_seeds": _parse_list(phase1_seeds, int), "cpus_per_trial": cpus_per_trial,
        "gpus_per_trial": gpus_per_trial,
        "max_concurrent": max_concurrent, "max_failures": max_failures,
    }.items() if v is not None}
    if "conditions" in changes:  # a narrowed grid diagnoses what it still runs
        changes["diagnose"] = tuple(c for c in space.diagnose if c in changes["conditions"])
    if changes:
        space = space.derive(**changes)
    space = space.validate(ALL_CONDITIONS, cfg)
    clash = sorted({k for v in space.variants for k, _ in v.overrides} & set(overrides or {}))
    if clash:
        raise PipelineError(
            f"--set {', '.join(clash)}: grid {space.name!r} sets "
            f"{'this field' if len(clash) == 1 else 'these fields'} in its variants "
            f"({', '.join(v.describe() for v in space.variants if v.overrides)}), which would "
            "silently override it; leave it out, or pick variants with --variants")
    if space.phase1_seeds and "phase1_seed" in (overrides or {}):
        raise PipelineError(
            f"--set phase1_seed: grid {space.name!r} trains one Phase-1 checkpoint per Phase-1 "
            f"seed ({', '.join(str(k) for k in space.phase1_seeds)}), so a single phase1_seed "
            "would be overridden; leave it out, or give the seeds with --phase1-seeds")
    return space


def plan_new(*, root: str | os.PathLike, name: str | None = None, preset: str | None = None,
             grid: str = "default", overrides: dict | None = None, conditions=None,
             seeds=None, variants=None, cpus_per_trial=None, gpus_per_trial=None,
             max_concurrent=None, max_failures=None, tracking_uri: str | None = None,
             ray_address: str | None = None, num_cpus: int | None = None,
             stage1_cpus: float | None = None,
             phase1_from: str | os.PathLike | None = None, phase1_seeds=None,
             check_tracking: bool = True, cluster: ClusterInfo | None = None,
             gpu_mem_gib: float | None = None, allow_cpu_paper: bool = False,
             store: str | os.PathLike | None = None, max_wall_s: float | None = None) -> Plan:
    """A new pipeline's plan (the arguments are `start`'s flags, pipelines.run). `cluster`:
    the nodes to plan for (default: `describe_cluster`, without starting Ray)."""
    from pmnet.train import TrainConfig

    check_compute_flags(num_cpus=num_cpus, stage1_cpus=stage1_cpus, gpu_mem_gib=gpu_mem_gib,
                        max_wall_s=max_wall_s)
    root = check_writable(storage_root(root))  # before Ray is asked: a bad root costs nothing
    if store is not None:
        store = open_store(store).root
    ray_address = check_ray_address(ray_address or os.environ.get("RAY_ADDRESS"))
    on_cluster = bool(ray_address) and cluster is None  # a running cluster, asked here
    if cluster is None:
        cluster = describe_cluster(ray_address, num_cpus)
    preset, reason = choose_preset(preset, cluster)
    overrides = dict(overrides or {})
    try:
        cfg = TrainConfig.from_name(preset, **overrides)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"bad training configuration: {e}") from e
    gpu = cluster.has_gpu if gpus_per_trial is None else bool(gpus_per_trial)
    space = build_space(cfg, grid=grid, gpu=gpu, conditions=conditions, seeds=seeds,
                        variants=variants, cpus_per_trial=cpus_per_trial,
                        gpus_per_trial=gpus_per_trial, max_concurrent=max_concurrent,
                        max_failures=max_failures, overrides=overrides,
                        phase1_seeds=phase1_seeds)
    name = check_name(name or f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    uri = requested_tracking_uri(tracking_uri)
    if uri and check_tracking:
        check_tracking_uri(uri)
    plan = Plan(layout=Layout(root, name, store=store), cfg=cfg, space=space,
                preset_reason=reason, overrides=overrides, tracking_uri=uri,
                ray_address=ray_address, num_cpus=num_cpus, stage1_cpus=stage1_cpus,
                cluster=cluster, max_wall_s=max_wall_s)
    fit_to_cluster(plan, explicit_gpus=gpus_per_trial is not None, gpu_mem_gib=gpu_mem_gib,
                   allow_cpu_paper=allow_cpu_paper)
    return _validate(plan, phase1_from, on_cluster)


def check_compute_flags(*, num_cpus=None, stage1_cpus=None, gpu_mem_gib=None,
                        max_wall_s=None) -> None:
    """The numeric compute flags, before the cluster is asked (their types too: a Python
    caller has no argparse)."""
    if max_wall_s is not None and (isinstance(max_wall_s, bool) or not isinstance(
            max_wall_s, (int, float)) or not max_wall_s > 0):  # (NaN too)
        raise PipelineError(f"--max-wall must be a positive number of seconds, got "
                            f"{max_wall_s!r}")
    if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, int)
                                 or num_cpus < 1):
        raise PipelineError(f"--num-cpus must be a positive integer, got {num_cpus!r}")
    if stage1_cpus is not None and not stage1_cpus > 0:
        raise PipelineError(f"--stage1-cpus must be > 0, got {stage1_cpus!r}")
    if gpu_mem_gib is not None and not (isinstance(gpu_mem_gib, (int, float))
                                        and 0 < gpu_mem_gib < 10_000):
        raise PipelineError(f"--gpu-mem must be the memory of one GPU in GiB (e.g. 24 or 80), "
                            f"got {gpu_mem_gib!r}")


# -- resources: what the grid asks of the cluster, checked before anything is written -------


def uses_gpu(plan: Plan) -> bool:
    """Whether the trials (and so Stage 1) train on GPUs."""
    return plan.space.gpus_per_trial > 0


def _arm(condition: str, variant: str) -> str:
    return f"{condition}-{variant}" if variant else condition


#: Milliseconds of one fp32 training step of the paper model per two-segment episode on 2
#: cores: 4,744 ms per step of batch 64 (`benchmarks/bench_model.py --preset paper --dtypes
#: fp32`, benchmarks/results/paper-cpu-20261122-032347.json; no optimizer step or evaluation).
PAPER_MS_PER_EPISODE_2_CORES = 4744.2 / 64


def cpu_days(cfg, n_trials: int, cpus: float) -> float:
    """A lower bound on the days a pipeline of TrainConfig `cfg` takes on `cpus` CPU cores:
    Phase 0, then Phase 1 and each of `n_trials` trials stopped at their first chance
    (patience + 1 epochs), spread perfectly over the cores."""
    episodes = (cfg.phase0_steps * cfg.batch_size
                + min(cfg.phase1_patience + 1, cfg.phase1_max_epochs)
                * cfg.phase1_episodes_per_epoch
                + n_trials * min(cfg.patience + 1, cfg.max_epochs) * cfg.episodes_per_epoch)
    core_s = episodes * PAPER_MS_PER_EPISODE_2_CORES / 1000 * 2
    return core_s / max(1.0, float(cpus)) / 86400


def fit_to_cluster(plan: Plan, *, explicit_gpus: bool = False,
                   gpu_mem_gib: float | None = None, allow_cpu_paper: bool = False) -> Plan:
    """Check every resource the pipeline will ask for against `plan.cluster`, and choose each
    arm's GPU share from the memory model (unless --gpus-per-trial gave one, which is then
    checked against it). PipelineError naming the problem; nothing is started or written."""
    from pmnet.gpu.footprint import StepSpec, describe_bytes, gpu_share, trial_memory, usable_bytes

    cluster, sp, cfg = plan.cluster, plan.space, plan.cfg
    gpu = uses_gpu(plan)
    where = cluster.where
    problem = resource_problem(plan, cluster)
    if problem:
        raise PipelineError(problem + ("; use --gpus-per-trial 0 (or a CPU preset)"
                                       if gpu and not cluster.has_gpu
                                       else "; lower --cpus-per-trial"))
    if gpu:  # issue 36: nvidia-smi sees a card, but the torch that would train cannot use it
        blind = [n for n in cluster.gpu_nodes if n.torch is not None and not n.torch.ok]
        if blind:
            n = blind[0]
            raise PipelineError(
                f"node {n.label}: nvidia-smi sees {len(n.cards) or n.gpus:g} GPU(s) but its "
                f"Python cannot use them ({n.torch.describe()}); install a CUDA build of "
                "torch in the environment the pipeline runs in (make: TORCH_SPEC=...), or "
                "train on CPUs (--gpus-per-trial 0 with a CPU preset)")
    kind = "GPU node" if gpu else "node"
    largest = cluster.largest_cpus(gpu=gpu)
    if plan.stage1_cpus is not None and plan.stage1_cpus > largest:
        raise PipelineError(
            f"--stage1-cpus {plan.stage1_cpus:g}: Stage 1 runs on one {kind} and the largest "
            f"of {where} has {largest:g} CPUs ({cluster.describe()})")
    if cfg.needs_gpu and not gpu and not allow_cpu_paper:
        from pmnet.config import default_preset

        total = sum(n.cpus for n in cluster.nodes)
        on_cpu = default_preset("cpu")
        raise PipelineError(
            f"the {cfg.preset} preset is built for a GPU, and its trials would train on CPUs "
            f"here (no GPU on the chosen nodes of {where}): the whole pipeline would take at "
            f"least {cpu_days(cfg, sp.n_trials, total):,.0f} days on {total:g} CPU cores "
            f"({PAPER_MS_PER_EPISODE_2_CORES:.1f} ms per episode on 2 cores, measured for "
            f"the paper model). Run it where a GPU is, or choose the {on_cpu} preset "
            f"(PRESET={on_cpu}), or pass --allow-cpu-paper if you mean it")
    if not gpu:
        return plan
    card = int(gpu_mem_gib * 2**30) if gpu_mem_gib is not None else cluster.card_bytes
    if card is None:
        raise PipelineError(
            f"the memory of the GPUs of {where} is unknown (nvidia-smi gave nothing there: "
            f"{cluster.describe()}); give each GPU's memory with --gpu-mem GiB (e.g. 24)")
    memories = {}  # each arm's (condition x variant) peak, in the precision it trains in
    for v in sp.variants:
        vcfg = v.apply(cfg)
        for c in sp.conditions:
            memories[(c, v.name)] = trial_memory(vcfg.model, c, batch_size=vcfg.batch_size,
                                                 precision=cfg.resolved_precision("gpu"),
                                                 spec=StepSpec.from_config(vcfg))
    plan.memory = {k: m.peak for k, m in memories.items()}
    usable = usable_bytes(card)
    card_s = f"a {card / 2**30:.0f} GiB card ({describe_bytes(usable)} usable)"
    how = f"`pmnet info --preset {cfg.preset} --gpu-mem {card / 2**30:.0f}` shows every figure"
    if explicit_gpus:
        for (c, v), m in memories.items():
            if m.peak > sp.gpus_per_trial * usable:
                raise PipelineError(
                    f"--gpus-per-trial {sp.gpus_per_trial:g}: a trial of {_arm(c, v)} needs "
                    f"{describe_bytes(m.peak)} of GPU memory at batch {m.batch_size} in "
                    f"{m.precision}, more than {sp.gpus_per_trial:g} of {card_s}; raise it, "
                    f"or leave it out and each condition gets its share ({how})")
        return plan
    shares = []
    for (c, v), m in memories.items():
        share = gpu_share(m.peak, card)
        if share is None:
            raise PipelineError(
                f"a trial of {_arm(c, v)} needs {describe_bytes(m.peak)} of GPU memory at batch "
                f"{m.batch_size} in {m.precision}, more than {card_s}: it cannot run there. "
                f"Leave it out (--conditions / CONDITIONS=), use larger GPUs, or lower "
                f"batch_size (--set batch_size=..., not the paper's) ({how})")
        shares.append((c, v, share.fraction))
    plan.space = sp.derive(gpu_shares=tuple(shares),
                           gpus_per_trial=max(f for _, _, f in shares)).validate(
        list(sp.conditions), None)
    return plan


def resource_problem(plan: Plan, cluster: ClusterInfo) -> str | None:
    """Why the grid cannot run on `cluster`, None when it can."""
    sp = plan.space
    gpu = uses_gpu(plan)
    if gpu and not cluster.has_gpu:
        return (f"the grid asks {sp.gpus_per_trial:g} GPU per trial but no node of "
                f"{cluster.where} has a GPU ({cluster.describe()})")
    largest = cluster.largest_cpus(gpu=gpu)
    if sp.cpus_per_trial > largest:
        return (f"the grid asks {sp.cpus_per_trial:g} CPUs per trial but the largest "
                f"{'GPU node' if gpu else 'node'} of {cluster.where} has {largest:g} "
                f"({cluster.describe()})")
    return None


def grid_record(space: Space) -> dict:
    """pipeline.json's `grid`: what identifies the experiment's trials. The variants (names
    and overrides) only when the grid has named ones, so a pipeline recorded before variants
    existed still matches its own configuration."""
    grid: dict[str, Any] = {"conditions": list(space.conditions), "seeds": list(space.seeds)}
    if space.has_variants:
        grid["variants"] = canon({v.name: v.as_dict() for v in space.variants})
    return grid


def _check_existing(plan: Plan) -> None:
    """A pipeline name that exists must describe the same experiment (then it continues)."""
    lay = plan.layout
    if read_json(lay.pipeline_json) is None:
        if lay.run_dir.exists() and any(lay.run_dir.iterdir()):
            raise PipelineError(f"{lay.run_dir} exists and is not a pipeline directory; "
                                "choose another --name")
        return
    stored = {"train_config": normalized_config(read_json(lay.config_json)),
              "grid": PipelineRecord.read(lay.pipeline_json).grid}
    mine = {"train_config": canon(plan.cfg.to_dict()), "grid": grid_record(plan.space)}
    if stored != mine:
        a, b = stored["train_config"] or {}, mine["train_config"]
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        diff += ["grid"] if stored["grid"] != mine["grid"] else []
        raise PipelineError(
            f"pipeline {plan.name!r} already exists under {lay.root} with a different "
            f"configuration ({', '.join(diff) or 'config'} differ); use another --name, "
            f"or `resume` to continue it as it was")
    plan.resumed = True


def plan_resume(*, root: str | os.PathLike, name: str | None = None,
                tracking_uri: str | None = None, ray_address: str | None = None,
                num_cpus: int | None = None,
                stage1_cpus: float | None = None, cluster: ClusterInfo | None = None,
                check_resources: bool = True, max_wall_s: float | None = None) -> Plan:
    """The plan of an existing pipeline from its pipeline.json/config.json: its grid,
    resources and `max_failures` are the stored ones, checked against the cluster found now
    unless `check_resources` is False (`report` computes nothing)."""
    from pipelines.layout import last_pipeline
    from pmnet.train import ALL_CONDITIONS, TrainConfig

    root = storage_root(root)
    name = check_name(name) if name else last_pipeline(root)
    lay = run_layout(root, name)
    meta, cfg_d = read_json(lay.pipeline_json), read_json(lay.config_json)
    if not lay.pipeline_json.is_file():
        raise PipelineError(f"no pipeline {name!r} under {root} (no {lay.pipeline_json})")
    for path, obj in ((lay.pipeline_json, meta), (lay.config_json, cfg_d)):
        if not isinstance(obj, dict):
            raise PipelineError(f"{path} is missing or not a JSON object; the pipeline's "
                                "record is damaged (restore it, or start a new --name)")
    check_writable(root)
    try:
        cfg = TrainConfig.from_dict(cfg_d)
    except (TypeError, ValueError, KeyError) as e:
        raise PipelineError(f"{lay.config_json} is not a valid TrainConfig ({e}); restore "
                            "it, or start a new --name") from e
    meta = PipelineRecord.from_dict(meta)
    if not isinstance(meta.space, dict):
        raise PipelineError(f"{lay.pipeline_json} has no 'space' record (the grid and its "
                            "resources); restore it, or start a new --name")
    try:
        space = Space.from_dict(meta.space).validate(ALL_CONDITIONS, cfg)
    except (TypeError, ValueError, KeyError) as e:
        raise PipelineError(f"{lay.pipeline_json}: its 'space' record is not valid ({e})"
                            ) from e
    if meta.pieces is not None:  # a run recorded before issue 51: its piece is its grid
        space = space.derive(phase1_seeds=tuple(meta.pieces))
    stored_uri = meta.tracking
    uri = requested_tracking_uri(tracking_uri)
    if uri is None and stored_uri not in (None, EMBEDDED):
        uri = stored_uri
    if uri:
        check_tracking_uri(uri)
    if stage1_cpus is None:  # the one the run last ran with
        stage1_cpus = meta.stage1_cpus
    check_compute_flags(num_cpus=num_cpus, stage1_cpus=stage1_cpus, max_wall_s=max_wall_s)
    ray_address, recorded = resume_ray_address(ray_address, meta, lay,
                                               use_recorded=check_resources)
    on_cluster = bool(ray_address) and cluster is None and check_resources
    if cluster is None and check_resources:
        cluster = describe_cluster(ray_address, num_cpus)
    if lay.store_elsewhere and check_resources:  # `report` reads it without this check
        open_store(lay.store)
    plan = Plan(layout=lay, cfg=cfg, space=space, preset_reason=meta.preset_reason or "",
                overrides=meta.overrides, tracking_uri=uri,
                ray_address=ray_address, ray_address_recorded=recorded, num_cpus=num_cpus,
                stage1_cpus=stage1_cpus, resumed=True, cluster=cluster,
                max_wall_s=max_wall_s)
    problem = resource_problem(plan, cluster) if check_resources else None
    if problem:
        raise PipelineError(f"pipeline {name!r} cannot continue here: {problem}")
    src = meta.phase1_from  # imported, then removed: import it again (checked again)
    again = src.get("checkpoint", "") if isinstance(src, dict) and not \
        plan.layout.units.phase1_ckpt(src.get("slot_seed")).is_file() else None
    return _validate(plan, again, on_cluster, store=check_resources)


def resume_ray_address(given: str | None, meta: PipelineRecord, lay: Layout, *,
                       use_recorded: bool = True) -> tuple[str | None, bool]:
    """(the Ray address a resume runs on, whether it is the recorded one): --ray-address,
    else RAY_ADDRESS, else (`use_recorded`) pipeline.json's `ray_address`, so that a cluster
    run resumes on its cluster; checked as a given one is."""
    requested = given or os.environ.get("RAY_ADDRESS")
    recorded = meta.ray_address if use_recorded else None
    if requested or not recorded:
        return check_ray_address(requested), False
    try:
        return check_ray_address(recorded), True
    except PipelineError as e:
        raise PipelineError(
            f"pipeline {lay.name!r} last ran on the Ray cluster {recorded} (recorded in "
            f"{lay.pipeline_json}), which a resume uses again: {e}. To continue it on local "
            "Ray pass --ray-address local (RAY_ADDRESS=local), or give the cluster's new "
            "address with --ray-address / RAY_ADDRESS") from e


def _validate(plan: Plan, phase1_from=None, on_cluster: bool = False,
              store: bool = True) -> Plan:
    """What both plans check last, reading only: `--phase1-from`, the name, the run's own
    Phase-1 checkpoints (a `--store`'s damaged ones are the driver's quarantine's, so one
    machine's damage stops no other), the store's units and paused progress (`store`), and
    last, on a running cluster, that every node sees the storage root."""
    if phase1_from is not None:
        plan.phase1_from = check_phase1_source(phase1_from, plan.phase1_slots)
    if not plan.resumed:
        _check_existing(plan)
    src = plan.phase1_from
    for slot in [] if plan.layout.store_elsewhere else plan.phase1_slots:
        digest = existing_phase1(slot)
        if src is not None and src.slot_seed == slot.seed and digest not in (None, src.sha256):
            raise PipelineError(
                f"pipeline {plan.name!r} already has a Phase-1 checkpoint in {slot.dir} "
                f"(sha256 {digest[:12]}...) that is not the one --phase1-from names "
                f"({src.sha256[:12]}...); use another --name")
    units = plan.layout.units
    if store:
        check_store_units(units, plan.cfg, plan.space, plan.phase1_slots, plan.space.trials)
        for slot in plan.phase1_slots:  # issue 52: a paused unit's progress, of its config
            check_progress(units, progress_unit(slot))
        for trial in plan.space.trials:  # issue 61: a paused trial's, also of its checkpoint
            if units.trial_progress(trial).is_dir():
                p1 = Stage1Record.read(units.stage1_json(trial.phase1_seed)).sha256
                check_progress(units, trial_unit(trial, plan.space.trial_config(plan.cfg, trial),
                                                 p1, plan.layout.trial_dir(trial)))
    if on_cluster:  # last: every input is valid, and nothing was written yet
        plan.storage_nodes = frozenset(check_storage(plan.layout.root))
    return plan


def check_ray_address(address: str | None, timeout: float = 3.0) -> str | None:
    """None/'' and 'local' (local Ray: this pipeline's own loopback-only instance), 'auto',
    or HOST:PORT / ray://HOST:PORT that accepts a TCP connection within `timeout` seconds
    (Ray itself waits minutes on a dead address). An http(s):// address (the dashboard's,
    which `ray job submit` takes) is refused with the GCS address to use instead."""
    address = (address or "").strip()
    if not address or address.lower() == "local":
        return None  # Ray's "local" means a new local instance: ours, loopback only
    if address == "auto":
        return address
    if address.lower().startswith(("http://", "https://")):
        raise PipelineError(
            f"Ray address {address!r} is a dashboard / job-submission URL (for `ray job "
            "submit`); the pipeline connects as a driver: use the head's HOST:6379 (the "
            "address `ray start --head` prints) or ray://HOST:10001, in --ray-address / "
            "RAY_ADDRESS, or unset RAY_ADDRESS to run on local Ray")
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PipelineError(f"Ray address {address!r} is not HOST:PORT (or ray://HOST:PORT, "
                            "auto); check --ray-address / RAY_ADDRESS")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise PipelineError(f"no Ray cluster answers at {address} ({e.strerror or e}); start "
                            "it (`ray start --head`), fix --ray-address / RAY_ADDRESS, or "
                            "unset RAY_ADDRESS to run on local Ray") from e
    return address
