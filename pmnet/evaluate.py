"""One evaluator for every metric the paper reports (and the shortcut diagnostics).

Accuracy is the argmax over the 10 digit tokens (the answer is always a digit), so chance
level is exactly 10% (`CHANCE`). Losses are cross-entropy over the whole 256-id vocabulary,
the training objective. All recall metrics are percentages.

Metric names (used everywhere: logs, MLflow, result JSON, CSV):

    updated_ltm              updated (last) mapping after every consolidation and the final
                             reset: segment T's query (T = 2 in the paper)
    initial_ltm              initial mapping after the first consolidation and reset
    forced_identity          updated_ltm of the same checkpoint with identity consolidation
    forced_identity_initial  initial_ltm likewise
    alternative_mode         the same checkpoint with the other operator (forced identity for
                             learned and operator conditions; the learned, identity-initialised
                             path for identity conditions): the paper's "Alternative mode"
                             column. A baseline (`pmnet.baselines`) has no consolidation to
                             force: its results have none of these three
    fresh_ltm                updated query with no experience (LTM at zero phase)
    mismatched_ltm           updated query after a donor experience (Section 5.3)
    mismatched_donor_follow  how often that answer follows the donor's rule (episodes where
                             the donor's answer differs from the episode's)
    seg1_stm, seg2_stm       immediate STM recall on the auxiliary trajectories
                             (seg3_stm ... seg{T}_stm for episodes of T > 2 segments)
    mean_stm                 mean of seg1_stm .. seg{T}_stm (and per rule family,
                             mean_stm_add10 / _affine10, each with its mean output-set
                             baseline, mean_stm_add10_baseline / ..., issue 52)
    dual                     mean of updated_ltm and mean_stm (dual-objective selection)

Episodes of T segments (issue 11; computed by default when T > 2, on request for T = 2 with
`positions=True`), all after the last consolidation and reset, i.e. from the final LTM:

    final_ltm_seg{t}           recall of segment t's mapping: segment t's query, scored
                               against theta_t (t = 1..T; final_ltm_seg{T} == updated_ltm)
    final_ltm_seg{t}_distinct  the same over the episodes where theta_t and theta_T answer
                               segment t's query differently (t < T; NaN if none)
    updated_ltm_follow_seg{t}  how often the final query's answer is theta_t's instead of
                               theta_T's, over the episodes where they differ (t < T)

Every recall metric M also has M_add10, M_affine10 (rule family), M_bijective,
M_nonbijective (rule of the queried segment), M_baseline (accuracy of the output-set
baseline on the same episodes: a rule-free guesser that knows which outputs were shown but
not which input produced each; ~50% on bijective rules) and M_in_unshown (fraction of
answers inside the set of outputs the demonstrations did not show). Recall above
M_baseline, not above 10%, is what shows rule use.

Phase 0's copy task has its own measure, `copy_accuracy`: per payload position, the
fraction of held-out examples whose byte is predicted (argmax over the 26 letters; chance
`COPY_CHANCE` = 1/26), read by `make gpu-check`'s learning gate (issue 62).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pmnet import task
from pmnet.model import PMNet
from pmnet.runner import RunOptions, query_segment, run_episodes

CHANCE = 10.0
#: the digit tokens, host-side (for code outside the compiled steps; `digit_prediction`
#: slices the logits instead)
DIGIT_IDS = torch.tensor(task.DIGIT_TOKENS, dtype=torch.long)
# the digit tokens are one contiguous range of ids: a slice selects them without any tensor
# of ids (a global CPU tensor moved `.to(device)` inside a compiled evaluation step is lifted
# by dynamo as a CPU input of the graph, and inductor then skips CUDA graphs: issue 46)
_DIGITS = slice(task.DIGIT_TOKENS[0], task.DIGIT_TOKENS[-1] + 1)
assert tuple(range(_DIGITS.start, _DIGITS.stop)) == task.DIGIT_TOKENS
# which segment's query each recall metric asks (0: segment 1, 1: segment 2, -1: the last
# segment, whose query is the final one; the same as 1 for the paper's two segments)
QUERY_SEGMENT = {
    "updated_ltm": -1, "initial_ltm": 0, "forced_identity": -1, "forced_identity_initial": 0,
    "alternative_mode": -1, "fresh_ltm": -1, "mismatched_ltm": -1, "seg1_stm": 0,
    "seg2_stm": 1,
}
RECALL_METRICS = tuple(QUERY_SEGMENT)


def segment_index(name: str) -> int | None:
    """Index into a segment axis of the segment whose query recall metric (or query kind)
    `name` asks; None for a name that is not one. The alternative pass's
    `alternative_mode_initial` asks segment 1's query, like `initial_ltm`."""
    if name in QUERY_SEGMENT:
        return QUERY_SEGMENT[name]
    if name == "alternative_mode_initial":
        return 0
    t = query_segment(name)
    return None if t is None else t - 1


def digit_prediction(logits: Tensor) -> Tensor:
    """(N, V) logits -> (N,) predicted digit 0..9 (argmax over the digit tokens)."""
    return logits[..., _DIGITS].argmax(-1)


def _passes(consolidation: str, ltm_routing: bool, full: bool, stm: bool, ltm: bool = True,
            n_seg: int = task.N_SEGMENTS, positions: bool = False):
    """(name, RunOptions, {query kind: metric name}) of each forward pass to run."""
    stm_q = {f"seg{t}_stm": f"seg{t}_stm" for t in range(1, n_seg + 1)}
    if not ltm:  # STM recall only (Phase 1)
        return [("stm", RunOptions(consolidation, ltm_routing, queries=tuple(stm_q)), stm_q)]
    other = "learned" if consolidation == "identity" else "identity"
    main_q = {"updated_ltm": "updated_ltm"}
    if full:
        main_q["initial_ltm"] = "initial_ltm"
    if full or stm:
        main_q.update(stm_q)
    if positions:
        main_q.update({f"final_ltm_seg{t}": f"final_ltm_seg{t}" for t in range(1, n_seg + 1)})
    main = RunOptions(consolidation, ltm_routing, queries=tuple(main_q))
    passes = [("main", main, main_q)]
    if full and not main.baseline:  # a baseline has no other consolidation to force
        alt_q = {"updated_ltm": "alternative_mode", "initial_ltm": "alternative_mode_initial"}
        passes.append(("alternative", RunOptions(other, ltm_routing, queries=tuple(alt_q)),
                       alt_q))
    if full:
        passes += [
            ("fresh", RunOptions(consolidation, ltm_routing, experience="fresh"),
             {"updated_ltm": "fresh_ltm"}),
            ("mismatched", RunOptions(consolidation, ltm_routing, experience="mismatched"),
             {"updated_ltm": "mismatched_ltm"}),
        ]
    return passes


@torch.no_grad()
def episode_outcomes(model: PMNet, batch, *, consolidation: str, ltm_routing: bool,
                     full: bool = True, stm: bool = True, ltm: bool = True,
                     positions: bool | None = None) -> dict[str, Tensor]:
    """Per-episode predictions (digit) and losses for every metric, one batch.

    full: also the alternative-mode, fresh and mismatched passes; stm: the STM queries (of
    every segment); ltm=False: only the STM queries (Phase 1); positions: the per-segment
    queries of the final LTM (`final_ltm_seg{t}`; None: when full and the episodes have more
    than two segments).
    """
    out: dict[str, Tensor] = {}
    full = full and ltm
    n_seg = batch.seg_tokens.shape[1]
    if positions is None:
        positions = full and n_seg > task.N_SEGMENTS
    for _, opts, names in _passes(consolidation, ltm_routing, full, stm, ltm, n_seg,
                                  positions and ltm):
        logits = run_episodes(model, batch, opts)
        for kind, name in names.items():
            lg = logits[kind].float()
            out[f"pred/{name}"] = digit_prediction(lg)
            out[f"loss/{name}"] = F.cross_entropy(lg, batch.target[:, segment_index(kind)],
                                                  reduction="none")
    if full and "pred/alternative_mode" in out:  # forced identity: the identity pass
        learned = consolidation != "identity"  # the Consolidator or an alternative operator
        src = "alternative_mode" if learned else "updated_ltm"
        src_init = "alternative_mode_initial" if learned else "initial_ltm"
        for kind in ("pred", "loss"):
            out[f"{kind}/forced_identity"] = out[f"{kind}/{src}"]
            out[f"{kind}/forced_identity_initial"] = out[f"{kind}/{src_init}"]
    return out


#: chance of one payload position of the copy task (`copy_accuracy`): the prediction is the
#: argmax over the 26 payload letters, drawn uniformly
COPY_CHANCE = 1.0 / len(task.PAYLOAD_TOKENS)
#: Phase 0's success test: held-out copy accuracy at least this many times chance (the
#: gpu-check learning gate's bar, `pmnet.gpu_check.table.LEARNING["acc_min"]`; the watchdog's
#: end-of-Phase-0 test, `pmnet.train.run_phase0`)
COPY_LEARNED_X_CHANCE = 1.5
#: the seed of held-out copy examples (Phase 0's probe, the gpu-check learning gate): a seed
#: training never draws (training batch i of Phase-1 seed k is seed k * 1_000_003 + i)
COPY_HELDOUT_SEED = 987_654_321
# the payload letters are one contiguous range of ids, sliced like the digits
_PAYLOAD = slice(task.PAYLOAD_TOKENS[0], task.PAYLOAD_TOKENS[-1] + 1)
assert tuple(range(_PAYLOAD.start, _PAYLOAD.stop)) == task.PAYLOAD_TOKENS


def copy_logits(model: PMNet, batch: task.CopyBatch) -> Tensor:
    """Phase 0's forward (`Phase0Module.copy_loss`, whose loss is the cross-entropy of these
    logits against `batch.labels`): the context `[#, payload]`, the KV cache cleared, the
    same text again -> (N, L + 1, V) logits, position i predicting payload byte i (the last
    position predicts nothing). Only the routed memory carries the payload across."""
    state = model.init_state(batch.context.shape[0], device=batch.context.device)
    _, state = model(batch.context, state, ltm_routing=False, logits="none")
    logits, _ = model(batch.prompt, state.clear_kv(), ltm_routing=False)
    return logits


@torch.no_grad()
def copy_accuracy(model: PMNet, batch: task.CopyBatch,
                  autocast_dtype: torch.dtype | None = None) -> Tensor:
    """Per-position copy accuracy on `batch` (held out: a seed training never drew): (L,)
    float, entry i the fraction of examples whose payload byte i is predicted, the argmax
    over the 26 payload letters (chance `COPY_CHANCE` = 1/26 at every position, whatever
    the model does with the other ids). The success test of a copy warm start (Phase 0):
    the loss alone cannot tell a model that carries the payload through memory from one
    that does not (docs/choices.md, "The success test"). The model runs in eval mode (no
    dropout; its mode is restored), on its device, under `autocast_dtype` if given."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = copy_logits(model, batch)
    finally:
        model.train(was_training)
    pred = logits[:, :-1, _PAYLOAD].float().argmax(-1) + _PAYLOAD.start  # (N, L) token ids
    return (pred == batch.labels[:, :-1]).float().mean(0)


def _pct(hit: Tensor, mask: Tensor) -> float:
    return 100 * hit[mask].float().mean().item() if mask.any() else float("nan")


def summarize(outcomes: dict[str, Tensor], stream) -> dict[str, float]:
    """Turn per-episode outcomes over a whole stream into the named metrics."""
    metrics: dict[str, float] = {}
    fam = stream.family
    n_seg = stream.seg_tokens.shape[1]
    for key in sorted(outcomes):
        kind, name = key.split("/", 1)
        seg = segment_index(name)
        if kind != "pred" or seg is None or name == "alternative_mode_initial":
            continue
        pred = outcomes[key]
        correct = (pred == stream.target_digit[:, seg]).float()
        bij = stream.bijective[:, seg]
        shown = stream.shown_outputs[:, seg]  # (N, 10)
        in_unshown = (~shown.gather(1, pred[:, None])[:, 0]).float()
        metrics[name] = 100 * correct.mean().item()
        masks = {"add10": fam == 0, "affine10": fam == 1, "bijective": bij, "nonbijective": ~bij}
        for split, m in masks.items():
            metrics[f"{name}_{split}"] = 100 * correct[m].mean().item() if m.any() else float("nan")
        base = stream.baseline_acc[:, seg].float()
        metrics[f"{name}_baseline"] = 100 * base.mean().item()
        for split in ("add10", "affine10"):  # the shortcut's level in each rule family
            m = masks[split]
            metrics[f"{name}_{split}_baseline"] = (100 * base[m].mean().item() if m.any()
                                                   else float("nan"))
        metrics[f"{name}_in_unshown"] = 100 * in_unshown.mean().item()
        metrics[f"loss_{name}"] = outcomes[f"loss/{name}"].mean().item()
    if "pred/mismatched_ltm" in outcomes:  # only where the donor's answer differs
        differs = stream.donor_target_digit != stream.target_digit[:, -1]
        follow = outcomes["pred/mismatched_ltm"][differs] == stream.donor_target_digit[differs]
        metrics["mismatched_donor_follow"] = 100 * follow.float().mean().item()
    if "pred/final_ltm_seg1" in outcomes:  # the per-segment metrics of the final LTM
        last = stream.theta[:, -1]
        for t in range(1, n_seg):
            qx = stream.query_x[:, t - 1]
            differs = task.answer(stream.theta[:, t - 1], qx) != task.answer(last, qx)
            hit = outcomes[f"pred/final_ltm_seg{t}"] == stream.target_digit[:, t - 1]
            metrics[f"final_ltm_seg{t}_distinct"] = _pct(hit, differs)
        if "pred/updated_ltm" in outcomes:
            final = stream.final_answers()  # (N, T): every rule at the final query
            for t in range(1, n_seg):
                differs = final[:, t - 1] != final[:, -1]
                hit = outcomes["pred/updated_ltm"] == final[:, t - 1]
                metrics[f"updated_ltm_follow_seg{t}"] = _pct(hit, differs)
    stm_names = [f"seg{t}_stm" for t in range(1, n_seg + 1)]
    if all(name in metrics for name in stm_names):
        metrics["mean_stm"] = sum(metrics[name] for name in stm_names) / n_seg
        for split in ("add10", "affine10"):
            metrics[f"mean_stm_{split}"] = sum(metrics[f"{name}_{split}"]
                                               for name in stm_names) / n_seg
            # its output-set baseline (issue 52: a family's STM beside its own shortcut)
            metrics[f"mean_stm_{split}_baseline"] = sum(
                metrics[f"{name}_{split}_baseline"] for name in stm_names) / n_seg
        if "updated_ltm" in metrics:
            metrics["dual"] = (metrics["updated_ltm"] + metrics["mean_stm"]) / 2
    return metrics


def evaluate(model: PMNet, stream, *, consolidation: str, ltm_routing: bool,
             batch_size: int = 250, full: bool = True, stm: bool = True, ltm: bool = True,
             progress: bool = False, autocast_dtype: torch.dtype | None = None,
             positions: bool | None = None) -> dict[str, float]:
    """Every metric on a stream (an EpisodeBatch of any number of segments), in batches, on
    the model's device."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    RunOptions(consolidation, ltm_routing)  # validates both before any work
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chunks: dict[str, list[Tensor]] = {}
    starts = range(0, len(stream), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="evaluate", leave=False)
    try:
        for i in starts:
            batch = stream[i:i + batch_size].to(device)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                res = episode_outcomes(model, batch, consolidation=consolidation,
                                       ltm_routing=ltm_routing, full=full, stm=stm, ltm=ltm,
                                       positions=positions)
            for k, v in res.items():
                chunks.setdefault(k, []).append(v.cpu())
    finally:
        model.train(was_training)
    outcomes = {k: torch.cat(v) for k, v in chunks.items()}
    metrics = summarize(outcomes, stream)
    metrics["n_episodes"] = float(len(stream))
    return metrics
