"""The Phase-2 conditions of the paper (Table "Parameter-isolation conditions") and its seeds,
and the consolidation-operator conditions that go beyond the paper.

The one place that names them: training (`pmnet.train`), statistics (`pmnet.stats`), the
report and the grids (`tune_spaces`) all read `CONDITIONS`, `OPERATOR_CONDITIONS` and
`PAPER_SEEDS` from here (and the baselines, `BASELINE_CONDITIONS`). `CONDITIONS` is exactly
the paper's six (its grid, tables and
comparisons); `OPERATOR_CONDITIONS` are kept apart so that nothing of the paper changes
meaning. The module imports nothing heavy (no torch), so light readers can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The watchdog's fields of `pmnet.train.TrainConfig` (issue 62): they decide whether a run is
#: stopped, not what it computes, so no checkpoint file and no unit's config hash holds them
#: (a unit trained before they existed keeps its hash), as `threads`.
WATCHDOG_FIELDS: tuple[str, ...] = ("watchdog", "watchdog_share", "watchdog_margin")

#: Phase-2-only fields of `pmnet.train.TrainConfig`: changing them does not change the Phase-1
#: checkpoint (nor do the speed settings threads, compile and cuda_graphs: they move only fp32
#: rounding; nor does test_seed, which picks the stream the final figures are read on; nor do
#: the watchdog's, WATCHDOG_FIELDS), so they are left out of the Phase-1 config hash, and a
#: grid's variants may set them. A fact about TrainConfig kept here, in a module with no heavy
#: imports, so that the grids (`tune_spaces`) and the pipeline read it without importing
#: torch or each other.
PHASE2_ONLY_FIELDS: tuple[str, ...] = (
    "lr", "episodes_per_epoch", "max_epochs", "patience", "seeds", "conditions", "detach_ltm",
    "notes", "threads", "consolidator_init_std", "consolidator_lr",
    "consolidator_weight_decay", "initial_ltm_loss", "segments", "ltm_graph", "compile",
    "cuda_graphs", "phase1_seeds", "test_seed", "phase2_families", "lr_schedule",
    *WATCHDOG_FIELDS)

#: TrainConfig fields added after stores were first written, with their default as a unit's
#: flat configuration spells it (`TrainConfig.flat`): a unit records such a field only when
#: it differs from that default, so every stored unit (which never had it) keeps its
#: configuration and hash, and compares equal to a run that leaves it at the default
LATE_FIELD_DEFAULTS: dict[str, object] = {"phase2_families": "add10,affine10",
                                          "lr_schedule": "cosine", "phase0_lr": 0.0,
                                          "phase0_lr_schedule": "cosine"}


@dataclass(frozen=True)
class Condition:
    name: str
    consolidation: str  # a PMNet.consolidate mode: "learned", "identity" or an operator name
    subset: str  # a PMNet.trainable_subset name
    ltm_routing: bool  # direct LTM term of Eq. 9
    objective: str  # "updated" (Eq. 10) or "dual" (Eq. 11)
    select: str  # validation metric that selects the checkpoint
    label: str  # short name in tables and figures
    description: str
    # L in the latent state u the deeper routers read (Eq. 1): True in every condition of the
    # paper; False is the strict routing off of issue 39 (no router sees L, directly or
    # through u), valid only with ltm_routing False
    routing_u_ltm: bool = True

    def __post_init__(self):
        if not self.routing_u_ltm and self.ltm_routing:
            raise ValueError(f"condition {self.name!r}: routing_u_ltm=False (strict routing "
                             f"off) needs ltm_routing=False")


#: The six conditions, in the paper's table order.
CONDITIONS: dict[str, Condition] = {
    c.name: c
    for c in (
        Condition("learned_full", "learned", "entire_model", True, "updated", "updated_ltm",
                  "Learned full",
                  "Learned full: entire model trainable, learned consolidation"),
        Condition("identity_full", "identity", "all_but_consolidator", True, "updated",
                  "updated_ltm", "Identity full",
                  "Identity full: all but the Consolidator, raw STM accumulation"),
        Condition("consolidator_only", "learned", "consolidator_only", True, "updated",
                  "updated_ltm", "Consolidator only",
                  "Consolidator only (12.35K parameters), LTM routing on"),
        Condition("consolidator_only_routing_off", "learned", "consolidator_only", False,
                  "updated", "updated_ltm", "Consolidator only, routing off",
                  "Consolidator only, direct LTM routing term of Eq. 9 removed"),
        Condition("memory_consolidator", "learned", "memory_consolidator", True, "updated",
                  "updated_ltm", "Memory + Consolidator",
                  "Memory read/write/routing + Consolidator"),
        Condition("learned_full_dual", "learned", "entire_model", True, "dual", "dual",
                  "Learned full, dual objective",
                  "Learned full with the dual objective L_updated + L_STM (Eq. 11)"),
    )
}

#: Beyond the paper (issue 11; its Limitations: "we do not compare alternative learned
#: overwrite, EMA, linear, or gated recurrent operators"): one condition per alternative
#: consolidation operator (`pmnet.operators.OPERATORS`), each in the Consolidator-only setting of
#: `consolidator_only` (only the operator's parameters trainable, LTM routing on, the same
#: Phase-1 checkpoint), the operator used at both boundaries of Eq. 8 in place of C_psi.
#: `consolidator_only` (`OPERATOR_REFERENCE`) is the learned arm they are compared with; the
#: forced-identity evaluation of each checkpoint is the identity baseline.
OPERATOR_CONDITIONS: dict[str, Condition] = {
    c.name: c
    for c in (
        Condition("operator_ema", "ema", "operator_only", True, "updated", "updated_ltm",
                  "EMA operator",
                  "EMA operator only: L+ = L + alpha * angle_diff(S), per-dimension alpha"),
        Condition("operator_overwrite", "overwrite", "operator_only", True, "updated",
                  "updated_ltm", "Overwrite operator",
                  "Gated overwrite operator only: L+ = U + g(S, L) * angle_diff(C(S) - U), "
                  "U = L + S"),
        Condition("operator_linear", "linear", "operator_only", True, "updated",
                  "updated_ltm", "Linear operator",
                  "Linear operator only: L+ = L + atan2((I + A)[cos S; sin S] + b)"),
        Condition("operator_gru", "gru", "operator_only", True, "updated", "updated_ltm",
                  "GRU operator",
                  "Gated recurrent (GRU) operator only on [cos; sin] of S and L"),
    )
}

#: The learned arm the operators are compared with (the Consolidator, Consolidator only).
OPERATOR_REFERENCE = "consolidator_only"

#: Beyond the paper (issue 23; its Limitations: "the synthetic task lacks a task-matched
#: external architecture baseline"): other ways to carry a segment across the boundary, on
#: the same backbone, episodes, runner and evaluator (`pmnet.baselines`). Each consolidation
#: field names a `pmnet.baselines.BASELINE_MODES` lifecycle instead of an LTM operator:
#:   no_reset         nothing is cleared: KV cache and STM run on through both segments and
#:                    the query (an upper bound: the query can read the demonstrations)
#:   memory_tokens    recurrent memory tokens (Bulatov et al. 2022): M embeddings read before
#:                    and written after each segment by the same Transformer, carried across
#:                    the boundary while KV and STM are cleared
#:   recurrent_state  a GRU cell over the mean of the segment's last hidden states, its state
#:                    carried across the boundary and read as one prefix embedding
#:   no_memory        KV, STM and every state cleared, LTM never written (the floor)
#: The two carried memories train only their own parameters (`baseline_only`, the
#: Consolidator-only setting: the backbone frozen, the Consolidator's learning rate); the two
#: bounds, which have no parameters of their own, train the entire model.
BASELINE_CONDITIONS: dict[str, Condition] = {
    c.name: c
    for c in (
        Condition("baseline_no_reset", "no_reset", "entire_model", True, "updated",
                  "updated_ltm", "No reset (upper bound)",
                  "Upper bound: KV cache and STM kept across the boundaries, entire model "
                  "trainable"),
        Condition("baseline_memory_tokens", "memory_tokens", "baseline_only", True, "updated",
                  "updated_ltm", "Memory tokens (RMT)",
                  "Recurrent memory tokens carried across the boundary, only their "
                  "parameters trainable"),
        Condition("baseline_recurrent_state", "recurrent_state", "baseline_only", True,
                  "updated", "updated_ltm", "Recurrent state (GRU)",
                  "A GRU state over pooled segment summaries carried across the boundary, "
                  "only its parameters trainable"),
        Condition("baseline_no_memory", "no_memory", "entire_model", True, "updated",
                  "updated_ltm", "No memory (floor)",
                  "No memory: KV, STM and LTM cleared at every boundary, entire model "
                  "trainable"),
    )
}

#: The arms every baseline is compared with, paired by seed: the Consolidator (Consolidator
#: only) and the GRU consolidation operator of issue 11.
BASELINE_REFERENCES: tuple[str, ...] = ("consolidator_only", "operator_gru")

#: Beyond the paper (issue 39, "can anything use the routing channel?"): the routing-off
#: twins of the two most capable arms that route with L, so that the routing effect
#: (on - off, paired by seed from the same checkpoint) can be measured for a capable
#: consolidation operator and for a trainable router, not only for the Consolidator. Each is
#: its routing-on condition with the direct L term of Eq. 9 removed, nothing else changed.
CHANNEL_CONDITIONS: dict[str, Condition] = {
    c.name: c
    for c in (
        Condition("operator_gru_routing_off", "gru", "operator_only", False, "updated",
                  "updated_ltm", "GRU operator, routing off",
                  "GRU operator only, direct LTM routing term of Eq. 9 removed"),
        Condition("memory_consolidator_routing_off", "learned", "memory_consolidator", False,
                  "updated", "updated_ltm", "Memory + Consolidator, routing off",
                  "Memory read/write/routing + Consolidator, direct LTM routing term of "
                  "Eq. 9 removed"),
    )
}

#: The routing-on arm each routing-off arm is paired with (the paper's, then issue 39's).
ROUTING_PAIRS: dict[str, str] = {
    "consolidator_only": "consolidator_only_routing_off",
    "operator_gru": "operator_gru_routing_off",
    "memory_consolidator": "memory_consolidator_routing_off",
}

#: Beyond the paper (issue 39, "what a strict-off arm changes"): the paper's routing off
#: removes the direct L term of Eq. 9 at each block's own level only; L written by the blocks
#: above still reaches the deeper routers through u (the paper says so, Sec. 4.3). A
#: strict-off twin removes that path too: no router sees L, directly or through u, while the
#: reads keep M = S + L (`PMNet.routing_u_uses_ltm`). One twin for the Consolidator and one
#: for the trainable router, the arm whose routing-off models lean on u most (issue 39's
#: probes).
STRICT_OFF_CONDITIONS: dict[str, Condition] = {
    c.name: c
    for c in (
        Condition("consolidator_only_strict_off", "learned", "consolidator_only", False,
                  "updated", "updated_ltm", "Consolidator only, strict routing off",
                  "Consolidator only, no router sees L (direct term of Eq. 9 and L in u "
                  "removed)", routing_u_ltm=False),
        Condition("memory_consolidator_strict_off", "learned", "memory_consolidator", False,
                  "updated", "updated_ltm", "Memory + Consolidator, strict routing off",
                  "Memory read/write/routing + Consolidator, no router sees L (direct term "
                  "of Eq. 9 and L in u removed)", routing_u_ltm=False),
    )
}

#: The routing-off arm each strict-off arm is paired with (off - strict off: what L reaching
#: the routers through u is worth).
STRICT_PAIRS: dict[str, str] = {
    "consolidator_only_routing_off": "consolidator_only_strict_off",
    "memory_consolidator_routing_off": "memory_consolidator_strict_off",
}

#: Every condition that can be trained: the paper's six, the operator conditions, the
#: baselines, the routing-off and strict-off twins of issue 39.
ALL_CONDITIONS: dict[str, Condition] = {**CONDITIONS, **OPERATOR_CONDITIONS,
                                        **BASELINE_CONDITIONS, **CHANNEL_CONDITIONS,
                                        **STRICT_OFF_CONDITIONS}

#: Phase-2 seeds of the paper (Appendix "Hyperparameters and Architecture").
PAPER_SEEDS: tuple[int, ...] = (42, 43, 44, 45, 46)

#: The largest seed (Phase-2 seed, `phase1_seed`, Phase-1 seeds) every generator a run seeds
#: accepts: Lightning's `seed_everything` seeds numpy's legacy generator, whose bound is
#: 2**32 - 1 (it raises above it). torch's `manual_seed` takes up to 2**64 - 1 and numpy's
#: `default_rng` (the episode streams) any non-negative integer; the seeds derived from these
#: (`phase1_seed * 7919 + step` for torch, `phase1_seed + 1_000_000` for numpy) stay inside
#: those ranges. So numpy's legacy bound is the binding one.
MAX_SEED = 2**32 - 1


def seed_problem(value, what: str = "seed") -> str | None:
    """Why `value` cannot seed a run (None when it can): a non-negative integer at most
    MAX_SEED."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{what} must be an integer, got {value!r}"
    if not 0 <= value <= MAX_SEED:
        return (f"{what} {value} is outside 0..{MAX_SEED} (2**32 - 1, the range of numpy's "
                "seed, which Lightning's seed_everything uses)")
    return None


def get_condition(name: str) -> Condition:
    if name not in ALL_CONDITIONS:
        raise ValueError(f"unknown condition {name!r}; known: {', '.join(ALL_CONDITIONS)}")
    return ALL_CONDITIONS[name]
