"""Running the pipeline's CLI as a user does, for the pipeline and fault tests: the `debug`
preset on the `tiny` grid (learned_full, consolidator_only x seeds 42, 43) in its own process
group, and the checks of its MLflow runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.layout import Layout, read_json, trial_key
from pmnet.trial_id import TrialId
from tests.support.net import free_port

REPO = Path(__file__).resolve().parents[2]
GRID = [(c, s) for s in (42, 43) for c in ("learned_full", "consolidator_only")]
# --gpus-per-trial 0: trials and Stage 1 on the CPU on any machine, so that results compare
# exactly with in-process reference runs (on CUDA `gather` and SDPA's backward are not
# deterministic); the `gpu` test asks for a GPU explicitly
BASE = ["--preset", "debug", "--grid", "tiny", "--stage1-cpus", "1", "--gpus-per-trial", "0"]

def pipeline_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "RAY_AUTH_MODE",
                        "PMNET_TEST_FAULT_ONCE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(*args: str, env: dict | None = None, stdout=subprocess.PIPE) -> subprocess.Popen:
    """`python -m pipelines.run ARGS` started in its own process group (so `kill_group` ends
    it and whatever it started), not waited for; its stderr goes with its stdout."""
    return subprocess.Popen([sys.executable, "-m", "pipelines.run", *args], cwd=REPO,
                            env=pipeline_env(env), stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def cli(*args: str, env: dict | None = None, timeout: float = 420) -> tuple[int, str]:
    """Run `python -m pipelines.run ARGS` in its own process group; return (rc, output)."""
    proc = spawn(*args, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"pipeline timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        kill_group(proc.pid)  # anything the driver left in its group (Ray agents)
    return proc.returncode, out


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
                stat = (d / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if text in cmd and stat != "Z":
                pids.append(int(d.name))
    return pids


def wait_gone(text: str, timeout: float = 30) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = processes_mentioning(text)
        if not left:
            return []
        time.sleep(0.5)
    return processes_mentioning(text)


def mlflow_runs(uri: str, name: str) -> tuple:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(f"pmnet/{name}")
    assert exp is not None, f"no MLflow experiment pmnet/{name} at {uri}"
    # tagged as model training: the MLflow UI opens its runs, not the GenAI traces view
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    return client, exp, client.search_runs([exp.experiment_id], max_results=1000)


def check_trial_runs(client, runs, name: str, lay: Layout) -> dict:
    """Exactly one FINISHED run per trial, with its tags, params, per-epoch metrics."""
    by_key: dict[str, list] = {}
    for r in runs:
        if "trial_key" in r.data.tags:
            by_key.setdefault(r.data.tags["trial_key"], []).append(r)
    assert sorted(by_key) == sorted(trial_key(name, TrialId(c, s)) for c, s in GRID)
    parents = {r.info.run_id for r in runs if r.data.tags.get("role") == "pipeline"}
    assert len(parents) == 1
    for c, s in GRID:
        found = by_key[trial_key(name, TrialId(c, s))]
        assert len(found) == 1, f"{len(found)} MLflow runs for {c}-s{s}"
        run = found[0]
        res = read_json(lay.result_path(TrialId(c, s)))
        assert run.info.status == "FINISHED" and run.info.run_name == TrialId(c, s).name
        tags = run.data.tags
        assert (tags["condition"], tags["seed"], tags["preset"]) == (c, str(s), "debug")
        assert tags["phase1_sha256"] == res["phase1_sha256"]
        assert tags["mlflow.parentRunId"] in parents
        assert run.data.params["model.hidden"] == "32" and run.data.params["seed"] == str(s)
        # every epoch once: an epoch reported while the driver was dead is logged from
        # the result file at the end, so the logging order may differ from the steps'
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "epoch"))
        assert steps == list(range(len(steps))) and len(steps) >= 1, steps
        assert steps == [h["epoch"] for h in res["history"]]
        val = client.get_metric_history(run.info.run_id, "val/updated_ltm")
        assert sorted(m.step for m in val) == steps
        assert run.data.metrics["test/updated_ltm"] == pytest.approx(res["test"]["updated_ltm"])
    return by_key


def trial_attempts(lay: Layout, condition: str, seed: int) -> list[dict]:
    """The attempts a trial recorded (attempts.jsonl), in order; [] before the first."""
    path = lay.trial_dir(TrialId(condition, seed)) / "attempts.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


class MlflowServer:
    """A user's `mlflow server` on 127.0.0.1 (the pipeline itself starts none), its backend
    store `backend` (a `sqlite:` file, or a `postgresql://` database), in its own process
    group; `start()` returns its URI once `/health` answers (`start_s` later: how long
    that took, a new database's migrations included)."""

    def __init__(self, backend: str, artifacts: Path, log: Path):
        self.backend, self.artifacts, self.log = backend, artifacts, log
        self.proc = None
        self.start_s: float | None = None  # until /health answered (migrations included)

    def start(self) -> str:
        import urllib.request

        port, t0 = free_port(), time.monotonic()
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend,
                 "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1",
                 "--port", str(port), "--workers", "1"], env=pipeline_env(
                     {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        uri, deadline = f"http://127.0.0.1:{port}", time.time() + 240
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=5):
                    self.start_s = time.monotonic() - t0
                    return uri
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                time.sleep(0.5)
        pytest.fail(f"mlflow server did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait(30)
