"""The local MLflow server of the embedded store (`<root>/mlflow.db` + `<root>/mlartifacts`).

During a pipeline the driver serves the embedded SQLite store with a local `mlflow server`
on 127.0.0.1 and a free port, so the driver and every trial talk HTTP to one process instead
of fighting over one SQLite file. The server runs under `pipelines.mlflow_guard`, which stops
it when the driver dies.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipelines.layout import PipelineError

SERVER_ENV = {
    # the server's job runner spawns a handful of huey consumers: not needed here
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}



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


def _pythonpath() -> str:
    """The project root first, so child processes import this checkout's packages."""
    here = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")

