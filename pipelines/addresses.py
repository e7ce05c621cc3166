"""The addresses a user types for storage (`storage_root`), tracking (`check_tracking_uri`)
and the UI, checked before anything is written: each works or is refused with a line that
says what to use instead (`PipelineError`, exit 2; the table of docs/pipeline.md,
"Addresses"). `store_uri`: the store the driver writes; `ui_address`: a pipeline's page.
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
    """The storage root (or the directory `what`) as an absolute path: `file://` URLs are
    that path; any other URL is refused, as is `s3:/bucket` (a URL that lost a slash), which
    `Path` would otherwise turn into `$PWD/s3:/bucket` silently."""
    text = os.fsdecode(root)
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


# -- tracking stores --------------------------------------------------------------------------

EMBEDDED = "embedded"
DATABRICKS = ("databricks", "databricks-uc", "uc")  # refused (docs/pipeline.md, "Addresses")

#: How long one MLflow call may take, read by MLflow's REST client at every request: its
#: defaults (7 retries, backoff 2, 120 s per attempt) keep a call on a dead server busy for
#: minutes; these, at most 3 x 10 s + 2.5 s = 32.5 s. Set for the whole process by its first
#: `tracking.Tracker` or by `check_tracking_uri`.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:` URI, absolute; None for any other scheme.
    PipelineError for an in-memory database (a resume or `make ui` could not see it)."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):].split("?", 1)[0]
    path = rest[3:] if rest.startswith("///") else ""
    if path in ("", ":memory:"):
        raise PipelineError(f"tracking URI {uri!r} names an in-memory SQLite database, which "
                            "no later process can see; use sqlite:///<file>")
    return Path(path).expanduser().absolute()


def store_uri(root: Path, recorded: str | None) -> str:
    """The URI the driver writes to: the recorded one (tracking.json, pipeline.json), or
    for `embedded` / None the SQLite file `<root>/mlflow.db`."""
    if recorded in (None, EMBEDDED):
        return f"sqlite:///{Path(root).absolute() / 'mlflow.db'}"
    return recorded


def artifact_location(uri: str, pipeline: str, root: Path | None = None) -> str | None:
    """Where a new experiment keeps its artifacts: `mlartifacts/<pipeline>` beside a SQLite
    store, or under `root` for a database (MLflow's default: `./mlruns` of the driver's
    working directory); None (the server decides) for a tracking server."""
    db = sqlite_path(uri)
    if db is not None:
        return (db.parent / "mlartifacts" / pipeline).as_uri()
    if root is not None and database_backend(uri):
        return (Path(root).absolute() / "mlartifacts" / pipeline).as_uri()
    return None


def requested_tracking_uri(arg: str | None = None) -> str | None:
    """`--tracking-uri`, else MLFLOW_TRACKING_URI, else None (the embedded store); a relative
    `sqlite:` path is made absolute (query kept), so a later `resume` names the same file."""
    uri = (arg or os.environ.get("MLFLOW_TRACKING_URI") or "").strip()
    db = sqlite_path(uri)
    if db is not None:
        uri = f"sqlite:///{db}" + (f"?{uri.split('?', 1)[1]}" if "?" in uri else "")
    return uri or None


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """PipelineError when a tracking URI cannot be used, creating nothing: a server must
    answer MLflow's API, a database its port (`check_database`), a `sqlite:` file's
    directory must be writable; `file:` stores, paths and Databricks are refused."""
    parsed = urlparse(uri)
    if uri.strip().lower() == "databricks" or parsed.scheme.lower() in DATABRICKS:
        raise PipelineError(
            f"tracking URI {uri!r} names a Databricks workspace, which this pipeline does not "
            "support (it names experiments by pipeline, where Databricks wants a workspace "
            "path such as /Users/<you>/<name>, and its Ray workers would each need the "
            "workspace's credentials). Use an MLflow server (http://HOST:PORT), a database "
            "(sqlite:////abs/path/mlflow.db, postgresql://USER@HOST/DB), or unset "
            "MLFLOW_TRACKING_URI / --tracking-uri for the embedded store under the root.")
    if parsed.scheme in ("http", "https"):
        if not parsed.netloc:
            raise PipelineError(f"tracking URI {uri!r} has no host: use http://HOST:PORT")
        from mlflow import MlflowClient

        os.environ.update(HTTP_LIMITS)
        try:
            MlflowClient(uri).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - said with its innermost reason
            why: BaseException = e
            while why.__cause__ or why.__context__:  # "[Errno 111] Connection refused"
                why = why.__cause__ or why.__context__
            raise PipelineError(
                f"MLflow tracking server {uri} is unreachable "
                f"({(str(why) or type(why).__name__).splitlines()[0][:300]}). Start it, fix "
                "MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
                "under the storage root.") from e
        return
    if parsed.scheme in ("", "file"):
        raise PipelineError(
            f"tracking URI {uri!r} is a path / file: store, which MLflow 3 no longer accepts "
            "for tracking (its file backend is in maintenance mode). Use an MLflow server "
            "(http://HOST:PORT), a database (sqlite:////abs/path/mlflow.db), or unset "
            "MLFLOW_TRACKING_URI / --tracking-uri for the embedded store under the root.")
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        _tracking_store_registry.get_store_builder(uri)
    except Exception as e:
        raise PipelineError(f"tracking URI {uri!r} is not one MLflow can use "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    if database_backend(uri):  # connected now, so a bad one fails before Stage 1
        check_database(uri, timeout)
    if parsed.scheme == "sqlite":
        parent = sqlite_path(uri).parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise PipelineError(f"tracking URI {uri!r}: directory {parent} does not exist "
                                "or is not writable")


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
    """At planning, so a bad database fails before Stage 1 (MLflow retries for minutes): a
    TCP probe of host:port, the driver's import, then `SELECT 1` within `timeout` seconds.
    PipelineError says which failed. Creates nothing (MLflow makes its tables later)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    backend, shown = database_backend(uri), hide_password(uri)
    fix = ("fix MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
           "under the storage root")
    parsed = urlparse(uri)
    if parsed.hostname:  # else a Unix socket (?host=/run/postgresql): the driver finds it
        where = parsed.netloc.rpartition("@")[2]
        try:
            port = parsed.port or DB_PORTS[backend]  # ValueError: not a port
            with socket.create_connection((parsed.hostname, port), timeout=timeout):
                pass
        except (OSError, ValueError) as e:
            raise PipelineError(
                f"no database answers at {where} for tracking URI {shown!r} "
                f"({getattr(e, 'strerror', None) or e}); start it, {fix}") from e
    try:
        engine = create_engine(uri, poolclass=NullPool,
                               connect_args={DB_TIMEOUT_ARGS[backend]: max(1, int(timeout))})
    except ImportError as e:
        raise PipelineError(
            f"tracking URI {shown!r} needs a {backend} driver for Python that is not "
            f"installed ({e}); install {DB_DRIVERS[backend]} in this environment (and on "
            f"every Ray node), or {fix}") from e
    except Exception as e:  # noqa: BLE001 - a malformed URL or an unknown +driver
        raise PipelineError(f"tracking URI {shown!r}: SQLAlchemy cannot load its driver "
                            f"({type(e).__name__}: {e})") from e
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as e:  # noqa: BLE001 - the driver's own reason, in one line
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise PipelineError(f"the database of tracking URI {shown!r} refused the connection "
                            f"({type(e).__name__}: {first}); {fix}") from e
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


def check_ui_bind(host: str, port: int) -> None:
    """PipelineError unless `make ui` can listen on host:port: a busy port or an address not
    of this machine is refused with exit 2 before anything starts (`mlflow server` prints
    "[Errno 98] ..." and exits 0). The probe binds as uvicorn does (SO_REUSEADDR)."""
    bare = host.strip("[]")
    try:
        family = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((bare, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port beyond 0-65535
        why = getattr(e, "strerror", None) or e
        raise PipelineError(f"cannot serve the MLflow UI on {host}:{port}: {why} (another "
                            "server there? pass PORT=...)") from e


def ui_warning(host: str, port: int) -> str | None:
    """What `make ui` prints when it serves beyond loopback, else None."""
    if is_loopback(host):
        return None
    return (f"warning: serving the MLflow UI on {host}:{port}, beyond this machine: the "
            "MLflow UI has no authentication, so anyone who can reach that port can read, "
            "change and delete every run and artifact of the store. Serve it only on a "
            "trusted network (or keep HOST=127.0.0.1 and use an SSH tunnel: ssh -L "
            f"{port}:127.0.0.1:{port} HOST). MLflow answers only requests addressed to "
            "localhost or a private IP by default; for a DNS name pass ALLOWED_HOSTS=name "
            "(--allowed-hosts).")


def ui_address(ui: str, experiment_id: str) -> str:
    """The page of an experiment's training runs with the sidebar on "Model training" (a
    fresh browser would open MLflow 3's GenAI overview; docs/pipeline.md, "The UI address")."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def run_address(ui: str, experiment_id: str, run_id: str) -> str:
    """The page of one run (the pipeline's parent run: its claims and report)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
