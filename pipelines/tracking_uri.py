"""Where the pipeline's MLflow runs go: the tracking URI a user asked for, checked before any
side effect (planning), the embedded SQLite store under the storage root, and the UI address
of an experiment's runs. No MLflow client is opened here (`pipelines.tracking` writes)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from pipelines.addresses import check_database, database_backend
from pipelines.layout import PipelineError

EMBEDDED = "embedded"
DATABRICKS = ("databricks", "databricks-uc", "uc")  # refused (docs/pipeline.md, "Addresses")


# -- where the runs go ---------------------------------------------------------------------


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

    http(s): the server must answer (`/health`, else its REST API). `file:` stores and bare
    paths are refused as MLflow 3 refuses them, and Databricks workspaces as unsupported.
    Other schemes must be one MLflow knows; a database (postgresql, mysql, mssql) must accept
    a connection (`addresses.check_database`); a `sqlite:` database's directory must exist
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
        _check_server(uri, timeout)
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


def _check_server(uri: str, timeout: float) -> None:
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
    except (OSError, ValueError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", e)
        raise PipelineError(
            f"MLflow tracking server {uri} is unreachable ({reason}). Start it, fix "
            "MLFLOW_TRACKING_URI / --tracking-uri, or unset it to use the embedded store "
            "under the storage root.") from e


UI_DEFAULT = "http://127.0.0.1:5000"  # `make ui`


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
