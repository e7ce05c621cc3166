"""The episode runner: each query kind sees exactly the state it should."""

import pytest
import torch
from torch.testing import assert_close

from pmnet import task
from pmnet.config import ModelConfig
from pmnet.model import PMNet
from pmnet.runner import RunOptions, run_episodes, stm_query


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
