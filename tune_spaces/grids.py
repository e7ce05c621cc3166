"""Experiment grids for Stage 2 of the pipeline: `condition x seed`, plus trial resources.

A grid is a plain function `(cfg, *, gpu) -> Space`. The base function is `default` (the
preset's own `cfg.conditions x cfg.seeds`); the others derive from it with `Space.derive`,
the way torchtitan's experiment configs derive from a base. To add a grid, write a function
here and register it in `SPACES`; `python -m pipelines.run start --grid NAME` picks it.

    def my_grid(cfg, *, gpu=False):
        return default(cfg, gpu=gpu).derive(name="my_grid", seeds=(42, 43, 44))

The library package (`pmnet`) knows nothing about these grids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pmnet.conditions import CONDITIONS, OPERATOR_CONDITIONS, OPERATOR_REFERENCE, PAPER_SEEDS

# the paper's Phase-2 grid (Section 6.2, Table "Parameter-isolation conditions"; Appendix
# "Hyperparameters": seeds 42..46)
PAPER_CONDITIONS: tuple[str, ...] = tuple(CONDITIONS)
# beyond the paper (issue 11): the Consolidator-only arm and one condition per alternative
# consolidation operator, all trained alone from the same Phase-1 checkpoint
OPERATOR_GRID_CONDITIONS: tuple[str, ...] = (OPERATOR_REFERENCE, *OPERATOR_CONDITIONS)


class SpaceError(ValueError):
    """A grid or its resources are invalid (raised before any trial starts)."""


@dataclass(frozen=True)
class Space:
    """One Stage-2 experiment: the grid and how each trial is scheduled.

    conditions, seeds: the grid (every condition runs with every seed).
    cpus_per_trial: CPUs reserved per trial actor (also its torch thread count).
    gpus_per_trial: a fraction of one GPU (0 on CPU machines; 0.25 lets four trials share one
        GPU). Each trial trains on one device, so values above 1 are refused.
    max_concurrent: cap on trials running at once (0: as many as the resources allow).
    max_failures: how often a crashed trial is retried from its last checkpoint.
    """

    name: str
    conditions: tuple[str, ...]
    seeds: tuple[int, ...]
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    max_concurrent: int = 0
    max_failures: int = 2

    def derive(self, **changes: Any) -> Space:
        """A copy with some fields changed (sequences become tuples)."""
        for key in ("conditions", "seeds"):
            if key in changes and changes[key] is not None:
                value = changes[key]
                changes[key] = (value,) if isinstance(value, (str, int)) else tuple(value)
        return dataclasses.replace(self, **changes)

    @property
    def trials(self) -> list[tuple[str, int]]:
        """Every (condition, seed) pair, in the order Tune expands the grid."""
        return [(c, s) for s in self.seeds for c in self.conditions]

    @property
    def n_trials(self) -> int:
        return len(self.conditions) * len(self.seeds)

    def resources(self) -> dict[str, float]:
        res = {"cpu": float(self.cpus_per_trial)}
        if self.gpus_per_trial:
            res["gpu"] = float(self.gpus_per_trial)
        return res

    def param_space(self) -> dict:
        """The Tune search space: a full grid over condition and seed."""
        from ray import tune

        return {"condition": tune.grid_search(list(self.conditions)),
                "seed": tune.grid_search([int(s) for s in self.seeds])}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["conditions"], d["seeds"] = list(self.conditions), list(self.seeds)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Space:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SpaceError(f"unknown Space field(s): {', '.join(sorted(unknown))}")
        return cls(**{**d, "conditions": tuple(d["conditions"]), "seeds": tuple(d["seeds"])})

    def validate(self, known_conditions: Iterable[str]) -> Space:
        """Raise SpaceError naming the first problem; return self when the space is sound."""
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
        dup_s = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if dup_s:
            raise SpaceError(f"grid {self.name!r}: seed(s) listed twice: {dup_s}")
        cpus = _number(self.cpus_per_trial, "cpus_per_trial", self.name)
        if cpus <= 0:
            raise SpaceError(f"grid {self.name!r}: cpus_per_trial must be > 0, got {cpus}")
        gpus = _number(self.gpus_per_trial, "gpus_per_trial", self.name)
        if gpus < 0 or gpus > 1:
            raise SpaceError(
                f"grid {self.name!r}: gpus_per_trial must be a fraction of one GPU in [0, 1] "
                f"(each trial trains on a single device), got {gpus}")
        for field_name in ("max_concurrent", "max_failures"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SpaceError(f"grid {self.name!r}: {field_name} must be a non-negative "
                                 f"integer, got {v!r}")
        return self


def _number(value: Any, what: str, grid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpaceError(f"grid {grid!r}: {what} must be a finite number, got {value!r}")
    return float(value)


# -----------------------------------------------------------------------------------------
# Grid functions
# -----------------------------------------------------------------------------------------


def default(cfg, *, gpu: bool = False) -> Space:
    """The preset's own grid: `cfg.conditions x cfg.seeds`.

    On a GPU machine each trial takes 2 CPUs and a quarter of a GPU (four trials share one
    GPU); on a CPU machine each trial takes one core (two single-threaded trials beat one
    two-threaded trial on a 2-core box, see the spec's cpu-probe findings).
    """
    return Space(
        name="default", conditions=tuple(cfg.conditions), seeds=tuple(cfg.seeds),
        cpus_per_trial=2.0 if gpu else 1.0, gpus_per_trial=0.25 if gpu else 0.0,
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


SPACES: dict[str, Callable[..., Space]] = {
    "default": default, "paper": paper, "tiny": tiny, "core": core, "operators": operators,
}


def get_space(name: str) -> Callable[..., Space]:
    if name not in SPACES:
        raise SpaceError(f"unknown grid {name!r}; known grids: {', '.join(SPACES)}")
    return SPACES[name]
