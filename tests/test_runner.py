"""The episode runner: each query kind sees exactly the state it should."""

import pytest
import torch
from torch.testing import assert_close

from pmnet import task
from pmnet.config import ModelConfig
from pmnet.model import PMNet
from pmnet.runner import RunOptions, run_episodes, stm_query
from tests.support.grad_probe import probe


@pytest.fixture(scope="module")
def batch():
    return task.make_episodes(6, seed=11)


def make(seed=0, perturb=False):
    torch.manual_seed(seed)
    m = PMNet(ModelConfig.from_name("debug")).eval()
    if perturb:  # move the Consolidator away from the identity
        with torch.no_grad():
            m.consolidator.w_d.weight.normal_(0, 0.5)
    return m


ALL = ("updated_ltm", "initial_ltm", "seg1_stm", "seg2_stm")


def test_auxiliary_stm_trajectories_do_not_leak(batch):
    m = make(perturb=True)
    only = run_episodes(m, batch, RunOptions("learned", True, queries=("updated_ltm",)))
    every = run_episodes(m, batch, RunOptions("learned", True, queries=ALL))
    assert torch.equal(only["updated_ltm"], every["updated_ltm"])
    assert list(every) == list(ALL)


def test_stm_recall_cannot_be_reached_by_the_consolidator_or_routing(batch):
    a = run_episodes(make(perturb=False), batch, RunOptions("learned", True, queries=ALL))
    b = run_episodes(make(perturb=True), batch, RunOptions("identity", False, queries=ALL))
    for k in ("seg1_stm", "seg2_stm"):
        assert torch.equal(a[k], b[k])
    assert not torch.allclose(a["updated_ltm"], b["updated_ltm"])


def test_segment1_branch_equals_separate_auxiliary_trajectory(batch):
    m = make(perturb=True)
    out = run_episodes(m, batch, RunOptions("learned", True, queries=ALL))
    sep = stm_query(m, batch.seg_tokens[:, 0], batch.query_tokens[:, 0])
    assert_close(out["seg1_stm"], sep)


def test_fresh_ltm_equals_a_never_written_model(batch):
    m = make(perturb=True)
    out = run_episodes(m, batch, RunOptions("learned", True, experience="fresh"))
    ref, _ = m(batch.query_tokens[:, 1], m.init_state(len(batch)), ltm_routing=True,
               logits="last")
    assert torch.equal(out["updated_ltm"], ref)


def test_mismatched_runs_the_donor_segments(batch):
    m = make(perturb=True)
    out = run_episodes(m, batch, RunOptions("learned", True, experience="mismatched"))
    st = m.init_state(len(batch))
    for d in range(2):
        _, st = m(batch.donor_seg_tokens[:, d], st, ltm_routing=True, logits="none")
        st = m.consolidate(st, mode="learned").clear_context()
    ref, _ = m(batch.query_tokens[:, 1], st, ltm_routing=True, logits="last")
    assert torch.equal(out["updated_ltm"], ref)
    correct = run_episodes(m, batch, RunOptions("learned", True))
    assert not torch.allclose(out["updated_ltm"], correct["updated_ltm"])


def test_forced_identity_differs_from_learned_only_through_consolidation(batch):
    init, pert = make(perturb=False), make(perturb=True)
    ident_a = run_episodes(init, batch, RunOptions("identity", True, queries=ALL))
    ident_b = run_episodes(pert, batch, RunOptions("identity", True, queries=ALL))
    for k in ALL:  # identity mode never touches the Consolidator
        assert torch.equal(ident_a[k], ident_b[k])
    learned_init = run_episodes(init, batch, RunOptions("learned", True, queries=ALL))
    for k in ALL:  # the Consolidator starts as the exact identity
        assert_close(learned_init[k], ident_a[k], atol=1e-4, rtol=1e-4)
    learned = run_episodes(pert, batch, RunOptions("learned", True, queries=ALL))
    assert not torch.allclose(learned["updated_ltm"], ident_b["updated_ltm"])
    assert not torch.allclose(learned["initial_ltm"], ident_b["initial_ltm"])


def test_detach_ltm_changes_gradients_not_values(batch):
    m = make(perturb=True).train()
    a = run_episodes(m, batch, RunOptions("learned", True, detach_ltm=False))
    b = run_episodes(m, batch, RunOptions("learned", True, detach_ltm=True))
    assert_close(a["updated_ltm"], b["updated_ltm"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(consolidation="copy", ltm_routing=True), "consolidation"),
        (dict(consolidation="learned", ltm_routing=1), "ltm_routing"),
        (dict(consolidation="learned", ltm_routing=True, experience="donor"), "experience"),
        (dict(consolidation="learned", ltm_routing=True, queries=("final",)), "unknown query"),
        (dict(consolidation="learned", ltm_routing=True, queries=()), "non-empty"),
        (dict(consolidation="learned", ltm_routing=True, queries="updated_ltm"), "non-empty"),
        (dict(consolidation="learned", ltm_routing=True, experience="fresh",
              queries=("seg1_stm",)), "experience='correct'"),
    ],
)
def test_bad_options_are_refused_before_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunOptions(**kwargs)


# ---------------------------------------------------------------------------------------------
# T-segment episodes (issue 11)
# ---------------------------------------------------------------------------------------------
def _original_run_episodes(model, batch, opts):
    """The two-segment runner as it was before T-segment episodes (commit 553279c),
    verbatim up to names: the reference the T = 2 path must match bit for bit."""
    out = {}
    if not {"updated_ltm", "initial_ltm"} & set(opts.queries):
        for d, kind in enumerate(("seg1_stm", "seg2_stm")):
            if kind in opts.queries:
                out[kind] = stm_query(model, batch.seg_tokens[:, d], batch.query_tokens[:, d])
        return out
    routing = opts.ltm_routing
    q1 = batch.query_tokens[:, 0]
    state = model.init_state(batch.seg_tokens.shape[0], device=batch.seg_tokens.device)
    if opts.experience != "fresh":
        segments = batch.seg_tokens if opts.experience == "correct" else batch.donor_seg_tokens
        for d in range(2):
            _, before = model(segments[:, d], state, ltm_routing=routing, logits="none")
            state = model.consolidate(before, mode=opts.consolidation).clear_context()
            if opts.detach_ltm:
                state = state.detach_ltm()
            if d == 0:
                if "seg1_stm" in opts.queries:
                    out["seg1_stm"], _ = model(q1, before.clear_kv(), ltm_routing=routing,
                                               logits="last")
                if "initial_ltm" in opts.queries:
                    out["initial_ltm"], _ = model(q1, state, ltm_routing=routing,
                                                  logits="last")
    if opts.experience == "fresh" and "initial_ltm" in opts.queries:
        out["initial_ltm"], _ = model(q1, state, ltm_routing=routing, logits="last")
    if "updated_ltm" in opts.queries:
        out["updated_ltm"], _ = model(batch.query_tokens[:, 1], state, ltm_routing=routing,
                                      logits="last")
    if "seg2_stm" in opts.queries:
        out["seg2_stm"] = stm_query(model, batch.seg_tokens[:, 1], batch.query_tokens[:, 1])
    return {k: out[k] for k in ALL if k in out}


@pytest.mark.parametrize("consolidation, routing, experience, detach, queries", [
    ("learned", True, "correct", False, ALL),
    ("identity", True, "correct", False, ALL),
    ("learned", False, "correct", True, ALL),
    ("learned", True, "mismatched", False, ("updated_ltm", "initial_ltm")),
    ("identity", False, "fresh", False, ("updated_ltm", "initial_ltm")),
    ("learned", True, "correct", False, ("seg1_stm", "seg2_stm")),
    ("learned", True, "correct", False, ("seg2_stm",)),
])
def test_two_segment_path_is_bit_for_bit_the_original_runner(batch, consolidation, routing,
                                                              experience, detach, queries):
    m = make(perturb=True)
    opts = RunOptions(consolidation, routing, experience=experience, detach_ltm=detach,
                      queries=queries)
    new, ref = run_episodes(m, batch, opts), _original_run_episodes(m, batch, opts)
    assert list(new) == list(ref)
    for k in ref:
        assert torch.equal(new[k], ref[k]), k
    # and the gradients of the Phase-2 loss, parameter by parameter
    if "updated_ltm" in queries and experience == "correct":
        m.train()
        grads = []
        for run in (run_episodes, _original_run_episodes):
            m.zero_grad()
            run(m, batch, opts)["updated_ltm"].logsumexp(-1).sum().backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()
                          if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and grads[0]
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def _manual_trajectory(m, b, routing=True, mode="learned"):
    """T segments by hand: process, consolidate, clear; returns the final state and the
    state after the first boundary."""
    st, first = m.init_state(len(b)), None
    for d in range(b.n_segments):
        _, st = m(b.seg_tokens[:, d], st, ltm_routing=routing, logits="none")
        st = m.consolidate(st, mode=mode).clear_context()
        first = st if d == 0 else first
    return st, first


@pytest.mark.parametrize("T", [3, 5, 8])
def test_t_segment_trajectory_consolidates_and_resets_after_every_segment(T):
    b = task.make_episodes(5, seed=T, segments=T)
    m = make(perturb=True)
    kinds = (("updated_ltm", "initial_ltm") + tuple(f"seg{t}_stm" for t in range(1, T + 1))
             + tuple(f"final_ltm_seg{t}" for t in range(1, T + 1)))
    out = run_episodes(m, b, RunOptions("learned", True, queries=kinds))
    assert set(out) == set(kinds)
    final, first = _manual_trajectory(m, b)
    ref, _ = m(b.query_tokens[:, -1], final, ltm_routing=True, logits="last")
    assert torch.equal(out["updated_ltm"], ref)  # the last segment's query, after T boundaries
    assert torch.equal(out[f"final_ltm_seg{T}"], out["updated_ltm"])
    for t in range(1, T):  # segment t's query asked of the same final state
        ref_t, _ = m(b.query_tokens[:, t - 1], final, ltm_routing=True, logits="last")
        assert torch.equal(out[f"final_ltm_seg{t}"], ref_t)
    init, _ = m(b.query_tokens[:, 0], first, ltm_routing=True, logits="last")
    assert torch.equal(out["initial_ltm"], init)
    for t in range(1, T + 1):  # immediate STM of every segment, never from LTM
        assert_close(out[f"seg{t}_stm"],
                     stm_query(m, b.seg_tokens[:, t - 1], b.query_tokens[:, t - 1]))
    # asking one kind alone gives the same logits (no query leaks into another)
    alone = run_episodes(m, b, RunOptions("learned", True, queries=("final_ltm_seg1",)))
    assert list(alone) == ["final_ltm_seg1"]
    assert torch.equal(alone["final_ltm_seg1"], out["final_ltm_seg1"])
    # every segment matters: the last boundary's LTM differs from the one before it
    before_last = m.init_state(len(b))
    for d in range(T - 1):
        _, before_last = m(b.seg_tokens[:, d], before_last, ltm_routing=True, logits="none")
        before_last = m.consolidate(before_last, mode="learned").clear_context()
    assert not all(torch.equal(x, y) for x, y in zip(before_last.ltm, final.ltm))


@pytest.mark.parametrize("T", [2, 4])
def test_gradient_modes_change_gradients_not_values(T):
    b = task.make_episodes(4, seed=1, segments=T)
    m = make(perturb=True).train()
    q = ("updated_ltm", "initial_ltm", "final_ltm_seg1")
    runs = [run_episodes(m, b, RunOptions("learned", True, queries=q, ltm_graph=g))
            for g in ("full", "truncated", "detached")]
    runs.append(run_episodes(m, b, RunOptions("learned", True, queries=q, detach_ltm=True)))
    for r in runs[1:]:
        for k in q:
            assert torch.equal(r[k], runs[0][k]), k


@pytest.mark.parametrize("T", [2, 3, 5])
def test_truncated_graph_reaches_only_the_last_boundary(T):
    """The Phase-2 loss's gradient w.r.t. the Consolidator's parameters, split by the
    boundary it flows through: "full" reaches every boundary; "truncated" only the last one
    (zero through every earlier boundary); "detached" none. In full mode the split sums to
    the gradient of the shared parameters."""
    b = task.make_episodes(4, seed=2, segments=T)
    norms = {}
    for graph in ("full", "truncated", "detached"):
        m = make(perturb=True).train()
        p = probe(m, T)
        out = run_episodes(m, b, RunOptions("learned", True, ltm_graph=graph))
        torch.nn.functional.cross_entropy(out["updated_ltm"], b.target[:, -1]).backward()
        norms[graph] = p.grad_norms()
        if graph == "full":
            summed = p.summed_grads()
            shared = make(perturb=True).train()
            out = run_episodes(shared, b, RunOptions("learned", True))
            torch.nn.functional.cross_entropy(out["updated_ltm"], b.target[:, -1]).backward()
            for n, g in shared.consolidator.named_parameters():
                assert_close(summed[n], g.grad, atol=1e-6, rtol=1e-4)
    assert all(g > 0 for g in norms["full"]), norms
    assert norms["truncated"][:-1] == [0.0] * (T - 1) and norms["truncated"][-1] > 0, norms
    assert norms["detached"] == [0.0] * T, norms


def test_bad_segment_queries_and_graph_modes_are_refused():
    b = task.make_episodes(3, seed=0, segments=3)
    m = make()
    for q in ("seg4_stm", "final_ltm_seg4"):
        with pytest.raises(ValueError, match="beyond the episodes' 3"):
            run_episodes(m, b, RunOptions("learned", True, queries=(q,)))
    with pytest.raises(ValueError, match="unknown query"):
        RunOptions("learned", True, queries=("seg9_stm",))
    with pytest.raises(ValueError, match="ltm_graph must be one of"):
        RunOptions("learned", True, ltm_graph="partial")
    with pytest.raises(ValueError, match="cannot be combined"):
        RunOptions("learned", True, detach_ltm=True, ltm_graph="truncated")
    with pytest.raises(ValueError, match="detach_ltm must be a bool"):
        RunOptions("learned", True, detach_ltm=1)
    assert RunOptions("learned", True, detach_ltm=True).graph == "detached"
    assert RunOptions("learned", True, ltm_graph="truncated").graph == "truncated"
