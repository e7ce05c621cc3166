"""The task-matched baselines (`pmnet.baselines`, issue 23): what crosses a boundary and what
is cleared, their parameter counts, and that fresh and mismatched memory cannot carry the
episode's own rule (so they fall to chance)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pmnet import baselines, task
from pmnet.conditions import BASELINE_CONDITIONS, BASELINE_REFERENCES, CONDITIONS
from pmnet.config import ModelConfig
from pmnet.model import BASELINE_SUBSET, PMNet
from pmnet.runner import RunOptions, persistent_state, phase2_losses, run_episodes

MODES = baselines.BASELINE_MODES


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = PMNet(ModelConfig.from_name("debug")).eval()
    for mode in MODES:
        baselines.add_baseline(m, mode)
    with torch.no_grad():  # a non-trivial write map, so carried memories differ by input
        for p in m.baselines.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


@pytest.fixture(scope="module")
def batch():
    return task.make_episodes(6, seed=5, stream="train")


def _states(model, batch, mode):
    seen = []
    persistent_state(model, batch, RunOptions(mode, True),
                     on_segment=lambda d, before, after: seen.append((before, after)))
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_what_crosses_a_boundary_and_what_is_cleared(model, batch, mode):
    seen = _states(model, batch, mode)
    assert len(seen) == batch.seg_tokens.shape[1]
    seg_len = batch.seg_tokens.shape[2]
    for d, (before, after) in enumerate(seen):
        assert all(not torch.any(x) for x in after.ltm)  # LTM is never written
        if mode == "no_reset":  # nothing is cleared: KV and STM run on
            assert after is before
            assert all(kv is not None for kv in after.kv) and after.pos == (d + 1) * seg_len
            assert any(torch.any(s) for s in after.stm)
            # the cache keeps the window - 1 most recent tokens (a new token sees window)
            assert after.kv[0][0].shape[2] == min((d + 1) * seg_len, model.cfg.window - 1)
            continue
        assert all(kv is None for kv in after.kv) and after.pos == 0  # KV cleared
        assert all(not torch.any(s) for s in after.stm)  # STM cleared
        assert all(not torch.any(o) for o in after.occ)
        if mode == "no_memory":
            assert after.carry is None  # nothing crosses
        else:
            assert after.carry is before.carry is not None  # the carried state crosses
            B, H = batch.seg_tokens.shape[0], model.cfg.hidden
            shape = ((B, baselines.memory_tokens_count(model.cfg), H)
                     if mode == "memory_tokens" else (B, baselines.recurrent_width(model.cfg)))
            assert tuple(after.carry.shape) == shape


def _updated(model, batch, mode, experience="correct"):
    with torch.no_grad():
        return run_episodes(model, batch, RunOptions(mode, True, experience=experience))[
            "updated_ltm"]


def _with_segments(batch, seg_tokens):
    return dataclasses.replace(batch, seg_tokens=seg_tokens)


@pytest.mark.parametrize("mode", MODES)
def test_information_crosses_only_where_the_baseline_carries_it(model, batch, mode):
    """Changing segment 1 changes the final answer's logits exactly where something crosses
    the first boundary (no reset: KV and STM; the carried memories), and never without
    memory: the mechanism under test is at work, or not, as designed."""
    other = batch.seg_tokens.clone()
    other[:, 0] = batch.donor_seg_tokens[:, 0]
    a = _updated(model, batch, mode)
    b = _updated(model, _with_segments(batch, other), mode)
    if mode == "no_memory":
        assert torch.equal(a, b)
    else:
        assert not torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_fresh_and_mismatched_memory_cannot_hold_the_episodes_rule(model, batch, mode):
    """Fresh: no segment is processed, so the answer does not depend on the episode's
    demonstrations at all; mismatched: it depends on the donor's only. Either way the
    episode's own rule cannot reach the answer, so recall is at chance in expectation."""
    scrambled = _with_segments(batch, batch.seg_tokens.flip(0))
    assert torch.equal(_updated(model, batch, mode, "fresh"),
                       _updated(model, scrambled, mode, "fresh"))
    assert torch.equal(_updated(model, batch, mode, "mismatched"),
                       _updated(model, scrambled, mode, "mismatched"))


def test_parameter_counts_match_the_formulas():
    for name in ("debug", "cpu", "paper"):
        cfg = ModelConfig.from_name(name)
        H, M, G = cfg.hidden, baselines.memory_tokens_count(cfg), baselines.recurrent_width(cfg)
        counts = baselines.baseline_parameter_counts(cfg)
        assert counts == {"no_reset": 0, "memory_tokens": M * H + H * H + H,
                          "recurrent_state": 3 * (H * G + G * G + 2 * G) + G * H + H,
                          "no_memory": 0}
    cfg = ModelConfig.from_name("debug")
    for mode in baselines.CARRIED_MODES:
        m = PMNet(cfg)
        phase1_keys = set(m.state_dict())
        assert baselines.add_baseline(m, mode) is m.baselines[mode]
        assert m.parameter_counts()["subsets"][BASELINE_SUBSET] == counts_of(cfg)[mode]
        assert {n for n, _ in m.trainable_subset(BASELINE_SUBSET)} == \
            set(m.state_dict()) - phase1_keys
    assert len(PMNet(cfg).baselines) == 0  # a Phase-1 model's state dict is the paper's
    assert baselines.add_baseline(PMNet(cfg), "no_reset") is None


def counts_of(cfg):
    return baselines.baseline_parameter_counts(cfg)


def test_adding_a_baseline_leaves_the_global_rng_alone():
    m = PMNet(ModelConfig.from_name("debug"))
    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    baselines.add_baseline(m, "memory_tokens")
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("mode", baselines.CARRIED_MODES)
def test_the_loss_reaches_the_first_segments_write_through_the_carried_state(model, batch,
                                                                             mode):
    cond = next(c for c in BASELINE_CONDITIONS.values() if c.consolidation == mode)
    m = model.train()
    for p in m.parameters():
        p.requires_grad_(False)
    module = m.baselines[mode]
    for p in module.parameters():
        p.requires_grad_(True)
    try:
        seg = batch.seg_tokens.shape[1]
        first = task.make_episodes(6, seed=5, stream="train", segments=seg)
        loss = phase2_losses(m, first, cond)["loss"]
        grads = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
        assert all(g is not None and torch.any(g) for g in grads)
        detached = phase2_losses(m, first, cond, ltm_graph="detached")["loss"]
        # detached: the carried state is cut at every boundary, so the update (write / GRU
        # input) map gets no gradient; only the read of the final state can (the recurrent
        # state's read map; the memory tokens are read as they are, so nothing does)
        if mode == "memory_tokens":
            assert not detached.requires_grad
        else:
            g = torch.autograd.grad(detached, [module.cell.weight_ih, module.read.weight],
                                    allow_unused=True)
            assert (g[0] is None or not torch.any(g[0])) and torch.any(g[1])
    finally:
        for p in m.parameters():
            p.requires_grad_(True)
        m.eval()


def test_baseline_conditions_and_references():
    assert [c.consolidation for c in BASELINE_CONDITIONS.values()] == list(MODES)
    assert set(BASELINE_CONDITIONS).isdisjoint(CONDITIONS)
    for c in BASELINE_CONDITIONS.values():
        want = BASELINE_SUBSET if c.consolidation in baselines.CARRIED_MODES else "entire_model"
        assert c.subset == want and c.objective == "updated" and c.select == "updated_ltm"
    assert BASELINE_REFERENCES == ("consolidator_only", "operator_gru")


def test_bad_baseline_input_is_named():
    m = PMNet(ModelConfig.from_name("debug"))
    with pytest.raises(ValueError, match="unknown baseline 'rmt'"):
        baselines.add_baseline(m, "rmt")
    b = task.make_episodes(2, seed=1, stream="train")
    with pytest.raises(ValueError, match="add_baseline"):
        run_episodes(m, b, RunOptions("memory_tokens", True))
    with pytest.raises(ValueError, match="consolidation must be one of"):
        RunOptions("rmt", True)
    with pytest.raises(ValueError, match="give tokens or embeds, not both"):
        m(b.query_tokens[:, 0], m.init_state(2), ltm_routing=True,
          embeds=torch.zeros(2, 3, m.cfg.hidden))
    with pytest.raises(ValueError, match="embeds must have shape"):
        m(None, m.init_state(2), ltm_routing=True, embeds=torch.zeros(2, 3, 5))


@pytest.mark.parametrize("mode", baselines.CARRIED_MODES)
def test_memory_enters_the_residual_stream_in_its_dtype_under_autocast(model, batch, mode):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = baselines.segment(model, mode, batch.seg_tokens[:, 0],
                                  model.init_state(batch.seg_tokens.shape[0]), ltm_routing=True)
        seen = []
        hook = model.layers[0].attn_norm.register_forward_hook(
            lambda mod, args, out: seen.append(args[0].dtype))
        try:
            baselines.query(model, mode, batch.query_tokens[:, 0], state, ltm_routing=True)
        finally:
            hook.remove()
    assert seen == [model.embed.weight.dtype]
