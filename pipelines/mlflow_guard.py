"""One local MLflow server per SQLite store, kept alive while any pipeline driver uses it.

    python -m pipelines.mlflow_guard --store DB [--grace S] -- CMD ARGS...

Two drivers under one storage root (or two pipelines pointed at one `sqlite:` URI) must not
each start an `mlflow server` on the same database: two servers writing one SQLite file
bring back the lock contention the server exists to avoid. So every store has, next to
its database file `DB`:

    DB.server.lock      an `fcntl.flock` lock around every read or change of the two below
    DB.server.json      the registry: url, guard pid (+ its start time), backend, host
    DB.clients/         one file per driver using the server, named `<pid>.<n>`, holding
                        that process's start time (so a reused pid is not taken for it)

A driver takes the lock, reuses the registered server when its guard is alive, else starts
this guard (which starts CMD, the server, in the guard's own process group) and registers
it; either way it adds its client file. The guard polls the clients: when none of them is
alive for `--grace` seconds (every driver exited, or died even by SIGKILL, where no cleanup
code runs), it takes the lock, checks once more, removes the registry and terminates its
whole group (the `mlflow server` CLI and the uvicorn process it spawns), so no server is
left holding the SQLite store or a port. It does the same on SIGTERM/SIGINT.

This module imports nothing heavy: the guard is a small process of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.5
GRACE_S = 2.0
_serial = itertools.count()


# -- processes --------------------------------------------------------------------------------


def process_start(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot, from /proc/<pid>/stat), or
    None when it is gone or a zombie. Start time plus pid names a process uniquely, where a
    pid alone may be reused by an unrelated process after the driver died."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` still runs and is the one that started at `start`."""
    if Path("/proc/self/stat").exists():
        now = process_start(pid)
        return now is not None and (start is None or now == start)
    try:  # no /proc (macOS): existence only
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the per-store files ----------------------------------------------------------------------


@dataclass(frozen=True)
class StoreFiles:
    """The registry, lock and client files of the SQLite database `db`."""

    db: Path

    @property
    def registry(self) -> Path:
        return self.db.with_name(self.db.name + ".server.json")

    @property
    def lock(self) -> Path:
        return self.db.with_name(self.db.name + ".server.lock")

    @property
    def clients(self) -> Path:
        return self.db.with_name(self.db.name + ".clients")


@contextlib.contextmanager
def locked(store: StoreFiles) -> Iterator[None]:
    """Hold the store's lock: registry reads, registration and shutdown never interleave."""
    store.lock.parent.mkdir(parents=True, exist_ok=True)
    with open(store.lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_registry(store: StoreFiles) -> dict | None:
    try:
        data = json.loads(store.registry.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_registry(store: StoreFiles, entry: dict) -> None:
    _write_atomic(store.registry, json.dumps(entry, indent=1, sort_keys=True) + "\n")


def drop_registry(store: StoreFiles, pid: int) -> None:
    """Remove the registry if it still names guard `pid` (a newer server's entry stays)."""
    entry = read_registry(store)
    if entry is not None and entry.get("pid") == pid:
        with contextlib.suppress(FileNotFoundError):
            store.registry.unlink()


def registered_guard_alive(entry: dict | None) -> bool:
    """Whether a registry entry names a guard that still runs on this machine."""
    return (entry is not None and entry.get("hostname") == socket.gethostname()
            and isinstance(entry.get("pid"), int) and alive(entry["pid"], entry.get("start")))


def add_client(store: StoreFiles, pid: int | None = None) -> Path:
    """Register a client process (default: this one); returns its file, removed by
    `remove_client` on a clean exit and ignored by the guard once the process is gone."""
    pid = os.getpid() if pid is None else pid
    store.clients.mkdir(parents=True, exist_ok=True)
    path = store.clients / f"{pid}.{next(_serial)}"
    _write_atomic(path, json.dumps({"pid": pid, "start": process_start(pid)}))
    return path


def remove_client(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def live_clients(store: StoreFiles) -> list[int]:
    """Pids of the registered clients that still run; files of dead ones are removed."""
    pids = []
    try:
        files = [p for p in store.clients.iterdir() if not p.name.startswith(".")]
    except FileNotFoundError:
        return []
    for path in files:
        try:
            info = json.loads(path.read_text())
            pid, start = int(info["pid"]), info.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or already removed
        if alive(pid, start):
            pids.append(pid)
        else:
            remove_client(path)
    return pids


# -- the guard ----------------------------------------------------------------------------------


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # let uvicorn finish its shutdown
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # anything left, the guard included
    except ProcessLookupError:
        pass


def _no_client_left(store: StoreFiles) -> bool:
    """Under the lock: True (and the registry dropped) when no client is alive, so a driver
    that registers afterwards starts a new server instead of joining one that is stopping."""
    with locked(store):
        if live_clients(store):
            return False
        drop_registry(store, os.getpid())
        return True


def main(argv: list[str]) -> int:
    if "--" not in argv or "--store" not in argv:
        print("usage: python -m pipelines.mlflow_guard --store DB [--grace S] -- CMD ...",
              file=sys.stderr)
        return 2
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    store = StoreFiles(Path(opts[opts.index("--store") + 1]))
    grace = float(opts[opts.index("--grace") + 1]) if "--grace" in opts else GRACE_S
    if os.getpgrp() != os.getpid():
        os.setpgrp()  # the group the guard cleans up is its own
    proc = subprocess.Popen(cmd)
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    alone_since: float | None = None
    while True:
        code = proc.poll()
        if code is not None:  # the server died on its own: unregister it
            with locked(store):
                drop_registry(store, os.getpid())
            return code
        if stop["flag"]:
            with locked(store):
                drop_registry(store, os.getpid())
            _stop_group(proc)
            return 0
        if live_clients(store):
            alone_since = None
        elif alone_since is None:
            alone_since = time.time()
        elif time.time() - alone_since >= grace and _no_client_left(store):
            _stop_group(proc)
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
