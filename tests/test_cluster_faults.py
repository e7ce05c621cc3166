"""The "Clusters: faults" table of docs/pipeline.md, produced by tests (all `slow`).

Each scenario runs the debug preset on the `tiny` grid on a Ray cluster of several nodes on
this machine (`tests/support/ray_nodes.py`: `ray start --block` per node, each in its own process
group), takes a node away the way a machine dies (SIGKILL of its process group) or starts
one that cannot see the storage root, and records what the user sees and the exit codes.
Then it checks, as tests/test_faults.py does, that nothing was lost: the final tables and
every trial's test metrics equal those of an uninterrupted run (the same `reference`), and
MLflow holds exactly one FINISHED run per trial with no duplicate epochs.

Trials and Phase 1 pause after each epoch (`PMNET_TEST_EPOCH_PAUSE_S`, a test hook that
changes no result), so that a node can be killed while it holds a task that has written a
checkpoint and is still running.

`PMNET_WRITE_FAULT_TABLE=1 .venv/bin/python -m pytest -m slow tests/test_cluster_faults.py`
writes the observed rows between the cluster-faults markers of docs/pipeline.md;
`test_docs_cluster_fault_table_lists_every_scenario` (fast) keeps table and scenarios in step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipelines.faults import KILL_ENV, PAUSE_ENV
from pipelines.layout import Layout
from pipelines.records import Progress, Started
from pmnet.trial_id import TrialId
from tests.support.faults import (
    assert_nothing_lost,
    write_doc_rows,
)
from tests.support.pipeline import (
    BASE,
    GRID,
    REPO,
    cli,
    kill_group,
    spawn,
    trial_attempts,
)
from tests.support.ray_nodes import LoopbackCluster, Node

DOCS = REPO / "docs" / "pipeline.md"
BEGIN, END = "<!-- cluster-faults:begin -->", "<!-- cluster-faults:end -->"
HEADER = ["| fault | how it is injected | what the user sees | exit code | the lost work | "
          "what is lost |", "|---|---|---|---|---|---|"]
ROWS: dict[str, dict] = {}
PAUSE = "4"  # seconds each trial and Phase-1 epoch pauses (pipelines.faults.epoch_pause)

SCENARIOS: dict[str, tuple[str, str]] = {
    "worker-lost-stage2": (
        "a worker node lost in the middle of Stage 2",
        "head (1 CPU) + worker (1 CPU); SIGKILL of the worker's process group once a trial "
        "on it has written an epoch checkpoint"),
    "worker-lost-stage1": (
        "the node running Phase 1 lost (Stage 1)",
        "head (0 CPU) + two workers (1 CPU each); SIGKILL of the worker whose Phase-1 task "
        "has written its first epoch checkpoint (`started.json` names the node)"),
    "worker-without-storage": (
        "a worker that does not see the head's storage (at resume)",
        "driver SIGKILLed after the first result; the worker replaced by one started in "
        "`unshare -m` with a tmpfs over the root's parent; `resume`; then a worker that "
        "sees it again, `resume`"),
}


def record(sid: str, *, sees: str, code: str, work: str, lost: str = "nothing") -> None:
    fault, how = SCENARIOS[sid]
    sees = re.sub(r"/tmp/\S+?/runs", "ROOT", sees)
    sees = re.sub(r"node [0-9a-f]{12}", "node NODE", sees)
    sees = re.sub(r"pid \d+", "pid N", sees)
    sees = re.sub(r"actor [0-9a-f]{16,}", "actor ID", sees)
    sees = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", sees)
    sees = re.sub(r"\.storage-check-[0-9a-f]+", ".storage-check-TOKEN", sees)
    ROWS[sid] = {"fault": fault, "how": how, "sees": sees[:300], "code": code, "work": work,
                 "lost": lost}


@pytest.fixture(scope="module", autouse=True)
def write_table():
    """The rows observed here replace their rows of "Clusters: faults" (`write_doc_rows`)."""
    yield
    write_doc_rows(BEGIN, END, HEADER, ("fault", "how", "sees", "code", "work", "lost"),
                   SCENARIOS, ROWS)


# -- helpers --------------------------------------------------------------------------------


def start_on(cluster: LoopbackCluster, root: Path, name: str, env: dict) -> subprocess.Popen:
    """`pipelines.run start` of the debug pipeline on the cluster, in its own process group,
    its output in `<root>.<name>.log` (read while it runs)."""
    log = open(f"{root}.{name}.log", "w")  # noqa: SIM115 - closed by the child's exit
    return spawn("start", *BASE, "--root", str(root), "--name", name,
                 env={"RAY_ADDRESS": cluster.address, **env}, stdout=log)


def finish(proc: subprocess.Popen, root: Path, name: str, timeout: float = 900) -> str:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the pipeline did not end within {timeout} s:\n"
                    + Path(f"{root}.{name}.log").read_text()[-4000:])
    finally:
        kill_group(proc.pid)
    return Path(f"{root}.{name}.log").read_text()


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the pipeline ended (rc {proc.returncode}) before {what}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def pid_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def trial_checkpointed_on(lay: Layout, node: Node):
    """(trial, its attempt) of a trial whose running attempt is on `node` and has written
    an epoch checkpoint since it started, or None."""
    for c, s in GRID:
        tried = trial_attempts(lay, c, s)
        if not tried or tried[-1]["node_id"] != node.node_id or tried[-1]["kind"] != "train":
            continue
        last = lay.trial_dir(TrialId(c, s)) / "ckpt" / "last.ckpt"
        try:
            if last.stat().st_mtime >= tried[-1]["time"]:
                return TrialId(c, s), tried[-1]
        except FileNotFoundError:
            pass
    return None


def crash_line(out: str) -> str:
    return next((ln.split("] ", 1)[-1] for ln in out.splitlines()
                 if "[stage 2/3]" in ln and "crashed" in ln), "no crash line")


# -- the scenarios --------------------------------------------------------------------------


@pytest.mark.slow
def test_worker_node_lost_mid_stage2(tmp_path, reference):  # noqa: F811
    root = tmp_path / "runs"
    lay = Layout(root, "lost2")
    with LoopbackCluster() as cluster:
        head = cluster.add_node(head=True, num_cpus=1)
        worker = cluster.add_node(num_cpus=1)
        proc = start_on(cluster, root, "lost2", {PAUSE_ENV: PAUSE})
        try:
            victim, attempt = wait_for(lambda: trial_checkpointed_on(lay, worker), 600,
                                       "a trial on the worker with a checkpoint", proc)
            epoch = json.loads((lay.trial_dir(victim) / "trial.json").read_text())["epoch"]
            worker.kill()  # the machine dies: raylet, agents and the trial's actor with it
            assert pid_gone(attempt["pid"]), "the trial's process outlived its node"
            out = finish(proc, root, "lost2")
        finally:
            kill_group(proc.pid)
        rc = proc.returncode
        codes = str(rc)
        if rc != 0:  # what the message says to do
            rc2, out2 = cli("resume", "--root", str(root), "--name", "lost2",
                            env={"RAY_ADDRESS": cluster.address}, timeout=900)
            assert rc2 == 0, out2[-4000:]
            codes = f"{rc}, then 0 after `resume`"
        retry = trial_attempts(lay, victim.condition, victim.seed)[-1]
    assert retry["node_id"] == head.node_id and retry["kind"] == "train"
    assert retry["resume_from"] is not None, retry  # from its checkpoint, not the start
    assert retry["resume_epoch"] >= epoch >= 0
    assert f"{victim.name} crashed" in out, out[-4000:]  # said, and retried
    assert_nothing_lost(lay.run_dir, reference)
    record("worker-lost-stage2", sees=crash_line(out), code=codes,
           work=f"the running epoch: {victim.name} continued on the head from its last.ckpt "
                f"(epoch {retry['resume_epoch']})")


@pytest.mark.slow
def test_node_running_phase1_lost(tmp_path, reference):  # noqa: F811
    root = tmp_path / "runs"
    lay = Layout(root, "lost1")
    started_file = lay.phase1_dir / "started.json"
    last = lay.phase1_dir / "phase1_ckpt" / "last.ckpt"
    with LoopbackCluster() as cluster:
        cluster.add_node(head=True, num_cpus=0)  # the head runs no task: Phase 1 is remote
        workers = [cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)]
        proc = start_on(cluster, root, "lost1", {PAUSE_ENV: PAUSE})
        try:
            first = wait_for(lambda: last.is_file() and Started.read(started_file), 600,
                             "Phase 1's first epoch checkpoint", proc)
            victim = next(w for w in workers if w.node_id == first.node_id)
            victim.kill()
            t_kill = time.time()
            assert pid_gone(first.pid), "the Phase-1 process outlived its node"
            resumed = wait_for(lambda: (p := Progress.read(lay.phase1_dir / "progress.json"))
                               .time > t_kill and p, 300, "the retried Phase-1 task", proc)
            out = finish(proc, root, "lost1")
        finally:
            kill_group(proc.pid)
        again = Started.read(started_file)
    assert proc.returncode == 0, out[-4000:]
    assert again.node_id != victim.node_id and again.node_id in {w.node_id for w in workers}
    assert resumed.epoch >= 1 and resumed.step > 0, resumed  # from its epoch-0 checkpoint
    line = next((ln.split("] ", 1)[-1] for ln in out.splitlines()
                 if "the Phase-1 task started again" in ln), None)
    assert line is not None and "continues from its last epoch checkpoint" in line, out[-4000:]
    assert_nothing_lost(lay.run_dir, reference)
    record("worker-lost-stage1", sees=line, code="0",
           work=f"the running epoch: Phase 1 continued on the other worker from its "
                f"last.ckpt (epoch {resumed.epoch}, step {resumed.step})")


@pytest.mark.slow
def test_worker_without_the_storage_is_named_at_resume(tmp_path, reference):  # noqa: F811
    root = tmp_path / "runs"
    lay = Layout(root, "nostore")
    hide = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs -o size=1m tmpfs {tmp_path} && exec "$@"', "sh"]
    probe = subprocess.run([*hide, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a new mount namespace here ({probe.stderr!r})")
    with LoopbackCluster() as cluster:
        cluster.add_node(head=True, num_cpus=1)
        worker = cluster.add_node(num_cpus=1)
        rc, out = cli("start", *BASE, "--root", str(root), "--name", "nostore", timeout=900,
                      env={"RAY_ADDRESS": cluster.address, KILL_ENV: "stage2-first-result"})
        assert rc == -signal.SIGKILL, out[-4000:]
        worker.kill()
        assert cluster.wait_dead(worker)
        blind = cluster.add_node(num_cpus=1, prefix=hide)  # no storage root there
        before = sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                        for p in lay.run_dir.rglob("*"))
        t0 = time.time()
        rc2, out2 = cli("resume", "--root", str(root), "--name", "nostore", timeout=600,
                        env={"RAY_ADDRESS": cluster.address})
        refused_s = time.time() - t0
        after = sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                       for p in lay.run_dir.rglob("*"))
        assert rc2 == 2, out2[-4000:]
        lines = out2.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("error:"))
        sees = " ".join(ln.strip() for ln in lines[at:at + 2])  # the message and the node
        assert f"do not see the storage root {root}" in out2, out2[-4000:]
        assert f"(node {blind.node_id[:12]})" in out2 and "cannot read" in out2, out2[-4000:]
        assert after == before  # refused before anything was written (or computed)
        assert not list(root.glob(".storage-check-*"))
        blind.kill()
        assert cluster.wait_dead(blind)
        cluster.add_node(num_cpus=1)  # the storage is back
        rc3, out3 = cli("resume", "--root", str(root), "--name", "nostore", timeout=900,
                        env={"RAY_ADDRESS": cluster.address})
        assert rc3 == 0, out3[-4000:]
    assert_nothing_lost(lay.run_dir, reference)
    record("worker-without-storage", sees=sees, code="-9 (the kill), then 2, then 0",
           work=f"none: refused in {refused_s:.0f} s before Stage 1; the next `resume` "
                "continued every trial")


def test_docs_cluster_fault_table_lists_every_scenario():
    block = DOCS.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    for sid, (fault, _) in SCENARIOS.items():
        assert f"| {fault} |" in block, f"docs/pipeline.md's cluster fault table lacks {sid}"
