"""Ray for the pipeline: a local instance by default, or a cluster (RAY_ADDRESS / --ray-address).

The local instance listens on 127.0.0.1 only (GCS, raylet, object manager, workers, agents):
nothing of it is reachable from the network.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipelines.layout import PipelineError

if TYPE_CHECKING:
    from pipelines.plan import Plan

REPO = Path(__file__).resolve().parent.parent
PASS_ENV = ("PMNET_TEST_FAULT_ONCE",)  # test hooks forwarded to the Ray workers
LOOPBACK = "127.0.0.1"


def _ray_env() -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    for k in PASS_ENV:
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


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
                  runtime_env={"env_vars": _ray_env()}, ignore_reinit_error=True)
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
    cpus, gpus = _node_capacity(ray)
    sp = plan.space
    if sp.gpus_per_trial > 0 and gpus == 0:
        raise PipelineError(f"the grid asks {sp.gpus_per_trial} GPU per trial but no Ray node "
                            "has a GPU; use --gpus-per-trial 0 (or a CPU preset)")
    if sp.cpus_per_trial > cpus:
        raise PipelineError(f"the grid asks {sp.cpus_per_trial:g} CPUs per trial but the "
                            f"largest Ray node has {cpus:g}; lower --cpus-per-trial")
    return cpus, gpus

