"""Ray for the pipeline: a local instance by default, or a cluster (RAY_ADDRESS / --ray-address).

- The local instance listens on 127.0.0.1 only (GCS, raylet, object manager, workers, agents):
  nothing of it is reachable from the network.
- The code (`pmnet`, `pipelines`, `tune_spaces`) travels to the workers in Ray's runtime
  environment (`py_modules`), so a cluster node needs the Python environment but not a
  checkout of this repository.
- Before Stage 1, one small task per alive node checks that the node sees the storage root
  (reads a token the driver just wrote there, writes beside it): a cluster without shared
  storage fails here with the nodes named, not later in a remote trial.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.console import say
from pipelines.layout import PipelineError

if TYPE_CHECKING:
    from pipelines.plan import Plan

REPO = Path(__file__).resolve().parent.parent
CODE_PACKAGES = ("pmnet", "pipelines", "tune_spaces")  # what the Ray workers import
PASS_ENV = ("PMNET_TEST_FAULT_ONCE",)  # test hooks forwarded to the Ray workers
LOOPBACK = "127.0.0.1"
STORAGE_CHECK_TIMEOUT_S = 120.0
SHARED_STORAGE_HELP = (
    "Every Ray node reads and writes the storage root: mount a shared filesystem (NFS or the "
    "like) at the same path on every node, or pass a --root that is on one.")


def runtime_env() -> dict:
    """The job's runtime environment: the project's packages as `py_modules`, so a node needs
    the Python environment but no checkout, and the test hooks in PASS_ENV. Ray zips the
    packages once per job (~380 KiB, ~10 ms; Ray's limit is 512 MiB) and unpacks them once
    per node; on local Ray this measured no slower than the PYTHONPATH it replaces, so local
    and cluster runs ship the code the same way (docs/pipeline.md, "Clusters")."""
    env_vars = {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}
    return {"py_modules": [str(REPO / p) for p in CODE_PACKAGES],
            "excludes": ["__pycache__", "*.pyc"], "env_vars": env_vars}


@contextlib.contextmanager
def _loopback_node_ip() -> Iterator[None]:
    """Let `ray.init(_node_ip_address="127.0.0.1")` keep the loopback address.

    A new local Ray node listens on all interfaces unless its node IP is 127.0.0.1, and
    ray.init replaces a loopback `_node_ip_address` by the routable address
    (`services.resolve_ip_for_localhost`) unless multi-node support is off, as it is on
    macOS and Windows (`ray_constants.ENABLE_RAY_CLUSTER`). Ray has no public option for
    this, so it is switched off for the one call that starts the local node and put back
    afterwards; connecting to a cluster never goes through here."""
    from ray._private import ray_constants as constants

    before = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before


def init_ray(plan: Plan):
    """Local Ray by default (loopback only, dashboard off, quiet); RAY_ADDRESS /
    --ray-address: a cluster."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's legacy reporter: silent at 0
    if plan.ray_address:
        # Ray >= 2.59 starts clusters with token authentication, and a client connecting to
        # one needs RAY_AUTH_MODE=token (read when ray is imported; the token itself comes
        # from ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH); token mode also
        # connects to clusters without authentication
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    kwargs = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                  runtime_env=runtime_env(), ignore_reinit_error=True)
    if plan.ray_address:
        try:
            ray.init(address=plan.ray_address, **kwargs)
        except Exception as e:
            raise PipelineError(f"cannot connect to the Ray cluster at {plan.ray_address} "
                                f"(RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')}): {e}"
                                ) from e
    else:
        ncpu = plan.num_cpus or os.cpu_count() or 1
        # address="local": always a new local instance, never another `ray start` cluster
        # that happens to run on this machine
        with _loopback_node_ip():
            ray.init(address="local", num_cpus=ncpu, _node_ip_address=LOOPBACK,
                     object_store_memory=min(2 << 30, (512 << 20) + ncpu * (128 << 20)),
                     **kwargs)
    return ray


def _node_capacity(ray) -> tuple[float, float]:
    """(largest CPU count, largest GPU count) of any alive node."""
    cpus, gpus = 0.0, 0.0
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            cpus = max(cpus, float(res.get("CPU", 0)))
            gpus = max(gpus, float(res.get("GPU", 0)))
    return cpus, gpus


def check_cluster(plan: Plan, ray) -> tuple[float, float]:
    """What must hold before Stage 1: the grid fits a node, and every node sees the root."""
    cpus, gpus = _node_capacity(ray)
    sp = plan.space
    if sp.gpus_per_trial > 0 and gpus == 0:
        raise PipelineError(f"the grid asks {sp.gpus_per_trial} GPU per trial but no Ray node "
                            "has a GPU; use --gpus-per-trial 0 (or a CPU preset)")
    if sp.cpus_per_trial > cpus:
        raise PipelineError(f"the grid asks {sp.cpus_per_trial:g} CPUs per trial but the "
                            f"largest Ray node has {cpus:g}; lower --cpus-per-trial")
    checked = check_storage(plan.layout.root, ray)
    if plan.ray_address:
        say(f"[pipeline] all {len(checked)} Ray nodes see the storage root {plan.layout.root}")
    return cpus, gpus


# -- does every node see the storage root? ----------------------------------------------------


def probe_storage(root: str, token_name: str, token: str) -> str | None:
    """Run on a node: None when it reads the driver's token under `root` and can write
    beside it; otherwise why not, in words."""
    path = Path(root) / token_name
    try:
        found = path.read_text()
    except OSError as e:
        return f"cannot read {path} ({type(e).__name__}: {e.strerror or e})"
    if found != token:
        return (f"{path} holds another token: this node has a different filesystem at "
                f"{root}")
    mine = path.with_name(f"{token_name}.{socket.gethostname()}.{os.getpid()}")
    try:
        mine.write_text(token)
        mine.unlink()
    except OSError as e:
        return f"cannot write in {root} ({type(e).__name__}: {e.strerror or e})"
    return None


def node_label(node: dict) -> str:
    name = node.get("NodeName") or node.get("NodeManagerAddress") or "?"
    return f"{name} (node {str(node.get('NodeID', '?'))[:12]})"


def probe_nodes(ray, nodes: list[dict], root: str, token_name: str, token: str,
                timeout: float = STORAGE_CHECK_TIMEOUT_S) -> dict[str, str]:
    """Run `probe_storage` once on each node (pinned there with a hard
    NodeAffinitySchedulingStrategy, no CPU taken so busy nodes answer too); returns
    {node label: why it failed} for the nodes that failed, did not run it, or did not
    answer within `timeout` seconds."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(probe_storage)
    refs = {node_label(node): task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["NodeID"], soft=False)).remote(root, token_name, token) for node in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    failures = {}
    for label, ref in refs.items():
        if ref not in ready:
            failures[label] = f"no answer within {timeout:.0f} s"
            ray.cancel(ref, force=True)
            continue
        try:
            why = ray.get(ref)
        except Exception as e:  # could not run there: node gone, runtime env failed, ...
            why = f"the check could not run there: {type(e).__name__}: {str(e)[:300]}"
        if why is not None:
            failures[label] = why
    return failures


def check_storage(root: Path, ray, timeout: float = STORAGE_CHECK_TIMEOUT_S) -> list[str]:
    """Every alive node must see the storage root at the same path, or the pipeline would
    fail late and obscurely (a missing Phase-1 checkpoint on a remote node, a refused
    trial). Returns the labels of the nodes checked; PipelineError names those that fail."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    token_name = f".storage-check-{secrets.token_hex(8)}"
    token = f"{socket.gethostname()} {os.getpid()} {time.time()} {secrets.token_hex(16)}\n"
    token_path = Path(root) / token_name
    token_path.parent.mkdir(parents=True, exist_ok=True)
    token_path.write_text(token)
    try:
        failures = probe_nodes(ray, nodes, str(root), token_name, token, timeout)
    finally:
        token_path.unlink(missing_ok=True)
    if failures:
        lines = "\n".join(f"  - {label}: {why}" for label, why in sorted(failures.items()))
        raise PipelineError(
            f"{len(failures)} of {len(nodes)} Ray nodes do not see the storage root {root}:\n"
            f"{lines}\n{SHARED_STORAGE_HELP}")
    return [node_label(n) for n in nodes]
