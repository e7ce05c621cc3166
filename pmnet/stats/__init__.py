"""Statistics over Phase-2 trial results (paper Section 6.3 "Metrics and statistics").

Every Phase-2 trial writes one JSON file (condition, seed, provenance, ``val``/``test`` metric
dicts, ``history``). This package turns those files into a tidy per-trial table and computes
what the paper reports from it:

* mean +- sample SD (ddof=1) over seeds per condition and metric (:func:`summarize`);
* paired-by-seed differences with a t-distribution 95% CI, a paired t-test, the effect size
  d_z and Holm-corrected p values over the paper's family of comparisons
  (:func:`paired_comparison`, :data:`COMPARISONS`, :func:`compare_all`).

A paired comparison never drops a seed silently: a seed present on only one side is named in
the ``note`` and ``missing_seeds`` columns, and degenerate cases (fewer than two paired seeds,
all differences equal) carry an explicit note instead of a silent NaN.

The paper's own numbers (``paper-aggregates.csv`` and ``paper-per-seed.csv`` in the spec
directory) can be loaded (:func:`paper_aggregates`, :func:`paper_per_seed`) and the per-seed
numbers pivoted into the same layout as :func:`load_results`
(:func:`per_seed_frame_from_paper`), so the paper's values go through the same statistics.
The spec directory is ``$PMNET_SPEC_DIR`` or ``<repo root>/../shared/spec``.

Modules (each imports only those above it):

==============  ==========================================================================
``vocabulary``  condition names and labels, the tidy table's columns, metric order
``loading``     result files -> tidy table, training curves, derived metrics, tidy files
``paired``      summaries, paired comparisons, the paper's family and Holm
``paper``       the paper's numbers through the same statistics (:class:`PaperReference`)
``variants``    named Phase-2 overrides: the default variant, arms (beyond the paper)
``operators``   consolidation operators against the Consolidator (beyond the paper)
``baselines``   task-matched baselines against the Consolidator and the GRU operator
``segments``    episodes of T segments: arms and their comparisons (beyond the paper)
``phase1``      the Phase-1 checkpoint as a random factor (beyond the paper)
``families``    did Phase 1 learn each rule family? (beyond the paper, issue 52)
``checkpoints`` an effect's distribution over checkpoints, and the power (issue 39)
``checkpoint_study``  the checkpoint study's channel interaction, strict-off contrasts,
                pre-registered predictor, diagnostics and sensitivity (issues 39, 45)
==============  ==========================================================================

Everything the rest of the repository uses is importable from ``pmnet.stats`` itself.
"""

from pmnet.conditions import BASELINE_REFERENCES, OPERATOR_REFERENCE, PAPER_SEEDS
from pmnet.stats.baselines import (
    BASELINE_COMPARISONS,
    BASELINE_CONDITIONS,
    compare_baselines,
    has_baseline_results,
)
from pmnet.stats.checkpoint_study import (
    ALL_ROUTING_COMPARISONS,
    CHANNEL_CONDITIONS,
    CHANNEL_ONLY,
    CHANNEL_OPERATORS,
    CONSOLIDATOR,
    LEVEL_COMPARISONS,
    STRICT_ARMS,
    STUDY_COMPARISONS,
    ChannelAnalysis,
    Correlation,
    Interaction,
    OneSample,
    PredictorTest,
    ProbeVsTrained,
    SensitivityRow,
    StrictAnalysis,
    at_last_epoch,
    channel_analysis,
    checkpoint_features,
    checkpoints_with,
    diagnosed_model,
    diagnostics_frame,
    load_diagnostics,
    predictor_test,
    routing_interaction,
    sensitivity,
    sensitivity_frame,
    spearman,
    strict_analysis,
    whole_checkpoints,
)
from pmnet.stats.checkpoints import (
    CHANNEL_COMPARISONS,
    CHECKPOINT_COMPARISONS,
    POWER_EFFECTS,
    STRICT_COMPARISONS,
    CheckpointPoint,
    EffectDistribution,
    checkpoint_distribution,
    checkpoints_needed,
    pooled_within_sd,
)
from pmnet.stats.checkpoints import frame as checkpoint_frame
from pmnet.stats.families import (
    FAMILY_COMPARISONS,
    FROZEN_BACKBONE_CONDITIONS,
    LEARNED_MARGIN_PP,
    FamilyCheckpoint,
    FamilyLearning,
    family_comparison,
    family_of,
    phase1_families,
)
from pmnet.stats.loading import (
    add_derived_metrics,
    curves_from_metrics_csv,
    load_histories,
    load_results,
    write_tidy,
)
from pmnet.stats.operators import (
    OPERATOR_COMPARISONS,
    compare_operators,
    has_operator_results,
)
from pmnet.stats.paired import (
    BASELINE_SUFFIX,
    COMPARISON_REMARKS,
    COMPARISONS,
    ArmCapability,
    CapabilityGate,
    Comparison,
    Family,
    _seed_word,
    arm_capability,
    baseline_metric,
    capability_gate,
    compare_all,
    expected_seed_set,
    metric_columns,
    paired_comparison,
    seed_values,
    summarize,
)
from pmnet.stats.paper import (
    DERIVED,
    PACKAGED_SPEC,
    PAPER_AGGREGATE_KEYS,
    PAPER_METRIC_RENAMES,
    PRINTED,
    REPO_ROOT,
    PaperReference,
    SpecNotFoundError,
    load_paper_reference,
    paper_aggregate_key,
    paper_aggregates,
    paper_per_seed,
    per_seed_frame_from_paper,
    spec_dir,
)
from pmnet.stats.phase1 import (
    MIXED_OPTIMIZERS,
    PHASE1_COMPARISON_LABELS,
    PHASE1_COMPARISONS,
    SINGULAR_ICC,
    CheckpointTest,
    Phase1Analysis,
    Phase1Effect,
    at_phase1_seed,
    fit_random_intercept,
    has_phase1_variance,
    phase1_seeds,
    phase1_variance,
    reference_phase1_seed,
)
from pmnet.stats.segments import (
    SEGMENT_COMPARISON,
    SEGMENT_GRAPH_ORDER,
    SegmentArm,
    compare_segments,
    compare_segments_identity,
    segment_arms,
    segment_comparisons,
    segment_identity_comparisons,
)
from pmnet.stats.variants import arm_name, by_arm, default_variant, has_variant_results
from pmnet.stats.vocabulary import (
    CONDITION_LABELS,
    CONDITIONS,
    DEVICE_COLUMNS,
    KNOWN_METRICS,
    LAST_PREFIX,
    META_COLUMNS,
    OPERATOR_CONDITIONS,
    PHASE1_SEED,
    RULE_FAMILIES,
    VARIANT_FIELDS_ATTR,
    condition_label,
    ordered_conditions,
)

__all__ = [
    "CONDITIONS", "CONDITION_LABELS", "OPERATOR_CONDITIONS", "OPERATOR_REFERENCE", "PAPER_SEEDS",
    "META_COLUMNS", "DEVICE_COLUMNS", "VARIANT_FIELDS_ATTR", "PHASE1_SEED", "LAST_PREFIX",
    "KNOWN_METRICS", "condition_label", "ordered_conditions",
    "load_results", "load_histories", "curves_from_metrics_csv", "write_tidy",
    "add_derived_metrics",
    "metric_columns", "seed_values", "summarize", "paired_comparison", "Comparison",
    "COMPARISONS", "COMPARISON_REMARKS", "expected_seed_set", "compare_all", "_seed_word",
    "BASELINE_SUFFIX", "ArmCapability", "CapabilityGate", "arm_capability", "baseline_metric",
    "capability_gate",
    "REPO_ROOT", "PACKAGED_SPEC", "SpecNotFoundError", "spec_dir", "paper_aggregates",
    "paper_per_seed", "per_seed_frame_from_paper", "PAPER_METRIC_RENAMES", "PAPER_AGGREGATE_KEYS",
    "paper_aggregate_key",
    "PRINTED", "DERIVED", "PaperReference", "load_paper_reference",
    "has_variant_results", "default_variant", "arm_name", "by_arm",
    "Family", "OPERATOR_COMPARISONS", "has_operator_results", "compare_operators",
    "BASELINE_CONDITIONS", "BASELINE_REFERENCES", "BASELINE_COMPARISONS",
    "has_baseline_results", "compare_baselines",
    "SEGMENT_GRAPH_ORDER", "SEGMENT_COMPARISON", "SegmentArm", "segment_arms",
    "segment_comparisons", "segment_identity_comparisons", "compare_segments",
    "compare_segments_identity",
    "PHASE1_COMPARISON_LABELS", "PHASE1_COMPARISONS", "SINGULAR_ICC", "MIXED_OPTIMIZERS",
    "CheckpointTest", "Phase1Effect", "Phase1Analysis", "phase1_seeds", "has_phase1_variance",
    "reference_phase1_seed", "at_phase1_seed", "fit_random_intercept", "phase1_variance",
    "CHECKPOINT_COMPARISONS", "CHANNEL_COMPARISONS", "STRICT_COMPARISONS", "POWER_EFFECTS",
    "CheckpointPoint",
    "EffectDistribution", "checkpoint_distribution", "checkpoints_needed", "pooled_within_sd",
    "checkpoint_frame",
    "CONSOLIDATOR", "CHANNEL_OPERATORS", "CHANNEL_CONDITIONS", "CHANNEL_ONLY",
    "LEVEL_COMPARISONS", "STRICT_ARMS", "ALL_ROUTING_COMPARISONS", "STUDY_COMPARISONS",
    "Correlation", "OneSample", "Interaction", "ChannelAnalysis", "ProbeVsTrained",
    "StrictAnalysis", "PredictorTest", "SensitivityRow", "spearman", "checkpoints_with",
    "whole_checkpoints", "routing_interaction", "channel_analysis", "strict_analysis",
    "diagnostics_frame", "load_diagnostics", "diagnosed_model", "checkpoint_features",
    "predictor_test", "at_last_epoch", "sensitivity", "sensitivity_frame",
    "RULE_FAMILIES", "FROZEN_BACKBONE_CONDITIONS", "LEARNED_MARGIN_PP", "FamilyCheckpoint",
    "FamilyLearning", "phase1_families", "family_of", "family_comparison",
    "FAMILY_COMPARISONS",
]
