"""MLflow for the pipeline: the embedded store and its local server, and run bookkeeping.

Embedded default: `<root>/mlflow.db` (SQLite) + `<root>/mlartifacts`. During a pipeline the
driver serves that store with a local `mlflow server` on 127.0.0.1 and a free port, so the
driver and every trial talk HTTP to one process instead of fighting over one SQLite file.
`MLFLOW_TRACKING_URI` (or `--tracking-uri`) points at a server of your own instead.

Runs are found again by the tag `run_key` (`<name>` for the pipeline's parent run,
`<name>/stage1-phase1` ... for the stages, `<name>/<condition>-s<seed>` for trials, which
also carry it as `trial_key`): a retried or resumed trial re-attaches to its run, and params
are logged only where missing (an identical value is never sent twice; a different value
is reported, not a crash).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipelines.layout import PipelineError, check_writable

log = logging.getLogger("pipelines.tracking")

EMBEDDED = "embedded"
# the MLflow UI opens an experiment in its training-runs view (not the GenAI traces view)
# when this tag says so (MLflow 3: "custom_model_development" vs "genai_development")
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000
SERVER_ENV = {
    # the server's job runner spawns a handful of huey consumers: not needed here
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}


def requested_tracking_uri(arg: str | None = None) -> str | None:
    """`--tracking-uri`, else MLFLOW_TRACKING_URI, else None (the embedded store)."""
    uri = arg or os.environ.get("MLFLOW_TRACKING_URI") or None
    return uri.strip() if uri else None


def _is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast (PipelineError) when a tracking URI cannot be used."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:  # a server answered: try the REST API itself
            try:
                url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
                with urllib.request.urlopen(url, timeout=timeout):
                    return
            except (OSError, urllib.error.URLError) as e2:
                raise PipelineError(f"MLflow tracking server {uri} answered /health with "
                                    f"HTTP {e.code} and its API failed ({e2})") from e2
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            raise PipelineError(
                f"MLflow tracking server {uri} is unreachable ({reason}). Start it, fix "
                "MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
                "under the storage root.") from e
        return
    if parsed.scheme == "sqlite":
        path = uri.split("sqlite:///", 1)[-1]
        check_writable(Path(path).expanduser().absolute().parent)
        return
    if parsed.scheme in ("", "file"):
        check_writable(Path(parsed.path if parsed.scheme else uri).expanduser().absolute())
        return
    # databricks, postgresql, ...: left to MLflow


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def routable_ip() -> str:
    """This machine's address on its default route (no packet is sent); 127.0.0.1 if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def server_command(backend_uri: str, artifacts_dir: Path, host: str, port: int,
                   workers: int = 1) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
           "--artifacts-destination", str(artifacts_dir), "--host", host, "--port", str(port),
           "--workers", str(workers)]
    if host not in ("127.0.0.1", "localhost"):
        # MLflow's security middleware only admits localhost Host headers by default
        names = {host, routable_ip()} - {"0.0.0.0"}
        allowed = [f"{n}:{port}" for n in sorted(names)] + ["localhost:*", "127.0.0.1:*"]
        cmd += ["--allowed-hosts", ",".join(allowed)]
    return cmd


def embedded_backend(root: Path) -> str:
    return f"sqlite:///{Path(root).absolute() / 'mlflow.db'}"


class LocalServer:
    """An `mlflow server` child process for the embedded store, stopped with the driver."""

    def __init__(self, backend_uri: str, artifacts_dir: Path, *, host: str = "127.0.0.1",
                 port: int = 0, log_path: Path | None = None):
        self.backend_uri, self.artifacts_dir = backend_uri, Path(artifacts_dir)
        self.host, self.port = host, port or free_port("" if host == "0.0.0.0" else host)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def uri(self) -> str:
        host = self.host
        if host == "localhost":
            host = "127.0.0.1"
        elif host == "0.0.0.0":  # all interfaces: give the trials an address they can reach
            host = routable_ip()
        return f"http://{host}:{self.port}"

    def start(self) -> LocalServer:
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pipelines.mlflow_guard", "--parent", str(os.getpid()),
               "--", *server_command(self.backend_uri, self.artifacts_dir, self.host,
                                     self.port)]
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        env = {**os.environ, **SERVER_ENV, "PYTHONPATH": _pythonpath()}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, env=env,
            cwd=str(self.artifacts_dir.parent))
        return self

    def wait_ready(self, timeout: float = 240.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise PipelineError(f"the local MLflow server exited with code "
                                    f"{self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.uri
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.25)
        self.stop()
        raise PipelineError(f"the local MLflow server did not answer within {timeout:.0f} s; "
                            f"see {self.log_path}")

    def stop(self, timeout: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the guard stops its whole process group
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalServer:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _pythonpath() -> str:
    """The project root first, so child processes import this checkout's packages."""
    here = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


# -----------------------------------------------------------------------------------------
# Run bookkeeping
# -----------------------------------------------------------------------------------------


def _param_str(value: Any) -> str:
    s = value if isinstance(value, str) else str(value)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


def _float(value: Any) -> float | None:
    try:
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool):
            return float(value)
        return float(value)
    except (TypeError, ValueError):
        return None


class Tracker:
    """A thin layer over `MlflowClient` with idempotent run creation and param logging."""

    def __init__(self, uri: str):
        from mlflow import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def experiment(self, name: str, tags: dict[str, str] | None = None) -> str:
        """The experiment's id (created, or restored if deleted), tagged as model training so
        the MLflow UI opens on its runs rather than on its GenAI (traces) view."""
        from mlflow.exceptions import MlflowException

        tags = {**(tags or {}), EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, tags=tags)
            except MlflowException:  # created concurrently
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # made by an older version
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG,
                                           EXPERIMENT_KIND)
        return exp.experiment_id

    def find_run(self, experiment_id: str, key: str):
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.run_key = '{key}'",
            order_by=["attributes.start_time ASC"], max_results=10)
        return runs[0] if runs else None

    def attach_run(self, experiment_id: str, key: str, *, run_name: str,
                   tags: dict[str, Any] | None = None, parent_run_id: str | None = None,
                   run_id: str | None = None) -> tuple[str, bool]:
        """(run_id, created): the run with tag run_key=key (or `run_id`), else a new one."""
        from mlflow.entities import RunTag
        from mlflow.exceptions import MlflowException

        tags = {k: str(v) for k, v in (tags or {}).items()}
        tags["run_key"] = key
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = None
        if run_id:
            try:
                run = self.client.get_run(run_id)
                if run.info.lifecycle_stage == "deleted":
                    run = None
            except MlflowException:
                run = None
        if run is None:
            run = self.find_run(experiment_id, key)
        if run is not None:
            rid = run.info.run_id
            if run.info.status != "RUNNING":
                self.client.update_run(rid, status="RUNNING")
            new = {k: v for k, v in tags.items() if run.data.tags.get(k) != v}
            if new:
                self.client.log_batch(rid, tags=[RunTag(k, v) for k, v in new.items()])
            return rid, False
        run = self.client.create_run(experiment_id, tags=tags, run_name=run_name)
        return run.info.run_id, True

    def log_params_once(self, run_id: str, params: dict[str, Any]) -> list[str]:
        """Log the params the run lacks; return the keys whose logged value differs."""
        from mlflow.entities import Param

        existing = self.client.get_run(run_id).data.params
        todo, differ = [], []
        for k, v in params.items():
            s = _param_str(v)
            if k not in existing:
                todo.append(Param(k, s))
            elif existing[k] != s:
                differ.append(k)
        for i in range(0, len(todo), 100):
            self.client.log_batch(run_id, params=todo[i:i + 100])
        if differ:
            log.warning("run %s already has different values for params %s; kept the logged "
                        "ones", run_id, differ)
        return differ

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            f = _float(v)
            if f is not None:
                items.append(Metric(k, f, now, int(step or 0)))
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, key)}

    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None):
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, path: str | os.PathLike,
                      artifact_path: str | None = None):
        self.client.log_artifacts(run_id, str(path), artifact_path)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)
