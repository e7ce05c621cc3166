"""Command line of the pipeline (the Makefile's pipeline/resume/status/report/ui targets).

    python -m pipelines.run start  [--preset P] [--name N] [--root DIR] [--grid G] ...
    python -m pipelines.run resume [--name N] [--root DIR]
    python -m pipelines.run status [--name N] [--root DIR]
    python -m pipelines.run report [--name N] [--root DIR]  |  report --store DIR
    python -m pipelines.run ui     [--name N] [--root DIR] [--port 5000]

Exit codes (`Exit`): 0 every trial finished; 1 the pipeline ran but some trials did not
finish (`resume` continues them); 2 bad input, refused before any compute and before
anything is written (flags, --set values, environment, paths, damaged records of a pipeline);
3 the pipeline started and failed (Stage 1 failed, disk full, an internal error: the message
and `<run>/logs/driver-error.txt` say why; fix it, then `resume`); 4 another driver is
running this pipeline (nothing was done); 130 interrupted (Ctrl-C; `resume` continues).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import time
import traceback
from enum import IntEnum
from pathlib import Path

from pipelines.layout import PipelineError
from pmnet.store_layout import StoreError

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "runs"


class Exit(IntEnum):
    """Exit codes of `python -m pipelines.run` (a wrapper may resume on UNFINISHED only)."""

    DONE = 0
    UNFINISHED = 1
    BAD_INPUT = 2
    FAILED = 3
    BUSY = 4
    INTERRUPTED = 130


def _common(p: argparse.ArgumentParser, name: bool = True) -> None:
    p.add_argument("--root", default=str(DEFAULT_ROOT),
                   help="storage root (a path or file:// URL; shared storage on a Ray "
                        "cluster; s3:// and other URLs are refused: mount them)")
    if name:
        p.add_argument("--name", default=None,
                       help="pipeline name (default: the last one started under --root)")


def _max_wall(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-wall", type=float, default=None, metavar="SECONDS", dest="max_wall_s",
                   help="stop cleanly between waves of Phase-1 checkpoints once this many "
                        "seconds have passed, and pause a Phase 1 at the last epoch end "
                        "within them (with --store: its progress into the store; exit 0; one "
                        "line says what is left and how to continue)")


def _compute(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking server or sqlite: URI (default: MLFLOW_TRACKING_URI, "
                        "else the embedded store <root>/mlflow.db, written by the driver)")
    p.add_argument("--ray-address", default=None,
                   help="a running Ray cluster (default: RAY_ADDRESS, else local Ray)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (default: all)")
    p.add_argument("--stage1-cpus", type=float, default=None,
                   help="CPUs (and torch threads) of the Stage-1 task (default: every CPU of "
                        "the largest node)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipelines.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="run a new pipeline (or continue one with the same name "
                                     "and configuration)")
    _common(p)
    # the presets as the registry has them (light: pmnet.config imports no torch)
    from pmnet.config import PRESETS, default_preset

    p.add_argument("--preset", default=None,
                   help=f"{' | '.join(PRESETS)} (default: {default_preset('gpu')} when a node "
                        f"has a GPU, {default_preset('cpu')} otherwise)")
    from tune_spaces import SPACES  # light: no torch, Ray or MLflow

    p.add_argument("--grid", default="default",
                   help=f"grid function in tune_spaces ({', '.join(SPACES)})")
    p.add_argument("--conditions", default=None, help="comma-separated conditions")
    p.add_argument("--variants", default=None,
                   help="comma-separated variants of the grid to run (e.g. T2-full,T4-full "
                        "of grid segments; default: all of them)")
    p.add_argument("--seeds", default=None, help="comma-separated Phase-2 seeds")
    p.add_argument("--cpus-per-trial", type=float, default=None)
    p.add_argument("--gpus-per-trial", type=float, default=None,
                   help="fraction of one GPU per trial (0.25: four trials share a GPU)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="cap on trials running at once (default: resources decide)")
    p.add_argument("--max-failures", type=int, default=None,
                   help="retries of a crashed trial from its last checkpoint (default 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="TrainConfig override, e.g. --set max_epochs=3 --set model.hidden=32")
    p.add_argument("--phase1-seeds", default=None, metavar="K1,K2,...",
                   help="nest the grid under one Phase-1 checkpoint per Phase-1 seed (the "
                        "Phase-1 variance analysis; grid phase1_variance uses 0,1,2), with or "
                        "without --store: a piece of a store's study is the grid over some "
                        "of its checkpoints")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="the run's store (pmnet.store_layout), instead of the run directory: "
                        "the run reads the finished units there and lands each of its own "
                        "there once, as it finishes; the store's report is rebuilt at the "
                        "end. Several runs may fill one store")
    _max_wall(p)
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GIB", dest="gpu_mem_gib",
                   help="memory of each GPU in GiB (default: what nvidia-smi reports on the "
                        "GPU nodes); each condition's GPU share is chosen to fit it")
    gpu_presets = ", ".join(n for n, pr in PRESETS.items() if pr.needs_gpu) or "none"
    p.add_argument("--allow-cpu-paper", action="store_true",
                   help=f"run a preset built for a GPU ({gpu_presets}) even where the chosen "
                        "nodes have no GPU (refused otherwise, with the estimated time: days "
                        "to years)")
    p.add_argument("--phase1-from", default=None, metavar="PATH",
                   help="reuse a finished Phase-1 checkpoint (a phase1.pt or its directory, "
                        "e.g. another pipeline's <run>/phase1) instead of training one; it "
                        "must match this preset's Phase-1 configuration")
    _compute(p)

    p = sub.add_parser("resume", help="continue the last (or --name) pipeline (its grid, "
                                      "resources and max_failures are the stored ones)")
    _common(p)
    _compute(p)
    _max_wall(p)

    p = sub.add_parser("status", help="table of a pipeline's trials, read from disk")
    _common(p)

    p = sub.add_parser("report", help="rebuild the report of a pipeline from its results")
    _common(p)
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--no-mlflow", action="store_true",
                   help="do not log the report to the pipeline's MLflow run")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="build the report of a durable store instead (into DIR/report/)")

    p = sub.add_parser("ui", help="MLflow UI of the last (or --name) pipeline's tracking store "
                                  "on 127.0.0.1 (a tracking server: its address)")
    _common(p)
    p.add_argument("--port", type=int, default=int(os.environ.get("MLFLOW_UI_PORT", 5000)))
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (0.0.0.0: every interface, e.g. from a "
                        "container; the UI has no authentication, a warning says so)")
    p.add_argument("--allowed-hosts", default=None,
                   help="Host headers MLflow answers beyond localhost and private IPs "
                        "(mlflow server --allowed-hosts), e.g. a DNS name of this machine")
    return ap


def _flags(a) -> dict:
    """The parsed flags as `plan_new`'s / `plan_resume`'s keyword arguments (their dests)."""
    return {k: v for k, v in vars(a).items() if k != "command"}


def cmd_start(a) -> int:
    from pipelines import plan as planning

    overrides = planning.parse_overrides(a.overrides)
    plan = planning.plan_new(**{**_flags(a), "overrides": overrides})
    print(f"preset: {plan.cfg.preset} ({plan.preset_reason})", flush=True)
    return run_plan(plan)


def cmd_resume(a) -> int:
    from pipelines.plan import plan_resume

    return run_plan(plan_resume(**_flags(a)))


def run_plan(plan) -> int:
    """Execute a validated plan; map what can go wrong after the start to an exit code."""
    from pipelines import driver
    from pipelines.console import say
    from pipelines.lock import DriverRunning

    try:
        rc = driver.execute(plan)
        args, lines = ui_plan(plan.layout.root, name=plan.name)  # where MLflow shows the run
        if args is not None:
            lines[0] += f" (`make ui NAME={plan.name} RUNS={plan.layout.root}` serves it)"
        for line in lines:
            say(f"[pipeline] {line}")
        return Exit.DONE if rc == 0 else Exit.UNFINISHED
    except DriverRunning as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BUSY
    except (PipelineError, StoreError) as e:  # a store's error is the pipeline's (exit 3)
        print(f"error: {e}", file=sys.stderr)
        return Exit.FAILED
    except Exception as e:
        where = _save_traceback(plan.layout.logs_dir / "driver-error.txt")
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            where_full = getattr(e, "filename", None) or plan.layout.root
            print(f"error: no space left on the device of {where_full} ({e.strerror}). "
                  f"Free space, then `make resume NAME={plan.name}`: finished trials are "
                  f"kept.{where}", file=sys.stderr)
        else:
            print(f"internal error: {type(e).__name__}: {e}.{where} Results that finished "
                  f"are kept; `make resume NAME={plan.name}` continues once the cause is "
                  "fixed.", file=sys.stderr)
        return Exit.FAILED


def _save_traceback(path: Path) -> str:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n{traceback.format_exc()}")
        return f" Traceback in {path}."
    except OSError:
        traceback.print_exc()
        return ""


def cmd_status(a) -> int:
    from pipelines.layout import last_pipeline, run_layout
    from pipelines.status import status_text

    root = Path(a.root).expanduser().absolute()
    name = a.name or last_pipeline(root)
    layout = run_layout(root, name)
    if not layout.pipeline_json.is_file():
        raise PipelineError(f"no pipeline {name!r} under {root}")
    print(status_text(layout))
    return Exit.DONE


def cmd_report(a) -> int:
    from pipelines.layout import last_pipeline
    from pipelines.plan import plan_resume
    from pipelines.stages import stage3
    from pipelines.tracking import Runs

    if a.store is not None:
        return report_store(a.store)
    root = Path(a.root).expanduser().absolute()
    # the store the pipeline recorded (or --tracking-uri); the report computes nothing
    plan = plan_resume(root=root, name=a.name or last_pipeline(root),
                       tracking_uri=a.tracking_uri, check_resources=False)
    runs = Runs() if a.no_mlflow else Runs.reopen(plan.layout, plan.tracking_uri)
    return Exit.DONE if stage3(plan, runs) else Exit.FAILED


def report_store(path: str) -> int:
    """`<store>/report/` of a durable store; exit 2 when it is not a store with results or
    a unit is damaged (`pmnet.store_verify`'s table)."""
    from pipelines.addresses import STORE_HELP, storage_root
    from pmnet.store_layout import read_store_record
    from pmnet.store_verify import verify_store

    root = storage_root(path, what="--store", help=STORE_HELP)
    try:
        record = read_store_record(root)
    except ValueError as e:
        raise PipelineError(f"--store {root}: {e}") from e
    if record is None or not (root / "results").is_dir():
        raise PipelineError(f"--store {root}: not a store with results (no store.json or no "
                            "results/); fill one with `make pipeline STORE=...`")
    check = verify_store(root)  # a damaged unit is never reported: refused with the table
    if not check.ok:
        raise PipelineError(f"--store {root} holds damaged units; the report reads whole "
                            f"units only:\n{check.table()}\nA run into the store (`make "
                            f"pipeline STORE={root} ...` or `make resume`) moves them to "
                            f"{root}/quarantine/ and trains them again")
    from pmnet.report import main_report  # (heavy: after the refusals)

    try:
        written = main_report(root)
    except Exception as e:  # noqa: BLE001 - the results are kept; say why
        print(f"error: the report of {root} failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return Exit.FAILED
    print(f"report of the store {root}: {root / 'report'} "
          f"({', '.join(sorted(str(k) for k in (written or {}))[:6])})")
    return Exit.DONE


def ui_plan(root: Path, host: str = "127.0.0.1", port: int = 5000,
            allowed_hosts: str | None = None, name: str | None = None):
    """(args, lines) for the store the pipeline (`name`, else the last one) logged to:
    `args`, the `mlflow server` options (None for a tracking server: its own UI); `lines`,
    where to look, the password hidden (also the run's closing lines). Reads only."""
    from pipelines.addresses import (
        EMBEDDED,
        hide_password,
        run_address,
        sqlite_path,
        store_uri,
        ui_address,
    )
    from pipelines.layout import Layout, check_name, last_pipeline
    from pipelines.records import PipelineRecord, TrackingRecord

    record = TrackingRecord()
    if name is None:
        with contextlib.suppress(PipelineError):
            name = last_pipeline(root)
    if name is not None:
        lay = Layout(root, check_name(name))
        if not lay.pipeline_json.is_file():
            raise PipelineError(f"no pipeline {name!r} under {root}")
        record = TrackingRecord.read(lay.tracking_json)
        if record.tracking_uri is None:
            record.tracking_uri = PipelineRecord.read(lay.pipeline_json).tracking
    uri = store_uri(root, record.tracking_uri)
    exp, parent = record.experiment_id, record.parent_run_id
    remote = uri.lower().startswith(("http://", "https://"))
    if remote:
        base = uri.rstrip("/")
    else:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "localhost") else \
            f"[{host}]" if ":" in host else host  # an address a browser here can open
        base = f"http://{shown}:{port}"
    lines = []
    if name is not None and exp and parent:
        lines.append(f"look first at the pipeline's parent run '{name}' "
                     f"({hide_password(run_address(base, exp, parent))}): its claims/* metrics "
                     "and tags hold each claim's effect, 95% CI and verdict (the report is "
                     "its artifact); the stages and trials are its child runs")
    if remote:
        where = f"; pipeline {name}'s training runs: " \
            f"{hide_password(ui_address(base, exp))}" if exp else ""
        lines.insert(0, f"pipeline {name} logged to the MLflow tracking server "
                        f"{hide_password(uri)}: its UI is the server's own, {hide_password(base)}"
                        f"{where} (no UI started here)")
        return None, lines
    db = sqlite_path(uri)
    artifacts = (db.parent if db is not None else root) / "mlartifacts"
    where = f"; pipeline {name}'s training runs: {ui_address(base, exp)}" if exp else ""
    what = "the embedded store " if record.tracking_uri in (None, EMBEDDED) else ""
    lines.insert(0, f"MLflow UI for {what}{hide_password(uri)}: {base}{where}")
    if db is not None and not db.is_file():
        lines.append(f"note: no MLflow store at {db} yet; the UI starts empty")
    args = ["--backend-store-uri", uri, "--artifacts-destination", str(artifacts),
            "--host", host, "--port", str(port), "--workers", "1"]
    if allowed_hosts:
        args += ["--allowed-hosts", allowed_hosts]
    return args, lines


def cmd_ui(a) -> int:
    """`mlflow server` on the store the pipeline logged to (`ui_plan`), or a server's address."""
    from pipelines.addresses import check_ui_bind, ui_warning

    root = Path(a.root).expanduser().absolute()
    args, lines = ui_plan(root, a.host, a.port, a.allowed_hosts, a.name)
    if args is None:  # a tracking server: its own UI
        print("\n".join(lines), flush=True)
        return Exit.DONE
    check_ui_bind(a.host, a.port)  # a busy port: exit 2, before the store's folder
    warning = ui_warning(a.host, a.port)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    print("\n".join([lines[0] + "  (Ctrl-C to stop)", *lines[1:]]), flush=True)
    os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner needed
    os.chdir(root)
    cmd = [sys.executable, "-m", "mlflow", "server", *args]
    os.execv(cmd[0], cmd)
    return 0  # not reached


COMMANDS = {"start": cmd_start, "resume": cmd_resume, "status": cmd_status,
            "report": cmd_report, "ui": cmd_ui}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    from tune_spaces import SpaceError

    try:
        from pipelines.addresses import storage_root

        args.root = str(storage_root(args.root))  # a URL is refused here (exit 2)
        return int(COMMANDS[args.command](args))
    except (PipelineError, StoreError, SpaceError) as e:  # while planning: nothing started
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: continue with `make resume` (python -m pipelines.run resume)",
              file=sys.stderr)
        return Exit.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
