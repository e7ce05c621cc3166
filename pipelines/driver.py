"""The pipeline driver: runs a validated `Plan` (pipelines.plan) through the three stages.

`execute(plan)` opens the MLflow runs and starts Ray, then Stage 1 (Phase 0/1
once), Stage 2 (the Tune grid) and Stage 3 (statistics and report) from pipelines.stages,
and writes the pipeline's records. Planning and validation live in pipelines.plan, Ray set-up
in pipelines.cluster, MLflow (the driver is its only writer) in pipelines.tracking.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from pipelines.cluster import ClusterInfo, check_storage, describe_ray, init_ray
from pipelines.console import say
from pipelines.faults import kill_point
from pipelines.layout import PipelineError
from pipelines.lock import RunLock
from pipelines.plan import Plan, resource_problem, uses_gpu
from pipelines.stages import (
    adopt_phase1,
    stage1_finish,
    stage1_start,
    stage2,
    stage3,
    timing_record,
    write_meta,
)
from pipelines.tracking import Runs, backfill_results, open_tracking


def execute(plan: Plan) -> int:
    """Run (or continue) the pipeline under its run lock. Returns 0 when every trial
    finished, 1 otherwise; DriverRunning (nothing written) when another driver holds it."""
    lock = RunLock(plan.layout.run_dir, plan.name).acquire()
    try:
        return _execute(plan)
    finally:
        lock.release()


def _execute(plan: Plan) -> int:
    t_start = time.time()
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    lay = plan.layout
    lay.run_dir.mkdir(parents=True, exist_ok=True)
    lay.logs_dir.mkdir(parents=True, exist_ok=True)
    say.log_path = lay.logs_dir / "driver.log"
    write_meta(plan, status="running",
               driver={"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
               **({"store": str(plan.store.root),
                   "pieces": list(plan.pieces) if plan.pieces is not None else None,
                   "max_wall_s": plan.max_wall_s} if plan.store is not None else {}))
    lay.last_file.write_text(plan.name + "\n")
    sp = plan.space
    kill_point("start")
    say(f"[pipeline] {plan.name}: preset {plan.cfg.preset} ({plan.preset_reason}); "
        f"{'continuing' if plan.resumed else 'new'} run in {lay.run_dir}")
    say(f"[pipeline] grid {sp.name}: {sp.size}; {sp.describe_resources()}, "
        f"max_failures {sp.max_failures}")
    if plan.memory:
        say("[pipeline] GPU memory per trial (memory model, pmnet/gpu/footprint.py): "
            + ", ".join(f"{c}{'-' + v if v else ''} {b / 2**30:.1f} GiB"
                        for (c, v), b in plan.memory.items()))

    runs = Runs()
    ray = None
    if plan.store is not None:
        from pipelines.store import init_store
        from pipelines.store_repair import quarantine_damaged

        init_store(plan.store)
        quarantine_damaged(plan.store)  # adoption below sees whole units only (issue 53)
        if _past_deadline(plan, t_start):
            return _stop_at_deadline(plan)
    try:
        t_ray = time.time()
        ray = init_ray(plan.ray_address, plan.num_cpus, plan.cluster)
        cluster = check_cluster(plan, ray)
        where = f"Ray cluster {plan.ray_address}" if plan.ray_address else "local Ray"
        say(f"[pipeline] {where} up in {time.time() - t_ray:.1f} s ({cluster.describe()})")
        if plan.store is not None:
            return execute_waves(plan, ray, cluster, t_start)
        t_stage1 = time.time()
        jobs = stage1_start(plan, ray, cluster)
        kill_point("stage1-submitted")
        runs = open_tracking(plan)
        p1 = stage1_finish(plan, ray, jobs, runs)
        stage1_wall = time.time() - t_stage1
        s2 = stage2(plan, runs, p1)
        kill_point("stage2-done")
        backfill_results(lay, runs)  # what trials could not log to MLflow, from their results
        status = "finished" if s2["errored"] == 0 and s2["finished"] == sp.n_trials else "failed"
        # the report reads both records
        timing = timing_record(plan, t_start, s2, p1.train_time_s, stage1_wall)
        write_meta(plan, status=status)
        kill_point("stage3-start")
        stage3(plan, runs)
        if runs.parent:
            runs.safe("timing", runs.tracker.log_metrics, runs.parent,
                      {f"pipeline/{k}": v for k, v in timing.to_dict().items()
                       if isinstance(v, (int, float))})
            runs.safe("finish", runs.tracker.finish, runs.parent,
                      "FINISHED" if status == "finished" else "FAILED")
        say(f"[pipeline] {status}: {s2['finished']}/{sp.n_trials} trials finished, "
            f"{s2['errored']} errored; wall {timing.wall_s:.1f} s "
            f"(trials' own training {timing.sum_trial_train_s:.1f} s)")
        say(f"[pipeline] results: {lay.results_dir}   report: {lay.report_dir}")
        if status != "finished":
            say("[pipeline] unfinished or errored trials continue from their checkpoints with "
                f"`make resume NAME={plan.name}` (python -m pipelines.run resume --name "
                f"{plan.name} --root {lay.root}); `make status` shows their errors")
        say(f"[pipeline] MLflow: {ui_hint(plan, runs)}")
        kill_point("end")
        return 0 if status == "finished" else 1
    except BaseException:
        write_meta(plan, status="interrupted")
        if runs.parent:
            runs.safe("finish", runs.tracker.finish, runs.parent, "FAILED")
        raise
    finally:
        if ray is not None:
            try:
                ray.shutdown()
            except Exception:
                pass


def check_cluster(plan: Plan, ray) -> ClusterInfo:
    """What must hold before Stage 1: the grid still fits the running cluster (planning
    checked it; a cluster can change since), and every node sees the root. Returns the
    cluster as it is now (local Ray: as planned)."""
    cluster = plan.cluster if (plan.cluster is not None and not plan.ray_address) \
        else describe_ray(ray)
    problem = resource_problem(plan, cluster)
    if problem:
        raise PipelineError(f"the cluster changed since planning: {problem}")
    checked = check_storage(plan.layout.root, ray, skip=plan.storage_nodes)
    if plan.ray_address:
        say(f"[pipeline] all {len(checked)} Ray nodes see the storage root {plan.layout.root}")
    return cluster


def ui_hint(plan: Plan, runs: Runs) -> str:
    """Where to see this pipeline's training runs in the MLflow UI."""
    from pipelines.tracking_uri import UI_DEFAULT, ui_address

    if runs.experiment_id is None:
        return "not tracked (MLflow failed; `make resume` logs the runs from the results)"
    from pipelines.addresses import database_backend, hide_password

    uri = plan.tracking_uri
    if uri is None or uri.startswith("sqlite:") or database_backend(uri):
        cmd = f"make ui RUNS={plan.layout.root}" if uri is None else \
            f"mlflow ui --backend-store-uri {hide_password(uri)}"
        return f"`{cmd}`, then open {ui_address(UI_DEFAULT, runs.experiment_id)}"
    return f"open {ui_address(hide_password(uri), runs.experiment_id)}"



# -- a run into a store: waves of Phase-1 checkpoints ----------------------------------------


def wave_size(plan: Plan, cluster: ClusterInfo) -> int:
    """How many Phase-1 checkpoints train at once in a wave: one per GPU with GPU trials,
    else one per `--stage1-cpus` CPUs (default 1) of the cluster."""
    if uses_gpu(plan):
        return max(1, int(sum(n.gpus for n in cluster.nodes)))
    per = float(plan.stage1_cpus or 1.0)
    return max(1, int(sum(n.cpus for n in cluster.nodes) // per))


def wave_plan(plan: Plan, seeds: list) -> Plan:
    """The plan narrowed to one wave's Phase-1 checkpoints, with its own Tune experiment
    (`stage2-p1s<k>...`; `stage2` for a grid's single checkpoint)."""
    from pipelines.layout import EXPERIMENT_DIRNAME, Layout

    keys = [k for k in seeds if k is not None]
    tag = EXPERIMENT_DIRNAME + ("-p1s" + "-".join(map(str, keys)) if keys else "")
    return dataclasses.replace(
        plan, space=plan.space.derive(phase1_seeds=tuple(keys)),
        layout=Layout(plan.layout.root, plan.layout.name, experiment=tag))


def _past_deadline(plan: Plan, t_start: float) -> bool:
    return plan.max_wall_s is not None and time.time() - t_start >= plan.max_wall_s


def _stop_at_deadline(plan: Plan) -> int:
    """One line: what of this run's piece is not in the store, and how to continue."""
    from pipelines.store import units_left

    p1, tr = units_left(plan.store, plan.piece_slots, plan.piece_trials)
    left = [s.seed for s in plan.piece_slots if not plan.store.stage1_json(s.seed).is_file()
            or any(not plan.store.result(t).is_file() for t in plan.piece_trials
                   if t.phase1_seed == s.seed)]
    seeds = ",".join(str(k) for k in left if k is not None)
    write_meta(plan, status="stopped")
    say(f"[pipeline] stopped at --max-wall {plan.max_wall_s:g} s: {p1} Phase-1 and {tr} trial "
        f"unit(s) of this run not in the store {plan.store.root}; continue with `make resume "
        f"NAME={plan.name} RUNS={plan.layout.root}` (python -m pipelines.run resume --name "
        f"{plan.name} --root {plan.layout.root})"
        + (f", or on another machine `make pipeline STORE={plan.store.root} "
           f"PHASE1_SEEDS={seeds} ...`" if seeds else ""))
    return 0


def _stop_paused(plan: Plan, wave: list, paused: dict) -> int:
    """A wave's Phase 1 stopped at an epoch end (`paused`: Phase-1 seed -> Phase1Paused) or
    the driver got a SIGTERM: publish each paused unit's progress, record the run as
    stopped and say, in one line, what is left and how to continue (here or elsewhere).
    Returns 0, as a stop at --max-wall between waves does (issue 52)."""
    from pipelines.phase1_progress import publish_progress
    from pipelines.store import units_left

    for slot in wave:
        if slot.seed in paused:
            p = paused[slot.seed]
            publish_progress(plan.store, slot, p.reason, p.train_time_s)
    p1, tr = units_left(plan.store, plan.piece_slots, plan.piece_trials)
    store = plan.store
    left = [s.seed for s in plan.piece_slots if s.seed is not None and (
        not store.stage1_json(s.seed).is_file()
        or any(not store.result(t).is_file() for t in plan.piece_trials
               if t.phase1_seed == s.seed))]
    labels = {s.seed: s.label for s in wave}
    what = "; ".join(f"{labels[k]} after epoch {p.epochs_done} of {p.max_epochs} ({p.reason})"
                     for k, p in paused.items())
    write_meta(plan, status="stopped")
    lay = plan.layout
    say("[pipeline] stopped: "
        + (f"Phase 1 paused ({what}), its progress is in the store; " if paused else
           "SIGTERM before Stage 2; ")
        + f"{p1} Phase-1 and {tr} trial unit(s) of this run not in the store {store.root}; "
        f"continue with `make resume NAME={plan.name} RUNS={lay.root}` (python -m "
        f"pipelines.run resume --name {plan.name} --root {lay.root})"
        + (f", or on another machine with a copy of the store `make pipeline "
           f"STORE={store.root} PHASE1_SEEDS={','.join(map(str, left))} ...` (the same "
           "preset, grid and --set values)" if left else ""))
    return 0


def execute_waves(plan: Plan, ray, cluster: ClusterInfo, t_start: float) -> int:
    """A run into a store: its Phase-1 checkpoints in waves of `wave_size`: each wave
    adopts what the store has, trains and publishes its missing checkpoints, then runs the
    trials of those checkpoints (each trial publishes itself) before the next wave starts,
    so a run stopped between waves (`--max-wall`) leaves whole checkpoints. Returns 0 when
    every trial of the run's piece is in the store (or the deadline stopped it), else 1."""
    from pipelines import phase1_progress as pp
    from pipelines import store as st
    from pipelines.tracking import open_tracking

    slots = plan.piece_slots
    size = wave_size(plan, cluster)
    waves = [slots[i:i + size] for i in range(0, len(slots), size)]
    say(f"[store] {plan.store.root}: {len(slots)} Phase-1 checkpoint(s) of this run in "
        f"{len(waves)} wave(s) of up to {size}; {plan.space.name} trials follow each wave")
    runs = open_tracking(plan)
    totals = {"wall_s": 0.0, "finished": 0, "errored": 0, "sum_trial_train_s": 0.0,
              "compile_warm_s": 0.0}
    p1_train = stage1_wall = 0.0
    digests: dict = {}
    stop_file = pp.stop_file(plan.layout.run_dir)  # issue 52: a SIGTERM writes it
    stop_file.unlink(missing_ok=True)
    for wave in waves:
        if _past_deadline(plan, t_start):
            return _stop_at_deadline(plan)
        wplan = wave_plan(plan, [s.seed for s in wave])
        trials = wplan.space.trials
        if st.units_left(plan.store, wave, trials) == (0, 0):
            say(f"[store] {', '.join(s.label for s in wave)}: every unit is in the store")
            continue
        for slot in wave:
            adopt_phase1(wplan, slot)
        n = st.adopt_results(wplan, trials)
        if n:
            say(f"[store] adopted {n} stored result(s) of this wave")
        provs = {}
        for slot in wave:
            config, digest = st.phase1_unit_config(slot)
            provs[slot.seed] = st.start_provenance(
                unit=slot.label, kind="phase1", config=config, digest=digest,
                run=str(plan.layout.run_dir), accelerator="gpu" if uses_gpu(plan) else "cpu")
            if not plan.store.stage1_json(slot.seed).is_file():
                st.write_started(plan.store, plan.store.phase1_provenance(slot.seed),
                                 plan.store.stage1_json(slot.seed), provs[slot.seed],
                                 slot.dir / "provenance.json")

        def publish(job, res, provs=provs):
            prov = provs[job.slot.seed]
            if res.get("device_kind"):
                prov = dataclasses.replace(prov, device=res["device_kind"])
            prov = dataclasses.replace(prov, threads=res.get("threads"))  # not in phase1.pt
            st.publish_phase1(plan.store, job.slot, prov)

        for slot in wave:  # issue 52: a unit's stored progress, where Phase 1 resumes
            pp.restore_progress(plan.store, slot)
        t1 = time.time()
        left = None if plan.max_wall_s is None else plan.max_wall_s - (time.time() - t_start)
        jobs = stage1_start(wplan, ray, cluster, deadline_s=left, stop_file=str(stop_file))
        kill_point("stage1-submitted")
        with pp.sigterm_writes_stop_file(stop_file):  # issue 52: SIGTERM pauses Phase 1
            p1 = stage1_finish(wplan, ray, jobs, runs, on_recorded=publish)
        stage1_wall += time.time() - t1
        p1_train += p1.train_time_s
        digests.update(p1.digests)
        for slot in wave:  # trained before a kill, or adopted: the store has it either way
            if slot.seed in p1.paused:
                continue
            if not plan.store.stage1_json(slot.seed).is_file():
                st.publish_phase1(plan.store, slot, provs[slot.seed])
            pp.drop_progress(plan.store, slot.seed)  # issue 52: the unit landed
            # another writer's, where it landed first
            p1.digests[slot.seed] = adopt_phase1(wplan, slot) or p1.digests[slot.seed]
        if p1.paused or stop_file.exists():  # issue 52: --max-wall or SIGTERM in Phase 1
            return _stop_paused(plan, wave, p1.paused)
        s2 = stage2(wplan, runs, p1)
        for k in totals:
            totals[k] += s2.get(k, 0.0)
        for t in trials:  # what a trial could not publish itself
            tdir, res = wplan.layout.trial_dir(t), wplan.layout.result_path(t)
            if res.is_file() and not plan.store.result(t).is_file():
                scratch = st.Provenance.read(tdir / "provenance.json")
                if scratch.config_hash:
                    say(f"[store] {t.name}: "
                        f"{st.publish_trial(plan.store, t, tdir, res, scratch)}")
    p1_left, tr_left = st.units_left(plan.store, slots, plan.piece_trials)
    totals["n_trials"] = len(plan.piece_trials)
    timing_record(plan, t_start, totals, p1_train, stage1_wall)
    status = "finished" if p1_left == tr_left == 0 else "failed"
    write_meta(plan, status=status, **({"phase1_sha256s": {str(k): v for k, v in
                                                           digests.items()}}
                                       if digests and None not in digests else {}))
    if runs.parent:
        runs.safe("finish", runs.tracker.finish, runs.parent,
                  "FINISHED" if status == "finished" else "FAILED")
    say(f"[pipeline] {status}: {len(plan.piece_trials) - tr_left}/{len(plan.piece_trials)} "
        f"trial unit(s) and {len(slots) - p1_left}/{len(slots)} Phase-1 unit(s) of this run "
        f"are in the store {plan.store.root}; report: `make report STORE={plan.store.root}`")
    return 0 if status == "finished" else 1
