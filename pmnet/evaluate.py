"""One evaluator for every metric the paper reports (and the shortcut diagnostics).

Accuracy is the argmax over the 10 digit tokens (the answer is always a digit), so chance
level is exactly 10% (`CHANCE`). Losses are cross-entropy over the whole 256-id vocabulary,
the training objective. All recall metrics are percentages.

Metric names (used everywhere: logs, MLflow, result JSON, CSV):

    updated_ltm              updated mapping after both consolidations and the final reset
    initial_ltm              initial mapping after the first consolidation and reset
    forced_identity          updated_ltm of the same checkpoint with identity consolidation
    forced_identity_initial  initial_ltm likewise
    alternative_mode         the same checkpoint with the other operator (forced identity for
                             learned and operator conditions; the learned, identity-initialised
                             path for identity conditions): the paper's "Alternative mode"
                             column
    fresh_ltm                updated query with no experience (LTM at zero phase)
    mismatched_ltm           updated query after a donor experience (Section 5.3)
    mismatched_donor_follow  how often that answer follows the donor's rule (episodes where
                             the donor's answer differs from the episode's)
    seg1_stm, seg2_stm       immediate STM recall on the auxiliary trajectories
    mean_stm                 mean of seg1_stm and seg2_stm
    dual                     mean of updated_ltm and mean_stm (dual-objective selection)

Every recall metric M also has M_add10, M_affine10 (rule family), M_bijective,
M_nonbijective (rule of the queried segment), M_baseline (accuracy of the output-set
baseline on the same episodes: a rule-free guesser that knows which outputs were shown but
not which input produced each; ~50% on bijective rules) and M_in_unshown (fraction of
answers inside the set of outputs the demonstrations did not show). Recall above
M_baseline, not above 10%, is what shows rule use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pmnet import task
from pmnet.model import PMNet
from pmnet.runner import RunOptions, run_episodes

CHANCE = 10.0
DIGIT_IDS = torch.tensor(task.DIGIT_TOKENS, dtype=torch.long)
# which segment's query each recall metric asks (0: segment 1, 1: segment 2)
QUERY_SEGMENT = {
    "updated_ltm": 1, "initial_ltm": 0, "forced_identity": 1, "forced_identity_initial": 0,
    "alternative_mode": 1, "fresh_ltm": 1, "mismatched_ltm": 1, "seg1_stm": 0, "seg2_stm": 1,
}
RECALL_METRICS = tuple(QUERY_SEGMENT)


def digit_prediction(logits: Tensor) -> Tensor:
    """(N, V) logits -> (N,) predicted digit 0..9 (argmax over the digit tokens)."""
    return logits.index_select(-1, DIGIT_IDS.to(logits.device)).argmax(-1)


def _passes(consolidation: str, ltm_routing: bool, full: bool, stm: bool, ltm: bool = True):
    """(name, RunOptions, {query kind: metric name}) of each forward pass to run."""
    if not ltm:  # STM recall only (Phase 1)
        q = {"seg1_stm": "seg1_stm", "seg2_stm": "seg2_stm"}
        return [("stm", RunOptions(consolidation, ltm_routing, queries=tuple(q)), q)]
    other = "learned" if consolidation == "identity" else "identity"
    main_q = {"updated_ltm": "updated_ltm"}
    if full:
        main_q["initial_ltm"] = "initial_ltm"
    if full or stm:
        main_q.update(seg1_stm="seg1_stm", seg2_stm="seg2_stm")
    passes = [("main", RunOptions(consolidation, ltm_routing, queries=tuple(main_q)), main_q)]
    if full:
        alt_q = {"updated_ltm": "alternative_mode", "initial_ltm": "alternative_mode_initial"}
        passes += [
            ("alternative", RunOptions(other, ltm_routing, queries=tuple(alt_q)), alt_q),
            ("fresh", RunOptions(consolidation, ltm_routing, experience="fresh"),
             {"updated_ltm": "fresh_ltm"}),
            ("mismatched", RunOptions(consolidation, ltm_routing, experience="mismatched"),
             {"updated_ltm": "mismatched_ltm"}),
        ]
    return passes


@torch.no_grad()
def episode_outcomes(model: PMNet, batch, *, consolidation: str, ltm_routing: bool,
                     full: bool = True, stm: bool = True, ltm: bool = True
                     ) -> dict[str, Tensor]:
    """Per-episode predictions (digit) and losses for every metric, one batch.

    full: also the alternative-mode, fresh and mismatched passes; stm: the STM queries;
    ltm=False: only the STM queries (Phase 1).
    """
    out: dict[str, Tensor] = {}
    full = full and ltm
    for _, opts, names in _passes(consolidation, ltm_routing, full, stm, ltm):
        logits = run_episodes(model, batch, opts)
        for kind, name in names.items():
            lg = logits[kind].float()
            seg = 0 if kind in ("initial_ltm", "seg1_stm") else 1
            out[f"pred/{name}"] = digit_prediction(lg)
            out[f"loss/{name}"] = F.cross_entropy(lg, batch.target[:, seg], reduction="none")
    if full:  # forced identity is whichever pass used identity consolidation
        learned = consolidation != "identity"  # the Consolidator or an alternative operator
        src = "alternative_mode" if learned else "updated_ltm"
        src_init = "alternative_mode_initial" if learned else "initial_ltm"
        for kind in ("pred", "loss"):
            out[f"{kind}/forced_identity"] = out[f"{kind}/{src}"]
            out[f"{kind}/forced_identity_initial"] = out[f"{kind}/{src_init}"]
    return out


def summarize(outcomes: dict[str, Tensor], stream) -> dict[str, float]:
    """Turn per-episode outcomes over a whole stream into the named metrics."""
    metrics: dict[str, float] = {}
    fam = stream.family
    for key in sorted(outcomes):
        kind, name = key.split("/", 1)
        if kind != "pred" or name not in QUERY_SEGMENT:
            continue
        seg = QUERY_SEGMENT[name]
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
        differs = stream.donor_target_digit != stream.target_digit[:, 1]
        follow = outcomes["pred/mismatched_ltm"][differs] == stream.donor_target_digit[differs]
        metrics["mismatched_donor_follow"] = 100 * follow.float().mean().item()
    if "seg1_stm" in metrics and "seg2_stm" in metrics:
        metrics["mean_stm"] = (metrics["seg1_stm"] + metrics["seg2_stm"]) / 2
        for split in ("add10", "affine10"):
            metrics[f"mean_stm_{split}"] = (metrics[f"seg1_stm_{split}"]
                                            + metrics[f"seg2_stm_{split}"]) / 2
        if "updated_ltm" in metrics:
            metrics["dual"] = (metrics["updated_ltm"] + metrics["mean_stm"]) / 2
    return metrics


def evaluate(model: PMNet, stream, *, consolidation: str, ltm_routing: bool,
             batch_size: int = 250, full: bool = True, stm: bool = True, ltm: bool = True,
             progress: bool = False, autocast_dtype: torch.dtype | None = None
             ) -> dict[str, float]:
    """Every metric on a stream (an EpisodeBatch), in batches, on the model's device."""
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
                                       ltm_routing=ltm_routing, full=full, stm=stm, ltm=ltm)
            for k, v in res.items():
                chunks.setdefault(k, []).append(v.cpu())
    finally:
        model.train(was_training)
    outcomes = {k: torch.cat(v) for k, v in chunks.items()}
    metrics = summarize(outcomes, stream)
    metrics["n_episodes"] = float(len(stream))
    return metrics
