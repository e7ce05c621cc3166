"""The local MLflow server of a SQLite store: the embedded one or a user's `sqlite:` URI.

A SQLite file takes one writer at a time, so many trial processes writing one database fight
over its lock. A pipeline therefore never hands trials a `sqlite:` URI: it serves the store
with a local `mlflow server` (on 127.0.0.1 and a free port by default) and the driver and
every trial talk HTTP to that one process. The store is either the embedded
`<root>/mlflow.db` (+ `<root>/mlartifacts`) or the database of a `sqlite:` tracking URI the
user gave (+ `mlartifacts/` beside it). Drivers that use one store share one server
(`pipelines.mlflow_guard` keeps a registry per store), which stops when the last of them
exits or dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.layout import PipelineError
from pipelines.mlflow_guard import (
    StoreFiles,
    add_client,
    alive,
    drop_registry,
    live_clients,
    locked,
    process_start,
    read_registry,
    registered_guard_alive,
    remove_client,
    write_registry,
)

if TYPE_CHECKING:
    from pipelines.plan import Plan

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


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:` URI, absolute; None for any other scheme.
    PipelineError for an in-memory database, which no second process can see."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):].split("?", 1)[0]
    path = rest[3:] if rest.startswith("///") else ""
    if path in ("", ":memory:"):
        raise PipelineError(f"tracking URI {uri!r} names an in-memory SQLite database, which "
                            "the trials cannot share; use sqlite:///<file>")
    return Path(path).expanduser().absolute()


def absolute_sqlite_uri(uri: str) -> str:
    """`sqlite:///runs.db` -> `sqlite:////abs/dir/runs.db` (query kept): a relative path
    would name another file for the server (started in another directory) and for a later
    `resume` from elsewhere; other URIs are returned unchanged."""
    db = sqlite_path(uri)
    if db is None:
        return uri
    query = uri.split("?", 1)[1] if "?" in uri else ""
    return f"sqlite:///{db}" + (f"?{query}" if query else "")


def served_backend(tracking_uri: str | None, root: Path) -> str | None:
    """The SQLite store a pipeline serves itself: the embedded `<root>/mlflow.db` when no
    URI is given, or the user's `sqlite:` URI; None for a tracking server of the user's."""
    if tracking_uri is None:
        return embedded_backend(root)
    if sqlite_path(tracking_uri) is not None:
        return absolute_sqlite_uri(tracking_uri)
    return None


def server_for(plan: Plan) -> LocalServer | None:
    """The (not yet started) local server of the plan's store; None when the plan logs to
    a tracking server of the user's own. Artifacts go to `mlartifacts/` beside the
    database, which for the embedded store is `<root>/mlartifacts`."""
    backend = served_backend(plan.tracking_uri, plan.layout.root)
    if backend is None:
        return None
    db = sqlite_path(backend)
    return LocalServer(backend, db.parent / "mlartifacts", host=plan.mlflow_host,
                       log_path=plan.layout.logs_dir / "mlflow-server.log")


class LocalServer:
    """The `mlflow server` of one SQLite store, shared by every driver that uses the store.

    `start()` reuses the server registered for the store (pipelines.mlflow_guard) when its
    guard is alive, else starts one under a new guard; either way this process becomes one
    of its clients. `stop()` leaves: the last client to leave stops the server at once, and
    the guard stops it after clients that died without leaving (SIGKILL)."""

    def __init__(self, backend_uri: str, artifacts_dir: Path, *, host: str = "127.0.0.1",
                 port: int = 0, log_path: Path | None = None):
        db = sqlite_path(backend_uri)
        if db is None:
            raise ValueError(f"LocalServer serves SQLite stores only, not {backend_uri!r}")
        self.backend_uri, self.artifacts_dir = backend_uri, Path(artifacts_dir)
        self.store = StoreFiles(db)
        self.host, self.port = host, port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None  # the guard, when this process started it
        self.guard: tuple[int, int | None] | None = None  # (pid, start) of the serving guard
        self.reused = False
        self._url: str | None = None
        self._client: Path | None = None
        self._log = None

    @property
    def uri(self) -> str:
        if self._url is None:
            raise RuntimeError("LocalServer.uri before start()")
        return self._url

    def start(self) -> LocalServer:
        """Join the store's live server or start one; returns without waiting for it."""
        with locked(self.store):
            entry = read_registry(self.store)
            if registered_guard_alive(entry):
                self._join(entry)
            elif entry is not None and entry.get("hostname") != socket.gethostname():
                raise PipelineError(
                    f"the MLflow store {self.store.db} is served by pid {entry.get('pid')} on "
                    f"host {entry.get('hostname')} ({entry.get('url')}); run this pipeline "
                    f"on that machine, or delete {self.store.registry} if that server is gone")
            else:
                self._launch()
        return self

    def _join(self, entry: dict) -> None:
        if not _covers(entry.get("host", "127.0.0.1"), self.host):
            raise PipelineError(
                f"the MLflow store {self.store.db} is already served on {entry.get('host')} "
                f"({entry.get('url')}) by another pipeline; start this one with the same "
                f"--mlflow-host, or after that pipeline has finished")
        self._client = add_client(self.store)
        self.guard = (entry["pid"], entry.get("start"))
        self._url, self.reused = entry["url"], True
        if entry.get("log"):
            self.log_path = Path(entry["log"])

    def _launch(self) -> None:
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port("" if self.host == "0.0.0.0" else self.host)
        self._url = _url(self.host, self.port)
        self._client = add_client(self.store)  # before the guard, which must see a client
        cmd = [sys.executable, "-m", "pipelines.mlflow_guard", "--store", str(self.store.db),
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
        self.guard = (self.proc.pid, process_start(self.proc.pid))
        write_registry(self.store, {
            "url": self._url, "pid": self.proc.pid, "start": self.guard[1],
            "backend": self.backend_uri, "artifacts": str(self.artifacts_dir),
            "host": self.host, "hostname": socket.gethostname(),
            "log": str(self.log_path) if self.log_path else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    def _guard_running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.guard is not None and alive(*self.guard)

    def wait_ready(self, timeout: float = 240.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self._guard_running():
                code = f" with code {self.proc.returncode}" if self.proc is not None else ""
                self.stop()
                raise PipelineError(f"the local MLflow server of {self.store.db} exited{code}; "
                                    f"see {self.log_path}")
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
        """Leave the server; stop it when no other live driver uses it."""
        client, self._client = self._client, None
        target = None
        if client is not None:
            with locked(self.store):
                remove_client(client)
                entry = read_registry(self.store)
                if (not live_clients(self.store) and registered_guard_alive(entry)
                        and self.guard is not None and entry["pid"] == self.guard[0]):
                    drop_registry(self.store, entry["pid"])
                    target = self.guard
        if target is not None:
            _terminate_guard(target, self.proc, timeout)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _covers(serving: str, wanted: str) -> bool:
    """Whether a server listening on `serving` serves the clients `wanted` asks for."""
    loopback = ("127.0.0.1", "localhost")
    return serving == wanted or serving == "0.0.0.0" or (
        wanted in loopback and serving in loopback)


def _url(host: str, port: int) -> str:
    if host == "localhost":
        host = "127.0.0.1"
    elif host == "0.0.0.0":  # all interfaces: give the trials an address they can reach
        host = routable_ip()
    return f"http://{host}:{port}"


def _terminate_guard(guard: tuple[int, int | None], proc: subprocess.Popen | None,
                     timeout: float) -> None:
    """SIGTERM the guard (it stops its process group), SIGKILL the group if it lingers."""
    pid = guard[0]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            return
        if proc is None and not alive(*guard):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _pythonpath() -> str:
    """The project root first, so child processes import this checkout's packages."""
    here = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")

