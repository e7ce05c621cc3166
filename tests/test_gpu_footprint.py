"""The memory model of a trial (`pmnet.gpu.footprint`): CUDA's autocast rules emulated on CPU,
the bytes saved for backward against a direct count, the linear fit in the batch, the static
parts against a real AdamW step, and the packing of trials onto a card never over budget.

Everything runs the `debug` model (milliseconds per step) except the packing tests, which
measure the `paper` model once per condition (a few seconds each, cached per process)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from pmnet import task
from pmnet.conditions import ALL_CONDITIONS, CONDITIONS, get_condition
from pmnet.config import ModelConfig
from pmnet.gpu import footprint as mm

DEBUG = ModelConfig.from_name("debug")
PAPER = ModelConfig.from_name("paper")
GiB = mm.GiB


# -- CUDA's autocast rules on CPU -----------------------------------------------------------


def test_every_op_cuda_autocast_handles_has_a_policy():
    """The emulation knows the cast policy of every aten op the installed torch registers on
    the AutocastCUDA key (a newer torch with new autocast ops fails here, not silently)."""
    cuda_ops = mm.registered_autocast_ops("AutocastCUDA")
    assert len(cuda_ops) > 50
    assert sorted(cuda_ops - set(mm.CUDA_POLICY)) == []


def test_the_emulation_applies_cudas_policies_not_cpus():
    x = torch.randn(3, 8)
    w = torch.randn(5, 8, requires_grad=True)
    norm_w = torch.ones(8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU's own rules, for contrast
        assert F.rms_norm(x.bfloat16(), (8,), norm_w).dtype == torch.bfloat16
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16
    with mm.cuda_autocast_on_cpu(torch.bfloat16):
        assert F.linear(x, w).dtype == torch.bfloat16  # lower precision (matmul-like)
        assert torch.bmm(x[None], x.T[None]).dtype == torch.bfloat16
        assert F.rms_norm(x.bfloat16(), (8,), norm_w).dtype == torch.float32  # CUDA: fp32
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32  # fp32_set_opt_dtype
        assert x.bfloat16().sum().dtype == torch.float32
        assert torch.atan2(x.bfloat16(), x).dtype == torch.float32  # promote
        assert torch.cat([x.bfloat16(), x.bfloat16()]).dtype == torch.bfloat16  # CPU-only op
        assert (x.bfloat16() * x).dtype == torch.float32  # no autocast rule: type promotion
        with torch.autocast("cpu", enabled=False):  # the model's fp32 blocks stay fp32
            assert F.linear(x, w).dtype == torch.float32
    # removed afterwards
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.rms_norm(x.bfloat16(), (8,), norm_w).dtype == torch.bfloat16


def test_the_cast_cache_follows_cudas_rule():
    """One cached bf16 copy per fp32 leaf that requires grad, for the whole region; frozen
    weights and non-leaves are cast at every use; fp32 casts are never cached."""
    cache = mm._CastCache()
    trainable = torch.randn(4, 8, requires_grad=True)
    frozen = torch.randn(4, 8)
    cast = lambda t: cache.cast(t, torch.bfloat16, torch.bfloat16)  # noqa: E731
    assert cast(trainable) is cast(trainable)
    assert cast(frozen) is not cast(frozen)
    assert cast(trainable * 1) is not cast(trainable * 1)
    half = trainable.detach().bfloat16().requires_grad_()
    assert cache.cast(half, torch.float32, torch.bfloat16) is not cache.cast(
        half, torch.float32, torch.bfloat16)
    assert cast(torch.arange(3)).dtype == torch.int64  # integers are never cast
    cache.clear()
    first = cast(trainable)
    cache.clear()
    assert cast(trainable) is not first  # a new region casts again


# -- saved bytes: against a direct count ------------------------------------------------------


def _graph_count(loss: torch.Tensor, exclude) -> int:
    """Bytes of the distinct storages the autograd graph of `loss` holds for backward, read
    node by node (`_saved_*` attributes, `saved_tensors` of custom functions): a count
    independent of the saved-tensor hooks."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    v = getattr(node, name)
                except RuntimeError:
                    continue
                vs = v if isinstance(v, (tuple, list)) else [v]
                tensors += [t for t in vs if isinstance(t, torch.Tensor)]
        if hasattr(node, "saved_tensors"):
            tensors += [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.dim() == 0 and t.dtype in (torch.float64, torch.int64):
                continue  # a Python number (`x * pi`, `/ n`): a wrapped number on the host, made
                #           afresh by each `_saved_other` read, never a saved GPU tensor
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in skip:
                seen[s.data_ptr()] = s.nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("condition", list(ALL_CONDITIONS))
def test_saved_bytes_equal_a_direct_count_of_the_graph(condition, precision, one_thread):
    cond = get_condition(condition)
    model = mm.build_model(DEBUG, cond)
    spec = mm.StepSpec()
    measured = mm.measure_step(model, cond, spec, 3, precision)
    batch = task.train_episodes(0, 0, 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with mm.precision_context(precision):
            loss = mm.phase2_step(model, batch, cond, spec)
    direct = _graph_count(loss, list(model.parameters()))
    if cond.consolidation == "no_memory":
        # nothing crosses a boundary, so the segments' graphs are dead by the loss; the one
        # storage they saved that is still alive is the batch's segment tokens (the
        # embedding's indices), which the batch itself keeps resident
        direct += batch.seg_tokens.untyped_storage().nbytes()
    assert measured == direct > 0


def test_bf16_saves_less_than_fp32_where_the_backbone_dominates(one_thread):
    cond = get_condition("learned_full")
    model = mm.build_model(DEBUG, cond)
    bf16 = mm.measure_step(model, cond, mm.StepSpec(), 8, "bf16-mixed")
    fp32 = mm.measure_step(model, cond, mm.StepSpec(), 8, "32-true")
    assert bf16 < fp32


@pytest.mark.parametrize("condition", ["learned_full", "consolidator_only", "learned_full_dual"])
def test_saved_bytes_are_linear_in_the_batch(condition, one_thread):
    """The two-point fit predicts a third, larger batch exactly (the model has no term that
    grows faster than the batch), so batch 256 is measured at batches 2 and 4."""
    fit = mm.saved_fit(DEBUG, condition, mm.StepSpec(), "bf16-mixed")
    cond = get_condition(condition)
    model = mm.build_model(DEBUG, cond)
    for b in (7, 16):
        assert mm.measure_step(model, cond, mm.StepSpec(), b, "bf16-mixed") == fit.at(b)


def test_more_segments_and_the_dual_objective_save_more(one_thread):
    spec4 = mm.StepSpec(segments=4)
    two = mm.saved_fit(DEBUG, "consolidator_only", mm.StepSpec(), "bf16-mixed").at(16)
    four = mm.saved_fit(DEBUG, "consolidator_only", spec4, "bf16-mixed").at(16)
    trunc = mm.saved_fit(DEBUG, "consolidator_only", dataclasses.replace(
        spec4, ltm_graph="truncated"), "bf16-mixed").at(16)
    assert two < four and trunc < four
    full = mm.saved_fit(DEBUG, "learned_full", mm.StepSpec(), "bf16-mixed").at(16)
    dual = mm.saved_fit(DEBUG, "learned_full_dual", mm.StepSpec(), "bf16-mixed").at(16)
    assert dual > full


# -- the step is the training step ------------------------------------------------------------


def test_phase2_step_is_the_training_steps_objective():
    """footprint.phase2_step measures the objective `Phase2Module.training_step` trains on
    (`runner.phase2_losses`, with the TrainConfig fields StepSpec carries): the same loss,
    bit for bit, for the dual objective, the initial-mapping loss, T = 3 with truncation and
    an operator condition."""
    import pmnet.train as train

    for name, init_loss in [("learned_full_dual", 0.0), ("consolidator_only", 0.5),
                            ("operator_ema", 0.0)]:
        cfg = train.TrainConfig.from_name("debug", segments=3, ltm_graph="truncated",
                                          initial_ltm_loss=init_loss)
        cond = get_condition(name)
        model = mm.build_model(DEBUG, cond).eval()  # no dropout: losses comparable
        module = train.Phase2Module(cfg, model, cond)
        module.log = lambda *a, **k: None
        batch = task.train_episodes(1, 0, 4, segments=3)
        loss = module.training_step(batch, 0)
        spec = mm.StepSpec.from_config(cfg)
        assert torch.equal(mm.phase2_step(model, batch, cond, spec), loss)


# -- static parts against a real optimizer step ----------------------------------------------


@pytest.mark.parametrize("condition", ["learned_full", "memory_consolidator", "operator_gru"])
def test_weights_gradients_and_adamw_state_equal_a_real_step(condition, one_thread):
    mem = mm.trial_memory(DEBUG, condition, batch_size=4, precision="32-true")
    cond = get_condition(condition)
    model = mm.build_model(DEBUG, cond)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    loss = mm.phase2_step(model, task.train_episodes(0, 0, 4), cond, mm.StepSpec())
    loss.backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert mem.weights == nbytes(model.parameters())
    assert mem.gradients == nbytes(p.grad for p in model.parameters() if p.grad is not None)
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert mem.optimizer == nbytes(moments) > 0
    assert mem.peak == (mem.context + mem.weights + mem.gradients + mem.optimizer
                        + mem.activations)
    assert mem.activations >= mem.saved


# -- packing ---------------------------------------------------------------------------------


def test_gpu_share_never_gives_a_trial_less_than_its_peak():
    card = 24 * GiB
    usable = mm.usable_bytes(card)
    for peak in [1, GiB, usable // 3, usable // 3 + 1, usable // 7, usable // 2, usable]:
        share = mm.gpu_share(peak, card)
        assert share is not None
        assert share.fraction * usable >= peak
        assert share.trials_per_gpu * peak <= usable
        units = share.fraction * mm.SHARE_QUANTUM  # Ray's resolution: 1/10000 of a GPU
        assert abs(units - round(units)) < 1e-6
    assert mm.gpu_share(usable + 1, card) is None


def _fill(shares: dict[str, mm.Share], order: list[str]) -> list[list[str]]:
    """Ray's fractional packing of one GPU, greedily in grid order: a trial joins the GPU
    while the fractions sum to at most 1."""
    gpus: list[list[str]] = []
    for name in order:
        for gpu in gpus:
            if sum(shares[n].fraction for n in gpu) + shares[name].fraction <= 1.0 + 1e-9:
                gpu.append(name)
                break
        else:
            gpus.append([name])
    return gpus


@pytest.mark.parametrize("card_gib", [24, 80])
def test_the_paper_grid_packed_on_one_card_never_exceeds_it(card_gib, one_thread):
    """Every condition of the paper grid, at the paper's batch 256 in bf16: each GPU that
    Ray's fractional accounting fills (in any mix and order of the grid's trials) holds
    trials whose predicted peaks sum to at most the card's usable memory; a condition that
    does not fit alone is refused (no share), never placed."""
    card = card_gib * GiB
    usable = mm.usable_bytes(card)
    peaks = {c: mm.trial_memory(PAPER, c, batch_size=256, precision="bf16-mixed").peak
             for c in CONDITIONS}
    shares = {c: mm.gpu_share(p, card) for c, p in peaks.items()}
    fits = {c: s for c, s in shares.items() if s is not None}
    for c, s in shares.items():
        assert (s is None) == (peaks[c] > usable), c
    assert set(fits) == set(CONDITIONS)  # every condition fits both cards (fused model)
    grid = [c for _ in range(5) for c in fits]  # five seeds each, Tune's order
    for order in (grid, sorted(grid), list(reversed(grid))):
        for gpu in _fill(fits, order):
            assert sum(peaks[c] for c in gpu) <= usable, gpu
    for a, b in itertools.combinations_with_replacement(fits, 2):  # every pair that Ray admits
        if fits[a].fraction + fits[b].fraction <= 1:
            assert peaks[a] + peaks[b] <= usable


def test_finding1_the_default_quarter_gpu_overflows_the_papers_card(one_thread):
    """Finding 1, verified: the grids' old default of 0.25 GPU per trial puts four trials on
    one card; four `learned_full` trials at batch 256 in bf16 need far more than a 24 GiB
    card, so each gets the whole card. With the fused model (issue 20: its autograd
    Functions save less) one `learned_full_dual` trial fits that card alone (on 235df21 it
    needed 27.1 GiB and did not)."""
    card = 24 * GiB
    full = mm.trial_memory(PAPER, "learned_full", batch_size=256, precision="bf16-mixed")
    dual = mm.trial_memory(PAPER, "learned_full_dual", batch_size=256, precision="bf16-mixed")
    assert 4 * full.peak > card
    assert 4 * (full.saved + full.weights + full.gradients + full.optimizer) > card  # no factor
    assert mm.gpu_share(full.peak, card).fraction == 1.0
    assert dual.peak <= mm.usable_bytes(card) < 2 * full.peak


def test_a_strict_off_trial_is_measured_with_its_routers_strict():
    """Issue 39: the model a strict-off trial's memory is measured on routes as the trial
    does (u without L for the routers), its routing-off twin as the paper's."""
    from pmnet.conditions import STRICT_PAIRS

    for off, strict in STRICT_PAIRS.items():
        assert mm.build_model(DEBUG, get_condition(strict)).routing_u_uses_ltm is False
        assert mm.build_model(DEBUG, get_condition(off)).routing_u_uses_ltm is True
