"""The GPU path of the pipeline, checked on a machine without a GPU (issue 19): fake clusters
(`pipelines.cluster.ClusterInfo`, a fake `ray` module) stand in for GPU nodes.

- the preset and the trials' resources follow the cluster's nodes, not the driver's torch;
- each condition's GPU share comes from the memory model and fits the card; an explicit
  --gpus-per-trial is checked against it; a condition that fits no card is refused;
- Stage 1 asks for the CPUs of a GPU node, and a Stage 1 that is not scheduled within the
  bound stops the driver with the reason;
- a trial trains on the device Ray gave it (CPU when none), records the device and precision
  it used in result.json, its MLflow run and the report;
- a configuration error inside a trial ends it once, with the reason;
- a trial gives the GPU memory it cached back before the actor runs the next one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from pipelines import plan as planning
from pipelines import stages
from pipelines.cluster import (
    ClusterInfo,
    GpuCard,
    NodeInfo,
    TorchCuda,
    describe_local,
    describe_ray,
)
from pipelines.layout import PipelineError
from pmnet.conditions import CONDITIONS
from pmnet.config import ModelConfig
from pmnet.gpu import footprint as mm
from pmnet.trial_id import TrialId

GiB = 1 << 30


def card(gib: float, name: str = "GPU") -> GpuCard:
    return GpuCard(name, int(gib * GiB))


def cluster(*nodes: NodeInfo) -> ClusterInfo:
    return ClusterInfo(tuple(nodes), where="the Ray cluster")


HEAD = NodeInfo("head", 64)  # a large CPU-only head node
RTX = NodeInfo("rtx", 16, 1, (card(24, "NVIDIA GeForce RTX 4090"),))
H100 = NodeInfo("h100", 16, 1, (card(80, "NVIDIA H100"),))


def _plan(tmp_path, nodes: ClusterInfo, **kw):
    kw.setdefault("preset", "debug")
    kw.setdefault("grid", "tiny")
    return planning.plan_new(root=tmp_path / "runs", name="p", cluster=nodes, **kw)


# -- the preset and resources follow the cluster ------------------------------------------


def test_preset_follows_the_clusters_gpu_nodes_not_the_drivers_torch(tmp_path, monkeypatch):
    """A CPU-only head of a GPU cluster plans the paper preset with GPU trials; a driver whose
    own torch sees a GPU plans the cpu preset when no node of the cluster has one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the head's own torch
    plan = _plan(tmp_path, cluster(HEAD, H100), preset=None, grid="default",
                 conditions="consolidator_only")
    assert plan.cfg.preset == "paper" and "have a GPU" in plan.preset_reason
    assert plan.space.gpus_per_trial > 0 and plan.space.gpu_shares
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = _plan(tmp_path, cluster(HEAD), preset=None)
    assert plan.cfg.preset == "cpu" and plan.space.gpus_per_trial == 0
    assert not (tmp_path / "runs").exists()  # planning writes nothing


def test_resource_requests_are_checked_against_the_cluster(tmp_path):
    with pytest.raises(PipelineError, match="asks 0.5 GPU per trial but no node"):
        _plan(tmp_path, cluster(HEAD), gpus_per_trial=0.5)
    # GPU trials must fit a GPU node: the 64-CPU head does not count
    with pytest.raises(PipelineError, match="asks 32 CPUs per trial but the largest GPU node"):
        _plan(tmp_path, cluster(HEAD, RTX), cpus_per_trial=32)
    _plan(tmp_path, cluster(HEAD, RTX), cpus_per_trial=32, gpus_per_trial=0)  # CPU trials: ok
    with pytest.raises(PipelineError, match="--stage1-cpus 32: Stage 1 runs on one GPU node"):
        _plan(tmp_path, cluster(HEAD, RTX), stage1_cpus=32)
    unknown = NodeInfo("gpu", 8, 1, ())  # nvidia-smi gave nothing there
    with pytest.raises(PipelineError, match="give each GPU's memory with --gpu-mem"):
        _plan(tmp_path, cluster(unknown))
    assert _plan(tmp_path, cluster(unknown), gpu_mem_gib=24).space.gpu_shares


def test_local_description_honours_cuda_visible_devices(monkeypatch):
    from pipelines import cluster as cl

    out = ("0, GPU-aaa, NVIDIA GeForce RTX 4090, 24564\n"
           "1, GPU-bbb, NVIDIA H100 80GB HBM3, 81559\n")

    class Done:
        stdout = out

    monkeypatch.setattr(cl.shutil, "which", lambda exe: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(cl.subprocess, "run", lambda *a, **k: Done())
    assert [c.name for c in cl.local_cards({})] == ["NVIDIA GeForce RTX 4090",
                                                    "NVIDIA H100 80GB HBM3"]
    assert cl.local_cards({"CUDA_VISIBLE_DEVICES": "GPU-bbb"})[0].memory_bytes == 81559 << 20
    assert cl.local_cards({"CUDA_VISIBLE_DEVICES": ""}) == ()
    local = describe_local(num_cpus=3, cards=lambda: cl.local_cards({"CUDA_VISIBLE_DEVICES": "0"}))
    assert local.nodes[0].cpus == 3 and local.nodes[0].gpus == 1
    assert local.card_bytes == 24564 << 20


class FakeRay:
    """The part of the `ray` module the cluster description and Stage 1 use: `nodes()`,
    `remote(...)` tasks (`options().remote()` returns a ref), `wait`, `get`, `cancel`.
    `answers`: what a probe task returns per node id; `ready`: whether tasks ever finish."""

    def __init__(self, nodes: list[dict], answers: dict | None = None, ready: bool = True):
        self._nodes, self.answers, self.ready = nodes, answers or {}, ready
        self.submitted: list[dict] = []
        self.cancelled: list = []

    def nodes(self):
        return self._nodes

    def remote(self, **resources):
        ray = self

        class Task:
            def __init__(self, fn, opts=None):
                self.fn, self.opts = fn, opts or {}

            def options(self, **opts):
                return Task(self.fn, opts)

            def remote(self, *args):
                strategy = self.opts.get("scheduling_strategy")
                ref = (getattr(strategy, "node_id", None), len(ray.submitted))
                ray.submitted.append({"resources": resources, "args": args, "ref": ref})
                return ref

        return lambda fn: Task(fn)

    def wait(self, refs, num_returns=1, timeout=None):
        if self.ready:
            return list(refs), []
        time.sleep(timeout or 0)  # as Ray does while nothing is ready
        return [], list(refs)

    def get(self, ref, timeout=None):
        if not self.ready:  # as Ray does while the task gives no answer
            from ray.exceptions import GetTimeoutError

            time.sleep(timeout or 0)
            raise GetTimeoutError(f"no answer within {timeout} s")
        return self.answers[ref[0]]

    def cancel(self, ref, force=False):
        self.cancelled.append(ref)


def _id(name: str) -> str:
    """A Ray node id (28 bytes, hex) made from a name."""
    return name.encode().hex().ljust(56, "0")


def _ray_node(name: str, cpus: float, gpus: float = 0) -> dict:
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"NodeID": _id(name), "Alive": True, "NodeName": name, "Resources": res}


SEES = TorchCuda(True, "torch 2.13.0+cu128, torch.version.cuda=12.8, ...")
BLIND = TorchCuda(False, "torch 2.13.0+cpu, torch.version.cuda=None, ...")


def test_a_ray_cluster_is_described_from_its_nodes_and_their_cards():
    ray = FakeRay([_ray_node("head", 64), _ray_node("gpu1", 16, 2), _ray_node("gpu2", 8, 1),
                   {**_ray_node("gone", 99, 8), "Alive": False}],
                  answers={_id("gpu1"): ((card(80), card(80)), SEES),
                           _id("gpu2"): ((card(24),), BLIND)})
    info = describe_ray(ray)
    assert [n.cpus for n in info.nodes] == [64, 16, 8]
    # one probe per GPU node, pinned there, taking no CPU: its cards, and its torch's CUDA
    # (issue 36)
    assert [r["resources"] for r in ray.submitted] == [{"num_cpus": 0, "max_retries": 0}] * 2
    assert [r["ref"][0] for r in ray.submitted] == [_id("gpu1"), _id("gpu2")]
    assert [n.torch for n in info.nodes] == [None, SEES, BLIND]
    assert [len(n.cards) for n in info.nodes] == [0, 2, 1]
    assert info.has_gpu and info.largest_cpus(gpu=True) == 16 and info.largest_cpus(gpu=False) == 64
    assert info.card_bytes == 24 * GiB  # a share must fit the smallest card


# -- GPU shares from the memory model --------------------------------------------------------


@pytest.mark.parametrize("node", [RTX, H100], ids=["24GiB", "80GiB"])
def test_every_gpu_of_the_paper_grid_holds_trials_that_fit_it(tmp_path, node, one_thread):
    """The paper preset's grid on one 24 GiB and one 80 GiB card: every condition gets a
    share with share x usable >= its predicted peak, so whatever trials Ray places together
    on the card (their shares sum to at most 1) fit it; a condition no card holds is refused
    before anything is written."""
    conditions = list(CONDITIONS)
    usable = mm.usable_bytes(node.cards[0].memory_bytes)
    peaks = {c: mm.trial_memory(ModelConfig.from_name("paper"), c, batch_size=256,
                                precision="bf16-mixed").peak for c in conditions}
    fitting = [c for c in conditions if peaks[c] <= usable]
    too_big = [c for c in conditions if peaks[c] > usable]
    if too_big:  # learned_full_dual on 24 GiB
        with pytest.raises(PipelineError, match=f"a trial of {too_big[0]} needs .* GiB"):
            _plan(tmp_path, cluster(node), preset="paper", grid="paper")
    plan = _plan(tmp_path, cluster(node), preset="paper", grid="paper",
                 conditions=",".join(fitting))
    sp = plan.space
    for c in fitting:
        share = sp.gpus_for(TrialId(c, 42))
        assert 0 < share <= 1 and share * usable >= peaks[c], c
        assert plan.memory[(c, "")] == peaks[c]
    # Tune's requests: each trial asks its arm's share
    req = stages.TrialResources(sp)(TrialId(fitting[0], 42).to_config())
    assert req.bundles == [{"CPU": sp.cpus_per_trial, "GPU": sp.gpus_for(TrialId(fitting[0], 42))}]
    # the stored space round-trips with its shares (resume asks the same)
    assert planning.Space.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp


def test_an_explicit_gpu_share_is_checked_against_the_memory_model(tmp_path, one_thread):
    with pytest.raises(PipelineError, match=r"--gpus-per-trial 0.25: a trial of learned_full "
                                            r"needs .* GiB .* more than 0.25 of a 24 GiB card"):
        _plan(tmp_path, cluster(RTX), preset="paper", grid="paper",
              conditions="learned_full,consolidator_only", gpus_per_trial=0.25)
    with pytest.raises(PipelineError, match="a trial of consolidator_only needs"):
        _plan(tmp_path, cluster(RTX), preset="paper", grid="paper",
              conditions="consolidator_only", gpus_per_trial=0.25)
    plan = _plan(tmp_path, cluster(RTX), preset="paper", grid="paper",
                 conditions="consolidator_only", gpus_per_trial=0.5)
    assert plan.space.gpus_for(TrialId("consolidator_only", 42)) == 0.5


# -- Stage 1 --------------------------------------------------------------------------------


def test_stage1_is_sized_from_the_gpu_nodes(tmp_path):
    """A large CPU-only head and a smaller GPU worker: Stage 1 asks for the GPU worker's CPUs
    and its GPU (the largest node's 64 CPUs plus a GPU would never be scheduled)."""
    plan = _plan(tmp_path, cluster(HEAD, RTX))
    res = stages.stage1_resources(plan, plan.cluster, n_tasks=1)
    assert (res.cpus, res.gpus) == (16, 1)
    assert any(n.cpus >= res.cpus and n.gpus >= res.gpus for n in plan.cluster.nodes)
    assert stages.stage1_resources(plan, plan.cluster, n_tasks=3).cpus == 5  # shared
    cpu_plan = _plan(tmp_path, cluster(HEAD, RTX), gpus_per_trial=0)
    res = stages.stage1_resources(cpu_plan, cpu_plan.cluster, n_tasks=1)
    assert (res.cpus, res.gpus) == (64, 0)


def test_stage1_on_one_node_with_fewer_cpus_than_checkpoints_trains_them_all_at_once(tmp_path):
    """Three Phase-1 checkpoints on a 2-CPU machine: each asks for 2/3 of a CPU (one torch
    thread), so Ray starts all three at once instead of leaving one core idle for the third;
    with enough CPUs, with a GPU, or on a cluster the whole-CPU shares are kept."""
    laptop = cluster(NodeInfo("laptop", 2))
    plan = _plan(tmp_path, laptop, gpus_per_trial=0)
    res = stages.stage1_resources(plan, plan.cluster, n_tasks=3)
    assert res.gpus == 0 and res.cpus == pytest.approx(2 / 3)
    assert 3 * res.cpus <= 2 + 1e-9  # Ray fits all three on the node
    assert stages.stage1_resources(plan, plan.cluster, n_tasks=2).cpus == 1
    assert stages.stage1_resources(plan, plan.cluster, n_tasks=1).cpus == 2
    two_nodes = cluster(NodeInfo("a", 2), NodeInfo("b", 2))
    plan2 = _plan(tmp_path / "b", two_nodes, gpus_per_trial=0)
    assert stages.stage1_resources(plan2, plan2.cluster, n_tasks=3).cpus == 1
    gpu_node = NodeInfo("g", 2, 1, (card(24, "NVIDIA GeForce RTX 4090"),))
    gpu_plan = _plan(tmp_path / "c", cluster(gpu_node))
    assert stages.stage1_resources(gpu_plan, gpu_plan.cluster, n_tasks=3).cpus == 1


# -- device truth ----------------------------------------------------------------------------


def test_the_device_is_what_ray_assigned(monkeypatch):
    import ray

    from pipelines.trial import assigned_device

    assert assigned_device() == "cpu"  # outside Ray: nothing was assigned
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert assigned_device() == "cpu"  # Ray gave no GPU, whatever torch can see
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0])
    assert assigned_device() == "gpu"


@pytest.fixture(scope="module")
def phase1(tmp_path_factory):
    from pipelines.trial import quiet_training_logs
    from pmnet.train import TrainConfig, run_phase1

    quiet_training_logs()
    threads = torch.get_num_threads()
    try:
        return run_phase1(TrainConfig.from_name("debug", threads=1),
                          tmp_path_factory.mktemp("p1"), progress=False)
    finally:
        torch.set_num_threads(threads)


def _ctx(root: Path, phase1: dict):
    from tests.support.trials import trial_ctx

    return trial_ctx(root, phase1)


def test_a_trial_given_no_gpu_trains_on_cpu_and_records_it(tmp_path, phase1, monkeypatch):
    """CUDA looks available to the trial's torch (as on a GPU node where Ray gave this trial
    no GPU): the trial still trains on the CPU, in fp32, and says so in result.json, its
    attempt record and the report."""
    from pipelines.layout import read_json
    from pmnet.report import _run_facts
    from pmnet.stats import load_results
    from tests.support.trials import FakeTune, run_trial_here

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ctx = _ctx(tmp_path / "runs", phase1)
    run_trial_here(ctx, "consolidator_only", 42, FakeTune(tmp_path / "tune"))
    lay = ctx.layout
    result = read_json(lay.result_path(TrialId("consolidator_only", 42)))
    assert result["device"].startswith("cpu (") and result["precision"] == "32-true"
    attempt = json.loads((lay.trial_dir(TrialId("consolidator_only", 42)) / "attempts.jsonl")
                         .read_text().splitlines()[0])
    assert attempt["accelerator"] == "cpu"
    facts = dict(_run_facts(load_results(lay.results_dir)))
    assert facts["trained on (from results)"] == f"{result['device']}, 32-true: 1 trial"


def test_the_mlflow_run_records_device_and_precision(tmp_path):
    from pipelines.layout import write_json
    from pipelines.tracking import trial_run

    result = {"condition": "learned_full", "seed": 42, "select": "updated_ltm", "history": [],
              "test": {}, "device": "NVIDIA H100 (cuda:0)", "precision": "bf16-mixed",
              "phase1_sha256": "a" * 64, "preset": "paper"}
    write_json(tmp_path / "result.json", result)
    tags = trial_run("p", tmp_path / "result.json")["tags"]
    assert (tags["device"], tags["precision"]) == ("NVIDIA H100 (cuda:0)", "bf16-mixed")


# -- configuration errors are not retried; GPU memory is freed between trials ---------------


def test_a_configuration_error_ends_a_trial_once_with_the_reason(tmp_path, phase1):
    """A trial whose configuration cannot run (here a seed beyond numpy's range) does not
    raise, so Tune does not retry it: it reports the reason once and records it."""
    from pipelines.layout import read_json
    from pipelines.trial import CONFIG_ERROR, train_trial
    from tests.support.trials import FakeTune

    ctx = _ctx(tmp_path / "runs", phase1)
    fake = FakeTune(tmp_path / "tune")
    trial = TrialId("consolidator_only", 2**32)
    with pytest.MonkeyPatch.context() as mp:
        from ray import tune

        mp.setattr(tune, "report", fake.report)
        mp.setattr(tune, "get_checkpoint", fake.get_checkpoint)
        train_trial(trial.to_config(), ctx)  # returns: nothing for Tune to retry
    [report] = fake.reports
    assert "outside 0..4294967295" in report["metrics"][CONFIG_ERROR]
    info = read_json(ctx.layout.trial_dir(trial) / "trial.json")
    assert info["state"] == "ERROR" and info[CONFIG_ERROR] is True
    assert "TrialConfigError" in info["error"]
    assert not ctx.layout.result_path(trial).exists()


def test_a_finished_trial_gives_its_cached_gpu_memory_back(tmp_path, phase1, monkeypatch):
    from tests.support.trials import FakeTune, run_trial_here

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    ctx = _ctx(tmp_path / "runs", phase1)
    run_trial_here(ctx, "consolidator_only", 43, FakeTune(tmp_path / "tune"))
    assert emptied, "the trial left its cached GPU memory to the next trial of the actor"


def test_a_resume_checks_the_stored_grid_against_the_cluster_a_report_does_not(tmp_path):
    from pipelines.stages import write_meta

    plan = _plan(tmp_path, cluster(HEAD, RTX))
    write_meta(plan, status="finished")
    with pytest.raises(PipelineError, match="cannot continue here: the grid asks .* GPU "
                                            "per trial but no node"):
        planning.plan_resume(root=tmp_path / "runs", name="p", cluster=cluster(HEAD))
    again = planning.plan_resume(root=tmp_path / "runs", name="p", cluster=cluster(RTX))
    assert again.space.gpu_shares == plan.space.gpu_shares  # the stored shares, unchanged
    assert planning.plan_resume(root=tmp_path / "runs", name="p", check_resources=False)


def test_a_gpu_the_trainers_torch_cannot_use_is_refused_before_anything_starts(
        tmp_path, monkeypatch):
    """Issue 36, finding 1: nvidia-smi (a fake one on PATH) sees an RTX 4090, but the torch
    that would train is this CPU build: planning asks that torch in a fresh process (never
    this one), names what it saw, and refuses with exit 2 before anything is written; where
    torch does see CUDA the same node plans GPU trials."""
    from pipelines import cluster as cl
    from pipelines import run

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho '0, GPU-aaa, NVIDIA GeForce RTX 4090, 24564'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    local = describe_local(num_cpus=4)
    node = local.nodes[0]
    assert [c.name for c in node.cards] == ["NVIDIA GeForce RTX 4090"] and node.gpus == 1
    assert node.torch is not None and not node.torch.ok
    # the trainer's torch, asked in a subprocess
    assert node.torch.describe().startswith(f"torch {torch.__version__}, ")
    with pytest.raises(PipelineError, match=r"nvidia-smi sees 1 GPU\(s\) but its Python "
                                            r"cannot use them .*torch.version.cuda=None"):
        _plan(tmp_path, local, preset="debug")
    root = tmp_path / "runs"
    assert run.main(["start", "--preset", "debug", "--grid", "tiny", "--root", str(root)]) == 2
    assert not root.exists()  # refused before anything was written
    seeing = cl.TorchCuda(True, "torch 2.13.0+cu128, torch.version.cuda=12.8")
    ok = ClusterInfo(nodes=(NodeInfo("gpu", 4, 1, node.cards, torch=seeing),))
    assert _plan(tmp_path, ok, preset="debug").space.gpus_per_trial > 0


def test_the_checkpoints_grid_plans_at_the_paper_preset_on_one_4090(tmp_path):
    """Issue 39: a user with one RTX 4090 runs the checkpoint study at the paper's scale:
    ten Phase-1 checkpoints, both Consolidator-only arms x two seeds each (40 trials), each
    arm with a GPU share from the memory model that fits the card."""
    plan = _plan(tmp_path, cluster(HEAD, RTX), preset="paper", grid="checkpoints")
    sp = plan.space
    assert plan.cfg.preset == "paper" and sp.phase1_seeds == tuple(range(10))
    assert sp.n_trials == 40 and sp.seeds == (42, 43)
    shares = {c: g for c, _, g in sp.gpu_shares}
    assert set(shares) == {"consolidator_only", "consolidator_only_routing_off"}
    assert all(0 < g <= 1 for g in shares.values())
    assert not (tmp_path / "runs").exists()
