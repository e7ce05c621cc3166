"""The addresses a user types for storage, tracking and the UI, checked before anything is
written (docs/pipeline.md, "Addresses"): each either works or is refused with a line that
says what to use instead (`PipelineError`, exit 2).

- `storage_root`: the storage root (`--root`, RUNS= for make) is a directory on a
  filesystem every Ray node mounts; `file://` URLs are read as that path, and any other URL
  (`s3://`, `gs://`, `hdfs://`, ...) is refused (the pipeline writes its records, locks,
  Phase-1 checkpoints and the embedded MLflow store with ordinary file operations).
- `check_database`: a database tracking URI (`postgresql://`, `mysql://`, `mssql://`) is
  connected to at planning, with a short timeout, so a bad one fails before Stage 1.
- `ui_bind`: the host and port `make ui` serves on, and the warning when that is beyond
  loopback (the MLflow UI has no authentication).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from urllib.parse import unquote, urlparse

from pipelines.layout import PipelineError

# scheme://... (RFC 3986 scheme), and scheme:/... for the object stores people type that way
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_STORES = ("s3", "s3a", "s3n", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "az",
                 "wasb", "wasbs", "adl", "oss", "cos", "r2", "dbfs", "minio")
ROOT_HELP = ("the storage root must be a directory on a filesystem every Ray node mounts at "
             "the same path (local disk for local Ray; NFS, or an object store mounted with "
             "s3fs / mountpoint-s3 / gcsfuse, on a cluster): pass that path as --root "
             "(RUNS=/path for make)")


STORE_HELP = ("a store must be a directory on a filesystem (an object store mounted with "
              "s3fs / mountpoint-s3 / gcsfuse works): pass that path as --store (STORE=/path "
              "for make)")


def storage_root(root: str | os.PathLike, *, what: str = "storage root",
                 help: str = ROOT_HELP) -> Path:
    """The storage root (or another directory the pipeline writes, named by `what`, with
    `help` saying what to pass instead) as an absolute path. `file:///abs/path` (or
    `file://localhost/...`) is that path; any other URL is refused (PipelineError), as is
    `s3:/bucket` (a URL that lost a slash), which `Path` would otherwise turn into
    `$PWD/s3:/bucket` silently."""
    text = os.fspath(root)
    if not isinstance(text, str):
        text = os.fsdecode(text)
    m = _URL.match(text)
    scheme = m.group(1).lower() if m else text.split(":", 1)[0].lower() if ":" in text else ""
    if scheme == "file" and (m or text[5:6] == "/"):  # file:///p, file://localhost/p, file:/p
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise PipelineError(
                f"{what} {text!r} names a file on another host ({parsed.netloc}); "
                f"{help}")
        if not parsed.path:
            raise PipelineError(f"{what} {text!r} has no path; {help}")
        return Path(unquote(parsed.path)).expanduser().absolute()
    if m or (scheme in OBJECT_STORES and text[len(scheme) + 1:].startswith("/")):
        raise PipelineError(
            f"{what} {text!r} is a {scheme}:// URL, which the pipeline cannot write to "
            f"(its records, locks, checkpoints and MLflow store are files); {help}")
    return Path(text).expanduser().absolute()


# -- tracking databases -----------------------------------------------------------------------

DB_SCHEMES = ("postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores besides sqlite
DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
DB_DRIVERS = {"postgresql": "psycopg[binary] (or psycopg2-binary with postgresql+psycopg2://)",
              "mysql": "mysqlclient (or pymysql with mysql+pymysql://)",
              "mssql": "pyodbc"}
DB_TIMEOUT_ARGS = {"postgresql": "connect_timeout", "mysql": "connect_timeout",
                   "mssql": "timeout"}


def database_backend(uri: str) -> str | None:
    """'postgresql' / 'mysql' / 'mssql' for a database tracking URI (a `+driver` suffix
    allowed), else None."""
    scheme = urlparse(uri).scheme.lower()
    backend = scheme.split("+", 1)[0]
    return backend if backend in DB_SCHEMES else None


def check_database(uri: str, timeout: float = 5.0) -> None:
    """Connect to the database of a tracking URI and run `SELECT 1`, within `timeout`
    seconds; PipelineError saying why not: nothing answers at its host and port (a TCP probe
    first, so a dead address fails in seconds whatever the driver), its Python driver is not
    installed, or the database refused the connection. Creates nothing (MLflow makes its
    tables when the driver first opens the store)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    backend = database_backend(uri)
    shown = hide_password(uri)
    try:
        url = make_url(uri)
    except ArgumentError as e:
        raise PipelineError(f"tracking URI {shown!r} is not a database URL ({e})") from e
    fix = ("fix MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
           "under the storage root")
    if url.host:  # else a Unix socket (?host=/run/postgresql): the driver finds it
        port = url.port or DB_PORTS[backend]
        try:
            with socket.create_connection((url.host, port), timeout=timeout):
                pass
        except OSError as e:
            raise PipelineError(
                f"no database answers at {url.host}:{port} for tracking URI {shown!r} "
                f"({e.strerror or e}); start it, {fix}") from e
    try:
        url.get_dialect().import_dbapi()
    except ImportError as e:
        raise PipelineError(
            f"tracking URI {shown!r} needs a {backend} driver for Python that is not "
            f"installed ({e}); install {DB_DRIVERS[backend]} in this environment (and on "
            f"every Ray node), or {fix}") from e
    except Exception as e:  # noqa: BLE001 - an unknown +driver, said as such
        raise PipelineError(f"tracking URI {shown!r}: SQLAlchemy cannot load its driver "
                            f"({type(e).__name__}: {e})") from e
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool,
                           connect_args={DB_TIMEOUT_ARGS[backend]: max(1, int(timeout))})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as e:  # noqa: BLE001 - the driver's own reason, in one line
        raise PipelineError(
            f"the database of tracking URI {shown!r} refused the connection "
            f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); {fix}"
        ) from e
    finally:
        engine.dispose()


def hide_password(uri: str) -> str:
    """The URI as it may be printed: its password, if any, as `***`."""
    parsed = urlparse(uri)
    if parsed.password:
        return uri.replace(f":{parsed.password}@", ":***@", 1)
    return uri


# -- the UI -----------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def ui_bind(host: str, port: int) -> str | None:
    """Check that `make ui` can serve on host:port (the name resolves, the port is free
    there); PipelineError if not. Returns the warning to print when `host` is beyond
    loopback, else None."""
    if not 0 < port < 65536:
        raise PipelineError(f"--port {port} is not a TCP port (1..65535); use PORT= for make")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise PipelineError(f"the UI host {host!r} is not an address of this machine "
                            f"({e}); use HOST=127.0.0.1 (default), HOST=0.0.0.0 for every "
                            "interface, or one of this machine's addresses") from e
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise PipelineError(
                f"the UI cannot listen on {host}:{port} ({e.strerror or e}): another "
                "program may hold the port (choose another with PORT=... for make, "
                "--port), or the host is not one of this machine's addresses") from e
    if is_loopback(host):
        return None
    return (f"warning: serving the MLflow UI on {host}:{port}, beyond this machine: the "
            "MLflow UI has no authentication, so anyone who can reach that port can read, "
            "change and delete every run and artifact of the store. Serve it only on a "
            "trusted network (or keep HOST=127.0.0.1 and use an SSH tunnel: ssh -L "
            f"{port}:127.0.0.1:{port} HOST). MLflow answers only requests addressed to "
            "localhost or a private IP by default; for a DNS name pass ALLOWED_HOSTS=name "
            "(--allowed-hosts).")
