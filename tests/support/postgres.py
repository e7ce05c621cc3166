"""A throwaway PostgreSQL cluster on 127.0.0.1 for the tracking tests (issue 53): `initdb`
into a temporary directory, `pg_ctl start` on a free loopback port, one database, and
`stop` + removal at the end. Run as the `postgres` system user when the tests run as root
(initdb refuses root), else as the current user.

The cluster trades durability for speed (fsync, full-page writes and synchronous commit
off: nothing outlives the test session), and asks for a password over TCP
(scram-sha-256), so a wrong password is refused as on a real server; the Unix socket, in
the cluster's own directory, trusts its local user (createdb, the tests' set-up).
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.net import free_port

USER = "postgres"  # the cluster's superuser and, under root, the system user that runs it
DATABASE = "mlflow"


def postgres_bin() -> Path | None:
    """The directory of PostgreSQL's server programs (initdb, pg_ctl, postgres): the one on
    the PATH, else the newest `/usr/lib/postgresql/<major>/bin` (Debian's layout); None
    when there is none."""
    found = shutil.which("initdb")
    if found:
        real = Path(found).resolve().parent
        if (real / "pg_ctl").is_file():
            return real
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: int(p.parent.parent.name) if
                      p.parent.parent.name.isdigit() else 0)
    return versions[-1].parent if versions else None


def missing_reason() -> str | None:
    """Why a cluster cannot be started here, or None when it can."""
    bindir = postgres_bin()
    if bindir is None:
        return ("no PostgreSQL server programs (initdb, pg_ctl) on the PATH or in "
                "/usr/lib/postgresql/*/bin: install PostgreSQL (Debian: apt-get install "
                "postgresql) to run the tests against a real database")
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam(USER)
        except KeyError:
            return (f"running as root, and there is no {USER!r} system user to run initdb "
                    "as (initdb refuses root)")
    return None


@dataclass
class Cluster:
    """A running cluster: `uri()` names its database over TCP with the password."""

    bindir: Path
    base: Path  # the temporary directory: data/, the log, the Unix socket
    port: int
    password: str
    start_s: float  # initdb + start + createdb, for the record

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def log(self) -> Path:
        return self.base / "postgres.log"

    def uri(self, *, password: str | None = None, port: int | None = None,
            database: str = DATABASE, driver: str = "") -> str:
        """`postgresql[+driver]://postgres:<password>@127.0.0.1:<port>/<database>`; with
        `password=""` none (libpq then reads PGPASSWORD or ~/.pgpass)."""
        scheme = "postgresql" + (f"+{driver}" if driver else "")
        pw = self.password if password is None else password
        user = f"{USER}:{pw}" if pw else USER
        return f"{scheme}://{user}@127.0.0.1:{port or self.port}/{database}"

    def createdb(self, name: str) -> None:
        _run(self.bindir / "createdb", "-h", str(self.base), "-p", str(self.port), "-U",
             USER, name)

    def running(self) -> bool:
        r = subprocess.run(_as_owner(str(self.bindir / "pg_ctl"), "-D", str(self.data),
                                     "status"), capture_output=True, text=True)
        return r.returncode == 0

    def stop(self, mode: str = "fast") -> None:
        """Stop the server if it runs (`fast`: a clean shutdown; `immediate`: no checkpoint,
        for a cluster about to be removed); the directory stays."""
        if self.running():
            _run(self.bindir / "pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60",
                 "stop")

    def start(self) -> None:
        """Start it again on the same port (after `stop`)."""
        _pg_ctl_start(self.bindir, self.base, self.port)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


def _as_owner(*cmd: str) -> list[str]:
    """The command as the `postgres` system user when we are root (initdb and postgres
    refuse root), else as it is."""
    if os.geteuid() != 0:
        return list(cmd)
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", USER, "--", *cmd]
    return ["su", USER, "-s", "/bin/sh", "-c", shlex.join(cmd)]


def _run(*cmd, timeout: float = 120) -> str:
    r = subprocess.run(_as_owner(*map(str, cmd)), capture_output=True, text=True,
                       timeout=timeout, cwd="/")
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n"
                           f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def _pg_ctl_start(bindir: Path, base: Path, port: int) -> None:
    options = (f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off "
               "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50")
    _run(bindir / "pg_ctl", "-D", base / "data", "-l", base / "postgres.log", "-w", "-t", "60",
         "-o", options, "start")


def start_cluster(tries: int = 3) -> Cluster:
    """initdb + start + createdb mlflow, on a free port of 127.0.0.1; the port is taken
    again where another program bound it in the meantime. RuntimeError with the server's
    log when it does not start."""
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    bindir = postgres_bin()
    t0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="pmnet-pg-"))
    try:
        if os.geteuid() == 0:
            shutil.chown(base, USER, USER)
        password = secrets.token_hex(12)
        pwfile = base / "pw"
        pwfile.write_text(password + "\n")
        if os.geteuid() == 0:
            shutil.chown(pwfile, USER, USER)
        _run(bindir / "initdb", "-D", base / "data", "-U", USER, "--pwfile", pwfile,
             "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C",
             "--no-sync", "--no-instructions")
        pwfile.unlink()
        for attempt in range(tries):
            port = free_port()
            try:
                _pg_ctl_start(bindir, base, port)
                break
            except RuntimeError:
                log = (base / "postgres.log").read_text(errors="replace") \
                    if (base / "postgres.log").exists() else ""
                if "could not bind" in log and attempt + 1 < tries:
                    continue  # another program took the port: another one
                raise RuntimeError(f"PostgreSQL did not start:\n{log[-3000:]}") from None
        cluster = Cluster(bindir=bindir, base=base, port=port, password=password, start_s=0.0)
        cluster.createdb(DATABASE)
        cluster.start_s = time.monotonic() - t0
        return cluster
    except BaseException:
        subprocess.run(_as_owner(str(bindir / "pg_ctl"), "-D", str(base / "data"), "-m",
                                 "immediate", "stop"), capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
        raise
