"""Route diagnostics (pmnet/diagnose.py): each measurement on a model built so that routes
matter and on one built so that they cannot, plus the probe's own mechanics."""

import json

import pytest
import torch

from pmnet import task
from pmnet.cli import main
from pmnet.config import ModelConfig
from pmnet.diagnose import (
    Probe,
    consolidator_gradient,
    diagnose,
    diagnose_file,
    learned_route_change,
    ltm_route_change,
    order_test,
    probing,
    query_reach,
    route_concentration,
    seg2_path_change,
    stm_recall,
    swap_last_segments,
)
from pmnet.evaluate import evaluate
from pmnet.model import PMNet
from pmnet.train import MODEL_FORMAT, PHASE1_FORMAT, save_model_file

N = 32  # validation episodes: enough for predictions to change, seconds on a CPU


def _model(seed: int = 0) -> PMNet:
    """The debug model (two blocks: the root group every token visits, then 4 groups chosen
    by the root's top-1 route), with weights large enough that memory moves the logits."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_name("debug")
    assert cfg.n_blocks == 2
    model = PMNet(cfg).eval()
    with torch.no_grad():  # x20 the N(0, 0.02) init of every memory map
        for layer in model.layers:
            for lin in (layer.read.w_q, layer.read.w_kv, layer.read.w_out, layer.write.w_k,
                        layer.write.w_v, layer.write.w_o):
                lin.weight.mul_(20)
    return model


def routes_cannot_matter() -> PMNet:
    """Block 1's read outputs zero: nothing below the root reaches the logits, so which child a
    token descends to changes no prediction."""
    model = _model()
    with torch.no_grad():
        model.layers[1].read.w_out.weight.zero_()
        model.layers[1].read.w_out.bias.zero_()
    return model


def routes_matter() -> PMNet:
    """The root's read outputs zero: only the routed block 1 reaches the logits."""
    model = _model()
    with torch.no_grad():
        model.layers[0].read.w_out.weight.zero_()
        model.layers[0].read.w_out.bias.zero_()
    return model


@pytest.fixture(scope="module")
def stream():
    return task.validation_stream(N)


def test_a_model_whose_routes_cannot_matter_shows_exactly_no_effect(stream):
    d = diagnose(routes_cannot_matter(), stream)
    assert d.stm_random_routes.drop == 0.0 and d.stm_random_routes.agreement == 100.0
    assert d.stm_one_path.agreement == 100.0
    assert d.stm_without_block[1].drop == 0.0 and d.stm_without_block[1].agreement == 100.0
    assert d.stm_without_blocks_from[1].agreement == 100.0
    # the mechanism is at work: removing the root's writes does change answers
    assert d.stm_without_block[0].agreement < 100.0
    assert d.random_route_drop == 0.0


def test_a_model_whose_routes_matter_shows_the_effect(stream):
    d = diagnose(routes_matter(), stream)
    assert d.stm_random_routes.agreement < 90.0 and d.stm_one_path.agreement < 90.0
    assert d.stm_without_block[1].agreement < 90.0
    assert d.stm_without_blocks_from[1] == d.stm_without_block[1]  # blocks 1.. is block 1
    assert d.stm_without_blocks_from[0] is None
    assert len(d.margin_median) == len(d.top_prob_mean) == d.n_blocks == 2
    assert all(0.0 <= m <= 1.0 for m in d.margin_median)
    assert all(0.25 <= t <= 1.0 for t in d.top_prob_mean)  # the largest of 4 probabilities


def test_drops_are_paired_differences_of_the_recalls(stream):
    model = routes_matter()
    d = diagnose(model, stream)
    assert d.stm.recall == pytest.approx(stm_recall(model, stream), abs=1e-9)
    for r in [d.stm_random_routes, *d.stm_without_block]:
        assert r.drop == pytest.approx(d.stm.recall - r.recall, abs=1e-9)
    assert d.stm_without_block[1].recall == pytest.approx(
        stm_recall(model, stream, Probe(drop_writes=frozenset({1}))), abs=1e-9)


def test_l_changes_routes_only_when_l_is_not_zero(stream):
    model = _model()
    changed = ltm_route_change(model, stream, "identity", batch_size=N)
    assert len(changed) == 2 and max(changed) > 0.0
    # no writes: STM and so L (identity consolidation) stay zero, routes cannot change
    with probing(model, Probe(drop_writes=frozenset({0, 1}))):
        assert ltm_route_change(model, stream, "identity", batch_size=N) == [0.0, 0.0]


def test_a_plain_probe_leaves_every_logit_unchanged(stream):
    model = _model()
    batch = stream[:8]
    state = model.init_state(8)
    out, s1 = model(batch.seg_tokens[:, 0], state, ltm_routing=True)
    with probing(model, Probe(record=True)) as probe:
        out2, s2 = model(batch.seg_tokens[:, 0], state, ltm_routing=True)
    assert torch.equal(out, out2)
    assert all(torch.equal(a, b) for a, b in zip(s1.routes, s2.routes))
    assert sorted(probe.margins) == [0, 1]
    assert model.probe is None


def test_margins_of_known_scores():
    probe = Probe(record=True)
    p = torch.tensor([[[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    delta = torch.ones(1, 2, 4, 3)
    assert torch.equal(probe.on_write(0, delta, p), delta)
    assert torch.allclose(probe.margins[0][0], torch.tensor([0.2, 0.0]))
    assert torch.allclose(probe.top[0][0], torch.tensor([0.5, 0.25]))
    dropped = Probe(drop_writes=frozenset({0}))
    assert torch.equal(dropped.on_write(0, delta, p), torch.zeros_like(delta))
    assert torch.equal(dropped.on_write(1, delta, p), delta)


def test_random_routes_are_uniform_children_drawn_from_a_fixed_seed():
    p = torch.softmax(torch.randn(64, 40, 4), -1)
    a = Probe(random_routes=True).choose(0, p)
    b = Probe(random_routes=True).choose(0, p)
    assert torch.equal(a, b) and a.shape == (64, 40)
    assert set(a.unique().tolist()) == {0, 1, 2, 3}
    assert (a != p.argmax(-1)).float().mean() > 0.5  # about 3/4 differ
    assert torch.equal(Probe().choose(0, p), p.argmax(-1))


def test_probing_removes_the_probe_after_an_error_and_refuses_nesting():
    model = _model()
    with pytest.raises(RuntimeError, match="boom"):
        with probing(model, Probe()):
            raise RuntimeError("boom")
    assert model.probe is None
    with probing(model, Probe()):
        with pytest.raises(RuntimeError, match="already has a probe"):
            with probing(model, Probe()):
                pass


def test_l_removed_from_every_block_is_routing_off(stream):
    model = _model()
    d = diagnose(model, stream, condition="consolidator_only", consolidation="learned",
                 ltm_routing=True)
    on = evaluate(model, stream, consolidation="learned", ltm_routing=True, full=False,
                  stm=False)
    off = evaluate(model, stream, consolidation="learned", ltm_routing=False, full=False,
                   stm=False)
    assert d.updated_ltm.recall == pytest.approx(on["updated_ltm"], abs=1e-9)
    assert d.updated_routing_off.recall == pytest.approx(off["updated_ltm"], abs=1e-9)
    assert len(d.updated_without_ltm_route) == 2
    assert d.kind == "phase2"
    # per family: the evaluator's own per-family recalls, and the drops paired within each
    assert set(d.updated_routing_off_by_family) == set(task.FAMILIES)
    for fam in task.FAMILIES:
        on_f, off_f = d.updated_ltm_by_family[fam], d.updated_routing_off_by_family[fam]
        assert on_f.recall == pytest.approx(on[f"updated_ltm_{fam}"], abs=1e-9)
        assert off_f.recall == pytest.approx(off[f"updated_ltm_{fam}"], abs=1e-9)
        assert off_f.drop == pytest.approx(on_f.recall - off_f.recall, abs=1e-9)
    n = {f: int((stream.family == i).sum()) for i, f in enumerate(task.FAMILIES)}
    assert d.updated_routing_off.drop == pytest.approx(sum(
        n[f] * d.updated_routing_off_by_family[f].drop for f in n) / len(stream), abs=1e-6)
    one = diagnose(model, stream[(stream.family == 0).nonzero().flatten()],
                   condition="consolidator_only", consolidation="learned", ltm_routing=True)
    assert set(one.updated_routing_off_by_family) == {"add10"}  # a family with no episode: none


def test_a_routing_off_model_gets_no_ltm_routing_ablation(stream):
    d = diagnose(_model(), stream, condition="consolidator_only_routing_off",
                 consolidation="learned", ltm_routing=False)
    assert d.updated_ltm is None and d.updated_without_ltm_route is None


def test_diagnose_file_reads_the_condition_of_a_phase2_model(tmp_path):
    model = _model()
    p1, p2 = tmp_path / "phase1.pt", tmp_path / "best_model.pt"
    save_model_file(p1, model, fmt=PHASE1_FORMAT, meta={})
    save_model_file(p2, model, fmt=MODEL_FORMAT, meta={"condition": "consolidator_only"})
    d1 = diagnose_file(p1, n=16)
    d2 = diagnose_file(p2, n=16)
    assert (d1.kind, d1.condition, d1.updated_ltm) == ("phase1", None, None)
    assert (d2.kind, d2.condition) == ("phase2", "consolidator_only")
    assert d2.stm == d1.stm  # the same weights: the same STM measurements


def test_cli_diagnose_writes_json_and_refuses_bad_input(tmp_path, capsys):
    path = tmp_path / "phase1.pt"
    save_model_file(path, _model(), fmt=PHASE1_FORMAT, meta={})
    out = tmp_path / "d.json"
    assert main(["diagnose", str(path), "--n", "8", "--out", str(out)]) == 0
    assert "random routes" in capsys.readouterr().out
    assert json.loads(out.read_text())["episodes"] == 8
    assert main(["diagnose", str(tmp_path / "missing.pt")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["diagnose", str(path), "--n", "0"]) == 2
    assert "positive integer" in capsys.readouterr().err


def test_route_concentration_is_100_for_one_path_and_lower_for_random_routes(stream):
    model = _model()
    with probing(model, Probe(one_path=True)):
        assert route_concentration(model, stream, batch_size=N) == [100.0, 100.0]
    with probing(model, Probe(random_routes=True)):
        top, spread = route_concentration(model, stream, batch_size=N)
    assert top == 100.0 and 25.0 < spread < 50.0  # ~40 tokens over 4 groups at random
    assert len(diagnose(model, stream).route_concentration) == 2


def test_strict_routing_off_removes_l_from_the_u_deeper_routers_see(stream):
    """Issue 39: the paper's routing off drops L only at each block's own level; the strict
    intervention also takes it out of u. The root has no u (nothing changes there); block 1
    routes on u from block 0, so with L != 0 some of its routes change, and with L = 0 (no
    writes) none do."""
    model = _model()
    changed = ltm_route_change(model, stream, "identity", batch_size=N, strict=True)
    assert changed[0] == 0.0 and changed[1] > 0.0
    with probing(model, Probe(drop_writes=frozenset({0, 1}))):
        assert ltm_route_change(model, stream, "identity", batch_size=N,
                                strict=True) == [0.0, 0.0]


def test_strict_probe_with_zero_ltm_is_the_plain_model(stream):
    """L = 0 (a fresh state): u with and without L are the same, so every logit and route is
    bitwise the plain model's; with L != 0 the deeper routes differ."""
    model = _model()
    batch = stream[:8]
    state = model.init_state(8)
    out, s1 = model(batch.seg_tokens[:, 0], state, ltm_routing=False)
    with probing(model, Probe(routing_u_uses_ltm=False)):
        out2, s2 = model(batch.seg_tokens[:, 0], state, ltm_routing=False)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(s1.routes,
                                                                             s2.routes))
    with_l = model.consolidate(s1, mode="identity").clear_context()
    _, off = model(batch.seg_tokens[:, 1], with_l, ltm_routing=False)
    with probing(model, Probe(routing_u_uses_ltm=False)):
        _, strict = model(batch.seg_tokens[:, 1], with_l, ltm_routing=False)
    assert torch.equal(off.routes[1], strict.routes[1])  # the root's choice: no u there
    assert not torch.equal(off.routes[2], strict.routes[2])


@pytest.mark.parametrize("condition, routing", [("consolidator_only", True),
                                                ("consolidator_only_routing_off", False)])
def test_every_phase2_model_gets_its_strict_off_recall(stream, condition, routing):
    model = _model()
    d = diagnose(model, stream, condition=condition, consolidation="learned",
                 ltm_routing=routing)
    with probing(model, Probe(routing_u_uses_ltm=False)):
        strict = evaluate(model, stream, consolidation="learned", ltm_routing=False,
                          full=False, stm=False)
    own = evaluate(model, stream, consolidation="learned", ltm_routing=routing, full=False,
                   stm=False)
    assert d.updated_strict_off.recall == pytest.approx(strict["updated_ltm"], abs=1e-9)
    assert d.updated_strict_off.drop == pytest.approx(own["updated_ltm"]
                                                      - strict["updated_ltm"], abs=1e-6)
    assert len(d.strict_route_change) == 2 and d.strict_route_change[0] == 0.0


# --- the capability diagnostics (issue 44) ----------------------------------------------


def test_swapping_segments_swaps_the_demonstrations_only(stream):
    swapped = swap_last_segments(stream)
    assert torch.equal(swapped.seg_tokens[:, 0], stream.seg_tokens[:, 1])
    assert torch.equal(swapped.seg_tokens[:, 1], stream.seg_tokens[:, 0])
    assert torch.equal(swapped.query_tokens, stream.query_tokens)
    assert torch.equal(swapped.target, stream.target)
    assert torch.equal(swap_last_segments(swapped).seg_tokens, stream.seg_tokens)


@pytest.mark.parametrize("routing", [True, False])
def test_the_order_gain_is_bounded_by_the_answers_the_order_changes(stream, routing):
    model = _model()
    o = order_test(model, stream, "identity", routing, batch_size=N)
    assert o.episodes == N
    on = evaluate(model, stream, consolidation="identity", ltm_routing=routing, full=False,
                  stm=False)
    assert o.updated == pytest.approx(on["updated_ltm"], abs=1e-9)
    assert o.order_gain <= o.order_change + 1e-9
    # the final query separates the last two rules: an answer cannot be both
    assert o.updated + o.stale <= 100.0 + 1e-9


def test_an_order_blind_model_has_no_order_gain(stream):
    """With every write removed, LTM stays zero whatever the order: no answer changes when
    the segments are swapped, so the update cannot be recalled above the stale rule."""
    model = _model()
    with probing(model, Probe(drop_writes=frozenset({0, 1}))):
        o = order_test(model, stream, "identity", True, batch_size=N)
    assert o.order_change == 0.0 and o.order_gain == pytest.approx(0.0, abs=1e-9)
    # and the plain model does depend on the order
    assert order_test(model, stream, "identity", True, batch_size=N).order_change > 0.0


def test_query_reach_splits_the_query_tokens_by_who_wrote_their_group(stream):
    reach = query_reach(_model(), stream, "identity", True, batch_size=N)
    assert len(reach) == 2
    for r in reach:
        assert r.last_only + r.earlier_only + r.both + r.neither == pytest.approx(100.0)
    # the root group is written by every segment and visited by every query token
    assert reach[0].both == pytest.approx(100.0)


def test_learned_route_change_is_zero_for_an_identity_consolidator(stream):
    """A Consolidator at its identity start writes the same L as forced identity, so the
    routes after it cannot differ; one that is not the identity moves them."""
    model = _model()
    assert learned_route_change(model, stream, True, batch_size=N) == [0.0, 0.0]
    with torch.no_grad():
        model.consolidator.reinit(1.0, torch.Generator().manual_seed(0))
        model.consolidator.w_d.weight.normal_(0, 1.0)
    assert max(learned_route_change(model, stream, True, batch_size=N)) > 0.0


def test_diagnose_reports_the_capability_measurements(stream):
    d = diagnose(_model(), stream, condition="consolidator_only", consolidation="learned",
                 ltm_routing=True)
    assert d.order is not None and len(d.query_reach) == 2
    assert d.seg2_route_change_learned == [0.0, 0.0]  # the identity start
    out = d.to_dict()
    assert out["order"]["order_gain"] == pytest.approx(d.order.order_gain)
    assert diagnose(_model(), stream).seg2_route_change_learned is None  # identity: n/a


@pytest.mark.parametrize("condition, routing_zero", [("consolidator_only", False),
                                                     ("consolidator_only_routing_off", True)])
def test_the_consolidator_gradient_splits_into_its_routing_and_memory_paths(
        stream, condition, routing_zero):
    """Without Eq. 9's direct term the routing paths carry nothing and the memory paths the
    whole gradient, exactly; with it, both kinds carry some."""
    model = _model()
    with torch.no_grad():  # a Consolidator away from its identity start
        model.consolidator.reinit(1.0, torch.Generator().manual_seed(0))
        model.consolidator.w_d.weight.normal_(0, 0.5)
    before = [p.requires_grad for p in model.parameters()]
    g = consolidator_gradient(model, stream, condition, batch_size=16)
    assert g.total > 0 and g.memory > 0
    assert (g.routing == 0.0) is routing_zero
    if routing_zero:
        assert g.mixed < 1e-6 * g.total and g.memory == pytest.approx(g.total, rel=1e-6)
    assert [p.requires_grad for p in model.parameters()] == before and not model.training
    assert all(p.grad is None for p in model.parameters())


def test_seg2_path_change_compares_the_last_segment_with_the_first(stream):
    """A last segment that repeats the first token for token: every position shares its
    prefix, so the two readings agree; with one path for every token nothing changes."""
    import dataclasses as dc

    seg = stream.seg_tokens.clone()
    seg[:, -1] = seg[:, 0]
    repeated = dc.replace(stream, seg_tokens=seg)
    pc = seg2_path_change(_model(), repeated, "identity", True, batch_size=N)
    assert pc.shared_prefix_share == 100.0 and pc.all == pc.shared_prefix
    # the real stream: segments share their address only (a prefix of each segment)
    real = seg2_path_change(_model(), stream, "identity", True, batch_size=N)
    assert 0.0 < real.shared_prefix_share < 50.0
    assert all(0.0 <= x <= 100.0 for x in pc.all)
    model = _model()
    with probing(model, Probe(one_path=True)):
        assert seg2_path_change(model, stream, "identity", True, batch_size=N).all == [0.0, 0.0]
    d = diagnose(_model(), stream, condition="consolidator_only", consolidation="learned",
                 ltm_routing=True)
    assert d.seg2_path_change == d.seg2_path_change_identity  # the identity start
    assert d.query_reach_identity == d.query_reach
    assert d.to_dict()["consolidator_gradient"]["routing_share"] >= 0


def test_cli_diagnose_reads_a_phase1_file_as_a_conditions_start(tmp_path, capsys):
    path = tmp_path / "phase1.pt"
    save_model_file(path, _model(), fmt=PHASE1_FORMAT, meta={})
    out = tmp_path / "d.json"
    assert main(["diagnose", str(path), "--n", "8", "--condition", "consolidator_only",
                 "--out", str(out)]) == 0
    assert "Consolidator gradient" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["condition"] == "consolidator_only" and d["kind"] == "phase2"
    assert d["seg2_route_change_learned"] == [0.0, 0.0]  # the start: an exact identity
    assert main(["diagnose", str(path), "--condition", "no_such_condition"]) == 2
    p2 = tmp_path / "best_model.pt"
    save_model_file(p2, _model(), fmt=MODEL_FORMAT, meta={"condition": "consolidator_only"})
    assert main(["diagnose", str(p2), "--n", "8", "--condition", "identity_full"]) == 2
    assert "not 'identity_full'" in capsys.readouterr().err
