"""Ray for the pipeline: a local instance by default, listening on 127.0.0.1 only, or a
cluster (RAY_ADDRESS / --ray-address); what the cluster has, per node; the code shipped in
Ray's runtime environment; and, before Stage 1, one task per node that checks the node sees
the storage root, so a cluster without shared storage fails with the nodes named, not later
in a remote trial (docs/pipeline.md, "Clusters").
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines.layout import PipelineError

REPO = Path(__file__).resolve().parent.parent
CODE_PACKAGES = ("pmnet", "pipelines", "tune_spaces")  # what the Ray workers import
PASS_ENV = ("PMNET_TEST_FAULT_ONCE", "PMNET_TEST_EPOCH_PAUSE_S")  # test hooks for the workers
LOOPBACK = "127.0.0.1"
STORAGE_CHECK_TIMEOUT_S = 120.0
SHARED_STORAGE_HELP = (
    "Every Ray node reads and writes the storage root: mount a shared filesystem (NFS or the "
    "like) at the same path on every node, or pass a --root that is on one.")


# -- what the cluster has: CPUs, GPUs and each GPU's memory, per node ---------------------------


@dataclass(frozen=True)
class GpuCard:
    """One GPU as `nvidia-smi` reports it: its name and total memory in bytes."""

    name: str
    memory_bytes: int


@dataclass(frozen=True)
class TorchCuda:
    """What the Python that trains on a node sees of CUDA (issue 36), in words; `ok` when its
    torch is a CUDA build that sees a card."""

    ok: bool
    seen: str

    def describe(self) -> str:
        return self.seen


TORCH_CUDA_CODE = ("import torch; c, a = torch.version.cuda, torch.cuda.is_available(); print(c "
                   "is not None and a, f'torch {torch.__version__}, torch.version.cuda={c}, "
                   "torch.cuda.is_available()={a}')")


def torch_cuda(timeout: float = 120.0) -> TorchCuda:
    """Ask a fresh Python (this interpreter, the one Ray's workers run) what torch sees of
    CUDA; never initialises CUDA in this process."""
    try:
        out = subprocess.run([sys.executable, "-c", TORCH_CUDA_CODE], capture_output=True,
                             text=True, timeout=timeout, check=True).stdout
        ok, seen = out.strip().splitlines()[-1].split(" ", 1)
        return TorchCuda(ok == "True", seen)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return TorchCuda(False, f"torch could not be asked ({type(e).__name__}: {e})"[:300])


@dataclass(frozen=True)
class NodeInfo:
    """One node of the cluster: its CPUs and GPUs (Ray's resources), the GPUs' cards (empty
    when they could not be read there) and, on a node with cards, what its torch sees of
    CUDA (None: not asked)."""

    label: str
    cpus: float
    gpus: float = 0.0
    cards: tuple[GpuCard, ...] = ()
    torch: TorchCuda | None = None


@dataclass(frozen=True)
class ClusterInfo:
    """What the pipeline may schedule on: every alive node (local Ray: this machine as Ray
    will see it). Planning decides the preset, the resources of the trials and of Stage 1,
    and the GPU shares from it (`pipelines.plan`), before anything is started or written."""

    nodes: tuple[NodeInfo, ...]
    where: str = "this machine"

    @property
    def gpu_nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.gpus >= 1)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_nodes)

    def largest_cpus(self, *, gpu: bool) -> float:
        """The CPUs of the largest node among the GPU nodes (gpu=True) or all nodes."""
        nodes = self.gpu_nodes if gpu else self.nodes
        return max((n.cpus for n in nodes), default=0.0)

    @property
    def card_bytes(self) -> int | None:
        """The smallest card of the GPU nodes (a fractional GPU share must fit every card
        Ray may place it on); None when no GPU node's cards are known."""
        return min((c.memory_bytes for n in self.gpu_nodes for c in n.cards), default=None)

    def describe(self) -> str:
        parts = []
        for n in self.nodes:
            gpu = ""
            if n.gpus:
                cards = ", ".join(sorted({f"{c.name} {c.memory_bytes / 2**30:.0f} GiB"
                                          for c in n.cards})) or "memory unknown"
                gpu = f" + {n.gpus:g} GPU ({cards})"
            parts.append(f"{n.label}: {n.cpus:g} CPU{gpu}")
        return f"{self.where}: " + "; ".join(parts)


NVIDIA_SMI_QUERY = ("--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits")


def local_cards(env: dict | None = None) -> tuple[GpuCard, ...]:
    """This machine's NVIDIA GPUs as CUDA (and Ray) will see them: `nvidia-smi`, narrowed to
    CUDA_VISIBLE_DEVICES when it is set (indices or UUIDs; empty: none). No GPU, or no
    `nvidia-smi`: (). Never initialises CUDA in this process."""
    env = os.environ if env is None else env
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[3].isdigit():
            rows.append((parts[0], parts[1], parts[2], int(parts[3]) * 2**20))  # MiB
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [r for w in wanted for r in rows if w in (r[0], r[1])]
    return tuple(GpuCard(name=name, memory_bytes=mem) for _, _, name, mem in rows)


def describe_local(num_cpus: int | None = None,
                   cards: Callable[[], tuple[GpuCard, ...]] = local_cards) -> ClusterInfo:
    """This machine as the local Ray instance will see it (`init_ray` gives Ray these CPUs
    and GPUs), without starting Ray."""
    found = cards()
    return ClusterInfo(nodes=(NodeInfo(label=socket.gethostname(), cpus=float(
        num_cpus or os.cpu_count() or 1), gpus=float(len(found)), cards=found,
        torch=torch_cuda() if found else None),))


def probe_gpus() -> tuple[tuple[GpuCard, ...], TorchCuda]:
    """Run on a node: its cards (`local_cards` there) and what its torch sees of CUDA."""
    return local_cards(), torch_cuda()


def on_each_node(ray, nodes: list[dict], fn, *args, timeout: float) -> dict[str, tuple]:
    """Run `fn(*args)` once on each of `nodes` (Ray's node dicts), pinned there and taking no
    CPU, so busy nodes answer too. Returns {NodeID: (True, its value) or (False, why not)}."""
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {n["NodeID"]: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(*args) for n in nodes}
    deadline = time.monotonic() + timeout  # one bound for all: the tasks run side by side
    out = {}
    for node_id, ref in refs.items():
        try:
            out[node_id] = (True, ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except GetTimeoutError:
            ray.cancel(ref, force=True)
            out[node_id] = (False, f"no answer within {timeout:.0f} s")
        except Exception as e:  # noqa: BLE001 - said for that node
            out[node_id] = (False, f"the check could not run there: {type(e).__name__}: "
                                   f"{str(e)[:300]}")
    return out


def describe_ray(ray, *, timeout: float = 120.0) -> ClusterInfo:
    """Every alive node of a running Ray cluster; each GPU node's cards and torch's CUDA from
    `probe_gpus` run there (a node that does not answer: no cards, torch not asked)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [n for n in alive if float(n.get("Resources", {}).get("GPU", 0)) >= 1]
    found = on_each_node(ray, gpu_nodes, probe_gpus, timeout=timeout)
    nodes = []
    for node in alive:
        res = node.get("Resources", {})
        ok, got = found.get(node["NodeID"], (False, None))
        cards, torch = got if ok else ((), None)
        nodes.append(NodeInfo(label=node_label(node), cpus=float(res.get("CPU", 0)),
                              gpus=float(res.get("GPU", 0)), cards=tuple(cards), torch=torch))
    return ClusterInfo(nodes=tuple(nodes), where="the Ray cluster")


def describe_cluster(ray_address: str | None, num_cpus: int | None = None) -> ClusterInfo:
    """The cluster a pipeline will run on: this machine (local Ray, not started here) or the
    running cluster at `ray_address` (connected to with `connect_ray`, as the driver will)."""
    return describe_ray(connect_ray(ray_address)) if ray_address else describe_local(num_cpus)


def runtime_env() -> dict:
    """The job's runtime environment: the project's packages as `py_modules` (local and
    cluster runs ship the code the same way, docs/pipeline.md, "Clusters") and the test hooks
    in PASS_ENV."""
    env_vars = {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}
    # trials sharing a GPU: the caching allocator grows segments instead of carving fixed
    # ones, so fragmentation stays small (the memory model's ACTIVATION_FACTOR counts on it)
    env_vars.setdefault("PYTORCH_CUDA_ALLOC_CONF", os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    return {"py_modules": [str(REPO / p) for p in CODE_PACKAGES],
            "excludes": ["__pycache__", "*.pyc"], "env_vars": env_vars}


def _ray_kwargs() -> dict:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's legacy reporter: silent at 0
    return dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                runtime_env=runtime_env(), ignore_reinit_error=True)


def connect_ray(address: str):
    """Connect to the running Ray cluster at `address` (the driver's one connection: the job's
    runtime environment is set here, so planning and the stages share it)."""
    # Ray >= 2.59 starts clusters with token authentication, and a client connecting to one
    # needs RAY_AUTH_MODE=token (read when ray is imported; the token itself comes from
    # ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH); token mode also connects to
    # clusters without authentication
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    try:
        ray.init(address=address, **_ray_kwargs())
    except Exception as e:
        raise PipelineError(f"cannot connect to the Ray cluster at {address} "
                            f"(RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')}): {e}") from e
    return ray


@contextlib.contextmanager
def _switched(module, name: str, value):
    """`module.name` is `value` inside the block and what it was after, even on an error."""
    was = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, was)


def init_ray(ray_address: str | None, num_cpus: int | None = None,
             planned: ClusterInfo | None = None):
    """Local Ray by default (loopback only, dashboard off, quiet; `num_cpus` and the GPUs
    planning saw, `planned`: None lets Ray detect the GPUs); `ray_address` (RAY_ADDRESS /
    --ray-address): a cluster."""
    if ray_address:
        return connect_ray(ray_address)
    import ray

    ncpu = num_cpus or os.cpu_count() or 1
    gpus = {}
    if planned is not None and len(planned.nodes) == 1:
        gpus = {"num_gpus": int(planned.nodes[0].gpus)}
    # A new local Ray node listens on all interfaces unless its node IP is 127.0.0.1, and
    # ray.init replaces a loopback `_node_ip_address` by the routable address
    # (`services.resolve_ip_for_localhost`) unless multi-node support is off, as it is on
    # macOS and Windows (`ray_constants.ENABLE_RAY_CLUSTER`). Ray has no public option for
    # this, so it is switched off for the one call that starts the local node.
    # address="local": always a new local instance, never another `ray start` cluster that
    # happens to run on this machine
    from ray._private import ray_constants

    with _switched(ray_constants, "ENABLE_RAY_CLUSTER", False):
        ray.init(address="local", num_cpus=ncpu, _node_ip_address=LOOPBACK,
                 object_store_memory=min(2 << 30, (512 << 20) + ncpu * (128 << 20)),
                 **gpus, **_ray_kwargs())
    return ray


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


def check_storage(root: Path, ray=None, skip: frozenset[str] = frozenset(),
                  timeout: float = STORAGE_CHECK_TIMEOUT_S) -> dict[str, str]:
    """Each alive node not in `skip` (NodeIDs that passed already) runs `probe_storage` on a
    token written under the root (planning: `ray` None, the connection `describe_cluster`
    made, before anything is written; the driver: the nodes that joined since). Returns
    {NodeID: label} of every alive node; PipelineError names those that fail. A root that
    does not exist yet is made for the check and removed again (when still empty)."""
    if ray is None:
        import ray
    root = Path(root)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    todo = [n for n in nodes if n["NodeID"] not in skip]
    labels = {n["NodeID"]: node_label(n) for n in nodes}
    if not todo:
        return labels
    token_name = f".storage-check-{secrets.token_hex(8)}"
    token = f"{socket.gethostname()} {os.getpid()} {time.time()} {secrets.token_hex(16)}\n"
    made = [p for p in (root, *root.parents) if not p.exists()]  # deepest first
    token_path = root / token_name
    root.mkdir(parents=True, exist_ok=True)
    try:
        token_path.write_text(token)
        got = on_each_node(ray, todo, probe_storage, str(root), token_name, token,
                           timeout=timeout)
    finally:
        token_path.unlink(missing_ok=True)
        for p in made:  # nothing of the check is left behind
            with contextlib.suppress(OSError):
                p.rmdir()
    failures = {labels[i]: why for i, (ok, why) in got.items() if not ok or why is not None}
    if failures:
        lines = "\n".join(f"  - {label}: {why}" for label, why in sorted(failures.items()))
        raise PipelineError(
            f"{len(failures)} of {len(nodes)} Ray nodes do not see the storage root {root}:\n"
            f"{lines}\n{SHARED_STORAGE_HELP}")
    return labels
