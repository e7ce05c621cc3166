"""Storage, cluster, tracking and UI addresses (docs/pipeline.md, "Addresses"): each either
works or is refused with exit 2, a line saying what to use instead, and nothing written.

The refusals run `pipelines.run.main` in-process from an empty working directory, and check
the exit code, the message, the time (a few seconds: nothing started, no network waited on)
and that neither the working directory nor the storage root changed. No test reaches beyond
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipelines import run
from pipelines.layout import PipelineError
from tests.support.net import free_port

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "pipeline.md"
BEGIN, END = "<!-- addresses:begin -->", "<!-- addresses:end -->"
S = ["start", "--preset", "debug", "--grid", "tiny"]


def _snapshot(path: Path) -> dict[str, tuple]:
    return {str(p.relative_to(path)): (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(path.rglob("*"))} if path.exists() else {}


def cli(argv: list[str], env: dict[str, str], cwd: Path, monkeypatch) -> tuple[int, str, float]:
    """`python -m pipelines.run ARGV` in-process, in `cwd`, with `env` set (and
    MLFLOW_TRACKING_URI / RAY_ADDRESS unset otherwise): (exit code, stdout+stderr, seconds)."""
    for k in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = run.main(argv)
        except SystemExit as e:  # argparse
            rc = int(e.code or 0)
    return rc, out.getvalue() + err.getvalue(), time.monotonic() - t0


# -- the refusals: exit 2, what to use instead, nothing written ------------------------------


@dataclass
class Refused:
    address: str  # the docs table's first column
    argv: list[str]  # ROOT: the case's storage root; PORT: a closed port
    message: str  # regex
    env: dict[str, str] = field(default_factory=dict)


def _pg_driver() -> bool:
    from sqlalchemy.engine import make_url

    try:
        make_url("postgresql://x@h/db").get_dialect().import_dbapi()
        return True
    except ImportError:
        return False


ROOT_FIX = r"filesystem every Ray node mounts at the same path.*pass that path as --root"
TRACK_FIX = r"unset (it|MLFLOW_TRACKING_URI / --tracking-uri) (to use|for) the embedded store"
REFUSED = [
    Refused("RUNS=s3://bucket/runs", [*S, "--root", "s3://bucket/runs"],
            r"storage root 's3://bucket/runs' is a s3:// URL.*" + ROOT_FIX),
    Refused("RUNS=gs://bucket/runs", [*S, "--root", "gs://bucket/runs"], r"gs:// URL"),
    Refused("RUNS=hdfs://namenode/runs", ["resume", "--root", "hdfs://namenode/runs"],
            r"hdfs:// URL"),
    Refused("RUNS=s3:/bucket/runs", ["status", "--root", "s3:/bucket/runs"], r"s3:// URL"),
    Refused("RUNS=file://otherhost/runs", [*S, "--root", "file://otherhost/runs"],
            r"names a file on another host \(otherhost\)"),
    Refused("STORE=s3://bucket/study", [*S, "--store", "s3://bucket/study"],
            r"--store 's3://bucket/study' is a s3:// URL.*pass that path as --store"),
    Refused("STORE=gs://bucket/study (report)", ["report", "--store", "gs://bucket/study"],
            r"--store 'gs://bucket/study' is a gs:// URL"),
    Refused("RAY_ADDRESS=http://HOST:8265", S,
            r"dashboard / job-submission URL.*use the head's HOST:6379",
            env={"RAY_ADDRESS": "http://127.0.0.1:8265"}),
    Refused("MLFLOW_TRACKING_URI=databricks", S,
            r"'databricks' names a Databricks workspace, which this pipeline does not "
            r"support.*Use an MLflow server", env={"MLFLOW_TRACKING_URI": "databricks"}),
    Refused("MLFLOW_TRACKING_URI=databricks://PROFILE", S, r"Databricks workspace",
            env={"MLFLOW_TRACKING_URI": "databricks://my-profile"}),
    Refused("MLFLOW_TRACKING_URI=postgresql://... (nothing listening)", S,
            r"no database answers at 127\.0\.0\.1:\d+ .*'postgresql://u:\*\*\*@.*Connection "
            r"refused.*" + TRACK_FIX,
            env={"MLFLOW_TRACKING_URI": "postgresql://u:secret@127.0.0.1:PORT/mlflow"}),
    Refused("MLFLOW_TRACKING_URI=mysql+pymysql://... (nothing listening)", S,
            r"no database answers at 127\.0\.0\.1:\d+",
            env={"MLFLOW_TRACKING_URI": "mysql+pymysql://u@127.0.0.1:PORT/mlflow"}),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c.address for c in REFUSED])
def test_refused_with_exit_2_and_nothing_written(case, tmp_path, monkeypatch):
    cwd, root = tmp_path / "cwd", tmp_path / "root"
    cwd.mkdir()
    root.mkdir()
    port = str(free_port())
    argv = [a.replace("ROOT", str(root)) for a in case.argv]
    env = {k: v.replace("PORT", port) for k, v in case.env.items()}
    if "--root" not in argv:
        argv += ["--root", str(root)]
    before = (_snapshot(cwd), _snapshot(root))
    rc, text, seconds = cli(argv, env, cwd, monkeypatch)
    assert rc == run.Exit.BAD_INPUT, text
    assert re.search(case.message, text, re.S), text
    assert "secret" not in text  # a database password is never printed
    assert (_snapshot(cwd), _snapshot(root)) == before, "something was written"
    assert seconds < 15, f"took {seconds:.1f} s: something started or waited"


def test_every_command_refuses_an_object_store_root(tmp_path, monkeypatch):
    """`Path("s3://b/r")` is `s3:/b/r`, relative: without the check each command would
    create or read `$PWD/s3:/b/r`."""
    (tmp_path / "cwd").mkdir()
    for argv in (S, ["resume"], ["status"], ["report"], ["ui", "--port", str(free_port())]):
        rc, text, _ = cli([*argv, "--root", "s3://b/r"], {}, tmp_path / "cwd", monkeypatch)
        assert rc == run.Exit.BAD_INPUT and "s3:// URL" in text, (argv, text)
    assert list((tmp_path / "cwd").iterdir()) == []


def test_postgres_without_its_driver_is_refused_by_name(tmp_path, monkeypatch):
    """Something listens at the database's port, but the Python driver is missing (here
    hidden from the import system: `make install` installs it, the `postgres` extra): the
    line names the package to install (before, MLflow failed after Stage 1 was
    submitted)."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` raises ImportError
    assert not _pg_driver()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        uri = f"postgresql://u@127.0.0.1:{srv.getsockname()[1]}/mlflow"
        (tmp_path / "cwd").mkdir()
        rc, text, seconds = cli([*S, "--root", str(tmp_path / "root")],
                                {"MLFLOW_TRACKING_URI": uri}, tmp_path / "cwd", monkeypatch)
    assert rc == run.Exit.BAD_INPUT, text
    assert re.search(r"needs a postgresql driver for Python that is not installed.*install "
                     r"psycopg\[binary\]", text), text
    assert not (tmp_path / "root").exists() and seconds < 15


# -- a real PostgreSQL server (tests/support/postgres.py: a throwaway cluster on 127.0.0.1) --


def _tables(uri: str) -> list[str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(uri, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return sorted(conn.execute(text(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = 'public'")).scalars())
    finally:
        engine.dispose()


def test_a_postgres_database_that_answers_passes_planning(postgres, tmp_path):
    """The probe against a real server: connected (`SELECT 1` through the installed
    driver), the plan keeps the URI, and nothing is created, neither a table in the database
    nor the storage root."""
    from pipelines import plan as planning
    from pipelines.addresses import check_tracking_uri

    uri = postgres.uri(database="probe")
    postgres.createdb("probe")
    assert _pg_driver()
    t0 = time.monotonic()
    check_tracking_uri(uri)
    assert time.monotonic() - t0 < 10
    plan = planning.plan_new(root=tmp_path / "runs", name="pg", preset="debug", grid="tiny",
                             tracking_uri=uri, num_cpus=2, gpus_per_trial=0)
    assert plan.tracking_uri == uri
    assert _tables(uri) == [] and not (tmp_path / "runs").exists()


def test_a_password_from_pgpassword_keeps_it_out_of_the_uri(postgres, monkeypatch):
    """`postgresql://postgres@HOST:PORT/DB` with the password in PGPASSWORD (or ~/.pgpass):
    libpq, under psycopg, reads it, so the URI that the run directory records and the
    console prints holds none (docs/pipeline.md, "One tracking server for many machines");
    without it the server refuses."""
    from pipelines.addresses import check_tracking_uri

    uri = postgres.uri(password="")
    assert postgres.password not in uri
    monkeypatch.setenv("PGPASSFILE", "/nonexistent")  # no ~/.pgpass of the user's
    monkeypatch.delenv("PGPASSWORD", raising=False)
    with pytest.raises(PipelineError, match="refused the connection .*(password|no password)"):
        check_tracking_uri(uri)
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    check_tracking_uri(uri)


@dataclass
class PgRefused:
    address: str  # the docs table's first column
    uri: dict  # keyword arguments of Cluster.uri
    message: str  # regex; PORT: the cluster's port
    stopped: bool = False  # the server is stopped for the case


PG_REFUSED = [
    PgRefused("MLFLOW_TRACKING_URI=postgresql://... (wrong password)", {"password": "secret"},
              r"the database of tracking URI 'postgresql://postgres:\*\*\*@127\.0\.0\.1:PORT/"
              r"mlflow' refused the connection \(OperationalError: .*password authentication "
              r"failed for user \"postgres\".*" + TRACK_FIX),
    PgRefused("MLFLOW_TRACKING_URI=postgresql://... (no such database)",
              {"database": "nosuchdb"},
              r"refused the connection \(OperationalError: .*database \"nosuchdb\" does not "
              r"exist"),
    PgRefused("MLFLOW_TRACKING_URI=postgresql://... (server stopped)", {"password": "secret"},
              r"no database answers at 127\.0\.0\.1:PORT for tracking URI "
              r"'postgresql://postgres:\*\*\*@.*Connection refused.*" + TRACK_FIX,
              stopped=True),
]


@pytest.mark.parametrize("case", PG_REFUSED, ids=[c.address for c in PG_REFUSED])
def test_a_real_postgres_refusal_is_exit_2_with_its_reason(case, postgres, tmp_path,
                                                           monkeypatch):
    """`make pipeline` with MLFLOW_TRACKING_URI naming the real server wrongly: exit 2 in
    seconds, the server's own reason, the password as `***`, nothing written."""
    cwd, root = tmp_path / "cwd", tmp_path / "root"
    cwd.mkdir()
    root.mkdir()
    before = (_snapshot(cwd), _snapshot(root))
    if case.stopped:
        postgres.stop()
    try:
        rc, text, seconds = cli([*S, "--root", str(root)],
                                {"MLFLOW_TRACKING_URI": postgres.uri(**case.uri)}, cwd,
                                monkeypatch)
    finally:
        if case.stopped:
            postgres.start()
    assert rc == run.Exit.BAD_INPUT, text
    assert re.search(case.message.replace("PORT", str(postgres.port)), text, re.S), text
    assert "secret" not in text and postgres.password not in text
    assert (_snapshot(cwd), _snapshot(root)) == before, "something was written"
    assert seconds < 15, f"took {seconds:.1f} s"


# -- the addresses that work --------------------------------------------------------------------


def test_ray_address_local_is_the_loopback_only_local_instance(tmp_path, monkeypatch):
    """RAY_ADDRESS=local plans (and so runs) exactly as no RAY_ADDRESS: `init_ray(None)`, the
    instance that listens on 127.0.0.1 only (tests/test_pipeline.py checks that it does).
    Before, "local" went to `ray.init(address="local")` without the loopback setting."""
    from pipelines import plan as planning

    for value in ("local", " LOCAL "):
        monkeypatch.setenv("RAY_ADDRESS", value)
        plan = planning.plan_new(root=tmp_path / "runs", name="p", preset="debug",
                                 grid="tiny", num_cpus=1)
        assert plan.ray_address is None and plan.cluster.where == "this machine"
    assert planning.check_ray_address("local") is None
    assert planning.check_ray_address("auto") == "auto"
    assert not (tmp_path / "runs").exists()


def test_file_url_root_is_that_path(tmp_path, monkeypatch):
    from pipelines import plan as planning

    for url in (f"file://{tmp_path}/runs", f"file://localhost{tmp_path}/runs",
                f"file:{tmp_path}/runs", f"FILE://{tmp_path}/runs"):
        plan = planning.plan_new(root=url, name="p", preset="debug", grid="tiny", num_cpus=1)
        assert plan.layout.root == tmp_path / "runs"
    (tmp_path / "cwd").mkdir()
    rc, text, _ = cli(["status", "--root", f"file://{tmp_path}/runs%20x", "--name", "q"], {},
                      tmp_path / "cwd", monkeypatch)
    assert rc == run.Exit.BAD_INPUT and f"no pipeline 'q' under {tmp_path}/runs x" in text


def test_plain_paths_with_a_colon_stay_paths(tmp_path):
    from pipelines.addresses import storage_root

    assert storage_root(tmp_path / "a:b") == tmp_path / "a:b"
    assert storage_root("runs:2026") == Path.cwd() / "runs:2026"
    assert storage_root("~/runs") == Path.home() / "runs"


def _ui(tmp_path, monkeypatch, *args) -> tuple[int | None, str, list[str]]:
    """`pipelines.run ui ...` up to the `execv` of `mlflow server`, which is caught (no
    server starts): (exit code, or None when it got to execv; the output; execv's argv)."""
    got: list[list[str]] = []

    class Exec(Exception):
        pass

    def execv(path, argv):
        got.append(list(argv))
        raise Exec

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(os, "chdir", lambda p: None)
    monkeypatch.chdir(tmp_path)
    buf = io.StringIO()
    rc = None
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), \
            contextlib.suppress(Exec):
        rc = run.main(["ui", "--root", str(tmp_path / "runs"), *args])
    return rc, buf.getvalue(), got[0] if got else []


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_ui_beyond_loopback_serves_there_with_the_warning(tmp_path, monkeypatch):
    port = str(free_port())
    rc, text, cmd = _ui(tmp_path, monkeypatch, "--host", "0.0.0.0", "--port", port,
                        "--allowed-hosts", "box.example")
    assert rc is None, text
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--port") + 1] == port
    assert cmd[cmd.index("--allowed-hosts") + 1] == "box.example"
    assert re.search(r"warning: serving the MLflow UI on 0\.0\.0\.0:\d+, beyond this machine: "
                     r"the MLflow UI has no authentication", text), text
    assert f"http://127.0.0.1:{port}" in text  # what a browser on this machine opens
    if _ipv6_loopback():
        rc, text, cmd = _ui(tmp_path, monkeypatch, "--host", "::1", "--port", port)
        assert rc is None and f"http://[::1]:{port}" in text, text
        assert "no authentication" not in text
    rc, text, cmd = _ui(tmp_path, monkeypatch, "--port", port)
    assert rc is None, text
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--allowed-hosts" not in cmd
    assert "no authentication" not in text


def test_ui_on_a_busy_port_or_a_foreign_address_is_refused_before_anything_starts(
        tmp_path, monkeypatch):
    """`mlflow server` on a busy port prints "[Errno 98] ..." and exits 0: `make ui` checks
    the bind first (exit 2, nothing made), and a port freed again serves."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = str(srv.getsockname()[1])
        rc, text, cmd = _ui(tmp_path, monkeypatch, "--port", port)
        assert rc == 2 and cmd == [], text
        assert f"error: cannot serve the MLflow UI on 127.0.0.1:{port}: " in text, text
        assert "another server there? pass PORT=" in text
    assert not (tmp_path / "runs").exists()
    rc, text, cmd = _ui(tmp_path, monkeypatch, "--port", port)
    assert rc is None and cmd[cmd.index("--port") + 1] == port, text
    rc, text, cmd = _ui(tmp_path, monkeypatch, "--host", "192.0.2.1", "--port", port)
    assert rc == 2 and "cannot serve the MLflow UI on 192.0.2.1:" in text, text  # TEST-NET-1
    rc, text, cmd = _ui(tmp_path, monkeypatch, "--port", "70000")
    assert rc == 2 and "cannot serve the MLflow UI on 127.0.0.1:70000: " in text, text


def test_make_ui_passes_host_port_and_allowed_hosts():
    from tests.support.make import make_dry_run

    out = make_dry_run("-o", ".venv/.installed", "ui", "HOST=0.0.0.0", "PORT=5123",
                       "ALLOWED_HOSTS=box.example")
    line = next(ln for ln in out.splitlines() if "pipelines.run ui" in ln)
    assert "--host 0.0.0.0 --port 5123 --allowed-hosts box.example" in line, line
    plain = make_dry_run("-o", ".venv/.installed", "ui", drop=("HOST", "PORT", "ALLOWED_HOSTS"))
    assert "--host" not in next(ln for ln in plain.splitlines() if "pipelines.run ui" in ln)


def test_the_printed_ui_address_is_a_route_of_the_installed_mlflow_ui():
    """`make ui` prints `<ui>/#/experiments/<id>/runs?workflowType=machine_learning`
    (`addresses.ui_address`; opened in headless Chromium on MLflow 3.17, docs/pipeline.md
    "The UI"). The installed MLflow's UI bundle still has that route and that toggle, and
    its server the options `make ui` passes."""
    import mlflow

    from pipelines.addresses import ui_address

    assert ui_address("http://h:1", "7") == (
        "http://h:1/#/experiments/7/runs?workflowType=machine_learning")
    assert int(mlflow.__version__.split(".")[0]) == 3, mlflow.__version__
    main = sorted((Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" /
                   "js").glob("main.*.js"))
    assert main, "no MLflow UI bundle installed"
    js = main[0].read_text(errors="replace")
    assert '"/experiments/:experimentId/runs"' in js
    assert 'get("workflowType")' in js and 'MACHINE_LEARNING="machine_learning"' in js
    out = subprocess.run([sys.executable, "-m", "mlflow", "server", "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    for option in ("--backend-store-uri", "--artifacts-destination", "--host", "--port",
                   "--workers", "--allowed-hosts"):
        assert option in out, option


# -- the table --------------------------------------------------------------------------------

WORKS = ["RUNS=/abs/path", "RUNS=file:///abs/path", "RAY_ADDRESS=local",
         "MLFLOW_TRACKING_URI=postgresql://... (a database that answers)",
         "make ui HOST=0.0.0.0"]


def test_docs_table_lists_every_case():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"docs/pipeline.md has no {BEGIN} table"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [ln for ln in block.splitlines() if ln.startswith("| `")]
    listed = [re.match(r"\| `([^`]+)`", ln).group(1) for ln in rows]
    assert sorted(listed) == sorted([c.address for c in REFUSED + PG_REFUSED] + WORKS)
    for ln in rows:
        address = re.match(r"\| `([^`]+)`", ln).group(1)
        assert ("| refused, exit 2 |" in ln) == (address not in WORKS), ln
    assert text.rstrip().endswith(END), "the Addresses table ends docs/pipeline.md"
