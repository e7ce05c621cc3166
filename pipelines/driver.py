"""The pipeline driver: runs a validated `Plan` (pipelines.plan) through the three stages.

`execute(plan)` opens the MLflow runs and starts Ray, then Stage 1 (Phase 0/1
once), Stage 2 (the Tune grid) and Stage 3 (statistics and report) from pipelines.stages,
and writes the pipeline's records. Planning and validation live in pipelines.plan, Ray set-up
in pipelines.cluster, MLflow (the driver is its only writer) in pipelines.tracking.
"""

from __future__ import annotations

import os
import socket
import time

from pipelines.cluster import ClusterInfo, check_storage, describe_ray, init_ray
from pipelines.console import say
from pipelines.faults import kill_point
from pipelines.layout import PipelineError
from pipelines.lock import RunLock
from pipelines.plan import Plan, resource_problem
from pipelines.stages import stage1_finish, stage1_start, stage2, stage3, timing_record, write_meta
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

    runs = Runs()
    ray = None
    try:
        t_ray = time.time()
        ray = init_ray(plan.ray_address, plan.num_cpus, plan.cluster)
        cluster = check_cluster(plan, ray)
        where = f"Ray cluster {plan.ray_address}" if plan.ray_address else "local Ray"
        say(f"[pipeline] {where} up in {time.time() - t_ray:.1f} s ({cluster.describe()})")
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
    if plan.tracking_uri is None or plan.tracking_uri.startswith("sqlite:"):
        cmd = f"make ui RUNS={plan.layout.root}" if plan.tracking_uri is None else \
            f"mlflow ui --backend-store-uri {plan.tracking_uri}"
        return f"`{cmd}`, then open {ui_address(UI_DEFAULT, runs.experiment_id)}"
    return f"open {ui_address(plan.tracking_uri, runs.experiment_id)}"

