"""The GPU path without a GPU (issue 36, findings 2-6): reused actors and the recompile
limit, the per-trial memory cap, the evaluation mode of compiled steps, flash-attn as a
custom op and the card's compute capability, the image's pinned versions."""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import types
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from pmnet import task
from pmnet.conditions import get_condition
from pmnet.model import PMNet
from pmnet.train import TrainConfig, compiled_steps
from pmnet.train.modules import Phase2Module
from pmnet.train.phases import _setup_threads, _trainer, init_phase2

ROOT = Path(__file__).resolve().parents[1]


def _limit_hits() -> int:
    return sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k.lower())


# -- finding 2: a reused actor's trials, one after another in fresh threads -----------------


def test_reused_actor_trials_each_start_from_no_compiled_code(monkeypatch):
    """The mechanism, fast: ten arms of a step whose graph depends on a value read from
    `self` (as `Phase2Module._outcomes` reads its condition), one trial each in a fresh
    thread of one process, begun by `_setup_threads` and ended by the pipeline's release.
    Each compiles one graph and none hits the recompile limit; on main the ninth arm was
    the code object's ninth cache entry and ran eager from then on (a log line only)."""
    from pmnet.train.compiled_steps import release_compiled_steps

    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "eager")
    cfg = TrainConfig.from_name("debug", compile=("phase2",))
    torch._dynamo.reset()
    counters.clear()

    class Arm:
        def __init__(self, mode: str):
            self.mode = mode

        def step(self, x):
            return x * 2 if self.mode.endswith("a") else x + len(self.mode)

    entries = []

    def trial(i):
        _setup_threads(cfg)
        try:
            arm = Arm("arm" + "b" * i)
            fn = compiled_steps.compile_step(arm.step, torch.device("cpu"), cfg)
            fn(torch.ones(3))
            fn(torch.ones(3))
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entries.append(len(_debug_get_cache_entry_list(Arm.step)))
        finally:
            release_compiled_steps()

    try:
        for i in range(10):
            t = threading.Thread(target=trial, args=(i,))
            t.start()
            t.join()
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit = False
    assert entries == [1] * 10 and _limit_hits() == 0
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 10


@pytest.mark.slow
def test_every_arm_of_the_largest_grid_compiles_in_one_process_in_fresh_threads(monkeypatch):
    """Tune's reused actor runs trials one after another in one process, each in a new
    thread. Every arm of the largest grid (eight: `checkpoint_channel`'s) runs its compiled
    training step and both evaluation passes (validation, test) there, as its trial does:
    `_setup_threads` first (what run_phase1 / run_phase2 / warm_compile call), the
    pipeline's release (`release_compiled_steps`) last. Each trial must compile its own
    graphs (one training, two evaluation) and none may hit dynamo's recompile limit. On
    main the cache entries of earlier arms stayed on the shared code objects: the fifth
    arm's test pass was the evaluation step's ninth entry, hit the limit (8) and ran eager
    from then on, with only a log line."""
    from pmnet.train.compiled_steps import release_compiled_steps
    from tune_spaces.grids import SPACES

    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "eager")  # dynamo as on a GPU
    cfg0 = TrainConfig.from_name("debug", compile=("phase2", "eval"))
    arms = max(([(c, v) for c in fn(cfg0).conditions for v in fn(cfg0).variants]
                for fn in SPACES.values()), key=len)
    assert len(arms) == 8  # as many arms as dynamo's recompile limit (8) per code object
    torch._dynamo.reset()
    counters.clear()
    seen = []

    def trial(condition, variant):
        cfg = variant.apply(cfg0)
        _setup_threads(cfg)
        try:
            torch.manual_seed(0)
            model = PMNet(cfg.model)
            cond = get_condition(condition)
            init_phase2(model, cfg, cond, 0)
            m = Phase2Module(cfg, model, cond)
            batch = task.train_episodes(0, 0, 2, segments=cfg.segments)
            m.step_fn(m.objective, train=True)(batch)["loss"].backward()
            m.eval()
            with torch.no_grad():
                for full in (False, True):
                    m.step_fn(m._outcomes, train=False)(batch, full)
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

            seen.append((condition, len(entries(Phase2Module.objective)),
                         len(entries(Phase2Module._outcomes)), _limit_hits()))
        finally:
            release_compiled_steps()

    try:
        for condition, variant in arms:
            t = threading.Thread(target=trial, args=(condition, variant))
            t.start()
            t.join()
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit = False
    assert [s[0] for s in seen] == [c for c, _ in arms]
    assert all(s[1:] == (1, 2, 0) for s in seen), seen
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 3 * len(arms)


def test_a_step_past_the_recompile_limit_fails_instead_of_running_eager(monkeypatch):
    """Within one trial a step that recompiles past the limit raises (it ran eager, with a
    log line only, on main)."""
    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    cfg = TrainConfig.from_name("debug", compile=("phase2",))

    def step(x, mode: str):
        return x * len(mode)

    fn = compiled_steps.compile_step(step, torch.device("cpu"), cfg)
    x = torch.ones(2)
    try:
        with pytest.raises(Exception, match="(?i)recompile"):
            for i in range(12):
                fn(x, "m" * (i + 1))
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit = False
        torch._dynamo.reset()


# -- finding 3: the trial's memory cap -----------------------------------------------------


def test_memory_cap_is_the_trials_share_of_the_usable_card_less_its_context():
    from pmnet.gpu.cap import memory_cap_bytes, memory_cap_fraction
    from pmnet.gpu.footprint import CUDA_CONTEXT_BYTES, GiB, gpu_share, usable_bytes

    card = 24 * GiB
    assert memory_cap_bytes(1.0, card) == usable_bytes(card) - CUDA_CONTEXT_BYTES
    assert memory_cap_fraction(0.5, card) == pytest.approx(
        (0.5 * usable_bytes(card) - CUDA_CONTEXT_BYTES) / card)
    # any peak planning packs fits its cap, and n caps + n contexts fit the usable card
    for peak in (3 * GiB, 7.5 * GiB, 20 * GiB):
        share = gpu_share(int(peak), card)
        cap = memory_cap_bytes(share.fraction, card)
        assert cap + CUDA_CONTEXT_BYTES >= peak
        assert share.trials_per_gpu * (cap + CUDA_CONTEXT_BYTES) <= usable_bytes(card)
    with pytest.raises(ValueError):
        memory_cap_bytes(0.01, card)  # less than the context
    with pytest.raises(ValueError):
        memory_cap_bytes(1.5, card)


def test_a_trial_on_a_gpu_sets_its_cap_and_checks_its_peak(monkeypatch):
    """With a fake CUDA: the cap goes to `set_per_process_memory_fraction` for the trial's
    device, and the trial's record holds its peaks against the cap."""
    from pmnet.gpu import cap as gm
    from pmnet.gpu.footprint import GiB

    calls = {}
    fake = types.SimpleNamespace(total_memory=24 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: fake)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: calls.update(fraction=f, device=d))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 4 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 5 * GiB)
    assert gm.apply_memory_cap(torch.device("cpu"), 0.3333) is None
    assert gm.apply_memory_cap(torch.device("cuda", 0), None) is None
    cap = gm.GpuMemoryCap(0.3333)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(
        root_device=torch.device("cuda", 0)))
    cap.setup(trainer, None, "fit")
    assert calls["fraction"] == pytest.approx(gm.memory_cap_fraction(0.3333, 24 * GiB))
    assert calls["device"] == torch.device("cuda", 0)
    cap.teardown(trainer, None, "fit")
    rec = cap.record
    assert rec["peak_reserved"] == 5 * GiB and rec["peak_allocated"] == 4 * GiB
    assert rec["within_cap"] is True and rec["cap_bytes"] == gm.memory_cap_bytes(0.3333,
                                                                                  24 * GiB)


def test_a_pipeline_trial_passes_rays_gpu_share_to_training(monkeypatch):
    """The Tune trial reads the GPU fraction Ray gave it and hands it to run_phase2."""
    import inspect

    from pipelines import trial as T

    ctx = types.SimpleNamespace(get_assigned_resources=lambda: {"CPU": 2.0, "GPU": 0.3333})
    fake = types.SimpleNamespace(get_runtime_context=lambda: ctx, is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert T.assigned_gpu_share() == pytest.approx(0.3333)
    ctx.get_assigned_resources = lambda: {"CPU": 1.0}
    assert T.assigned_gpu_share() is None
    # outside Ray it asks nothing (get_runtime_context would start a local Ray instance)
    fake.is_initialized = lambda: False
    fake.get_runtime_context = lambda: pytest.fail("asked Ray outside Ray")
    assert T.assigned_gpu_share() is None
    src = inspect.getsource(T._train_and_record)
    assert "gpu_share=assigned_gpu_share()" in src
    from pmnet.train import run_phase2

    assert "gpu_share" in inspect.signature(run_phase2).parameters


# -- finding 4: evaluation mode of a compiled evaluation step ------------------------------


def test_compiled_evaluation_runs_under_no_grad_not_inference_mode(tmp_path):
    """Lightning's validation inside `fit` always runs under no_grad (its epoch loop builds
    its own evaluation loop with inference_mode=False), so that half of the finding does
    not apply; `trainer.test` (and `validate`) use the Trainer's `inference_mode`, True by
    default. With a compiled evaluation step (the paper preset) every evaluation now runs
    under no_grad, as `warm_compile` compiles it; eager evaluation keeps the default."""
    paper_like = TrainConfig.from_name("debug", compile=("phase2", "eval"))
    eager = TrainConfig.from_name("debug")
    for cfg, test_mode in ((paper_like, False), (eager, True)):
        trainer, _ = _trainer(cfg, tmp_path, max_epochs=1, monitor=None, patience=1,
                              callbacks=(), loggers=(), progress=False, ckpt_dir=None,
                              accelerator="cpu")
        assert trainer.fit_loop.epoch_loop.val_loop.inference_mode is False
        assert trainer.test_loop.inference_mode is test_mode
        assert trainer.validate_loop.inference_mode is test_mode
    assert TrainConfig.from_name("paper").compile.count("eval") == 1


# -- finding 5: flash-attn as a custom op, and the card's capability -----------------------


_LIB = None


def _stand_in_ops(ns: str):
    """A CPU stand-in for flash-attn >= 2.7: `<ns>::_flash_attn_forward` / `_backward` as
    torch custom ops (computed by SDPA's math, dropout from a seeded mask), and
    `flash_attn_func` an autograd.Function calling them, as flash-attn's own."""
    global _LIB
    calls = {"fwd": 0, "bwd": 0, "dropout": set()}
    if _LIB is not None:
        return _LIB
    from torch.library import custom_op

    def _probs(q, k, p, seed):
        # q: (B, T, H, D), k: (B, S, H, D) -> softmax P and the dropout scale, (B, H, T, S)
        q_, k_ = (t.transpose(1, 2).float() for t in (q, k))
        scale = q.shape[-1] ** -0.5
        s = q_ @ k_.transpose(-1, -2) * scale
        T, S = q.shape[1], k.shape[1]
        pos = torch.arange(S - T, S)[:, None] - torch.arange(S)[None, :]
        P = torch.softmax(s.masked_fill(pos < 0, float("-inf")), -1)
        keep = torch.ones_like(P)
        if p > 0:
            g = torch.Generator().manual_seed(int(seed))
            keep = (torch.rand(P.shape, generator=g) >= p).float() / (1 - p)
        return q_, k_, P, keep, scale

    def _attn(q, k, v, p, seed):
        _, _, P, keep, _ = _probs(q, k, p, seed)
        out = (P * keep) @ v.transpose(1, 2).float()
        return out.transpose(1, 2).to(q.dtype).contiguous()

    def _attn_backward(g, q, k, v, p, seed):
        q_, k_, P, keep, scale = _probs(q, k, p, seed)
        v_, g_ = v.transpose(1, 2).float(), g.transpose(1, 2).float()
        dv = (P * keep).transpose(-1, -2) @ g_
        dP = (g_ @ v_.transpose(-1, -2)) * keep
        dS = P * (dP - (dP * P).sum(-1, keepdim=True))
        dq, dk = dS @ k_ * scale, dS.transpose(-1, -2) @ q_ * scale
        return tuple(t.transpose(1, 2).to(x.dtype).contiguous()
                     for t, x in ((dq, q), (dk, k), (dv, v)))

    @custom_op(f"{ns}::_flash_attn_forward", mutates_args=(), device_types="cpu")
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
            seed: torch.Tensor) -> torch.Tensor:
        calls["fwd"] += 1
        calls["dropout"].add(dropout_p)
        return _attn(q, k, v, dropout_p, seed)

    @fwd.register_fake
    def _(q, k, v, dropout_p, seed):
        return q.new_empty(q.shape)

    @custom_op(f"{ns}::_flash_attn_backward", mutates_args=(), device_types="cpu")
    def bwd(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            dropout_p: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
        calls["bwd"] += 1
        return _attn_backward(g, q, k, v, dropout_p, seed)

    @bwd.register_fake
    def _(g, q, k, v, dropout_p, seed):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    class Func(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, dropout_p):
            q, k, v = (t.contiguous() for t in (q, k, v))  # as flash-attn's maybe_contiguous
            seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
            ctx.save_for_backward(q, k, v, seed)
            ctx.dropout_p = dropout_p
            return fwd(q, k, v, dropout_p, seed)

        @staticmethod
        def backward(ctx, g):
            q, k, v, seed = ctx.saved_tensors
            dq, dk, dv = bwd(g.contiguous(), q, k, v, ctx.dropout_p, seed)
            return dq, dk, dv, None

    def flash_attn_func(q, k, v, dropout_p=0.0, causal=True, window_size=(-1, -1)):
        return Func.apply(q, k, v, dropout_p)

    _LIB = (flash_attn_func, calls)
    return _LIB


def test_flash_attn_is_used_only_as_a_custom_op_and_compiles_without_a_graph_break(
        monkeypatch):
    """A compiled Phase-2 step through the stand-in custom ops in bf16 on the CPU: no graph
    break, forward and backward through the ops, dropout passed in training. A flash-attn
    whose kernels are not custom ops (2.6.x) is not used: SDPA runs (on main it was used,
    and each layer's call broke the compiled graph)."""
    from pmnet import backbone as M

    ns = "pmnet_flash_standin"
    flash, calls = _stand_in_ops(ns)
    assert M.flash_is_custom_op(ns) and not M.flash_is_custom_op("pmnet_no_such_ns")
    monkeypatch.setattr(compiled_steps, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(M, "FLASH_DEVICE", "cpu")
    monkeypatch.setattr(M, "flash_attn_func", flash)
    cfg = TrainConfig.from_name("debug", compile=("phase2",))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_dropout=0.1))
    torch.manual_seed(0)
    model = PMNet(cfg.model)
    cond = get_condition("learned_full")
    init_phase2(model, cfg, cond, 0)
    m = Phase2Module(cfg, model, cond)
    batch = task.train_episodes(0, 0, 2)
    # a flash-attn that is not a custom op: not used
    monkeypatch.setattr(M, "FLASH_IS_OP", M.flash_is_custom_op("pmnet_no_such_ns"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.objective(batch)["loss"]
    assert calls["fwd"] == 0
    # as custom ops: used, compiled in one graph, backward through them, dropout on
    monkeypatch.setattr(M, "FLASH_IS_OP", M.flash_is_custom_op(ns))
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m.step_fn(m.objective, train=True)(batch)["loss"]
        loss.backward()
    finally:
        torch._dynamo.config.fail_on_recompile_limit_hit = False
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert calls["fwd"] > 0 and calls["bwd"] > 0
    assert calls["dropout"] == {0.1}
    q_grad = m.model.layers[0].attn.q_proj.weight.grad
    assert q_grad is not None and q_grad.abs().sum() > 0
    torch._dynamo.reset()


def test_flash_attn_needs_compute_capability_8(monkeypatch):
    """flash-attn 2 has kernels for sm80 and newer only: an older card runs SDPA (on main
    nothing asked the card)."""
    from pmnet import backbone as M

    for cap, ok in (((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, c=cap: c)
        assert M.flash_capable(torch.device("cuda", 0)) is ok
    assert M.flash_capable(torch.device("cpu"))  # a stand-in's device


# -- finding 6: the image's versions -------------------------------------------------------


def test_the_image_pins_the_tested_versions():
    """docker/: torch, Lightning, Ray, MLflow (and every other dependency) at the versions
    of the tested environment; flash-attn pinned to a custom-op version and never built
    from source unless asked (main: torch 2.8, the rest unpinned, flash-attn>=2.6 built
    when no wheel matched)."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    lines = [ln.split("#")[0].strip()
             for ln in (ROOT / "docker" / "constraints.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    # pip refuses extras in a constraints file ("Constraints cannot have extras"): a pin
    # with one would stop `docker build` at its first install (issue 46)
    assert not [ln for ln in lines if "[" in ln], lines
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", "\n".join(lines), re.M))
    assert len(pins) == len(lines), lines
    for pkg in ("torch", "lightning", "ray", "mlflow"):
        assert pins.get(pkg) == version(pkg).split("+")[0], pkg
    for pkg, v in pins.items():
        assert version(pkg).split("+")[0] == v, pkg
    torch_arg = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1)
    assert torch_arg == torch.__version__.split("+")[0]
    assert "${TORCH_VERSION}" in re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M)[1]
    assert "-c docker/constraints.txt" in dockerfile
    flash = re.search(r"^ARG FLASH_ATTN_VERSION=(\d+)\.(\d+)\.(\d+)$", dockerfile, re.M)
    assert flash and (int(flash[1]), int(flash[2])) >= (2, 7)
    assert re.search(r"^ARG FLASH_ATTN_FROM_SOURCE=0$", dockerfile, re.M)
    assert ".[flash" not in dockerfile  # the extra would build flash-attn from source
    assert '"flash-attn>=2.7"' in (ROOT / "pyproject.toml").read_text()
