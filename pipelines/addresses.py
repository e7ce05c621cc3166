"""The addresses a user types for storage, tracking and the UI, checked before anything is
written (docs/pipeline.md, "Addresses"): each either works or is refused with a line that
says what to use instead (`PipelineError`, exit 2).

- `storage_root`: the storage root (`--root`, RUNS= for make) is a directory on a
  filesystem every Ray node mounts; `file://` URLs are read as that path, and any other URL
  (`s3://`, `gs://`, `hdfs://`, ...) is refused (the pipeline writes its records, locks,
  Phase-1 checkpoints and the embedded MLflow store with ordinary file operations).
- `check_tracking_uri`: the tracking URI a user asked for (`requested_tracking_uri`),
  checked at planning: a server must answer MLflow's API, a database (`postgresql://`,
  `mysql://`, `mssql://`, `check_database`) accept a connection, with short timeouts, so a
  bad one fails before Stage 1. `store_uri`: the store the driver writes (the embedded
  SQLite file under the root by default), `artifact_location`: where its artifacts go.
- `ui_warning`: the warning when `make ui` serves beyond loopback (the MLflow UI has no
  authentication); `ui_address`: the page of a pipeline's runs.
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


# -- tracking stores --------------------------------------------------------------------------

EMBEDDED = "embedded"
DATABRICKS = ("databricks", "databricks-uc", "uc")  # refused (docs/pipeline.md, "Addresses")

#: How long one MLflow call may take. MLflow's REST client reads these variables at every
#: request (`mlflow.utils.rest_utils.http_request`); its defaults (7 retries, backoff factor 2,
#: 120 s per attempt) keep one call against a dead server busy for minutes. Under these a
#: call takes at most 3 x 10 s + (2 + 0.5) s = 32.5 s against a server that accepts but never
#: answers, about 3 s against a refused connection. Set for the whole process by its first
#: `tracking.Tracker` (the driver's, or `report`'s: a value in their environment is overridden
#: there), or by `check_tracking_uri`.
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


def absolute_sqlite_uri(uri: str) -> str:
    """`sqlite:///runs.db` -> `sqlite:////abs/dir/runs.db` (query kept), so that `resume`
    and `report` from another directory name the same file; other URIs unchanged."""
    db = sqlite_path(uri)
    if db is None:
        return uri
    query = uri.split("?", 1)[1] if "?" in uri else ""
    return f"sqlite:///{db}" + (f"?{query}" if query else "")


def store_uri(root: Path, recorded: str | None) -> str:
    """The URI the driver writes to: the recorded one (tracking.json, pipeline.json), or
    for `embedded` / None the SQLite file `<root>/mlflow.db`."""
    if recorded in (None, EMBEDDED):
        return f"sqlite:///{Path(root).absolute() / 'mlflow.db'}"
    return recorded


def artifact_location(uri: str, pipeline: str, root: Path | None = None) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite store, in
    `mlartifacts/<pipeline>`; for a database server (`postgresql://`, ...) under the storage
    `root`, `<root>/mlartifacts/<pipeline>` (MLflow's default would be `./mlruns` of
    whatever directory the driver ran in); None (the server decides) for a tracking
    server."""
    db = sqlite_path(uri)
    if db is not None:
        return (db.parent / "mlartifacts" / pipeline).as_uri()
    if root is not None and database_backend(uri):
        return (Path(root).absolute() / "mlartifacts" / pipeline).as_uri()
    return None


def requested_tracking_uri(arg: str | None = None) -> str | None:
    """`--tracking-uri`, else MLFLOW_TRACKING_URI, else None (the embedded store); a relative
    `sqlite:` path is made absolute."""
    uri = arg or os.environ.get("MLFLOW_TRACKING_URI") or None
    return absolute_sqlite_uri(uri.strip()) if uri else None


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast (PipelineError) when a tracking URI cannot be used; create nothing.

    http(s): the server must answer MLflow's API (one `search_experiments`, bounded by
    HTTP_LIMITS). `file:` stores and bare
    paths are refused as MLflow 3 refuses them, and Databricks workspaces as unsupported.
    Other schemes must be one MLflow knows; a database (postgresql, mysql, mssql) must accept
    a connection (`check_database`); a `sqlite:` database's directory must exist
    and be writable.
    """
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


def ui_warning(host: str, port: int) -> str | None:
    """What `make ui` prints when it serves beyond loopback, else None. A busy port or a
    foreign host is `mlflow server`'s own error ("[Errno 98] ... address already in use")."""
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
    """The page of an experiment's training runs with the sidebar on "Model training".

    In a fresh browser MLflow 3's UI opens a GenAI home at its root and a GenAI overview at
    `#/experiments/<id>`, whatever the experiment's kind tag (its sidebar toggle lives in
    localStorage; mlflow issue 24498). `/runs` opens the runs table and `workflowType` sets
    the toggle; checked with headless Chromium on MLflow 3.17 (docs/pipeline.md, "The UI")."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def run_address(ui: str, experiment_id: str, run_id: str) -> str:
    """The page of one run (the pipeline's parent run: its claims and report)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
