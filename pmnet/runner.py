"""The episode runner: drives the model through the paper's memory lifecycle.

One function, `run_episodes`, serves training (Phase 1 and Phase 2 losses) and evaluation
(every metric of the paper), so every condition is scored by one code path.

Persistent trajectory (Appendix "Exact Memory-Episode Procedure"):

    for segment d in (1, 2):
        process the 40-token demonstration context (routed STM writes, LTM reads)
        consolidate occupied STM groups into LTM (Eq. 8, learned or forced identity)
        clear KV cache and STM; keep LTM
        [initial_ltm: after d = 1, ask segment 1's query on a branch of the state]
    updated_ltm: ask segment 2's query with no demonstrations            (Eq. 10 target)

Immediate STM queries (`seg1_stm`, `seg2_stm`) run on separate auxiliary trajectories:
segment d's context alone from an empty memory (no LTM), clear the KV cache, ask the query.
They never feed the persistent trajectory (every state operation returns a new state).
Because the persistent trajectory's first segment also starts from an empty memory with the
same tokens, the auxiliary trajectory of segment 1 is that very state, branched before the
first consolidation (identical values, one forward pass saved); segment 2's auxiliary
trajectory is a separate forward pass from an empty memory. The Consolidator therefore
cannot influence STM recall, as in the paper (89.90 for every Consolidator-only seed).

Experience: "correct" (the episode's own segments), "mismatched" (the donor's segments,
same family, other parameters, recipient's address token; Section 5.3), or "fresh" (no
segment is processed: LTM stays at the zero phase vector).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from pmnet.model import CONSOLIDATION_MODES, PMNet

QUERY_KINDS = ("updated_ltm", "initial_ltm", "seg1_stm", "seg2_stm")
EXPERIENCES = ("correct", "mismatched", "fresh")
MODES = CONSOLIDATION_MODES  # learned, identity, then the alternative operators


@dataclass(frozen=True)
class RunOptions:
    """How one pass through a batch of episodes is run.

    consolidation: "learned" (C_psi), "identity" (raw S accumulation) or an alternative
        operator (ema, overwrite, linear, gru; the model must have it) at both boundaries.
    ltm_routing: the direct L term of Eq. 9 on (True) or off (False).
    experience: which experience fills LTM: "correct", "mismatched" or "fresh".
    detach_ltm: detach LTM after each boundary (`detach_long_term_between_sleeps`; the
        paper's reported runs use False: the graph is kept across both boundaries).
    queries: which of QUERY_KINDS to ask.
    """

    consolidation: str
    ltm_routing: bool
    experience: str = "correct"
    detach_ltm: bool = False
    queries: tuple[str, ...] = ("updated_ltm",)

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
        stm = {"seg1_stm", "seg2_stm"} & set(self.queries)
        if stm and self.experience != "correct":
            raise ValueError(f"STM queries {sorted(stm)} need experience='correct'")


def stm_query(model: PMNet, context: Tensor, query: Tensor) -> Tensor:
    """Immediate STM recall on an auxiliary trajectory: context from an empty memory,
    clear the KV cache (STM stays), ask the query. Returns logits (N, V) at the last token."""
    state = model.init_state(context.shape[0], device=context.device)
    _, state = model(context, state, ltm_routing=False, logits="none")  # L = 0: on == off
    logits, _ = model(query, state.clear_kv(), ltm_routing=False, logits="last")
    return logits


def persistent_state(model: PMNet, batch, opts: RunOptions, on_segment=None):
    """The persistent trajectory up to the final reset: for each segment of the experience,
    process it, consolidate (Eq. 8), clear KV and STM (and detach LTM if asked). Returns the
    state whose LTM answers the final query. `on_segment(d, before, after)` is called with
    the state before the boundary and after the reset of segment d (0 or 1)."""
    state = model.init_state(batch.seg_tokens.shape[0], device=batch.seg_tokens.device)
    if opts.experience == "fresh":
        return state
    segments = batch.seg_tokens if opts.experience == "correct" else batch.donor_seg_tokens
    for d in range(2):
        _, before = model(segments[:, d], state, ltm_routing=opts.ltm_routing, logits="none")
        state = model.consolidate(before, mode=opts.consolidation).clear_context()
        if opts.detach_ltm:
            state = state.detach_ltm()
        if on_segment is not None:
            on_segment(d, before, state)
    return state


def run_episodes(model: PMNet, batch, opts: RunOptions) -> dict[str, Tensor]:
    """Run a batch of episodes (a `pmnet.task.EpisodeBatch`) through the lifecycle.

    Returns {query kind: logits (N, V) at the query's last (delimiter) position}.
    """
    out: dict[str, Tensor] = {}
    if not {"updated_ltm", "initial_ltm"} & set(opts.queries):  # STM queries only
        for d, kind in enumerate(("seg1_stm", "seg2_stm")):
            if kind in opts.queries:
                out[kind] = stm_query(model, batch.seg_tokens[:, d], batch.query_tokens[:, d])
        return out
    routing = opts.ltm_routing
    q1 = batch.query_tokens[:, 0]

    def after_segment(d: int, before, after) -> None:
        if d != 0:
            return
        if "seg1_stm" in opts.queries:  # auxiliary trajectory of segment 1
            out["seg1_stm"], _ = model(q1, before.clear_kv(), ltm_routing=routing,
                                       logits="last")
        if "initial_ltm" in opts.queries:
            out["initial_ltm"], _ = model(q1, after, ltm_routing=routing, logits="last")

    state = persistent_state(model, batch, opts, on_segment=after_segment)
    if opts.experience == "fresh" and "initial_ltm" in opts.queries:
        out["initial_ltm"], _ = model(q1, state, ltm_routing=routing, logits="last")
    if "updated_ltm" in opts.queries:
        out["updated_ltm"], _ = model(batch.query_tokens[:, 1], state, ltm_routing=routing,
                                      logits="last")
    if "seg2_stm" in opts.queries:
        out["seg2_stm"] = stm_query(model, batch.seg_tokens[:, 1], batch.query_tokens[:, 1])
    return {k: out[k] for k in QUERY_KINDS if k in out}
