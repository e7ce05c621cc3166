"""The pipeline driver: runs a validated `Plan` (pipelines.plan) through the three stages.

`execute(plan)` starts the tracking server (embedded store) and Ray, then Stage 1 (Phase 0/1
once), Stage 2 (the Tune grid) and Stage 3 (statistics and report) from pipelines.stages,
and writes the pipeline's records. Planning and validation live in pipelines.plan, Ray set-up
in pipelines.cluster, MLflow in pipelines.tracking and pipelines.mlflow_server.
"""

from __future__ import annotations

import os
import socket
import time

from pipelines.cluster import check_cluster, init_ray
from pipelines.console import say
from pipelines.faults import kill_point
from pipelines.lock import RunLock
from pipelines.mlflow_server import server_for
from pipelines.plan import Plan
from pipelines.stages import stage1_finish, stage1_start, stage2, stage3, timing_record, write_meta
from pipelines.tracking import Runs, backfill_results, experiment_name, open_tracking


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
        say("[pipeline] GPU memory per trial (memory model, pmnet/memory_model.py): "
            + ", ".join(f"{c}{'-' + v if v else ''} {b / 2**30:.1f} GiB"
                        for (c, v), b in plan.memory.items()))

    runs = Runs()
    server = server_for(plan)  # a SQLite store (embedded or sqlite:) is served, shared per store
    ray = None
    try:
        if server is not None:
            server.start()
        t_ray = time.time()
        ray = init_ray(plan)
        cluster = check_cluster(plan, ray)
        where = f"Ray cluster {plan.ray_address}" if plan.ray_address else "local Ray"
        say(f"[pipeline] {where} up in {time.time() - t_ray:.1f} s ({cluster.describe()})")
        jobs = stage1_start(plan, ray, cluster)  # run while the MLflow server starts
        kill_point("stage1-submitted")
        uri = server.wait_ready() if server is not None else plan.tracking_uri
        runs = open_tracking(plan, uri)
        p1 = stage1_finish(plan, ray, jobs, runs)
        s2 = stage2(plan, runs, p1)
        kill_point("stage2-done")
        backfill_results(lay, runs)  # what trials could not log to MLflow, from their results
        status = "finished" if s2["errored"] == 0 and s2["finished"] == sp.n_trials else "failed"
        timing = timing_record(plan, t_start, s2, p1.train_time_s)  # the report reads both
        write_meta(plan, status=status)
        kill_point("stage3-start")
        stage3(plan, runs)
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
        if server is not None:
            server.stop()

