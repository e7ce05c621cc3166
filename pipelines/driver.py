"""The pipeline driver: runs a validated `Plan` (pipelines.plan) through the three stages,
its Phase-1 checkpoints in waves (issue 51), as docs/design.md ("One run, from `make
pipeline` to the report") tells step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pipelines import store as st
from pipelines.cluster import ClusterInfo, check_storage, describe_ray, init_ray
from pipelines.console import say
from pipelines.faults import kill_point
from pipelines.layout import EXPERIMENT_DIRNAME, PipelineError, read_json
from pipelines.lock import run_lock
from pipelines.plan import Plan, resource_problem, uses_gpu
from pipelines.stages import (
    stage1,
    stage2,
    stage3,
    timing_record,
    write_meta,
)
from pipelines.tracking import Runs, mirror, open_tracking
from pmnet.store_layout import init_store, unit_name

#: the run's file a SIGTERM writes, which every Phase-1 task and trial polls at epoch ends
STOP_FILENAME = "phase1-stop.request"


def execute(plan: Plan) -> int:
    """Run (or continue) the pipeline under its run lock. Returns 0 when every trial
    finished, 1 otherwise; DriverRunning (nothing written) when another driver holds it."""
    with run_lock(plan.layout.run_dir, plan.name):
        return _execute(plan)


def _execute(plan: Plan) -> int:
    """The run's records, Ray, then each wave's missing checkpoints and their missing
    trials before the next wave (a stop between waves leaves whole units), then Stage 3
    (`finish`). 0, or 1 if a unit failed."""
    from pmnet.store_progress import drop_progress, restore_progress
    from pmnet.train import checkpoint_epoch

    t_start = time.time()
    deadline_at = None if plan.max_wall_s is None else t_start + plan.max_wall_s  # --max-wall
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    lay = plan.layout
    lay.run_dir.mkdir(parents=True, exist_ok=True)
    lay.logs_dir.mkdir(parents=True, exist_ok=True)
    say.log_path = lay.logs_dir / "driver.log"
    write_meta(plan, status="running", max_wall_s=plan.max_wall_s,
               store=str(lay.store),
               ray_address=plan.ray_address,  # a later resume runs there again
               stage1_cpus=plan.stage1_cpus,  # and with the same Stage-1 CPUs
               driver={"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
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
    if lay.store_elsewhere:  # a shared store is repaired, a run's own units refused (plan)
        from pmnet.store_repair import quarantine_damaged

        init_store(lay.units)
        quarantine_damaged(lay.units, say)  # the waves below see whole units only (issue 53)
    if deadline_at is not None and time.time() >= deadline_at:
        return _stop_at_deadline(plan)
    ray, runs = None, Runs()
    try:
        t_ray = time.time()
        ray = init_ray(plan.ray_address, plan.num_cpus, plan.cluster)
        cluster = check_cluster(plan, ray)
        where = f"Ray cluster {plan.ray_address}" if plan.ray_address else "local Ray"
        if plan.ray_address_recorded:
            where += (" (the address this run recorded; --ray-address local / "
                      "RAY_ADDRESS=local runs it here)")
        say(f"[pipeline] {where} up in {time.time() - t_ray:.1f} s ({cluster.describe()})")
        slots, units = plan.phase1_slots, lay.units
        size = wave_size(plan, cluster)
        waves = [slots[i:i + size] for i in range(0, len(slots), size)]
        if len(waves) > 1 or lay.store_elsewhere:
            say(f"[pipeline] {len(slots)} Phase-1 checkpoint(s) in {len(waves)} wave(s) of up to "
                f"{size}; the trials of each follow it; store {units.root}")
        totals = {"wall_s": 0.0, "finished": 0, "errored": 0, "sum_trial_train_s": 0.0,
                  "paused": 0}
        p1_train = stage1_wall = 0.0
        stopped = False
        accelerator = "gpu" if uses_gpu(plan) else "cpu"
        stop_file = lay.run_dir / STOP_FILENAME  # issue 52: a SIGTERM writes it
        stop_file.unlink(missing_ok=True)
        for i, wave in enumerate(waves):
            if i and deadline_at is not None and time.time() >= deadline_at:
                stopped = True
                break
            wplan = wave_plan(plan, wave)
            trials = wplan.space.trials
            for slot in wave:  # issue 52: a unit's progress in the store, where it resumes
                st.start_unit(units, slot, str(lay.run_dir), accelerator)
                restore_progress(units, st.progress_unit(slot), checkpoint_epoch, say)
            t1 = time.time()
            left = None if deadline_at is None else deadline_at - time.time()
            # issue 52: from submission to the last Phase-1 result, SIGTERM pauses Phase 1
            if runs.tracker is None:
                runs = open_tracking(plan)
            with sigterm_writes_stop_file(stop_file):
                p1 = stage1(wplan, cluster, runs, deadline_s=left, stop_file=str(stop_file))
            stage1_wall += time.time() - t1
            p1_train += p1.train_time_s
            for slot in wave:
                if slot.seed not in p1.paused:
                    drop_progress(units, slot.seed)  # issue 52: the unit landed
            if p1.paused or stop_file.exists():  # issue 52: --max-wall or SIGTERM in Phase 1
                _pause(plan, wave, p1.paused)
                stopped = "by SIGTERM" if stop_file.exists() else True
                break
            held = st.gated(units, plan.space.phase1_gate, [s.seed for s in wave])
            for k, v in held.items():  # their trials enter no claim (docs/pipeline.md)
                say(f"[stage 2/3] {unit_name(k)}: {plan.space.phase1_gate.describe(v)}: its "
                    "trials are held back by the grid's Phase-1 gate, not trained")
            if held and not (wave := [s for s in wave if s.seed not in held]):
                continue
            wplan = wave_plan(plan, wave) if held else wplan
            trials = wplan.space.trials
            if any((read_json(units.result(t)) or {}).get("phase1_sha256")
                   != p1.digests[t.phase1_seed] for t in trials):  # else: nothing to train
                # issue 61: --max-wall or a SIGTERM pauses a trial at an epoch end
                with sigterm_writes_stop_file(stop_file):
                    s2 = stage2(wplan, runs, p1, deadline_at=deadline_at,
                                stop_file=str(stop_file))
            else:
                say(f"[stage 2/3] every trial of {', '.join(s.label for s in wave)} has its "
                    "result from its checkpoint in the store")
                s2 = {"finished": len(trials)}
            for k in totals:
                totals[k] += s2.get(k, 0.0)
            kill_point("stage2-done")
            mirror(lay, runs, trials=plan.space.trials)  # MLflow mirrors the store
            if s2.get("paused") or stop_file.exists():  # issue 61: trials paused in the store
                stopped = "by SIGTERM" if stop_file.exists() else True
                break
        return finish(plan, runs, t_start, totals, p1_train, stage1_wall, stopped)
    except BaseException:
        if runs.parent:
            runs.safe("finish", runs.tracker.client.set_terminated, runs.parent, "FAILED")
        write_meta(plan, status="interrupted")
        raise
    finally:
        if ray is not None:
            try:
                ray.shutdown()
            except Exception:
                pass


def check_cluster(plan: Plan, ray) -> ClusterInfo:
    """The cluster as it is now (local Ray: as planned), checked again as planning did: the
    grid still fits it, and every node sees the root."""
    cluster = plan.cluster if (plan.cluster is not None and not plan.ray_address) \
        else describe_ray(ray)
    problem = resource_problem(plan, cluster)
    if problem:
        raise PipelineError(f"the cluster changed since planning: {problem}")
    checked = check_storage(plan.layout.root, ray, skip=plan.storage_nodes)
    if plan.ray_address:
        say(f"[pipeline] all {len(checked)} Ray nodes see the storage root {plan.layout.root}")
    return cluster


# -- every run: waves of Phase-1 checkpoints --------------------------------------------------


def wave_size(plan: Plan, cluster: ClusterInfo) -> int:
    """How many Phase-1 checkpoints train at once in a wave: one per GPU with GPU trials,
    else one per `--stage1-cpus` CPUs of the cluster; without `--stage1-cpus` on CPUs, all
    of them (Stage 1 shares the CPUs among its tasks, `stages.stage1_resources`)."""
    if uses_gpu(plan):
        return max(1, int(sum(n.gpus for n in cluster.nodes)))
    if not plan.stage1_cpus:
        return max(1, len(plan.phase1_slots))
    return max(1, int(sum(n.cpus for n in cluster.nodes) // float(plan.stage1_cpus)))


def wave_plan(plan: Plan, wave: list) -> Plan:
    """The plan narrowed to one wave's Phase-1 checkpoints, with its own Tune experiment
    (`stage2-p1s<k>...`); the plan itself when the wave holds all of them (`stage2`)."""
    if len(wave) == len(plan.phase1_slots):
        return plan
    keys = [s.seed for s in wave]
    tag = EXPERIMENT_DIRNAME + "-p1s" + "-".join(map(str, keys))
    return dataclasses.replace(
        plan, space=plan.space.derive(phase1_seeds=tuple(keys)),
        layout=dataclasses.replace(plan.layout, experiment=tag))


def _stop_at_deadline(plan: Plan, why: str | None = None) -> int:
    """One line: what of this run is not done, and how to continue (`why`: "by SIGTERM";
    by default --max-wall's)."""
    done = plan.layout.units
    p1, tr, held = st.units_left(done, plan.phase1_slots, plan.space)
    left = [s.seed for s in plan.phase1_slots if not done.stage1_json(s.seed).is_file()
            or any(not done.result(t).is_file() for t in plan.space.trials
                   if t.phase1_seed == s.seed and s.seed not in held)]
    seeds = ",".join(str(k) for k in left if k is not None)
    write_meta(plan, status="stopped")
    if why is None:
        why = "by SIGTERM" if plan.max_wall_s is None else f"at --max-wall {plan.max_wall_s:g} s"
    say(f"[pipeline] stopped {why}: {p1} Phase-1 and {tr} trial "
        f"unit(s) of this run not done in {done.root}; continue with `make resume "
        f"NAME={plan.name} RUNS={plan.layout.root}` (python -m pipelines.run resume --name "
        f"{plan.name} --root {plan.layout.root})"
        + (f", or on another machine `make pipeline STORE={done.root} "
           f"PHASE1_SEEDS={seeds} ...`" if seeds and plan.layout.store_elsewhere else ""))
    return 0


def _pause(plan: Plan, wave: list, paused: dict) -> None:
    """A wave's Phase 1 paused at an epoch end (`paused`: Phase-1 seed -> Phase1Paused) or
    a SIGTERM came (issue 52): each paused unit's progress goes into the store."""
    from pmnet.store_progress import land_progress
    from pmnet.train import checkpoint_epoch

    for k, p in paused.items():
        slot = next(s for s in wave if s.seed == k)
        land_progress(plan.layout.units, st.progress_unit(slot), p.reason,
                      checkpoint_epoch, p.train_time_s, say)
        say(f"[pipeline] {slot.label}: Phase 1 paused after epoch {p.epochs_done} of "
            f"{p.max_epochs} ({p.reason}); its progress is in the store")
    if not paused:
        say("[pipeline] SIGTERM before Stage 2")


@contextlib.contextmanager
def sigterm_writes_stop_file(path: Path) -> Iterator[None]:
    """Within the block (issues 52, 61) the first SIGTERM writes the stop file, which each
    task or trial polls at its epoch ends (`pmnet.train.StopAtEpochEnd`), and restores the
    previous handler, so a second SIGTERM ends the driver as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL  # None: not set from Python

    def handler(signum, frame):
        Path(path).touch()
        signal.signal(signal.SIGTERM, previous)
        say("[pipeline] SIGTERM: training stops at its next epoch end and its progress "
            "goes into the store (a second SIGTERM ends the driver now)")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def finish(plan: Plan, runs: Runs, t_start: float, totals: dict, p1_train: float,
           stage1_wall: float, stopped: bool | str) -> int:
    """Stage 3: MLflow completed from the run's units, the records, the report, the timing
    on the parent run, and the closing lines."""
    lay, sp = plan.layout, plan.space
    mirror(lay, runs, plan.phase1_slots, sp.trials)  # MLflow mirrors the run's units
    p1_left, tr_left, held = st.units_left(lay.units, plan.phase1_slots, sp)
    n_held = sum(t.phase1_seed in held for t in sp.trials)
    status = "stopped" if stopped else (
        "finished" if p1_left == tr_left == 0 and not totals["errored"] else "failed")
    totals["n_trials"] = sp.n_trials
    timing = timing_record(plan, t_start, totals, p1_train, stage1_wall)
    write_meta(plan, status=status)
    kill_point("stage3-start")
    stage3(plan, runs)
    if runs.parent:
        runs.safe("timing", runs.tracker.log_metric_rows, runs.parent, [(0, {
            f"pipeline/{k}": v for k, v in timing.items() if isinstance(v, (int, float))})])
        runs.safe("finish", runs.tracker.client.set_terminated, runs.parent,
                  "FAILED" if status == "failed" else "FINISHED")
    done = sp.n_trials - tr_left - n_held
    say(f"[pipeline] {status}: {done}/{sp.n_trials} trials finished, {totals['errored']} "
        f"errored" + (f", {n_held} held back by the Phase-1 gate" if n_held else "")
        + f"; wall {timing['wall_s']:.1f} s (trials' own training "
        f"{timing['sum_trial_train_s']:.1f} s)")
    say(f"[pipeline] results: {lay.results_dir}   report: {lay.report_dir}")
    if stopped:
        _stop_at_deadline(plan, stopped if isinstance(stopped, str) else None)
    elif status != "finished":
        say("[pipeline] unfinished or errored trials continue from their checkpoints with "
            f"`make resume NAME={plan.name}` (python -m pipelines.run resume --name "
            f"{plan.name} --root {lay.root}); `make status` shows their errors")
    kill_point("end")
    return 1 if status == "failed" else 0
