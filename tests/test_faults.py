"""The fault table of docs/pipeline.md, produced by tests (all `slow`: 745 s for the 15 on 2 cores).

Each scenario injects one fault into a real debug-preset pipeline on the `tiny` grid (local
Ray, embedded MLflow store on loopback), records what the user sees and the exit code, then
continues the pipeline the way the message says and checks that nothing was lost: the final
tables (`report/tables/*.md`, `report/data/comparisons.csv`) and every trial's test metrics
equal those of one uninterrupted run, and MLflow holds exactly one FINISHED run per trial
with no duplicate epochs.

`PMNET_WRITE_FAULT_TABLE=1 .venv/bin/python -m pytest -m slow tests/test_faults.py` writes
the observed rows into docs/pipeline.md between the fault-table markers;
`test_docs_fault_table_lists_every_scenario` (fast) keeps the table and the scenarios in step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipelines.faults import KILL_ENV, PAUSE_ENV, POINTS
from pipelines.layout import Layout, read_json
from pmnet.trial_id import TrialId
from tests.support.faults import (
    DOCS,
    Reference,
    assert_nothing_lost,
    write_doc_rows,
)
from tests.support.pipeline import (
    BASE,
    GRID,
    cli,
    kill_group,
    spawn,
    trial_attempts,
)

BEGIN, END = "<!-- fault-table:begin -->", "<!-- fault-table:end -->"
ROWS: dict[str, dict] = {}

# The random-kill soak: PMNET_SOAK_KILLS kills of the driver's process group per schedule, one
# schedule per seed of PMNET_SOAK_SEEDS (each a seeded random.Random), each kill uniformly
# SOAK_DELAY_S seconds after a `start` or `resume`; trials pause SOAK_PAUSE_S after each
# epoch, so that kills fall in Stage 2 too. The recorded figures are 10 kills on schedules 1, 2.
SOAK_KILLS = int(os.environ.get("PMNET_SOAK_KILLS") or 10)
SOAK_SEEDS = tuple(int(x) for x in (os.environ.get("PMNET_SOAK_SEEDS") or "1,2").split(",")
                   if x.strip())
SOAK_MIN_DELAY_S = 3.0  # the latest: the expected length of the run (`soak_span` at first)
SOAK_PAUSE_S = 2

#: Scenario id -> (fault, how it is injected); the observed columns come from the runs.
SCENARIOS: dict[str, tuple[str, str]] = {
    **{f"kill-{p}": (f"driver SIGKILLed at `{p}`",
                     f"`{KILL_ENV}={p}` (pipelines/faults.py), then `resume`")
       for p in POINTS},
    "two-drivers": ("two drivers on one pipeline",
                    "`start` and `resume` of the same name while its driver runs"),
    "trial-worker-killed": ("a trial's worker process killed",
                            "SIGKILL of the pid in `trials/<t>/attempts.jsonl` mid-training"),
    "disk-full": ("the disk fills up during Stage 2",
                  "root on a 64 MiB tmpfs, filled once Stage 1 is recorded; freed, `resume`"),
    "corrupted-checkpoint": ("Phase-1 checkpoint corrupted after Stage 1",
                             "a flipped byte in `phase1/phase1.pt`; then `rm -r phase1`, "
                             "`resume`"),
    "garbage-checkpoint": ("garbage Phase-1 checkpoint whose sidecar matches",
                           "random bytes + their sha256 in sidecar and `stage1.json`; then "
                           "`rm -r phase1`, `resume`"),
    **{f"soak-{seed}": (f"driver's process group SIGKILLed at random moments, schedule {seed}",
                        f"{SOAK_KILLS} kills, each at a moment drawn uniformly (`random."
                        f"Random({seed})`) between {SOAK_MIN_DELAY_S:g} s and the expected "
                        "length of the run (the uninterrupted run's wall time; after a run "
                        "that ended first, that run's) after a `start`/`resume`, each "
                        f"followed by `resume`; trials pause {SOAK_PAUSE_S} s per epoch "
                        f"(`{PAUSE_ENV}`)")
       for seed in SOAK_SEEDS},
}


# -- helpers --------------------------------------------------------------------------------


def first_error(out: str) -> str:
    """The message the user reads: the final `error:` line, else the first line that
    mentions an error (ANSI colour codes removed)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in out.splitlines()]
    final = [ln for ln in lines if ln.startswith(("error:", "internal error:"))]
    if final:
        return final[-1]
    some = [ln for ln in lines if "error" in ln.lower()]
    return some[0] if some else (lines[-1] if lines else "")


def quiescent(run_dir: Path, settle_s: float = 3.0, timeout: float = 90.0) -> None:
    """Wait until nothing under `run_dir` changes for `settle_s` (after a SIGKILLed driver,
    its Ray workers and MLflow server take a few seconds to notice and exit)."""
    def snap():
        return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in run_dir.rglob("*") if p.is_file())
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        now = snap()
        if now == last:
            return
        last = now
        time.sleep(settle_s)


def record(sid: str, *, sees: str, code: int | str, lost: str = "nothing") -> None:
    fault, how = SCENARIOS[sid]
    sees = re.sub(r"/tmp/\S+?/(runs|root|disk)/", "ROOT/", sees)
    sees = re.sub(r"(pid|kill) \d+", r"\1 N", sees)
    sees = re.sub(r"[0-9a-f]{12}\.\.\.", "SHA...", sees)
    sees = re.sub(r"\(started [^)]*\)", "(started TIME)", sees)
    sees = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", sees)
    ROWS[sid] = {"fault": fault, "how": how, "sees": sees[:220], "code": str(code),
                 "lost": lost}


@pytest.fixture(scope="module", autouse=True)
def write_table():
    """The rows observed here replace their rows of the fault table (`write_doc_rows`)."""
    yield
    write_doc_rows(BEGIN, END, ["| fault | how it is injected | what the user sees | exit code "
                                "| what is lost |", "|---|---|---|---|---|"],
                   ("fault", "how", "sees", "code", "lost"), SCENARIOS, ROWS)


# -- the scenarios --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_driver_killed_then_resumed_loses_nothing(point, tmp_path, reference):
    root = tmp_path / "runs"
    rc, out = cli("start", *BASE, "--root", str(root), "--name", "k", env={KILL_ENV: point})
    assert rc == -signal.SIGKILL, out[-3000:]
    lay = Layout(root, "k")
    rc_status, status = cli("status", "--root", str(root))
    assert rc_status == 0, status
    if POINTS.index(point) < POINTS.index("stage3-start"):
        assert "interrupted" in status, status
    done_before = {(c, s): lay.result_path(TrialId(c, s)).read_bytes() for c, s in GRID
                   if lay.result_path(TrialId(c, s)).is_file()}
    n_attempts = {t: len(trial_attempts(lay, *t)) for t in GRID}
    rc2, out2 = cli("resume", "--root", str(root))
    assert rc2 == 0, out2[-3000:]
    assert_nothing_lost(lay.run_dir, reference)
    for t, data in done_before.items():  # a finished trial is never trained again
        assert lay.result_path(TrialId(*t)).read_bytes() == data
        assert {a["kind"] for a in trial_attempts(lay, *t)[n_attempts[t]:]} <= {"reuse"}
    state = "interrupted" if "interrupted" in status else "finished"
    record(f"kill-{point}", code="-9 (SIGKILL), then 0",
           sees=f"`status`: {state}; `resume`: " + first_line(out2, "[stage"))


def start_in_background(root: Path, name: str, env: dict | None = None) -> subprocess.Popen:
    """`pipelines.run start` of the debug pipeline in its own process group, not waited for."""
    return spawn("start", *BASE, "--root", str(root), "--name", name, env=env)


def first_line(out: str, prefix: str) -> str:
    for ln in out.splitlines():
        if prefix in ln and ("skipped" in ln or "continuing" in ln):
            return ln.split("] ", 1)[-1].strip()
    return "Stage 1 and 2 rerun what is missing"


@pytest.mark.slow
def test_two_drivers_at_once(tmp_path, reference):
    root = tmp_path / "runs"
    # trials pause 10 s per epoch, so that the first driver is still in Stage 2 while the
    # two refused ones run (on a lightly loaded box it used to finish first, and its own
    # last write to pipeline.json failed the comparison)
    first = start_in_background(root, "two", {PAUSE_ENV: "10"})
    try:
        lock = root / "two" / "driver.lock"
        deadline = time.time() + 120
        meta = root / "two" / "pipeline.json"
        # the first driver writes pipeline.json itself when its Stage 1 ends (the Phase-1
        # sha256) and again when it finishes: take the snapshot in between (Stage 2 running),
        # so that a difference can only come from the refused drivers
        while time.time() < deadline and not (
                lock.is_file()
                and (read_json(meta) or {}).get("driver")
                and (read_json(meta) or {}).get("phase1_sha256")):
            time.sleep(0.2)
        before = (root / "two" / "pipeline.json").read_bytes()
        rc_b, out_b = cli("resume", "--root", str(root), "--name", "two")
        rc_c, out_c = cli("start", *BASE, "--root", str(root), "--name", "two")
        assert first.poll() is None, "the first driver ended before the refused ones did"
        assert (root / "two" / "pipeline.json").read_bytes() == before
        out_a, _ = first.communicate(timeout=420)
    finally:
        kill_group(first.pid)
    assert rc_b == rc_c == 4, out_b + out_c
    assert "is being run by driver pid" in out_b and "is being run by driver pid" in out_c
    assert first.returncode == 0, out_a[-3000:]
    assert_nothing_lost(root / "two", reference)
    record("two-drivers", code="4 for the second; 0 for the first", sees=first_error(out_b))


@pytest.mark.slow
def test_trial_worker_killed_mid_training(tmp_path, reference):
    root = tmp_path / "runs"
    proc = start_in_background(root, "w")
    lay = Layout(root, "w")
    victim = lay.trial_dir(TrialId("learned_full", 42)) / "attempts.jsonl"
    killed = None
    try:
        deadline = time.time() + 240
        while time.time() < deadline and killed is None:
            if victim.is_file() and victim.read_text().strip():
                pid = json.loads(victim.read_text().splitlines()[0])["pid"]
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
                except ProcessLookupError:
                    break
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=420)
    finally:
        kill_group(proc.pid)
    assert killed is not None, "the trial's worker was not found alive"
    assert proc.returncode == 0, out[-3000:]
    attempts = victim.read_text().splitlines()
    assert len(attempts) >= 2 and json.loads(attempts[-1])["pid"] != killed
    assert_nothing_lost(lay.run_dir, reference)
    line = next((ln.split("] ", 2)[-1] for ln in out.splitlines()
                 if "[stage 2/3]" in ln and "crashed" in ln),
                "the trial is retried from its last checkpoint")
    record("trial-worker-killed", code=0, sees=line)


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.slow
def test_disk_full_during_stage2_then_freed_and_resumed(tmp_path, reference):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, 64):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        root = disk / "runs"
        proc = start_in_background(root, "d")
        filler = disk / "filler"
        try:
            stage1 = root / "d" / "phase1" / "stage1.json"
            deadline = time.time() + 240
            while time.time() < deadline and not stage1.is_file():
                time.sleep(0.05)
            with open(filler, "wb") as f:  # fill the device to the last byte
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            out, _ = proc.communicate(timeout=420)
        finally:
            kill_group(proc.pid)
        assert proc.returncode in (1, 3), out[-3000:]
        sees = first_error(out)
        filler.unlink()
        rc, out2 = cli("resume", "--root", str(root), "--name", "d")
        err = root / "d" / "logs" / "driver-error.txt"
        assert rc == 0, out2[-3000:] + (err.read_text()[-3000:] if err.is_file() else "")
        assert_nothing_lost(root / "d", reference)
        record("disk-full", code=f"{proc.returncode}, then 0 after freeing space", sees=sees,
               lost="no finished result; unfinished trials continue from their last.ckpt")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _stage1_then_kill(root: Path, name: str) -> Layout:
    rc, out = cli("start", *BASE, "--root", str(root), "--name", name,
                  env={KILL_ENV: "stage2-first-result"})
    assert rc == -signal.SIGKILL, out[-3000:]
    return Layout(root, name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["corrupted", "garbage"])
def test_bad_phase1_checkpoint_is_refused_then_retrained(kind, tmp_path, reference):
    root = tmp_path / "runs"
    lay = _stage1_then_kill(root, kind)
    original = read_json(lay.stage1_json)["sha256"]  # the checkpoint the trials started from
    ckpt = lay.phase1_ckpt
    ckpt.chmod(0o644)
    if kind == "corrupted":
        data = bytearray(ckpt.read_bytes())
        data[len(data) // 2] ^= 0xFF
        ckpt.write_bytes(bytes(data))
        message = "does not match its recorded sha256"
    else:
        data = os.urandom(ckpt.stat().st_size)
        digest = hashlib.sha256(data).hexdigest()
        ckpt.write_bytes(data)
        Path(f"{ckpt}.sha256").write_text(f"{digest}  phase1.pt\n")
        info = read_json(lay.stage1_json)
        lay.stage1_json.write_text(json.dumps({**info, "sha256": digest}))
        message = "not a loadable Phase-1 model file"
    quiescent(lay.run_dir)
    before = sorted((p, p.stat().st_mtime_ns) for p in lay.run_dir.rglob("*") if p.is_file())
    rc, out = cli("resume", "--root", str(root), "--name", kind)
    assert rc == 2 and message in out, out[-3000:]
    after = sorted((p, p.stat().st_mtime_ns) for p in lay.run_dir.rglob("*") if p.is_file())
    assert after == before  # refused before anything was written
    shutil.rmtree(lay.phase1_dir)  # what the message says to do
    rc, out2 = cli("resume", "--root", str(root), "--name", kind)
    assert rc == 0, out2[-3000:]
    discarded = [a["discarded"] for c, s in GRID for a in trial_attempts(lay, c, s)
                 if a.get("discarded")]
    if read_json(lay.stage1_json)["sha256"] != original:
        # a new checkpoint: the trials' checkpoints of the old one are discarded, never
        # resumed from (each names the Phase-1 file it was trained from)
        assert discarded and all("trained from Phase-1" in d for d in discarded), discarded
    else:
        # Phase 1 retrained to the same bytes (deterministic on one CPU): the same
        # checkpoint, so its trials are rightly kept and continue
        assert not discarded, out2[-3000:]
    assert_nothing_lost(lay.run_dir, reference)
    record(f"{kind}-checkpoint", code="2, then 0 after `rm -r phase1`", sees=first_error(out))


def _run_killed_after(args: list[str], delay: float, env: dict) -> tuple[int, str, float]:
    """`pipelines.run ARGS` in its own process group, the group SIGKILLed `delay` seconds
    after the start unless it ended before: (exit code, output, seconds it ran)."""
    t0 = time.time()
    proc = spawn(*args, env=env)
    try:
        out, _ = proc.communicate(timeout=delay)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, _ = proc.communicate()
    finally:
        kill_group(proc.pid)  # whatever the driver left in its group (local Ray)
    return proc.returncode, out, time.time() - t0


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def soak_span(reference: Reference) -> float:
    """The latest kill moment: the uninterrupted run's command wall time (its pipeline wall
    from `timing.json` plus 15 s of interpreter start and imports), so that the moments
    cover every stage on this machine at its present load."""
    wall = (read_json(reference.run_dir / "timing.json") or {}).get("wall_s") or 60.0
    return float(wall) + 15.0


def _where_killed(out: str) -> str:
    """The stage a killed run had reached, from the last stage line it printed (each line
    starts with its time, `[hh:mm:ss] [stage 2/3] ...`)."""
    for ln in reversed(out.splitlines()):
        if "[pipeline] finished" in ln:
            return "the end"
        for tag, where in (("[stage 3/3]", "Stage 3"), ("[stage 2/3]", "Stage 2"),
                           ("[stage 1/3]", "Stage 1")):
            if tag in ln:
                return where
    return "set-up"


def soak_figures(lay: Layout) -> dict:
    """What the kills cost, from the trials' attempts: attempts that trained after the
    first (from their last checkpoint or from the start), and completed epochs lost (an
    attempt resuming from an earlier epoch than the one before it resumed from)."""
    again = from_ckpt = from_start = epochs_lost = 0
    for c, s in GRID:
        trained = [a for a in trial_attempts(lay, c, s) if a["kind"] == "train"]
        for prev, a in zip(trained, trained[1:]):
            again += 1
            if a.get("resume_from"):
                from_ckpt += 1
            else:
                from_start += 1
            before = prev.get("resume_epoch")
            now = a.get("resume_epoch")
            epochs_lost += max(0, (-1 if before is None else before) -
                               (-1 if now is None else now))
    return {"retrained": again, "from_checkpoint": from_ckpt, "from_start": from_start,
            "epochs_lost": epochs_lost}


@pytest.mark.slow
@pytest.mark.parametrize("seed", SOAK_SEEDS)
def test_driver_killed_at_random_moments_loses_nothing(seed, tmp_path, reference):
    import random

    rng = random.Random(seed)
    span = first_span = soak_span(reference)
    root = tmp_path / "runs"
    env = {PAUSE_ENV: str(SOAK_PAUSE_S)}
    start = ["start", *BASE, "--root", str(root), "--name", "soak"]
    resume = ["resume", "--root", str(root), "--name", "soak"]
    kills: list[tuple[float, str]] = []  # (delay, where)
    statuses: list[str] = []  # what `status` said after each kill
    runs = resumes = finished_first = 0
    t0 = time.time()
    phase1_runs = 0
    while len(kills) < SOAK_KILLS:
        assert runs < 3 * SOAK_KILLS, f"{runs} runs for {len(kills)} kills"
        delay = rng.uniform(SOAK_MIN_DELAY_S, span)
        # `resume` once the pipeline is recorded; a `start` killed before that starts again
        again = (root / "soak" / "pipeline.json").is_file()
        rc, out, took = _run_killed_after(resume if again else start, delay, env)
        runs += 1
        resumes += again
        phase1_runs += "Phase 1 as a Tune trial" in out
        if rc == -signal.SIGKILL:
            kills.append((delay, _where_killed(out)))
            if not (root / "soak" / "pipeline.json").is_file():  # killed before it wrote
                statuses.append("not started")
                continue
            rc_status, status = cli("status", "--root", str(root), "--name", "soak")
            assert rc_status == 0, status  # the records stay readable after every kill
            statuses.append("interrupted" if "interrupted" in status else "finished")
        else:  # it finished before its moment came: the next moment falls within a run
            assert rc == 0, out[-3000:]  # as long as this one (what is left is less now)
            finished_first += 1
            span = max(SOAK_MIN_DELAY_S + 1, took)
    rc, out = cli("resume", "--root", str(root), "--name", "soak", env=env, timeout=600)
    wall = time.time() - t0
    assert rc == 0, out[-3000:]
    lay = Layout(root, "soak")
    assert_nothing_lost(lay.run_dir, reference)
    fig = soak_figures(lay)
    assert fig["epochs_lost"] == 0, fig
    where = {w: sum(1 for _, x in kills if x == w) for w in
             ("set-up", "Stage 1", "Stage 2", "Stage 3", "the end")}
    print(f"\nsoak schedule {seed}: " + json.dumps(
        {"kills": kills, "statuses": statuses, "runs": runs + 1, "resumes": resumes + 1,
         "wall_s": wall, "first_span_s": first_span, "last_span_s": span,
         "finished_before_kill": finished_first,
         "phase1_submitted": phase1_runs, **fig}))
    fault, how = SCENARIOS[f"soak-{seed}"]
    ROWS[f"soak-{seed}"] = {
        "fault": fault, "how": how,
        "sees": (f"{len(kills)} kills (" + ", ".join(f"{n} in {w}" for w, n in where.items()
                                                  if n) +
                 f"), {resumes + 1} resumes, {_n(runs - resumes, 'start')}; "
                 "`status` after each: "
                 + ", ".join(f"{statuses.count(k)} {k}" for k in
                             ("interrupted", "finished", "not started") if statuses.count(k))
                 + f"; {finished_first} runs ended before their moment; "
                   f"{wall / 60:.0f} min in all"),
        "code": f"-9 x {len(kills)}, then 0",
        "lost": (f"nothing: Phase 1 submitted in {_n(phase1_runs, 'run')}; "
                 f"{fig['retrained']} trial "
                 f"attempts trained again ({fig['from_checkpoint']} from their last "
                 f"checkpoint, {fig['from_start']} from the start), 0 finished epochs lost"),
    }


def test_docs_fault_table_lists_every_scenario():
    block = DOCS.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    for sid, (fault, _) in SCENARIOS.items():
        assert f"| {fault} |" in block, f"docs/pipeline.md's fault table lacks {sid}"
