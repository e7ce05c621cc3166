"""The evaluator: metric names, splits, baselines, and a perfect / shortcut oracle."""

import math

import pytest
import torch

from pmnet import task
from pmnet.config import ModelConfig
from pmnet.evaluate import CHANCE, RECALL_METRICS, evaluate, summarize
from pmnet.model import PMNet


@pytest.fixture(scope="module")
def stream():
    return task.make_episodes(400, seed=5, stream="val")


def test_full_evaluation_has_every_metric(stream):
    torch.manual_seed(0)
    m = PMNet(ModelConfig.from_name("debug"))
    r = evaluate(m, stream[:64], consolidation="learned", ltm_routing=True, batch_size=32)
    for name in RECALL_METRICS:
        assert 0 <= r[name] <= 100
        for suffix in ("add10", "affine10", "bijective", "nonbijective", "baseline",
                       "in_unshown"):
            assert f"{name}_{suffix}" in r
        assert f"loss_{name}" in r
    assert r["mean_stm"] == pytest.approx((r["seg1_stm"] + r["seg2_stm"]) / 2)
    for fam in ("add10", "affine10"):  # each family's STM beside its baseline (issue 52)
        assert r[f"mean_stm_{fam}_baseline"] == pytest.approx(
            (r[f"seg1_stm_{fam}_baseline"] + r[f"seg2_stm_{fam}_baseline"]) / 2)
    assert r["dual"] == pytest.approx((r["updated_ltm"] + r["mean_stm"]) / 2)
    assert r["forced_identity"] == r["alternative_mode"]  # learned condition
    assert "mismatched_donor_follow" in r and r["n_episodes"] == 64
    assert m.training  # restored


def test_identity_condition_alternative_mode_is_learned_path(stream):
    torch.manual_seed(0)
    m = PMNet(ModelConfig.from_name("debug"))
    r = evaluate(m, stream[:32], consolidation="identity", ltm_routing=True)
    assert r["forced_identity"] == r["updated_ltm"]
    # an identity-initialised Consolidator gives (nearly) the same recall
    assert abs(r["alternative_mode"] - r["updated_ltm"]) <= 100 / 32 + 1e-9


def _outcomes(pred_updated, pred_stm):
    z = torch.zeros_like(pred_updated, dtype=torch.float32)
    return {"pred/updated_ltm": pred_updated, "loss/updated_ltm": z,
            "pred/seg1_stm": pred_stm[0], "loss/seg1_stm": z,
            "pred/seg2_stm": pred_stm[1], "loss/seg2_stm": z}


def test_perfect_predictions_score_100_and_shortcut_sits_at_baseline(stream):
    t = stream.target_digit
    perfect = summarize(_outcomes(t[:, 1], (t[:, 0], t[:, 1])), stream)
    assert perfect["updated_ltm"] == 100 and perfect["mean_stm"] == 100
    # a rule-free guesser: first unshown output (or first shown one for non-bijective rules)
    shown = stream.shown_outputs[:, 1]
    all_distinct = shown.sum(-1) == 8
    guess = torch.where(all_distinct, (~shown).float().argmax(-1), shown.float().argmax(-1))
    r = summarize(_outcomes(guess, (t[:, 0], t[:, 1])), stream)
    add = stream.family == 0
    assert r["updated_ltm_add10"] == pytest.approx(
        100 * (guess[add] == t[add, 1]).float().mean().item())
    assert r["updated_ltm_in_unshown"] >= 100 * all_distinct.float().mean().item() - 1e-6
    assert 35 < r["updated_ltm_add10"] < 65  # ~50%: the shortcut, not rule use
    assert r["updated_ltm_baseline"] > 3 * CHANCE
    # per-family baselines: exactly 50% on ADD10 (two unshown outputs), the mean of the
    # per-episode baseline over the AFFINE10 episodes, and they average to the overall one
    assert r["updated_ltm_add10_baseline"] == pytest.approx(50.0)
    aff = stream.family == 1
    assert r["updated_ltm_affine10_baseline"] == pytest.approx(
        100 * stream.baseline_acc[aff, 1].float().mean().item())
    share = add.float().mean().item()
    assert r["updated_ltm_baseline"] == pytest.approx(
        share * r["updated_ltm_add10_baseline"]
        + (1 - share) * r["updated_ltm_affine10_baseline"], abs=1e-4)


def test_bad_batch_size_and_options_fail_before_work(stream):
    m = PMNet(ModelConfig.from_name("debug"))
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(m, stream, consolidation="learned", ltm_routing=True, batch_size=0)
    with pytest.raises(ValueError, match="consolidation"):
        evaluate(m, stream, consolidation="identityish", ltm_routing=True)


def test_nan_for_empty_split():
    s = task.make_episodes(50, seed=3, families=("add10",))
    t = s.target_digit
    r = summarize(_outcomes(t[:, 1], (t[:, 0], t[:, 1])), s)
    assert math.isnan(r["updated_ltm_affine10"]) and r["updated_ltm_add10"] == 100


# ---------------------------------------------------------------------------------------------
# T-segment episodes (issue 11)
# ---------------------------------------------------------------------------------------------
def test_t_segment_evaluation_has_every_per_segment_metric():
    T = 4
    s = task.make_episodes(24, seed=6, stream="val", segments=T)
    torch.manual_seed(0)
    m = PMNet(ModelConfig.from_name("debug"))
    r = evaluate(m, s, consolidation="learned", ltm_routing=True, batch_size=12)
    for name in RECALL_METRICS + tuple(f"seg{t}_stm" for t in range(3, T + 1)):
        assert 0 <= r[name] <= 100 and f"{name}_baseline" in r and f"loss_{name}" in r
    assert r["mean_stm"] == pytest.approx(sum(r[f"seg{t}_stm"] for t in range(1, T + 1)) / T)
    for t in range(1, T + 1):
        assert 0 <= r[f"final_ltm_seg{t}"] <= 100 and f"final_ltm_seg{t}_add10" in r
    assert r[f"final_ltm_seg{T}"] == r["updated_ltm"]  # the same query of the same state
    for t in range(1, T):
        for key in (f"final_ltm_seg{t}_distinct", f"updated_ltm_follow_seg{t}"):
            assert math.isnan(r[key]) or 0 <= r[key] <= 100
    assert f"final_ltm_seg{T}_distinct" not in r and f"updated_ltm_follow_seg{T}" not in r
    # the per-segment queries are an extra set of queries: every other metric is unchanged
    without = evaluate(m, s, consolidation="learned", ltm_routing=True, batch_size=12,
                       positions=False)
    assert not any(k.startswith("final_ltm") or "follow_seg" in k for k in without)
    assert all(r[k] == v or (math.isnan(v) and math.isnan(r[k])) for k, v in without.items())


def test_two_segment_metric_set_is_unchanged_unless_positions_are_asked(stream):
    torch.manual_seed(0)
    m = PMNet(ModelConfig.from_name("debug"))
    r = evaluate(m, stream[:24], consolidation="learned", ltm_routing=True)
    assert not any(k.startswith("final_ltm") or "follow_seg" in k for k in r)
    # 95 metrics + n_episodes: what the evaluator gave before issue 11, + the two families'
    # mean-STM baselines (issue 52)
    assert len(r) == 98 and {"mean_stm_add10_baseline", "mean_stm_affine10_baseline"} <= set(r)
    p = evaluate(m, stream[:24], consolidation="learned", ltm_routing=True, positions=True)
    assert p["final_ltm_seg2"] == p["updated_ltm"] and "updated_ltm_follow_seg1" in p
    assert all(p[k] == v or (math.isnan(v) and math.isnan(p[k])) for k, v in r.items())


def _answers(stream, t, at):
    """Rule t's (0-based) answers at segment `at`'s query inputs."""
    return task.answer(stream.theta[:, t], stream.query_x[:, at])


@pytest.mark.parametrize("T", [2, 3, 6])
def test_per_segment_metrics_score_oracles_that_follow_one_rule(T):
    s = task.make_episodes(600, seed=T, segments=T)

    def outcomes(rule):  # answer every query with rule `rule` (0-based)
        z = torch.zeros(len(s))
        out = {"pred/updated_ltm": _answers(s, rule, -1), "loss/updated_ltm": z}
        for t in range(1, T + 1):
            out[f"pred/final_ltm_seg{t}"] = _answers(s, rule, t - 1)
            out[f"loss/final_ltm_seg{t}"] = z
        return out

    last = summarize(outcomes(T - 1), s)  # the updated mapping everywhere: perfect recall
    assert last["updated_ltm"] == 100 and last[f"final_ltm_seg{T}"] == 100
    for t in range(1, T):
        assert last[f"updated_ltm_follow_seg{t}"] == 0  # never a stale rule's answer
        assert last[f"final_ltm_seg{t}_distinct"] == 0  # segment t's query: theta_T's answer
    first = summarize(outcomes(0), s)  # the first mapping everywhere: stale
    assert first["final_ltm_seg1"] == 100 and first["final_ltm_seg1_distinct"] == 100
    assert first["updated_ltm_follow_seg1"] == 100
    stale_agrees = (s.final_answers()[:, 0] == s.target_digit[:, -1]).float().mean().item()
    assert first["updated_ltm"] == pytest.approx(100 * stale_agrees)
    if T > 2:  # the final query need not separate theta_1 from theta_T
        assert first["updated_ltm"] > 0
    else:  # for T = 2 it always does
        assert first["updated_ltm"] == 0


# -- Phase 0's copy task: per-position accuracy (issue 62) -----------------------------------


def test_copy_logits_are_phase0s_forward():
    """`copy_logits` is the forward `Phase0Module.copy_loss` trains: the loss of its logits
    is that loss, bit for bit (the accuracy reads what Phase 0 trains)."""
    import torch.nn.functional as F

    from pmnet import train as T
    from pmnet.evaluate import copy_logits

    cfg = T.TrainConfig.from_name("debug")
    torch.manual_seed(0)
    module = T.Phase0Module(cfg, PMNet(cfg.model), cfg.phase1_lr)
    batch = task.make_copy_batch(6, 5, 3)
    logits = copy_logits(module.model, batch)
    assert logits.shape == (6, 6, cfg.model.vocab_size)
    want = module.copy_loss(batch)
    got = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(),
                          ignore_index=task.IGNORE_INDEX)
    assert torch.equal(got, want)


def test_copy_accuracy_is_per_position_over_the_payload_letters(monkeypatch):
    """(L,) accuracies, one per payload byte: an oracle scores 1 at every position even
    where a non-letter id has the largest logit (the argmax is over the 26 letters: chance
    is 1/26 whatever the model does elsewhere), a model wrong at one position scores 0
    there; an untrained model sits near chance; the model's training mode is restored."""
    import pmnet.evaluate as E

    batch = task.make_copy_batch(400, 4, 11)
    V = 256

    def oracle(model, b, wrong_at=None):
        logits = torch.zeros(*b.labels.shape, V)
        logits[..., 0] = 10.0  # a non-letter id above every letter
        for i in range(b.labels.shape[1] - 1):
            target = b.labels[:, i] if i != wrong_at else (b.labels[:, i] - 97 + 1) % 26 + 97
            logits[torch.arange(len(target)), i, target] = 5.0
        return logits

    torch.manual_seed(0)
    model = PMNet(ModelConfig.from_name("debug"))
    model.train()
    monkeypatch.setattr(E, "copy_logits", oracle)
    assert E.copy_accuracy(model, batch).tolist() == [1.0] * 4
    monkeypatch.setattr(E, "copy_logits", lambda m, b: oracle(m, b, wrong_at=2))
    assert E.copy_accuracy(model, batch).tolist() == [1.0, 1.0, 0.0, 1.0]
    monkeypatch.undo()
    acc = E.copy_accuracy(model, task.make_copy_batch(2048, 4, 12))
    assert acc.shape == (4,) and model.training
    assert abs(float(acc.mean()) - E.COPY_CHANCE) < 0.015  # 8192 predictions, SE 0.2 pp
    assert E.COPY_CHANCE == 1 / 26
    bf16 = E.copy_accuracy(model, batch, autocast_dtype=torch.bfloat16)
    assert bf16.shape == (4,)
