"""The episode runner: drives the model through the paper's memory lifecycle.

One function, `run_episodes`, serves training (Phase 1 and Phase 2 losses) and evaluation
(every metric of the paper), so every condition is scored by one code path.

Persistent trajectory (Appendix "Exact Memory-Episode Procedure"), for an episode of T
segments (T = 2 in the paper; `pmnet.task` makes T = 2..8):

    for segment d in (1, ..., T):
        process the 40-token demonstration context (routed STM writes, LTM reads)
        consolidate occupied STM groups into LTM (Eq. 8, learned or forced identity)
        clear KV cache and STM; keep LTM
        [initial_ltm: after d = 1, ask segment 1's query on a branch of the state]
    updated_ltm: ask segment T's query with no demonstrations           (Eq. 10 target)
    final_ltm_seg{t}: ask segment t's query of that same final state   (t = 1..T)

`final_ltm_seg{t}` is recall of segment t's mapping after the last consolidation; for t = T
it is `updated_ltm` itself (the same logits).

Immediate STM queries (`seg1_stm`, ..., `seg{T}_stm`) run on separate auxiliary trajectories:
segment d's context alone from an empty memory (no LTM), clear the KV cache, ask the query.
They never feed the persistent trajectory (every state operation returns a new state).
Because the persistent trajectory's first segment also starts from an empty memory with the
same tokens, the auxiliary trajectory of segment 1 is that very state, branched before the
first consolidation (identical values, one forward pass saved); every later segment's
auxiliary trajectory is a separate forward pass from an empty memory. The Consolidator
therefore cannot influence STM recall, as in the paper (89.90 for every Consolidator-only seed).

Baselines (issue 23, `pmnet.baselines`): a `consolidation` of `BASELINE_MODES` replaces the
segment forward, the consolidate-and-clear of every boundary and the queries by that
baseline's own steps (`_segment`, `_boundary`, `_query`); the STM queries stay the plain
backbone's.

Experience: "correct" (the episode's own segments), "mismatched" (the donor's segments,
same family, other parameters, recipient's address token; Section 5.3), or "fresh" (no
segment is processed: LTM stays at the zero phase vector).

Gradient through the boundaries (`ltm_graph`; the forward values never change):

    full       the graph is kept across every boundary (the paper's setting): the final
               loss reaches every consolidation and, through LTM-conditioned routing and
               reads, every earlier segment
    truncated  truncated BPTT: LTM is detached after every boundary except the last, so a
               query's loss reaches only the last consolidation before it (the final query:
               boundary T; `initial_ltm`: boundary 1), never an earlier one
    detached   LTM is detached after every boundary, the last included: no query's loss
               reaches any consolidation (`detach_ltm=True`, the older spelling)

Clearing KV and STM at a boundary leaves LTM as the only path between segments, so
detaching LTM cuts every gradient path across that boundary.
"""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from pmnet import baselines
from pmnet.model import MemoryState, PMNet
from pmnet.operators import CONSOLIDATION_MODES
from pmnet.task import MAX_SEGMENTS

STM_KINDS = tuple(f"seg{t}_stm" for t in range(1, MAX_SEGMENTS + 1))
FINAL_KINDS = tuple(f"final_ltm_seg{t}" for t in range(1, MAX_SEGMENTS + 1))
QUERY_KINDS = ("updated_ltm", "initial_ltm") + STM_KINDS + FINAL_KINDS
EXPERIENCES = ("correct", "mismatched", "fresh")
# learned, identity, the alternative operators, then the baselines' lifecycles (issue 23)
MODES = CONSOLIDATION_MODES + baselines.BASELINE_MODES
LTM_GRAPHS = ("full", "truncated", "detached")


_SEGMENT_KIND = re.compile(r"^(?:seg(\d+)_stm|final_ltm_seg(\d+))$")


def query_segment(kind: str) -> int | None:
    """The segment (1-based) whose query and mapping a `seg{t}_stm` or `final_ltm_seg{t}`
    kind names; None for any other kind."""
    m = _SEGMENT_KIND.match(kind)
    return int(m.group(1) or m.group(2)) if m else None


@dataclass(frozen=True)
class RunOptions:
    """How one pass through a batch of episodes is run.

    consolidation: "learned" (C_psi), "identity" (raw S accumulation) or an alternative
        operator (ema, overwrite, linear, gru; the model must have it) at every boundary,
        or a baseline's lifecycle (`pmnet.baselines.BASELINE_MODES`) in place of the
        consolidate-and-clear of every boundary.
    ltm_routing: the direct L term of Eq. 9 on (True) or off (False).
    experience: which experience fills LTM: "correct", "mismatched" or "fresh".
    detach_ltm: detach LTM after each boundary, the last included (`ltm_graph="detached"`;
        the paper's reported runs use False: the graph is kept across both boundaries).
    queries: which of QUERY_KINDS to ask (`seg{t}_stm` and `final_ltm_seg{t}` up to the
        episodes' number of segments).
    ltm_graph: "full", "truncated" or "detached" (see the module docstring); detach_ltm=True
        means "detached" and cannot be combined with "truncated".
    """

    consolidation: str
    ltm_routing: bool
    experience: str = "correct"
    detach_ltm: bool = False
    queries: tuple[str, ...] = ("updated_ltm",)
    ltm_graph: str = "full"

    def __post_init__(self):
        if self.consolidation not in MODES:
            raise ValueError(f"consolidation must be one of {MODES}, got {self.consolidation!r}")
        if not isinstance(self.ltm_routing, bool):
            raise ValueError(f"ltm_routing must be a bool, got {self.ltm_routing!r}")
        if self.experience not in EXPERIENCES:
            raise ValueError(f"experience must be one of {EXPERIENCES}, got {self.experience!r}")
        if isinstance(self.queries, str) or not self.queries:
            raise ValueError("queries must be a non-empty tuple of query kinds")
        unknown = [q for q in self.queries if q not in QUERY_KINDS]
        if unknown:
            raise ValueError(f"unknown query kind(s) {unknown}; known: {QUERY_KINDS}")
        stm = set(STM_KINDS) & set(self.queries)
        if stm and self.experience != "correct":
            raise ValueError(f"STM queries {sorted(stm)} need experience='correct'")
        if not isinstance(self.detach_ltm, bool):
            raise ValueError(f"detach_ltm must be a bool, got {self.detach_ltm!r}")
        if self.ltm_graph not in LTM_GRAPHS:
            raise ValueError(f"ltm_graph must be one of {LTM_GRAPHS}, got {self.ltm_graph!r}")
        if self.detach_ltm and self.ltm_graph == "truncated":
            raise ValueError("detach_ltm=True detaches LTM after every boundary (ltm_graph="
                             "'detached'); it cannot be combined with ltm_graph='truncated'")

    @property
    def baseline(self) -> bool:
        """Whether `consolidation` names a baseline's lifecycle (`pmnet.baselines`)."""
        return self.consolidation in baselines.BASELINE_MODES

    @property
    def graph(self) -> str:
        """The effective gradient mode: "detached" when detach_ltm, else `ltm_graph`."""
        return "detached" if self.detach_ltm else self.ltm_graph


def stm_query(model: PMNet, context: Tensor, query: Tensor) -> Tensor:
    """Immediate STM recall on an auxiliary trajectory: context from an empty memory,
    clear the KV cache (STM stays), ask the query. Returns logits (N, V) at the last token."""
    state = model.init_state(context.shape[0], device=context.device)
    _, state = model(context, state, ltm_routing=False, logits="none")  # L = 0: on == off
    logits, _ = model(query, state.clear_kv(), ltm_routing=False, logits="last")
    return logits


def _segment(model: PMNet, tokens: Tensor, state: MemoryState, opts: RunOptions):
    """One segment's demonstrations -> the state before its boundary."""
    if opts.baseline:
        return baselines.segment(model, opts.consolidation, tokens, state,
                                 ltm_routing=opts.ltm_routing)
    return model(tokens, state, ltm_routing=opts.ltm_routing, logits="none")[1]


def _boundary(model: PMNet, state: MemoryState, opts: RunOptions) -> MemoryState:
    """The context boundary: consolidate (Eq. 8), then clear KV and STM; a baseline's own."""
    if opts.baseline:
        return baselines.boundary(model, opts.consolidation, state)
    return model.consolidate(state, mode=opts.consolidation).clear_context()


def _query(model: PMNet, tokens: Tensor, state: MemoryState, opts: RunOptions) -> Tensor:
    """Ask a query of a state: logits (N, V) at its last token."""
    if opts.baseline:
        return baselines.query(model, opts.consolidation, tokens, state,
                               ltm_routing=opts.ltm_routing)
    return model(tokens, state, ltm_routing=opts.ltm_routing, logits="last")[0]


def persistent_state(model: PMNet, batch, opts: RunOptions, on_segment=None):
    """The persistent trajectory up to the final reset: for each of the T segments of the
    experience, process it, consolidate (Eq. 8), clear KV and STM, and detach LTM as
    `opts.graph` says. Returns the state whose LTM answers the final query.
    `on_segment(d, before, after)` is called with the state before the boundary and after the
    reset of segment d (0-based); `after` carries the graph a query asked right there may
    use (under "truncated", through boundary d only; the trajectory goes on detached)."""
    state = model.init_state(batch.seg_tokens.shape[0], device=batch.seg_tokens.device)
    if opts.experience == "fresh":
        return state
    segments = batch.seg_tokens if opts.experience == "correct" else batch.donor_seg_tokens
    n_seg = segments.shape[1]
    graph = opts.graph
    for d in range(n_seg):
        before = _segment(model, segments[:, d], state, opts)
        state = _boundary(model, before, opts)
        if graph == "detached":
            state = state.detach_ltm()
        if on_segment is not None:
            on_segment(d, before, state)
        if graph == "truncated" and d < n_seg - 1:
            state = state.detach_ltm()
    return state


def _ordered(out: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: out[k] for k in QUERY_KINDS if k in out}


def run_episodes(model: PMNet, batch, opts: RunOptions) -> dict[str, Tensor]:
    """Run a batch of episodes (a `pmnet.task.EpisodeBatch` of T segments) through the
    lifecycle.

    Returns {query kind: logits (N, V) at the query's last (delimiter) position}. A
    `seg{t}_stm` or `final_ltm_seg{t}` kind with t > T is refused (ValueError).
    """
    n_seg = batch.seg_tokens.shape[1]
    beyond = [q for q in opts.queries if (query_segment(q) or 0) > n_seg]
    if beyond:
        raise ValueError(f"queries {beyond} name a segment beyond the episodes' {n_seg}")
    out: dict[str, Tensor] = {}
    final_kinds = set(FINAL_KINDS[:n_seg]) & set(opts.queries)
    if not ({"updated_ltm", "initial_ltm"} & set(opts.queries) or final_kinds):
        for d, kind in enumerate(STM_KINDS[:n_seg]):  # STM queries only
            if kind in opts.queries:
                out[kind] = stm_query(model, batch.seg_tokens[:, d], batch.query_tokens[:, d])
        return _ordered(out)
    routing = opts.ltm_routing
    q1 = batch.query_tokens[:, 0]

    def after_segment(d: int, before, after) -> None:
        if d != 0:
            return
        if "seg1_stm" in opts.queries:  # auxiliary trajectory of segment 1
            if opts.consolidation in baselines.CARRIED_MODES:  # memory around segment 1:
                # not the plain STM trajectory, so run that one
                out["seg1_stm"] = stm_query(model, batch.seg_tokens[:, 0], q1)
            else:
                out["seg1_stm"], _ = model(q1, before.clear_kv(), ltm_routing=routing,
                                           logits="last")
        if "initial_ltm" in opts.queries:
            out["initial_ltm"] = _query(model, q1, after, opts)

    state = persistent_state(model, batch, opts, on_segment=after_segment)
    if opts.experience == "fresh" and "initial_ltm" in opts.queries:
        out["initial_ltm"] = _query(model, q1, state, opts)
    last = FINAL_KINDS[n_seg - 1]
    if "updated_ltm" in opts.queries or last in final_kinds:
        out["updated_ltm"] = _query(model, batch.query_tokens[:, -1], state, opts)
        if last in final_kinds:
            out[last] = out["updated_ltm"]  # segment T's query of the final state
            if "updated_ltm" not in opts.queries:
                del out["updated_ltm"]
    for d, kind in enumerate(FINAL_KINDS[: n_seg - 1]):
        if kind in final_kinds:
            out[kind] = _query(model, batch.query_tokens[:, d], state, opts)
    for d in range(1, n_seg):
        if STM_KINDS[d] in opts.queries:
            out[STM_KINDS[d]] = stm_query(model, batch.seg_tokens[:, d],
                                          batch.query_tokens[:, d])
    return _ordered(out)


def phase2_losses(model: PMNet, batch, condition, *, detach_ltm: bool = False,
                  ltm_graph: str = "full", initial_ltm_loss: float = 0.0) -> dict[str, Tensor]:
    """The Phase-2 objective of a condition (`pmnet.conditions.Condition`) on one batch:
    {"loss", "loss_updated", "loss_initial" (initial_ltm_loss > 0), "loss_stm" (dual)}.

    Eq. 10: cross-entropy of the last segment's query after the last boundary; Eq. 11 (the
    dual objective) adds the mean of every segment's pre-consolidation STM query loss;
    `initial_ltm_loss` (not in the paper) adds that weight times the first mapping's loss
    after the first boundary. The one definition: `Phase2Module` trains on it and
    `pmnet.gpu.footprint` measures it."""
    dual = condition.objective == "dual"
    n_seg = batch.seg_tokens.shape[1]
    stm_kinds = STM_KINDS[:n_seg]
    queries = ("updated_ltm",) + (("initial_ltm",) if initial_ltm_loss > 0 else ())
    queries += stm_kinds if dual else ()
    opts = RunOptions(condition.consolidation, condition.ltm_routing, detach_ltm=detach_ltm,
                      ltm_graph=ltm_graph, queries=queries)
    out = run_episodes(model, batch, opts)
    loss = F.cross_entropy(out["updated_ltm"].float(), batch.target[:, -1])  # Eq. 10
    losses = {"loss_updated": loss}
    if initial_ltm_loss > 0:  # auxiliary (not in the paper): keep the first mapping readable
        init = F.cross_entropy(out["initial_ltm"].float(), batch.target[:, 0])
        losses["loss_initial"] = init
        loss = loss + initial_ltm_loss * init
    if dual:  # Eq. 11: + mean of the pre-consolidation STM query losses of every segment
        stm = functools.reduce(operator.add, (
            F.cross_entropy(out[k].float(), batch.target[:, d])
            for d, k in enumerate(stm_kinds))) / n_seg
        losses["loss_stm"] = stm
        loss = loss + stm
    losses["loss"] = loss
    return losses
