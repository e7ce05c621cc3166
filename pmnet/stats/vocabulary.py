"""The vocabulary of the tidy trial table: condition names and labels, the provenance and
metric columns, and the order tables and CSVs show them in."""

from __future__ import annotations

from collections.abc import Iterable

from pmnet.conditions import ALL_CONDITIONS as _ALL_CONDITIONS
from pmnet.conditions import BASELINE_CONDITIONS as _BASELINE_CONDITIONS
from pmnet.conditions import CHANNEL_CONDITIONS as _CHANNEL_CONDITIONS
from pmnet.conditions import CONDITIONS as _CONDITIONS
from pmnet.conditions import OPERATOR_CONDITIONS as _OPERATOR_CONDITIONS
from pmnet.conditions import STRICT_OFF_CONDITIONS as _STRICT_OFF_CONDITIONS

#: Condition names in the paper's order, and their table labels (from pmnet.conditions).
CONDITIONS: tuple[str, ...] = tuple(_CONDITIONS)
#: The consolidation-operator conditions (beyond the paper), in their defined order.
OPERATOR_CONDITIONS: tuple[str, ...] = tuple(_OPERATOR_CONDITIONS)
#: The task-matched baselines (beyond the paper, issue 23), in their defined order.
BASELINE_CONDITION_NAMES: tuple[str, ...] = tuple(_BASELINE_CONDITIONS)
#: The routing-off twins of issue 39 (beyond the paper), in their defined order.
CHANNEL_CONDITION_NAMES: tuple[str, ...] = tuple(_CHANNEL_CONDITIONS)
#: The strict-off twins of issue 39 (beyond the paper), in their defined order.
STRICT_OFF_CONDITION_NAMES: tuple[str, ...] = tuple(_STRICT_OFF_CONDITIONS)
CONDITION_LABELS: dict[str, str] = {n: c.label for n, c in _ALL_CONDITIONS.items()}

#: Per-trial provenance columns of the tidy table, in order. ``condition``, ``seed`` and
#: ``variant`` are the trial's identity (:class:`pmnet.trial_id.TrialId`; ``variant`` is ""
#: for the default variant).
META_COLUMNS: tuple[str, ...] = (
    "condition",
    "seed",
    "variant",
    "preset",
    "phase1_sha256",
    "best_epoch",
    "trainable_params",
    "total_params",
    "trainable_fraction",
    "train_time_s",
)
IDENTITY_COLUMNS = ("condition", "seed", "variant")
STRING_META = ("preset", "phase1_sha256")
#: Where each trial trained (`pmnet.train.trained_on`): columns only when a result has them
#: (results written before they were recorded keep the table as it was).
DEVICE_COLUMNS = ("device", "precision")
NUMERIC_META = tuple(c for c in META_COLUMNS if c not in IDENTITY_COLUMNS + STRING_META)
#: Numeric columns that describe the run rather than measure it (never summarised).
NOT_METRICS = frozenset({"seed", "phase1_seed", "trainable_params", "total_params",
                          "trainable_fraction", "last_epoch"})
#: ``df.attrs`` key listing the TrainConfig fields that some trial's variant overrides (each a
#: column of the tidy table, never summarised as a metric)
VARIANT_FIELDS_ATTR = "variant_fields"

#: Optional column of the tidy table: the seed of the Phase-1 checkpoint a trial started from.
#: Present only when some result file carries a top-level ``phase1_seed`` (pipelines with K
#: Phase-1 checkpoints, issue 11); nullable integer (``Int64``), missing where a file has none.
PHASE1_SEED = "phase1_seed"

#: Prefix of the tidy columns of the last epoch's test metrics (result.json "test_last"),
#: beside the validation-selected epoch's (present only when some result has them).
LAST_PREFIX = "last_"

#: Test metrics in the order tables and CSVs show them; unknown metrics follow sorted.
KNOWN_METRICS: tuple[str, ...] = (
    "updated_ltm",
    "initial_ltm",
    "forced_identity",
    "forced_identity_initial",
    "alternative_mode",
    "fresh_ltm",
    "mismatched_ltm",
    "mismatched_donor_follow",
    "seg1_stm",
    "seg2_stm",
    "mean_stm",
    "dual",
)

#: The task's rule families (`pmnet.task`: family 0 ADD10, 1 AFFINE10): the suffix of each
#: recall metric's per-family split (`updated_ltm_add10`, `seg1_stm_affine10_baseline`, ...,
#: `pmnet.evaluate.summarize`) and its name in tables.
RULE_FAMILIES: dict[str, str] = {"add10": "ADD10", "affine10": "AFFINE10"}

EQUAL_TOL = 1e-9


def condition_label(condition: str) -> str:
    """Display name of a condition (the paper's wording), or the raw name if unknown."""
    return CONDITION_LABELS.get(condition, condition)


def ordered_conditions(names: Iterable[str]) -> list[str]:
    """The paper's condition order first, then the operator conditions, the baselines, the
    routing-off and strict-off twins of issue 39, then unknown names sorted."""
    present = set(names)
    order = (CONDITIONS + OPERATOR_CONDITIONS + BASELINE_CONDITION_NAMES
             + CHANNEL_CONDITION_NAMES + STRICT_OFF_CONDITION_NAMES)
    known = [c for c in order if c in present]
    return known + sorted(present - set(order))
