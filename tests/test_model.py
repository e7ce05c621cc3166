"""Tests of pmnet.model: parameter counts, lifecycle operations, equivalences, controls."""

import math

import pytest
import torch
from torch.testing import assert_close

from pmnet.config import ModelConfig
from pmnet.model import TWO_PI, Consolidator, PMNet, wrap


def make(name="debug", seed=0, **kw):
    torch.manual_seed(seed)
    return PMNet(ModelConfig.from_name(name, **kw))


def tokens(B=3, T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g)


def random_ltm(model, B, seed=5):
    g = torch.Generator().manual_seed(seed)
    st = model.init_state(B)
    return st.with_ltm(tuple(torch.rand(x.shape, generator=g) * TWO_PI for x in st.ltm))


def angular_error(a, b):
    return (wrap(a - b + math.pi) - math.pi).abs().max().item()


# ------------------------------------------------------------------ parameter counts
def test_paper_parameter_counts_match_the_paper():
    with torch.device("meta"):
        model = PMNet(ModelConfig.from_name("paper"))
    counts = model.parameter_counts()
    total, sub = counts["total"], counts["subsets"]
    assert round(total / 1e6, 2) == 29.95
    assert sub["entire_model"] == total
    assert sub["consolidator_only"] == 12_352
    assert round(100 * sub["consolidator_only"] / total, 3) == 0.041
    assert round(sub["memory_consolidator"] / 1e6, 3) == 1.526
    assert round(100 * sub["memory_consolidator"] / total, 3) == 5.095
    assert round(100 * sub["all_but_consolidator"] / total, 3) == 99.959
    assert round(sub["all_but_consolidator"] / 1e6, 2) == 29.93  # 29.934M (paper: "29.94M")
    assert sub["all_but_consolidator"] + sub["consolidator_only"] == total


def test_trainable_subsets_are_disjoint_where_they_should_be():
    model = make()
    names = {s: {n for n, _ in model.trainable_subset(s)} for s in
             ("entire_model", "all_but_consolidator", "consolidator_only", "memory_consolidator")}
    assert names["consolidator_only"] < names["memory_consolidator"] < names["entire_model"]
    assert not names["consolidator_only"] & names["all_but_consolidator"]
    assert all(".attn." not in n and ".mlp." not in n for n in names["memory_consolidator"])
    with pytest.raises(ValueError, match="unknown trainable subset"):
        model.trainable_subset("backbone")


# ------------------------------------------------------------------ consolidator
def test_consolidator_is_exact_identity_at_init():
    cfg = ModelConfig.from_name("paper")
    torch.manual_seed(0)
    cons = Consolidator(cfg)
    S = (torch.rand(7, 85, 4, 32) - 0.5) * 40.0  # far outside [0, 2pi) on purpose
    C = cons(S)
    assert C.min() >= 0 and C.max() < TWO_PI
    assert angular_error(C, S) < 1e-5
    assert_close(torch.cos(C), torch.cos(S), atol=1e-6, rtol=0)
    assert_close(torch.sin(C), torch.sin(S), atol=1e-6, rtol=0)


def test_consolidator_parameter_count_and_learnability():
    cons = Consolidator(ModelConfig.from_name("paper"))
    assert sum(p.numel() for p in cons.parameters()) == 12_352
    S = torch.rand(4, 32) * TWO_PI
    loss = cons(S).sin().sum()
    loss.backward()
    assert cons.w_d.weight.grad.abs().sum() > 0  # gradient reaches the zero-initialised W_d


# ------------------------------------------------------------------ lifecycle
def test_consolidate_touches_only_occupied_groups_and_identity_accumulates():
    model = make()
    B = 2
    st = random_ltm(model, B)
    g = torch.Generator().manual_seed(3)
    stm = tuple(torch.rand(x.shape, generator=g) * TWO_PI for x in st.stm)
    occ = tuple(torch.rand(o.shape, generator=g) > 0.5 for o in st.occ)
    st = type(st)(kv=st.kv, stm=stm, occ=occ, ltm=st.ltm)
    out = model.consolidate(st, mode="identity")
    for S, O, L, L2 in zip(st.stm, st.occ, st.ltm, out.ltm):
        m = O[:, :, None, None].expand_as(L)
        assert torch.equal(L2[~m], L[~m])  # unoccupied groups untouched
        assert_close(L2[m], wrap(L + S)[m])
    # learned at init == identity (up to float)
    learned = model.consolidate(st, mode="learned")
    for a, b in zip(learned.ltm, out.ltm):
        assert angular_error(a, b) < 1e-5
    with pytest.raises(ValueError, match="consolidation mode"):
        model.consolidate(st, mode="copy")


def test_clear_context_keeps_ltm_and_clears_the_rest():
    model = make().eval()
    st = random_ltm(model, 3)
    _, st = model(tokens(), st, ltm_routing=True)
    assert st.kv[0] is not None and any(o.any() for o in st.occ) and st.pos == 40
    cleared = st.clear_context()
    assert all(c is None for c in cleared.kv) and cleared.pos == 0
    assert all(not o.any() for o in cleared.occ)
    assert all(torch.count_nonzero(s) == 0 for s in cleared.stm)
    assert all(torch.equal(a, b) for a, b in zip(cleared.ltm, st.ltm))
    fresh = cleared.fresh_ltm()
    assert all(torch.count_nonzero(x) == 0 for x in fresh.ltm)


def test_fresh_ltm_query_equals_never_written_model():
    model = make().eval()
    q = tokens(T=4, seed=9)
    written = model.consolidate(model(tokens(), model.init_state(3), ltm_routing=True)[1],
                                mode="learned").clear_context().fresh_ltm()
    a, _ = model(q, written, ltm_routing=True)
    b, _ = model(q, model.init_state(3), ltm_routing=True)
    assert torch.equal(a, b)


def test_clearing_stm_removes_its_influence():
    model = make().eval()
    q = tokens(T=4, seed=9)
    _, st = model(tokens(), model.init_state(3), ltm_routing=True)
    with_stm, _ = model(q, st.clear_kv(), ltm_routing=True)
    without, _ = model(q, st.clear_context(), ltm_routing=True)
    empty, _ = model(q, model.init_state(3), ltm_routing=True)
    assert not torch.allclose(with_stm, without)  # STM carried information
    assert torch.equal(without, empty)


def test_detach_cuts_the_graph():
    model = make().train()
    _, st = model(tokens(), model.init_state(3), ltm_routing=True)
    st = model.consolidate(st, mode="learned")
    assert st.ltm[0].requires_grad
    d = st.detach()
    assert not any(x.requires_grad for x in d.ltm + d.stm)
    assert not st.detach_ltm().ltm[0].requires_grad


# ------------------------------------------------------------------ equivalences
@pytest.mark.parametrize("splits", [[40], [7, 13, 20], [16, 16, 8], [1] * 5 + [35],
                                    [3, 5, 6, 26]])
def test_chunked_equals_whole_segment(splits):
    model = make().eval()
    x = tokens()
    st0 = random_ltm(model, 3)
    whole, st_w = model(x, st0, ltm_routing=True)
    outs, st_c, i = [], st0, 0
    for n in splits:
        o, st_c = model(x[:, i:i + n], st_c, ltm_routing=True)
        outs.append(o)
        i += n
    assert_close(torch.cat(outs, 1), whole, atol=1e-4, rtol=1e-4)
    for a, b in zip(st_c.stm, st_w.stm):
        assert angular_error(a, b) < 1e-4
    for a, b in zip(st_c.occ, st_w.occ):
        assert torch.equal(a, b)
    assert st_c.pos == st_w.pos == 40


def test_batched_equals_one_by_one():
    model = make().eval()
    x = tokens(B=4)
    st = random_ltm(model, 4)
    out, st_b = model(x, st, ltm_routing=True)
    for i in range(4):
        one = type(st)(kv=st.kv, stm=tuple(s[i:i + 1] for s in st.stm),
                       occ=tuple(o[i:i + 1] for o in st.occ),
                       ltm=tuple(x_[i:i + 1] for x_ in st.ltm))
        o, st_1 = model(x[i:i + 1], one, ltm_routing=True)
        assert_close(o, out[i:i + 1], atol=1e-5, rtol=1e-5)
        for a, b in zip(st_1.stm, st_b.stm):
            assert angular_error(a, b[i:i + 1]) < 1e-5


def test_same_seed_gives_bitwise_identical_outputs():
    x = tokens()
    outs = []
    for _ in range(2):
        model = make(seed=123).eval()
        st = model.init_state(3)
        o, st = model(x, st, ltm_routing=True)
        st = model.consolidate(st, mode="learned").clear_context()
        o2, _ = model(x[:, :4], st, ltm_routing=True)
        outs.append((o, o2))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    other = make(seed=124).eval()
    assert not torch.equal(other(x, other.init_state(3), ltm_routing=True)[0], outs[0][0])


def test_train_mode_forward_values_equal_eval_mode():
    """The straight-through gradient scaling changes gradients, never forward values."""
    model = make()  # debug preset has no dropout
    x = tokens()
    model.train()
    a, _ = model(x, model.init_state(3), ltm_routing=True)
    model.eval()
    b, _ = model(x, model.init_state(3), ltm_routing=True)
    assert torch.equal(a, b)


# ------------------------------------------------------------------ precision
def test_state_sums_run_in_fp32_under_bf16_autocast():
    """Under bf16 autocast the Linear projections run in bf16 (so deltas and routes may differ
    from an fp32 forward), but the segmented accumulation of the deltas that were produced must
    be fp32: we compare the bf16 forward's STM (chunk totals) and its block-1 routing state
    (which holds block 0's causal running sum) to an fp64 re-accumulation of the same deltas.

    Tolerance: summing n = 40 terms in fp32 errs by at most n * eps32 * sum|delta|, computed
    below from the data (~1e-4 rad here; measured ~2e-6). A bf16 bmm rounds its inputs and its
    output to 8 mantissa bits: errors ~ 2**-9 * |sum|, 1e-2 to 6e-2 rad at these magnitudes
    (measured on the old code), far above the bound.
    """
    model = make().eval()
    with torch.no_grad():  # trained-size deltas (|delta| up to ~1 rad), not init's ~0.02
        for layer in model.layers:
            if layer.write is not None:
                layer.write.w_v.weight.normal_(0, 0.5)
                layer.write.w_o.weight.normal_(0, 1.0)
    B, T, (K, P) = 4, 40, (model.cfg.branch, model.cfg.phase_dim)
    g = torch.Generator().manual_seed(7)
    st = random_ltm(model, B)
    st = type(st)(kv=st.kv, stm=tuple(torch.rand(s.shape, generator=g) * TWO_PI for s in st.stm),
                  occ=st.occ, ltm=st.ltm)
    deltas, write_inputs = [], []
    hooks = [h for layer in model.layers if layer.write is not None for h in (
        layer.write.register_forward_hook(lambda m, i, o: deltas.append(o[0].double())),
        layer.write.register_forward_pre_hook(lambda m, i: write_inputs.append(i[1].double())),
    )]
    x = tokens(B=B, T=T)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, out = model(x, st, ltm_routing=True)
    for h in hooks:
        h.remove()
    eps = torch.finfo(torch.float32).eps
    for b, delta in enumerate(deltas):
        G, flat = model.cfg.n_groups(b), delta.reshape(B, T, K * P)
        idx = out.routes[b][:, :, None].expand(B, T, K * P)
        total = torch.zeros(B, G, K * P, dtype=torch.float64).scatter_add_(1, idx, flat)
        bound = T * eps * (torch.zeros_like(total).scatter_add_(1, idx, flat.abs()).max() + TWO_PI)
        want = wrap(st.stm[b].double() + total.view(B, G, K, P))
        assert out.stm[b].dtype == torch.float32
        assert angular_error(out.stm[b].double(), want) <= bound, b
    # block 0 has one group: its running sum is a cumsum; block 1 routes with
    # a = wrap(S_0 + L_0) + e_1 + L_1 (u carried from block 0, LTM routing on)
    S0 = st.stm[0][:, :1].double() + deltas[0].cumsum(1)  # (B, T, K, P)
    g1 = out.routes[1]
    e1 = model.slot_emb[1].detach().double()[g1]
    L1 = torch.stack([st.ltm[1][i, g1[i]] for i in range(B)]).double()
    want_a = wrap(S0 + st.ltm[0][:, :1].double()) + e1 + L1
    bound = T * eps * (deltas[0].abs().sum(1).max() + 4 * TWO_PI)
    assert angular_error(write_inputs[1], want_a) <= bound
    # smoke check against the fp32 forward: the bf16 projections move a few near-tie routes
    _, ref = model(x, st, ltm_routing=True)
    for r16, r32 in zip(out.routes, ref.routes):
        assert (r16 == r32).float().mean() >= 0.9


# ------------------------------------------------------------------ LTM-conditioned routing
def test_routing_off_ltm_never_changes_block0_routes_but_on_can():
    model = make().eval()
    x = tokens(B=8)
    zero = model.init_state(8)
    rand = random_ltm(model, 8)
    _, off_zero = model(x, zero, ltm_routing=False)
    _, off_rand = model(x, rand, ltm_routing=False)
    assert torch.equal(off_zero.routes[1], off_rand.routes[1])  # block-0 choices
    _, on_zero = model(x, zero, ltm_routing=True)
    _, on_rand = model(x, rand, ltm_routing=True)
    assert torch.equal(on_zero.routes[1], off_zero.routes[1])  # L = 0: on == off
    assert not torch.equal(on_rand.routes[1], on_zero.routes[1])
    # routing off still reads LTM: outputs depend on it
    lo_zero, _ = model(x, zero, ltm_routing=False)
    lo_rand, _ = model(x, rand, ltm_routing=False)
    assert not torch.allclose(lo_zero, lo_rand)


def test_gradient_reaches_consolidator_through_both_boundaries():
    for routing in (True, False):
        model = make().train()
        with torch.no_grad():  # move the Consolidator off the identity so gradients are generic
            model.consolidator.w_d.weight.normal_(0, 0.1)
        st = model.init_state(3)
        _, st = model(tokens(seed=1), st, ltm_routing=routing, logits="none")
        st = model.consolidate(st, mode="learned").clear_context()
        _, st = model(tokens(seed=2), st, ltm_routing=routing, logits="none")
        st = model.consolidate(st, mode="learned").clear_context()
        out, _ = model(tokens(T=4, seed=3), st, ltm_routing=routing, logits="last")
        out.logsumexp(-1).sum().backward()
        g = model.consolidator.w_d.weight.grad
        assert g is not None and g.abs().sum() > 0


def test_model_without_memory_runs():
    model = make(use_memory=False).eval()
    out, st = model(tokens(), model.init_state(3), ltm_routing=False)
    assert out.shape == (3, 40, 256) and st.stm == ()


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(3, 4, 2, dtype=torch.long), "shape"),
        (torch.full((3, 4), 256), "token ids"),
        (torch.full((3, 4), -1), "token ids"),
        (torch.zeros(3, 129, dtype=torch.long), "max_chunk"),
        (torch.zeros(2, 4, dtype=torch.long), "batch size"),
        (torch.zeros(3, 4), "integer"),
        (torch.zeros(3, 0, dtype=torch.long), "non-empty"),
    ],
)
def test_bad_inputs_raise_clear_errors(bad, match):
    model = make()
    with pytest.raises(ValueError, match=match):
        model(bad, model.init_state(3), ltm_routing=True)


def test_paper_preset_uses_the_reference_rope_base():
    """RoPE base 1e6 as in the public PMNet reference configuration; cpu and debug keep 1e4."""
    assert ModelConfig.from_name("paper").rope_theta == 1_000_000.0
    assert ModelConfig.from_name("cpu").rope_theta == ModelConfig.from_name("debug").rope_theta
    assert ModelConfig.from_name("debug").rope_theta == 10_000.0
    # the model reads the field: the same weights with another base give other outputs
    x = tokens()
    a, _ = make().eval()(x, make().init_state(3), ltm_routing=True)
    b, _ = make(rope_theta=1_000_000.0).eval()(x, make().init_state(3), ltm_routing=True)
    assert not torch.allclose(a, b)


def test_bad_config_and_preset():
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("huge")
    with pytest.raises(ValueError, match="ModelConfig.hidden"):
        ModelConfig.from_name("debug", hidden=0)
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelConfig.from_name("debug", n_kv_head=3)
    model = make()
    with pytest.raises(ValueError, match="ltm_routing"):
        model(tokens(), model.init_state(3), ltm_routing="on")


# ------------------------------------------------------------------ consolidation operators
from pmnet.model import OPERATOR_SUBSET, angle_diff  # noqa: E402
from pmnet.operators import (  # noqa: E402
    CONSOLIDATION_MODES,
    OPERATORS,
    add_operator,
    operator_parameter_counts,
)


def occupied_state(model, B=3, seed=3, occupancy=0.6):
    """A state with random STM / LTM in [0, 2pi) and a random occupancy mask."""
    g = torch.Generator().manual_seed(seed)
    st = model.init_state(B)
    return type(st)(kv=st.kv,
                    stm=tuple(torch.rand(x.shape, generator=g) * TWO_PI for x in st.stm),
                    occ=tuple(torch.rand(o.shape, generator=g) < occupancy for o in st.occ),
                    ltm=tuple(torch.rand(x.shape, generator=g) * TWO_PI for x in st.ltm))


def perturb(op, seed=0, scale=0.3):
    """Move every parameter of an operator off its identity start (generic gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in op.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return op


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_identity_start_equals_identity_consolidation_bit_for_bit(name):
    model = make()
    st = occupied_state(model)
    identity = model.consolidate(st, mode="identity")
    add_operator(model, name)
    out = model.consolidate(st, mode=name)
    assert all(torch.equal(a, b) for a, b in zip(out.ltm, identity.ltm))
    # also for S, L far outside [0, 2pi) and after a seeded reset with a large std
    op = model.operators[name]
    op.reset(1.0, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(11)
    S = (torch.rand(4, 16, 4, 8, generator=g) - 0.5) * 40.0
    L = (torch.rand(4, 16, 4, 8, generator=g) - 0.5) * 40.0
    assert torch.equal(op(S, L), wrap(L + S))


def test_operator_parameter_counts_at_the_paper_and_cpu_presets():
    assert CONSOLIDATION_MODES == ("learned", "identity", "ema", "overwrite", "linear", "gru")
    expected = {"paper": {"ema": 32, "overwrite": 16_512, "linear": 4_160, "gru": 24_768},
                "cpu": {"ema": 8, "overwrite": 1_824, "linear": 272, "gru": 1_584}}  # P = 8
    for preset, counts in expected.items():
        cfg = ModelConfig.from_name(preset)
        P, C = cfg.phase_dim, cfg.consolidator_hidden
        assert counts == {"ema": P,  # alpha
                          "overwrite": (6 * P * C + 2 * P) + (4 * P * P + P) + P,  # C, gate, gamma
                          "linear": 4 * P * P + 2 * P,
                          "gru": 24 * P * P + 6 * P}
        assert operator_parameter_counts(cfg) == counts
    # a model with an operator counts it in its total and in the operator-only subset
    model = make()
    base = model.parameter_counts()
    assert OPERATOR_SUBSET not in base["subsets"]
    add_operator(model, "gru")
    counts = model.parameter_counts()
    assert counts["subsets"][OPERATOR_SUBSET] == operator_parameter_counts(model.cfg)["gru"] \
        == 1_584
    assert counts["total"] == base["total"] + 1_584
    for s in ("consolidator_only", "memory_consolidator"):  # the paper's subsets unchanged
        assert counts["subsets"][s] == base["subsets"][s]


@pytest.mark.parametrize("name", list(OPERATORS))
def test_gradients_reach_exactly_the_operators_parameters(name):
    model = make().train()
    op = perturb(add_operator(model, name))
    subset = {n for n, _ in model.trainable_subset(OPERATOR_SUBSET)}
    assert subset == {f"operators.{name}.{n}" for n, _ in op.named_parameters()}
    for n, p in model.named_parameters():  # the operator-only setting
        p.requires_grad_(n in subset)
    st = model.init_state(3)
    for seed in (1, 2):  # two segments, two boundaries, then a query from LTM
        _, st = model(tokens(seed=seed), st, ltm_routing=True, logits="none")
        st = model.consolidate(st, mode=name).clear_context()
    out, _ = model(tokens(T=4, seed=3), st, ltm_routing=True, logits="last")
    out.logsumexp(-1).sum().backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got == subset
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in subset)
    # the operator replaces C_psi: with every parameter trainable, the Consolidator gets none
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(True)
    st = model.consolidate(occupied_state(model), mode=name)
    sum(x.sin().sum() for x in st.ltm).backward()
    assert all(p.grad is None for p in model.consolidator.parameters())
    assert all(p.grad is not None for p in op.parameters())


@pytest.mark.parametrize("name", list(OPERATORS))
def test_identity_start_is_not_a_stationary_point(name):
    """At its exact identity start some parameter of each operator gets a nonzero gradient,
    so training can leave the identity (as W_d and b_d do for the Consolidator)."""
    op = add_operator(make(), name)
    g = torch.Generator().manual_seed(4)
    S, L = torch.rand(64, 8, generator=g) * TWO_PI, torch.rand(64, 8, generator=g) * TWO_PI
    target = torch.rand(64, 8, generator=g) * TWO_PI
    (1 - torch.cos(op(S, L) - target)).sum().backward()
    assert any(p.grad.abs().sum() > 0 for p in op.parameters())


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_outputs_are_wrapped(name):
    op = perturb(add_operator(make(), name), scale=1.0)
    g = torch.Generator().manual_seed(5)
    S = (torch.rand(8, 21, 4, 8, generator=g) - 0.5) * 60.0
    L = (torch.rand(8, 21, 4, 8, generator=g) - 0.5) * 60.0
    out = op(S, L)
    assert torch.isfinite(out).all() and out.min() >= 0 and out.max() < TWO_PI


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_is_slot_local_and_batch_independent(name):
    model = make()
    op = perturb(add_operator(model, name))
    g = torch.Generator().manual_seed(6)
    S, L = (torch.rand(3, 4, 4, 8, generator=g) * TWO_PI for _ in range(2))
    base = op(S, L)
    S2 = S.clone()
    S2[1, 2, 3] = torch.rand(8, generator=g) * TWO_PI  # one slot (row 1, group 2, slot 3)
    changed = (op(S2, L) != base).any(-1)  # (B, G, K)
    assert changed[1, 2, 3] and changed.sum() == 1
    for b in range(3):  # each batch row alone gives the same L+
        assert_close(op(S[b:b + 1], L[b:b + 1]), base[b:b + 1], atol=1e-6, rtol=0)
    # through Eq. 8: unoccupied groups keep L exactly
    st = occupied_state(model)
    out = model.consolidate(st, mode=name)
    for O, L0, L1 in zip(st.occ, st.ltm, out.ltm):
        m = O[:, :, None, None].expand_as(L0)
        assert torch.equal(L1[~m], L0[~m])


def _reference(name, op, S, L):
    """Each operator's documented equation, written literally (no exactness tricks)."""
    zS, zL = torch.cat([S.cos(), S.sin()], -1), torch.cat([L.cos(), L.sin()], -1)
    P = S.shape[-1]
    if name == "ema":
        return wrap(L + op.alpha * angle_diff(S))
    if name == "overwrite":
        U = L + S
        g = op.gamma * torch.sigmoid(op.gate(torch.cat([zS, zL], -1)))
        return wrap(U + g * angle_diff(op.candidate(S) - U))
    if name == "linear":
        w = zS @ (torch.eye(2 * P) + op.map.weight).T + op.map.bias
        return wrap(L + torch.atan2(w[..., P:], w[..., :P]))
    W, Uh, b = op.w_x.weight, op.w_h.weight, op.w_x.bias
    (Wr, Wu, Wn), (Ur, Uu, Un), (br, bu, bn) = W.chunk(3), Uh.chunk(3), b.chunk(3)
    r = torch.sigmoid(zS @ Wr.T + zL @ Ur.T + br)
    u = torch.sigmoid(zS @ Wu.T + zL @ Uu.T + bu)
    n = torch.tanh(zS @ Wn.T + r * (zL @ Un.T) + bn)
    a = torch.cat([(L + S).cos(), (L + S).sin()], -1)
    h = (1 - u) * a + u * (a + n)
    return wrap(torch.atan2(h[..., P:], h[..., :P]))


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_computes_its_documented_equation(name):
    op = perturb(add_operator(make(), name), scale=0.5)
    g = torch.Generator().manual_seed(8)
    S, L = torch.rand(50, 8, generator=g) * TWO_PI, torch.rand(50, 8, generator=g) * TWO_PI
    with torch.no_grad():
        assert angular_error(op(S, L), _reference(name, op, S, L)) < 1e-5


def test_operator_limits_ema_keeps_and_overwrite_replaces():
    model = make()
    g = torch.Generator().manual_seed(9)
    S, L = torch.rand(50, 8, generator=g) * TWO_PI, torch.rand(50, 8, generator=g) * TWO_PI
    ema = add_operator(model, "ema")
    with torch.no_grad():
        ema.alpha.zero_()  # alpha = 0: the boundary keeps L
    assert angular_error(ema(S, L), L) < 1e-5
    ow = add_operator(model, "overwrite")
    with torch.no_grad():  # gate fully open: L is replaced by the candidate C(S) = S
        ow.gamma.fill_(1.0)
        ow.gate.bias.fill_(50.0)
    assert angular_error(ow(S, L), S) < 1e-4


def test_operators_are_created_at_phase_2_and_named_errors():
    model = make()
    keys = set(model.state_dict())
    assert not any(k.startswith("operators.") for k in keys)  # a Phase-1 model: the paper's
    st = occupied_state(model)
    with pytest.raises(ValueError, match="add_operator"):
        model.consolidate(st, mode="ema")
    with pytest.raises(ValueError, match="consolidation mode"):
        model.consolidate(st, mode="copy")
    with pytest.raises(ValueError, match="unknown consolidation operator"):
        add_operator(model, "lstm")
    rng = torch.get_rng_state()
    op = add_operator(model, "gru")
    assert torch.equal(torch.get_rng_state(), rng)  # no other randomness of a run changes
    assert add_operator(model, "gru") is op
    new = set(model.state_dict()) - keys
    assert new and all(k.startswith("operators.gru.") for k in new)
    with pytest.raises(ValueError, match="use_memory"):
        add_operator(make(use_memory=False), "ema")


def test_operator_reset_is_seeded():
    op = add_operator(make(), "overwrite")

    def draw(seed):
        op.reset(0.5, torch.Generator().manual_seed(seed))
        return [p.clone() for p in op.parameters()]

    a, b, c = draw(1), draw(1), draw(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert op.candidate.w_g.weight.std().item() == pytest.approx(0.5, rel=0.2)


# ------------------------------------------------------------------ strict routing off
def test_a_strict_off_model_is_the_strict_probe_and_keeps_the_roots_routes():
    """Issue 39: a model whose routers read u without L (`routing_u_uses_ltm=False`, the
    trained strict-off arm) computes exactly what the diagnostic strict probe computes; with
    L != 0 its deeper routes differ from the paper's routing off, the root's (no u above it)
    do not; the attribute is not a parameter (the state dict is the paper's)."""
    from pmnet.diagnose import Probe, probing

    model = make().eval()
    keys = set(model.state_dict())
    st, x = random_ltm(model, 3), tokens(3)
    with torch.no_grad():
        _, off = model(x, st, ltm_routing=False)
        with probing(model, Probe(routing_u_uses_ltm=False)):
            probe_logits, probe = model(x, st, ltm_routing=False)
        model.routing_u_uses_ltm = False
        own_logits, own = model(x, st, ltm_routing=False)
    assert torch.equal(own_logits, probe_logits)
    assert all(torch.equal(a, b) for a, b in zip(own.routes, probe.routes))
    assert all(torch.equal(a, b) for a, b in zip(own.stm, probe.stm))
    assert torch.equal(own.routes[1], off.routes[1])  # the root's choice
    assert not torch.equal(own.routes[2], off.routes[2])  # block 1 routed without L in u
    assert set(model.state_dict()) == keys
