"""A Ray cluster of several nodes on this machine (127.0.0.1), for the cluster tests.

Each node is `ray start ... --block` in its own process group, so that ending that group
stops exactly this node: SIGTERM drains it as `ray stop` would, SIGKILL takes it away at once,
as a machine that dies (a global `ray stop` would also hit other Ray users of the box). A node
may be started inside a command prefix, e.g. `unshare -m` with a tmpfs mounted over a path, so
that it does not see the storage root (`LoopbackCluster.add_node(prefix=...)`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.net import free_port

REPO = Path(__file__).resolve().parents[2]
AUTH = {"RAY_AUTH_MODE": "token"}  # `ray start` clusters use token auth (Ray >= 2.59)
PROBE = ("import json, ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
         "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))")


def node_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "PMNET_TEST_FAULT_ONCE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(AUTH)
    env.update(extra or {})
    return env


@dataclass
class Node:
    proc: subprocess.Popen
    node_id: str = ""  # Ray's NodeID, known once the node has joined

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class LoopbackCluster:
    """`with LoopbackCluster() as c: c.add_node(head=True); c.add_node()`: nodes on 127.0.0.1;
    every node still running is stopped on exit (SIGTERM to its group, SIGKILL after 40 s)."""

    port: int = field(default_factory=free_port)
    nodes: list[Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive_ids(self, timeout: float = 90) -> list[str] | None:
        """The NodeIDs Ray reports alive, or None when the cluster did not answer."""
        try:
            r = subprocess.run([sys.executable, "-c", PROBE, self.address], env=node_env(),
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if r.returncode != 0:
            return None
        for line in reversed(r.stdout.splitlines()):  # Ray may print its own lines around
            try:  # the probe's JSON ("raylet has lagging heartbeats" on a loaded host)
                ids = json.loads(line)
            except ValueError:
                continue
            if isinstance(ids, list):
                return ids
        return None

    def add_node(self, *, head: bool = False, num_cpus: float = 1,
                 resources: dict | None = None, prefix: list[str] | None = None,
                 timeout: float = 180) -> Node:
        """Start a node and wait until Ray reports it alive; `prefix` wraps the command."""
        ray_bin = str(Path(sys.executable).parent / "ray")
        before = set() if head else set(self.alive_ids() or [])
        cmd = [ray_bin, "start", "--node-ip-address", "127.0.0.1", "--num-cpus",
               f"{num_cpus:g}", "--block", "--disable-usage-stats"]
        cmd += (["--head", "--port", str(self.port), "--include-dashboard=false"] if head
                else ["--address", self.address])
        if resources:
            cmd += ["--resources", json.dumps(resources)]
        proc = subprocess.Popen([*(prefix or []), *cmd], env=node_env(), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        node = Node(proc)
        self.nodes.append(node)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}")
            ids = self.alive_ids()
            new = [i for i in ids or [] if i not in before
                   and i not in {n.node_id for n in self.nodes}]
            if len(new) == 1:
                node.node_id = new[0]
                return node
            time.sleep(1)
        raise RuntimeError("the Ray node did not join within the bound")

    def wait_dead(self, node: Node, timeout: float = 120) -> bool:
        """Wait until Ray no longer reports `node` alive (its health check notices)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            ids = self.alive_ids()
            if ids is not None and node.node_id not in ids:
                return True
            time.sleep(2)
        return False

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc) -> None:
        live = [n for n in self.nodes if n.alive()]
        for n in reversed(live):  # workers first, the head last
            n.kill(signal.SIGTERM)
        for n in live:  # a node drains for up to 30 s after SIGTERM
            try:
                n.proc.wait(40)
            except subprocess.TimeoutExpired:
                pass
            n.kill(signal.SIGKILL)
