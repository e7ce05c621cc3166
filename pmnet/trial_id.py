"""The identity of one Phase-2 trial: `TrialId(condition, seed, variant, phase1_seed)`.

The one place that says what tells two trials apart. Everything that names, finds or groups
trials uses it: the pipeline's paths and MLflow keys (`pipelines.layout`), the Tune config of
a trial (`to_config` / `from_config`), the grids (`tune_spaces.Space.trials`), the status
table, and the tidy results table (`pmnet.stats.load_results`, from a result file's keys with
`from_result`). A new axis is a new field here (with its name segment, its validation and its
config / result keys), not a new argument threaded through every function.

    condition    a Phase-2 condition (`pmnet.conditions`); letters, digits and '_'
    seed         the Phase-2 seed (a non-negative integer)
    variant      a named set of Phase-2 TrainConfig overrides (`tune_spaces.Variant`);
                 "" is the default variant: the pipeline's own configuration
    phase1_seed  which Phase-1 checkpoint the trial starts from, in a grid nested under K
                 checkpoints (`Space.phase1_seeds`); None is the pipeline's one checkpoint.

Names (directories, result files, MLflow run names), from left to right:

    <condition>[-<variant>][-p<phase1_seed>]-s<seed>

so the default trial keeps its name `<condition>-s<seed>` (existing runs, resumes and result
files are unchanged). A condition holds no '-', and no '-'-separated part of a variant name is
`s<digits>` or `p<digits>`, so `parse` reads every name back to the one TrialId that wrote it.

The module imports nothing heavy (no torch), so light readers (status, stats) can use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: a condition name: no '-', which separates the parts of a trial name
CONDITION_RE = re.compile(r"^[A-Za-z0-9_]+$")
#: a variant name: '-'-separated parts of letters, digits and '_', starting with a letter
VARIANT_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*$")
VARIANT_MAX_LEN = 48
#: a variant part that would read as a seed or Phase-1 seed segment
_RESERVED_PART = re.compile(r"^[sp][0-9]+$")
_SEED_PART = re.compile(r"^s[0-9]+$")
_PHASE1_PART = re.compile(r"^p[0-9]+$")
DEFAULT_VARIANT = ""


def variant_name_problem(name: Any) -> str | None:
    """Why `name` cannot be a variant name, or None when it can ("" is the default)."""
    if not isinstance(name, str):
        return f"a variant name must be a string, got {name!r}"
    if name == DEFAULT_VARIANT:
        return None
    if len(name) > VARIANT_MAX_LEN:
        return f"variant name {name!r} is longer than {VARIANT_MAX_LEN} characters"
    if not VARIANT_RE.match(name):
        return (f"invalid variant name {name!r}: use letters, digits and '_' in parts joined "
                "by single '-', starting with a letter (e.g. 'T4-truncated')")
    reserved = [p for p in name.split("-") if _RESERVED_PART.match(p)]
    if reserved:
        return (f"invalid variant name {name!r}: a part {reserved[0]!r} would read as a seed "
                "('-s<n>') or Phase-1 seed ('-p<n>') in trial names")
    return None


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class TrialId:
    """One Phase-2 trial (see the module docstring). Invalid fields raise ValueError."""

    condition: str
    seed: int
    variant: str = DEFAULT_VARIANT
    phase1_seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.condition, str) or not CONDITION_RE.match(self.condition):
            raise ValueError(f"TrialId.condition must be a condition name (letters, digits, "
                             f"'_'), got {self.condition!r}")
        if not _non_negative_int(self.seed):
            raise ValueError(f"TrialId.seed must be a non-negative integer, got {self.seed!r}")
        problem = variant_name_problem(self.variant)
        if problem:
            raise ValueError(f"TrialId.variant: {problem}")
        if self.phase1_seed is not None and not _non_negative_int(self.phase1_seed):
            raise ValueError(f"TrialId.phase1_seed must be None or a non-negative integer, "
                             f"got {self.phase1_seed!r}")

    # names ---------------------------------------------------------------------------------
    @property
    def arm(self) -> str:
        """The name without the seed: what the seeds of one arm of a comparison share
        (`<condition>` for the default variant)."""
        parts = [self.condition]
        if self.variant:
            parts.append(self.variant)
        if self.phase1_seed is not None:
            parts.append(f"p{self.phase1_seed}")
        return "-".join(parts)

    @property
    def name(self) -> str:
        """`<condition>[-<variant>][-p<phase1_seed>]-s<seed>` (directories, result files,
        MLflow run names)."""
        return f"{self.arm}-s{self.seed}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_default(self) -> bool:
        """The default variant from the pipeline's one Phase-1 checkpoint: named like
        before variants existed."""
        return self.variant == DEFAULT_VARIANT and self.phase1_seed is None

    @classmethod
    def parse(cls, name: str) -> TrialId:
        """The TrialId whose `name` is `name`; ValueError if none is. The name's '-'-separated
        parts are the condition, the variant's parts, `p<phase1_seed>` and `s<seed>`: no
        variant part looks like the last two, so the split is unique."""
        bad = f"{name!r} is not a trial name (<condition>[-<variant>][-p<phase1_seed>]-s<seed>)"
        parts = name.split("-") if isinstance(name, str) else []
        if len(parts) < 2 or not _SEED_PART.match(parts[-1]):
            raise ValueError(bad)
        middle = parts[1:-1]
        phase1 = None
        if middle and _PHASE1_PART.match(middle[-1]):
            phase1 = int(middle.pop()[1:])
        try:
            trial = cls(parts[0], int(parts[-1][1:]), "-".join(middle), phase1)
        except ValueError as e:
            raise ValueError(f"{bad}: {e}") from e
        if trial.name != name:  # e.g. a leading zero in a seed
            raise ValueError(f"{bad}: it reads as {trial.name!r}")
        return trial

    # the Tune config and the result file -------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """The trial's Tune config: condition and seed, and variant / phase1_seed only when
        they are not the defaults (so a default trial's config is what it always was)."""
        return {"condition": self.condition, "seed": self.seed, **self.to_result()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrialId:
        """Read back `to_config` (and a Tune config written before variants existed)."""
        return cls.from_result({**config, "condition": str(config["condition"]),
                                "seed": config["seed"],
                                "variant": str(config.get("variant") or "")})

    def to_result(self) -> dict[str, Any]:
        """The identity keys a result file carries beyond condition and seed (none for a
        default trial, so its result file is what it always was)."""
        out: dict[str, Any] = {}
        if self.variant:
            out["variant"] = self.variant
        if self.phase1_seed is not None:
            out["phase1_seed"] = self.phase1_seed
        return out

    @classmethod
    def from_result(cls, obj: Mapping[str, Any]) -> TrialId:
        """The trial of a result file's object (condition, seed, optional variant); ValueError
        naming the key that is wrong."""
        p1 = obj.get("phase1_seed")
        return cls(obj.get("condition"), as_int(obj.get("seed"), "seed"),
                   obj.get("variant") or DEFAULT_VARIANT,
                   None if p1 is None else as_int(p1, "phase1_seed"))


def grid_size(conditions: int, seeds: int, variants: int = 0, phase1_checkpoints: int = 0
              ) -> str:
    """`2 conditions x 3 seeds x 3 Phase-1 checkpoints = 18 trials`, one description of a
    grid's size for the driver's log (`Space.size`) and the report's "What ran": variants and
    Phase-1 checkpoints are named only where the grid has them (0 = it has not)."""
    parts = [f"{conditions} conditions"]
    if variants:
        parts.append(f"{variants} variants")
    parts.append(f"{seeds} seeds")
    if phase1_checkpoints:
        parts.append(f"{phase1_checkpoints} Phase-1 checkpoints")
    n = conditions * seeds * max(variants, 1) * max(phase1_checkpoints, 1)
    return f"{' x '.join(parts)} = {n} trials"


def as_int(value: Any, what: str) -> int:
    """An integer from a config or JSON value (3, 3.0, "3", numpy ints); ValueError else."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    if hasattr(value, "__index__"):
        return int(value.__index__())
    raise ValueError(f"{what} must be an integer, got {value!r}")
