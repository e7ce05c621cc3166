"""Two processes writing one SQLite MLflow store at once (docs/pipeline.md, "MLflow layout").

    PYTHONPATH=. .venv/bin/python benchmarks/mlflow_two_writers.py --metrics 2000 --db /tmp/two.db

Each writer creates its own runs in one shared experiment and logs `--metrics` values, one
MlflowClient call per epoch-sized batch of `--per-call` metrics (what the driver's callback
does per reported epoch). Prints, per writer, the wall time, the calls that raised (e.g.
"database is locked") and the slowest call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def writer(uri: str, tag: str, n_metrics: int, per_call: int, runs: int, out) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("two-writers")
    errors, slowest, t0 = [], 0.0, time.time()
    per_run = n_metrics // runs
    for r in range(runs):
        t = time.time()
        run = client.create_run(exp.experiment_id, run_name=f"{tag}-{r}")
        for step in range(0, per_run, per_call):
            items = [Metric(f"m{k}", float(step + k), int(time.time() * 1000), step)
                     for k in range(min(per_call, per_run - step))]
            t = time.time()
            try:
                client.log_batch(run.info.run_id, metrics=items)
            except Exception as e:  # noqa: BLE001 - counted, that is the measurement
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            slowest = max(slowest, time.time() - t)
        client.set_terminated(run.info.run_id)
    out.put({"writer": tag, "wall_s": round(time.time() - t0, 2), "errors": len(errors),
             "first_error": errors[0] if errors else None, "slowest_call_s": round(slowest, 3)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="/tmp/mlflow-two-writers.db")
    ap.add_argument("--metrics", type=int, default=2000)
    ap.add_argument("--per-call", type=int, default=10)
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    from mlflow import MlflowClient

    uri = f"sqlite:///{a.db}"
    client = MlflowClient(tracking_uri=uri)  # creates the schema before the race
    if client.get_experiment_by_name("two-writers") is None:
        client.create_experiment("two-writers")
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=writer, args=(
        uri, tag, a.metrics, a.per_call, a.runs, q)) for tag in ("A", "B")]
    t0 = time.time()
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    print(json.dumps({"both_wall_s": round(time.time() - t0, 2), "writers": results,
                      "metrics_each": a.metrics, "per_call": a.per_call}, indent=1))


if __name__ == "__main__":
    main()
