"""Experiment grids for Stage 2 of the pipeline: `condition x variant x seed`, plus trial
resources.

A grid is a plain function `(cfg, *, gpu) -> Space`. The base function is `default` (the
preset's own `cfg.conditions x cfg.seeds`, one default variant); the others derive from it
with `Space.derive`, the way torchtitan's experiment configs derive from a base. To add a
grid, write a function here and register it in `SPACES`; `python -m pipelines.run start
--grid NAME` picks it.

    def my_grid(cfg, *, gpu=False):
        return default(cfg, gpu=gpu).derive(name="my_grid", seeds=(42, 43, 44))

A `Variant` is a named set of Phase-2 TrainConfig overrides; every trial of the grid runs
once per variant, from the pipeline's one Phase-1 checkpoint (so a variant may set only
Phase-2-only fields). Each trial is a `pmnet.trial_id.TrialId`.

The library package (`pmnet`) knows nothing about these grids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pmnet.conditions import (
    ALL_CONDITIONS,
    BASELINE_CONDITIONS,
    BASELINE_REFERENCES,
    CONDITIONS,
    OPERATOR_CONDITIONS,
    OPERATOR_REFERENCE,
    PAPER_SEEDS,
    PHASE2_ONLY_FIELDS,
    ROUTING_PAIRS,
    STRICT_PAIRS,
    seed_problem,
)
from pmnet.trial_id import DEFAULT_VARIANT, TrialId, grid_size, variant_name_problem

# the paper's Phase-2 grid (Section 6.2, Table "Parameter-isolation conditions"; Appendix
# "Hyperparameters": seeds 42..46)
PAPER_CONDITIONS: tuple[str, ...] = tuple(CONDITIONS)
# beyond the paper (issue 11): the Consolidator-only arm and one condition per alternative
# consolidation operator, all trained alone from the same Phase-1 checkpoint
OPERATOR_GRID_CONDITIONS: tuple[str, ...] = (OPERATOR_REFERENCE, *OPERATOR_CONDITIONS)
# beyond the paper (issue 11, memory episodes of T > 2 segments): the episode lengths and the
# gradient modes across boundaries (`TrainConfig.segments`, `TrainConfig.ltm_graph`) of the
# `segments` grid, in the Consolidator-only setting
SEGMENT_COUNTS: tuple[int, ...] = (2, 4, 8)
# beyond the paper (issue 23): the arms the baselines are compared with (the Consolidator and
# the GRU operator), then every baseline, all from the same Phase-1 checkpoint
BASELINE_GRID_CONDITIONS: tuple[str, ...] = (*BASELINE_REFERENCES, *BASELINE_CONDITIONS)
# the fewest Phase-2 seeds of the baselines grid (paired tests need more than two)
BASELINE_MIN_SEEDS = 3
SEGMENT_GRAPHS: tuple[str, ...] = ("full", "truncated")
SEGMENT_CONDITIONS: tuple[str, ...] = (OPERATOR_REFERENCE,)
# the Phase-1 variance grid (issue 11): K = 3 Phase-1 checkpoints, the preset's grid under each
# (seed 0 is every preset's own `phase1_seed`, so its checkpoint is the usual one)
PHASE1_VARIANCE_SEEDS: tuple[int, ...] = (0, 1, 2)
# the checkpoint study (issue 39): the routing effect's distribution over K = 10 Phase-1
# checkpoints, both Consolidator-only arms, two Phase-2 seeds each (the between-checkpoint SD
# decides how many checkpoints a claim needs; more seeds per checkpoint barely help)
CHECKPOINT_STUDY_SEEDS: tuple[int, ...] = tuple(range(10))
CHECKPOINT_STUDY_CONDITIONS: tuple[str, ...] = ("consolidator_only",
                                                "consolidator_only_routing_off")
CHECKPOINT_STUDY_PHASE2_SEEDS = 2
# "can anything use the channel?" (issue 39): every arm with a routing-off twin (the
# Consolidator, the GRU operator, `memory_consolidator` with router and memory trainable),
# routing on and off, under the first 5 of the study's checkpoints
CHECKPOINT_CHANNEL_SEEDS: tuple[int, ...] = CHECKPOINT_STUDY_SEEDS[:5]
CHECKPOINT_CHANNEL_CONDITIONS: tuple[str, ...] = (
    *(c for pair in ROUTING_PAIRS.items() for c in pair), *STRICT_PAIRS.values())
# the scale ladder (issue 52): what each rung reports, from one Phase-2 seed under two Phase-1
# checkpoints: both Consolidator-only arms, the trainable-memory arm and the GRU operator
# (routing off; every trial's evaluation also gives forced identity). Phase-1 seeds 1 and 2:
# the run that chose the `small` rung's Phase-1 budget on validation was seed 0's.
LADDER_CONDITIONS: tuple[str, ...] = ("consolidator_only", "consolidator_only_routing_off",
                                      "memory_consolidator", "operator_gru_routing_off")
LADDER_PHASE1_SEEDS: tuple[int, ...] = (1, 2)

# the decisive test at the paper's Phase-2 budget (issue 61): both Consolidator-only arms
# trained on ADD10 episodes only (the family every backbone reads near 100%, where the
# paper's routing-off arm sits at the either-rule level, 52.5%, and routing on at 99.0%), at
# a constant rate after warmup, validated every 500 steps of batch 64 (32,000 episodes),
# early stopped on validation ADD10 with the paper's patience (6), up to 640,000 episodes
# (10x the `cpu` recipe's 64,000; the paper: up to 6M)
ADD10_LONG_CONDITIONS: tuple[str, ...] = CHECKPOINT_STUDY_CONDITIONS
ADD10_LONG_RECIPE: dict[str, Any] = {
    "phase2_families": "add10", "lr_schedule": "constant", "episodes_per_epoch": 32_000,
    "max_epochs": 20, "patience": 6}
# claim 4 of docs/preregistration.md (secondary): the same recipe on both rule families
# (validation selection then reads overall updated-LTM recall), the Consolidator alone with
# routing on
BOTH_LONG_CONDITIONS: tuple[str, ...] = ("consolidator_only",)
BOTH_LONG_RECIPE: dict[str, Any] = {k: v for k, v in ADD10_LONG_RECIPE.items()
                                    if k != "phase2_families"}


@dataclass(frozen=True)
class Phase1Gate:
    """A bar a landed Phase-1 checkpoint must reach before the grid trains any trial on it.

    metric: a column of the checkpoint's validation history (`phase1_metrics.json`), read at
        its selected epoch (`best_epoch`), in percent.
    minimum: the bar; a checkpoint below it keeps its unit in the store, and its trials are
        held back (`pipelines.store.gated`): they enter no claim, so they are not trained.
    """

    metric: str
    minimum: float

    def reading(self, metrics: Mapping) -> float:
        """The metric at the selected epoch of a `phase1_metrics.json` record."""
        best = next(r for r in metrics["history"] if r["epoch"] == metrics["best_epoch"])
        return float(best[self.metric])

    def describe(self, value: float) -> str:
        return f"{self.metric} {value:.2f} < {self.minimum:g} at its selected epoch"


# docs/preregistration.md: a confirmatory checkpoint needs validation ADD10 STM >= 99% at its
# selected epoch; one below is reported and replaced, its arms not trained (also
# experiments/confirmatory.py's reading)
CONFIRMATORY_PHASE1_GATE = Phase1Gate("val/mean_stm_add10", 99.0)

#: TrainConfig fields a variant may set: the Phase-2-only ones (every trial starts from the
#: pipeline's one Phase-1 checkpoint), except what the grid itself decides (its conditions,
#: seeds and Phase-1 checkpoints, the trial's threads) and the preset's notes
GRID_DECIDED_FIELDS: tuple[str, ...] = ("seeds", "conditions", "threads", "notes",
                                        "phase1_seeds")
VARIANT_FIELDS: tuple[str, ...] = tuple(f for f in PHASE2_ONLY_FIELDS
                                        if f not in GRID_DECIDED_FIELDS)


class SpaceError(ValueError):
    """A grid or its resources are invalid (raised before any trial starts)."""


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, str)) or (
        isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True)
class Variant:
    """A named set of Phase-2 TrainConfig overrides: `Variant("T4-truncated", {"segments": 4,
    "ltm_graph": "truncated"})`. The default variant `Variant()` (name "") has none: the
    pipeline's own configuration, and trial names without a variant part.

    `overrides` is given as a mapping and kept as sorted (field, value) pairs (hashable,
    equal whatever the order it was given in); values are JSON scalars. Whether the fields
    may be set and give a valid TrainConfig is checked by `Space.validate`, which names the
    grid.
    """

    name: str = DEFAULT_VARIANT
    overrides: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()  # stored as sorted pairs

    def __post_init__(self):
        problem = variant_name_problem(self.name)
        if problem:
            raise SpaceError(problem)
        try:
            items = (self.overrides.items() if isinstance(self.overrides, Mapping)
                     else tuple(self.overrides))
            pairs = tuple(sorted((k, v) for k, v in items))
        except (TypeError, ValueError) as e:
            raise SpaceError(f"variant {self.name!r}: overrides must be a mapping of "
                             f"TrainConfig field -> value, got {self.overrides!r}") from e
        for key, value in pairs:
            if not isinstance(key, str):
                raise SpaceError(f"variant {self.name!r}: a field name must be a string, "
                                 f"got {key!r}")
            if not _scalar(value):
                raise SpaceError(f"variant {self.name!r}: {key} must be a single JSON value "
                                 f"(number, string, boolean or null), got {value!r}")
        if len({k for k, _ in pairs}) != len(pairs):
            raise SpaceError(f"variant {self.name!r}: a field is set twice in {pairs}")
        if self.name == DEFAULT_VARIANT and pairs:
            raise SpaceError(f"the default variant (no name) cannot set fields, got "
                             f"{dict(pairs)}; give the variant a name")
        object.__setattr__(self, "overrides", pairs)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.overrides)

    def describe(self) -> str:
        """`T4-truncated (ltm_graph=truncated, segments=4)`, or `default` for Variant()."""
        if not self.name:
            return "default"
        sets = ", ".join(f"{k}={v}" for k, v in self.overrides)
        return f"{self.name} ({sets})" if sets else self.name

    def apply(self, cfg):
        """The trial's TrainConfig: the pipeline's `cfg` with this variant's overrides
        (TrainConfig validates the result; ValueError if it is not valid)."""
        return dataclasses.replace(cfg, **self.as_dict()) if self.overrides else cfg

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "overrides": self.as_dict()}

    @classmethod
    def from_dict(cls, d: Any) -> Variant:
        if not isinstance(d, Mapping) or set(d) - {"name", "overrides"}:
            raise SpaceError(f"a variant record must be {{'name': ..., 'overrides': {{...}}}}, "
                             f"got {d!r}")
        return cls(d.get("name", DEFAULT_VARIANT), d.get("overrides") or {})


DEFAULT_VARIANTS: tuple[Variant, ...] = (Variant(),)


@dataclass(frozen=True)
class Space:
    """One Stage-2 experiment: the grid and how each trial is scheduled.

    conditions, seeds, variants: the grid (every condition runs with every variant and every
        seed); `variants` defaults to the one default variant (the pipeline's configuration).
    cpus_per_trial: CPUs reserved per trial actor (also its torch thread count).
    gpus_per_trial: a fraction of one GPU (0 on CPU machines; 0.25 lets four trials share one
        GPU). Each trial trains on one device, so values above 1 are refused.
    max_concurrent: cap on trials running at once (0: as many as the resources allow).
    max_failures: how often a crashed trial is retried from its last checkpoint.

    phase1_seeds: empty (the paper's protocol: every trial starts from the pipeline's one
        Phase-1 checkpoint), or K Phase-1 seeds: Stage 1 trains one checkpoint per seed
        (`TrainConfig.phase1_seed = k`) and the whole grid is nested under each
        (`TrialId.phase1_seed`), for the Phase-1 variance analysis (issue 11).
    gpu_shares: the GPU fraction of each arm, (condition, variant name, fraction), chosen by
        planning from the memory model so that trials sharing a card fit it
        (`pipelines.plan`); empty: every trial asks `gpus_per_trial`. With shares,
        `gpus_per_trial` is the largest of them.
    diagnose: conditions whose trials get `pmnet diagnose` of their best model after they
        train (`pmnet.diagnose.diagnose_file`), at the grid's first Phase-2 seed only (what
        the checkpoint study diagnosed), published beside the result as
        `diagnostics/<trial>.json` of a store (`pipelines.store`); each must be a condition
        of the grid.
    phase1_gate: a Phase1Gate, or None: no trial is trained on a landed Phase-1 checkpoint
        below it (the driver says which and why; `pipelines.store.gated`).
    """

    name: str
    conditions: tuple[str, ...]
    seeds: tuple[int, ...]
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    max_concurrent: int = 0
    max_failures: int = 2
    variants: tuple[Variant, ...] = field(default=DEFAULT_VARIANTS)
    phase1_seeds: tuple[int, ...] = ()
    gpu_shares: tuple[tuple[str, str, float], ...] = ()
    diagnose: tuple[str, ...] = ()
    phase1_gate: Phase1Gate | None = None

    def derive(self, **changes: Any) -> Space:
        """A copy with some fields changed (sequences become tuples)."""
        for key in ("conditions", "seeds", "variants", "phase1_seeds", "diagnose"):
            if key in changes and changes[key] is not None:
                value = changes[key]
                single = (str, int, Variant)
                changes[key] = (value,) if isinstance(value, single) else tuple(value)
        return dataclasses.replace(self, **changes)

    @property
    def has_variants(self) -> bool:
        """Whether the grid has more than the one default variant."""
        return tuple(self.variants) != DEFAULT_VARIANTS

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise SpaceError(f"grid {self.name!r} has no variant {name!r}; its variants: "
                         f"{', '.join(self.variant_names) or '(none)'}")

    def only_variants(self, names: Iterable[str]) -> Space:
        """The grid narrowed to the named variants, in the grid's order (`--variants`)."""
        names = list(names)
        unknown = [n for n in names if n not in self.variant_names]
        if unknown:
            known = ", ".join(repr(n) for n in self.variant_names if n) or (
                "none: this grid has only the default variant")
            raise SpaceError(f"grid {self.name!r}: unknown variant(s) {unknown}; known "
                             f"variants: {known}")
        return self.derive(variants=[v for v in self.variants if v.name in names])

    def trial_config(self, cfg, trial: TrialId, *, threads: int = 0):
        """The TrainConfig `trial` trains with, built in this one place (issue 51): the
        pipeline's `cfg` with the trial's variant's overrides (`Variant.apply`), its Phase-1
        checkpoint's own `phase1_seed`, and `threads` (the trial's CPUs) where the preset
        leaves them to the pipeline. SpaceError (a ValueError) for a variant the grid lacks,
        ValueError for a config TrainConfig refuses."""
        out = self.variant(trial.variant).apply(cfg)
        if trial.phase1_seed is not None:
            out = dataclasses.replace(out, phase1_seed=trial.phase1_seed)
        if threads and not out.threads:
            out = dataclasses.replace(out, threads=int(threads))
        return out

    def diagnosed(self, trial: TrialId) -> bool:
        """Whether `trial` gets `pmnet diagnose` of its best model (`diagnose`: its condition
        is declared, and its seed is the grid's first Phase-2 seed)."""
        return trial.condition in self.diagnose and bool(self.seeds) \
            and trial.seed == self.seeds[0]

    @property
    def phase1_keys(self) -> list[int | None]:
        """The Phase-1 checkpoints the trials start from (None: the pipeline's only one)."""
        return [int(k) for k in self.phase1_seeds] or [None]

    @property
    def trials(self) -> list[TrialId]:
        """Every trial, in the order Tune expands the grid (`param_space`; Tune takes the keys
        in sorted order: the condition varies fastest, then the Phase-1 seed, then the seed,
        then the variant)."""
        return [TrialId(c, int(s), v.name, k) for v in self.variants for s in self.seeds
                for k in self.phase1_keys for c in self.conditions]

    @property
    def n_trials(self) -> int:
        return (len(self.conditions) * len(self.seeds) * len(self.variants)
                * len(self.phase1_keys))

    @property
    def size(self) -> str:
        """`2 conditions x 3 seeds x 3 Phase-1 checkpoints = 18 trials` (variants and Phase-1
        checkpoints named only where the grid has them)."""
        return grid_size(len(self.conditions), len(self.seeds),
                         len(self.variants) if self.has_variants else 0, len(self.phase1_seeds))

    def resources(self) -> dict[str, float]:
        """The uniform request (`cpu`, and `gpu` = gpus_per_trial when set); with GPU shares
        each trial asks `resources_for(trial)`."""
        res = {"cpu": float(self.cpus_per_trial)}
        if self.gpus_per_trial:
            res["gpu"] = float(self.gpus_per_trial)
        return res

    def gpus_for(self, trial: TrialId) -> float:
        """The GPU fraction `trial` asks for: its arm's share, else `gpus_per_trial`."""
        for condition, variant, share in self.gpu_shares:
            if condition == trial.condition and variant == trial.variant:
                return float(share)
        return float(self.gpus_per_trial)

    def resources_for(self, trial: TrialId) -> dict[str, float]:
        """Tune's resource dict of one trial (`cpu`, and `gpu` when it has a share)."""
        res = {"cpu": float(self.cpus_per_trial)}
        if self.gpus_for(trial):
            res["gpu"] = self.gpus_for(trial)
        return res

    def describe_resources(self) -> str:
        """`2 CPU + 0.25 GPU per trial`, or with shares per arm
        `2 CPU per trial; GPU share: learned_full 1, consolidator_only 0.3333`."""
        if not self.gpu_shares:
            gpu = f" + {self.gpus_per_trial:g} GPU" if self.gpus_per_trial else ""
            return f"{self.cpus_per_trial:g} CPU{gpu} per trial"
        shares = ", ".join(f"{c}{'-' + v if v else ''} {g:g}" for c, v, g in self.gpu_shares)
        return f"{self.cpus_per_trial:g} CPU per trial; GPU share: {shares}"

    def param_space(self) -> dict:
        """The Tune search space: a full grid over condition (x variant) x seed; the keys are
        `TrialId.to_config`'s (no variant key for a grid of the default variant only)."""
        from ray import tune

        space = {"condition": tune.grid_search(list(self.conditions))}
        if self.has_variants:
            space["variant"] = tune.grid_search(self.variant_names)
        if self.phase1_seeds:
            space["phase1_seed"] = tune.grid_search([int(k) for k in self.phase1_seeds])
        space["seed"] = tune.grid_search([int(s) for s in self.seeds])
        return space

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["conditions"], d["seeds"] = list(self.conditions), list(self.seeds)
        d["variants"] = [v.to_dict() for v in self.variants]
        d["phase1_seeds"] = [int(k) for k in self.phase1_seeds]
        d["gpu_shares"] = [[c, v, float(g)] for c, v, g in self.gpu_shares]
        d["diagnose"] = list(self.diagnose)
        if d["phase1_gate"] is None:  # an ungated grid's record is what it was before gates
            del d["phase1_gate"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Space:
        """Read back `to_dict` (a space stored before variants existed has one default
        variant)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SpaceError(f"unknown Space field(s): {', '.join(sorted(unknown))}")
        variants = d.get("variants")
        if variants is None:
            variants = DEFAULT_VARIANTS
        elif isinstance(variants, (list, tuple)):
            variants = tuple(Variant.from_dict(v) for v in variants)
        else:
            raise SpaceError(f"Space.variants must be a list of variant records, got "
                             f"{variants!r}")
        shares = d.get("gpu_shares") or ()
        try:
            shares = tuple((str(c), str(v), float(g)) for c, v, g in shares)
        except (TypeError, ValueError) as e:
            raise SpaceError(f"Space.gpu_shares must be [condition, variant, fraction] "
                             f"records, got {d.get('gpu_shares')!r}") from e
        gate = d.get("phase1_gate")  # None: a space stored before gates existed
        try:
            gate = None if gate is None else Phase1Gate(str(gate["metric"]),
                                                        float(gate["minimum"]))
        except (TypeError, KeyError, ValueError) as e:
            raise SpaceError(f"Space.phase1_gate must be {{'metric': ..., 'minimum': ...}}, "
                             f"got {gate!r}") from e
        return cls(**{**d, "conditions": tuple(d["conditions"]), "seeds": tuple(d["seeds"]),
                      "variants": variants, "phase1_seeds": tuple(d.get("phase1_seeds") or ()),
                      "gpu_shares": shares, "diagnose": tuple(d.get("diagnose") or ()),
                      "phase1_gate": gate})

    def validate(self, known_conditions: Iterable[str], cfg=None) -> Space:
        """Raise SpaceError naming the first problem; return self when the space is sound.
        With `cfg` (the pipeline's TrainConfig), each variant's TrainConfig is built too, so a
        variant that makes it invalid is refused before any compute."""
        known = list(known_conditions)
        if isinstance(self.conditions, str) or not self.conditions:
            raise SpaceError(f"grid {self.name!r}: the condition list is empty")
        unknown = [c for c in self.conditions if c not in known]
        if unknown:
            raise SpaceError(f"grid {self.name!r}: unknown condition(s) {unknown}; "
                             f"known conditions: {', '.join(known)}")
        dup = sorted({c for c in self.conditions if self.conditions.count(c) > 1})
        if dup:
            raise SpaceError(f"grid {self.name!r}: condition(s) listed twice: {dup}")
        if not self.seeds:
            raise SpaceError(f"grid {self.name!r}: the seed list is empty; give at least one "
                             "Phase-2 seed (the paper uses 42..46)")
        bad = [s for s in self.seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise SpaceError(f"grid {self.name!r}: seeds must be non-negative integers, "
                             f"got {bad}")
        out_of_range = [seed_problem(s, "seed") for s in self.seeds if seed_problem(s)]
        if out_of_range:
            raise SpaceError(f"grid {self.name!r}: {out_of_range[0]}")
        dup_s = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if dup_s:
            raise SpaceError(f"grid {self.name!r}: seed(s) listed twice: {dup_s}")
        self._validate_variants(cfg)
        p1 = self.phase1_seeds
        if isinstance(p1, (str, int)) or not isinstance(p1, (tuple, list)):
            raise SpaceError(f"grid {self.name!r}: phase1_seeds must be a list of Phase-1 "
                             f"seeds, got {p1!r}")
        bad = [k for k in p1 if isinstance(k, bool) or not isinstance(k, int) or k < 0]
        if bad:
            raise SpaceError(f"grid {self.name!r}: Phase-1 seeds must be non-negative "
                             f"integers, got {bad}")
        out_of_range = [seed_problem(k, "Phase-1 seed") for k in p1 if seed_problem(k)]
        if out_of_range:
            raise SpaceError(f"grid {self.name!r}: {out_of_range[0]}")
        dup_p = sorted({k for k in p1 if list(p1).count(k) > 1})
        if dup_p:
            raise SpaceError(f"grid {self.name!r}: Phase-1 seed(s) listed twice: {dup_p}")
        cpus = _number(self.cpus_per_trial, "cpus_per_trial", self.name)
        if cpus <= 0:
            raise SpaceError(f"grid {self.name!r}: cpus_per_trial must be > 0, got {cpus}")
        gpus = _number(self.gpus_per_trial, "gpus_per_trial", self.name)
        if gpus < 0 or gpus > 1:
            raise SpaceError(
                f"grid {self.name!r}: gpus_per_trial must be a fraction of one GPU in [0, 1] "
                f"(each trial trains on a single device), got {gpus}")
        for condition, variant, share in self.gpu_shares:
            if condition not in self.conditions or variant not in self.variant_names:
                raise SpaceError(f"grid {self.name!r}: a GPU share names an arm that is not in "
                                 f"the grid: {condition!r}, variant {variant!r}")
            if not 0 < _number(share, "a GPU share", self.name) <= 1:
                raise SpaceError(f"grid {self.name!r}: the GPU share of {condition!r} must be "
                                 f"in (0, 1], got {share}")
        if isinstance(self.diagnose, str) or not all(isinstance(c, str) for c in self.diagnose):
            raise SpaceError(f"grid {self.name!r}: diagnose must be a list of conditions, got "
                             f"{self.diagnose!r}")
        stray = [c for c in self.diagnose if c not in self.conditions]
        if stray:
            raise SpaceError(f"grid {self.name!r}: diagnose names condition(s) {stray} that "
                             f"the grid does not run (its conditions: "
                             f"{', '.join(self.conditions)})")
        gate = self.phase1_gate
        if gate is not None and not (isinstance(gate, Phase1Gate) and gate.metric.startswith(
                "val/") and math.isfinite(_number(gate.minimum, "the Phase-1 gate", self.name))):
            raise SpaceError(f"grid {self.name!r}: phase1_gate must be a Phase1Gate on a "
                             f"validation metric ('val/...'), got {gate!r}")
        for field_name in ("max_concurrent", "max_failures"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SpaceError(f"grid {self.name!r}: {field_name} must be a non-negative "
                                 f"integer, got {v!r}")
        return self

    def _validate_variants(self, cfg) -> None:
        grid = f"grid {self.name!r}"
        if isinstance(self.variants, Variant) or not self.variants:
            raise SpaceError(f"{grid}: the variant list is empty (a grid without variants has "
                             "the one default variant, Variant())")
        if not all(isinstance(v, Variant) for v in self.variants):
            raise SpaceError(f"{grid}: variants must be Variant(name, overrides), got "
                             f"{list(self.variants)!r}")
        folded = [v.name.lower() for v in self.variants]  # trial directories: case-blind too
        dup = sorted({v.name for v in self.variants if folded.count(v.name.lower()) > 1})
        if dup:
            raise SpaceError(f"{grid}: variant name(s) listed twice (letter case ignored, "
                             f"they name directories): {dup}")
        for v in self.variants:
            for key, _ in v.overrides:
                if key in GRID_DECIDED_FIELDS:
                    raise SpaceError(
                        f"{grid}: variant {v.name!r} sets {key!r}, which the grid itself "
                        f"decides ({', '.join(GRID_DECIDED_FIELDS)}); a variant may set only: "
                        f"{', '.join(VARIANT_FIELDS)}")
                if key not in VARIANT_FIELDS:
                    raise SpaceError(
                        f"{grid}: variant {v.name!r} sets {key!r}, which is not a Phase-2-only "
                        "TrainConfig field: every trial of a pipeline starts from its one "
                        f"Phase-1 checkpoint, so a variant may set only: "
                        f"{', '.join(VARIANT_FIELDS)}")
            if cfg is not None:
                try:
                    v.apply(cfg)
                except (TypeError, ValueError) as e:
                    raise SpaceError(f"{grid}: variant {v.describe()} gives an invalid "
                                     f"training configuration: {e}") from e


def _number(value: Any, what: str, grid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpaceError(f"grid {grid!r}: {what} must be a finite number, got {value!r}")
    return float(value)


# -----------------------------------------------------------------------------------------
# Grid functions
# -----------------------------------------------------------------------------------------


def default(cfg, *, gpu: bool = False) -> Space:
    """The preset's own grid: `cfg.conditions x cfg.seeds`, nested under the preset's Phase-1
    checkpoints `cfg.phase1_seeds` when it names them (every grid derived from this one
    inherits them; none: the paper's single checkpoint).

    On a GPU machine each trial takes 2 CPUs and a quarter of a GPU (four trials share one
    GPU); on a CPU machine each trial takes one core (two single-threaded trials beat one
    two-threaded trial on a 2-core box, see the spec's cpu-probe findings).
    """
    return Space(
        name="default", conditions=tuple(cfg.conditions), seeds=tuple(cfg.seeds),
        cpus_per_trial=2.0 if gpu else 1.0, gpus_per_trial=0.25 if gpu else 0.0,
        phase1_seeds=tuple(getattr(cfg, "phase1_seeds", ()) or ()),
    )


def paper(cfg, *, gpu: bool = False) -> Space:
    """The paper's grid whatever the preset: six conditions x seeds 42..46 = 30 trials."""
    return default(cfg, gpu=gpu).derive(name="paper", conditions=PAPER_CONDITIONS,
                                        seeds=PAPER_SEEDS)


def tiny(cfg, *, gpu: bool = False) -> Space:
    """Two conditions x the preset's first two seeds (tests, smoke runs)."""
    return default(cfg, gpu=gpu).derive(
        name="tiny", conditions=("learned_full", "consolidator_only"), seeds=tuple(cfg.seeds)[:2])


def core(cfg, *, gpu: bool = False) -> Space:
    """The single-objective conditions only (no dual objective) over the preset's seeds."""
    base = default(cfg, gpu=gpu)
    return base.derive(name="core",
                       conditions=[c for c in base.conditions if c != "learned_full_dual"])


def operators(cfg, *, gpu: bool = False) -> Space:
    """The preset's seeds x (consolidator_only + the four operator conditions): each
    alternative consolidation operator against the Consolidator (`pmnet.report`'s operators
    table and paired comparisons)."""
    return default(cfg, gpu=gpu).derive(name="operators", conditions=OPERATOR_GRID_CONDITIONS)


def baselines(cfg, *, gpu: bool = False) -> Space:
    """Task-matched baselines (issue 23): the Consolidator-only arm, the GRU operator and the
    four baselines of `pmnet.baselines` (no reset, memory tokens, recurrent state, no
    memory), paired by seed, from one Phase-1 checkpoint (the preset's `phase1_seed`: the
    baselines are compared with the Consolidator, not across checkpoints; `--phase1-seeds`
    nests them under K). The preset's seeds, at least BASELINE_MIN_SEEDS of PAPER_SEEDS."""
    seeds = tuple(cfg.seeds)
    if len(seeds) < BASELINE_MIN_SEEDS:
        seeds = seeds + tuple(s for s in PAPER_SEEDS if s not in seeds)
        seeds = seeds[:BASELINE_MIN_SEEDS]
    return default(cfg, gpu=gpu).derive(name="baselines", conditions=BASELINE_GRID_CONDITIONS,
                                        seeds=seeds, phase1_seeds=())


def segment_variants(counts: Iterable[int] = SEGMENT_COUNTS,
                     graphs: Iterable[str] = SEGMENT_GRAPHS) -> tuple[Variant, ...]:
    """One variant per (T, gradient mode): `T<T>-<mode>` sets `segments` and `ltm_graph`."""
    graphs = tuple(graphs)
    return tuple(Variant(f"T{t}-{g}", {"segments": int(t), "ltm_graph": g})
                 for t in counts for g in graphs)


def segments(cfg, *, gpu: bool = False) -> Space:
    """Memory episodes of T segments (issue 11): `consolidator_only` x T in SEGMENT_COUNTS x
    `ltm_graph` in SEGMENT_GRAPHS (the full graph across boundaries, the paper's setting, and
    truncated BPTT) x the preset's seeds; variants `T2-full`, `T2-truncated`, `T4-full`, ...

    Cost grows about linearly in T: every training and evaluation episode runs T segments,
    so a trial of T segments costs about T/2 two-segment trials, and one seed of this grid
    about 2 x (1 + 2 + 4) = 14 (the same budget per trial: `episodes_per_epoch`, `max_epochs`).
    Narrow it with `--variants T2-full,T4-full` or `--seeds`."""
    return default(cfg, gpu=gpu).derive(name="segments", conditions=SEGMENT_CONDITIONS,
                                        variants=segment_variants())


def phase1_variance(cfg, *, gpu: bool = False) -> Space:
    """The preset's grid nested under K Phase-1 checkpoints (PHASE1_VARIANCE_SEEDS): Stage 1
    trains one checkpoint per Phase-1 seed, every (condition, seed) trial runs from each, and
    the report adds the headline effects with the checkpoint as a random factor
    (`pmnet.stats.phase1_variance`) beside the paper's fixed-checkpoint tests. Costs K Phase-1
    trainings and K times the trials; `--phase1-seeds` nests any grid the same way."""
    return default(cfg, gpu=gpu).derive(name="phase1_variance",
                                        phase1_seeds=PHASE1_VARIANCE_SEEDS)


def checkpoints(cfg, *, gpu: bool = False) -> Space:
    """The checkpoint study (issue 39): both Consolidator-only arms (routing on and off) x
    the first CHECKPOINT_STUDY_PHASE2_SEEDS of the preset's seeds, nested under K = 10
    Phase-1 checkpoints (CHECKPOINT_STUDY_SEEDS; `--phase1-seeds` sets others). The report
    adds the effects' distribution over the checkpoints (`tab:checkpoint-distribution`,
    `tab:checkpoint-effects`, `fig-checkpoints`: each checkpoint's effect with its CI, the
    mean with the checkpoint as a random factor, the between-checkpoint SD, and how many
    checkpoints a study needs). On `cpu`: 10 Phase-1 trainings and 40 trials."""
    return default(cfg, gpu=gpu).derive(
        name="checkpoints", conditions=CHECKPOINT_STUDY_CONDITIONS,
        seeds=tuple(cfg.seeds)[:CHECKPOINT_STUDY_PHASE2_SEEDS],
        phase1_seeds=CHECKPOINT_STUDY_SEEDS, diagnose=CHECKPOINT_STUDY_CONDITIONS)


def checkpoint_channel(cfg, *, gpu: bool = False) -> Space:
    """Can anything use the routing channel? (issue 39): the Consolidator, the GRU operator
    and `memory_consolidator` (router and memory trainable), each with routing on and off
    (`pmnet.conditions.ROUTING_PAIRS`), and the strict-off twins of the Consolidator and
    `memory_consolidator` (no router sees L; `STRICT_PAIRS`), x the first
    CHECKPOINT_STUDY_PHASE2_SEEDS of the preset's seeds, nested under K = 5 Phase-1
    checkpoints (CHECKPOINT_CHANNEL_SEEDS; `--phase1-seeds` sets others). The report's
    checkpoint section gives each arm's routing effect over the checkpoints and what L
    through u is worth (off - strict off). On `cpu`: 5 Phase-1 trainings and 80 trials."""
    return default(cfg, gpu=gpu).derive(
        name="checkpoint_channel", conditions=CHECKPOINT_CHANNEL_CONDITIONS,
        seeds=tuple(cfg.seeds)[:CHECKPOINT_STUDY_PHASE2_SEEDS],
        phase1_seeds=CHECKPOINT_CHANNEL_SEEDS, diagnose=CHECKPOINT_CHANNEL_CONDITIONS)


def ladder(cfg, *, gpu: bool = False) -> Space:
    """A rung of the scale ladder (issue 52): LADDER_CONDITIONS x the preset's first seed,
    nested under the Phase-1 checkpoints LADDER_PHASE1_SEEDS (`--phase1-seeds` sets others).
    Each trial's evaluation gives per-family recall beside its output-set baseline and the
    forced-identity pass; `experiments/issue52_ladder.py` reads the rungs' stores together.
    On `small`: 2 Phase-1 trainings and 8 trials."""
    return default(cfg, gpu=gpu).derive(
        name="ladder", conditions=LADDER_CONDITIONS, seeds=tuple(cfg.seeds)[:1],
        phase1_seeds=LADDER_PHASE1_SEEDS)


def add10_long(cfg, *, gpu: bool = False) -> Space:
    """The decisive test (issue 61): ADD10_LONG_CONDITIONS x the preset's first seed in one
    variant, `add10-long` (ADD10_LONG_RECIPE), under the preset's Phase-1 checkpoints
    (`--phase1-seeds` picks them: `cpu` ran 0, 1, 3, `medium` 2, each with validation ADD10
    STM >= 99%). Both arms' best models are diagnosed (the mechanism: `pmnet diagnose`). No
    trial trains on a checkpoint below CONFIRMATORY_PHASE1_GATE. On `cpu`: 3 Phase-1
    trainings and 6 trials of up to 10,000 steps."""
    return default(cfg, gpu=gpu).derive(
        name="add10_long", conditions=ADD10_LONG_CONDITIONS, seeds=tuple(cfg.seeds)[:1],
        variants=(Variant("add10-long", ADD10_LONG_RECIPE),), diagnose=ADD10_LONG_CONDITIONS,
        phase1_gate=CONFIRMATORY_PHASE1_GATE)


def both_long(cfg, *, gpu: bool = False) -> Space:
    """Claim 4 of the pre-registration (issue 61): BOTH_LONG_CONDITIONS x the preset's first
    seed in one variant, `both-long` (BOTH_LONG_RECIPE: `add10_long`'s recipe on both rule
    families), under the preset's Phase-1 checkpoints (`--phase1-seeds`; the confirmatory
    run: `medium`'s 3-7, into the same store as its `add10_long` units). Diagnosed and gated
    like `add10_long`'s arms."""
    return default(cfg, gpu=gpu).derive(
        name="both_long", conditions=BOTH_LONG_CONDITIONS, seeds=tuple(cfg.seeds)[:1],
        variants=(Variant("both-long", BOTH_LONG_RECIPE),), diagnose=BOTH_LONG_CONDITIONS,
        phase1_gate=CONFIRMATORY_PHASE1_GATE)


SPACES: dict[str, Callable[..., Space]] = {
    "default": default, "paper": paper, "tiny": tiny, "core": core, "operators": operators,
    "segments": segments, "phase1_variance": phase1_variance, "baselines": baselines,
    "checkpoints": checkpoints, "checkpoint_channel": checkpoint_channel, "ladder": ladder,
    "add10_long": add10_long, "both_long": both_long,
}


#: The preset `grids_running` reads every grid at: the paper's conditions and seeds, one
#: Phase-1 checkpoint (what the grid functions read of a TrainConfig).
_PAPER_PRESET = dataclasses.make_dataclass(
    "PaperPreset", [("conditions", tuple, field(default=PAPER_CONDITIONS)),
                    ("seeds", tuple, field(default=PAPER_SEEDS)),
                    ("phase1_seeds", tuple, field(default=()))])


def grids_running(conditions: Iterable[str]) -> tuple[str, ...]:
    """The grids (names of SPACES, in its order) whose trials run every one of `conditions` in
    the default variant (the one the paper's tables read), each grid read at the paper
    preset's conditions and seeds. `default` is left out (it is the preset's own grid: what
    it runs depends on the preset), and so is a grid that runs a condition only in named
    variants (`segments`). The report names these under a table whose rows did not run."""
    wanted = set(conditions)
    out = []
    for name, grid in SPACES.items():
        if name == "default":
            continue
        space = grid(_PAPER_PRESET())
        if wanted <= set(space.conditions) and any(not v.name for v in space.variants):
            out.append(name)
    return tuple(out)


def report_grid_map() -> dict[str, tuple[str, ...]]:
    """Every condition (`pmnet.conditions.ALL_CONDITIONS`) -> `grids_running([it])`: the
    table `pmnet.report.grid_map.GRIDS_RUNNING` holds (the report may not import this
    package; a test holds the two equal, `python -m tune_spaces.grid_map` writes it)."""
    return {c: grids_running([c]) for c in ALL_CONDITIONS}


def get_space(name: str) -> Callable[..., Space]:
    if name not in SPACES:
        raise SpaceError(f"unknown grid {name!r}; known grids: {', '.join(SPACES)}")
    return SPACES[name]
