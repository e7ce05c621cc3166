"""Experiment grids (condition x variant x seed, optionally x Phase-1 seed) and trial
resources for the pipeline's Stage 2."""

from tune_spaces.grids import (
    CHECKPOINT_CHANNEL_CONDITIONS,
    CHECKPOINT_CHANNEL_SEEDS,
    CHECKPOINT_STUDY_SEEDS,
    OPERATOR_GRID_CONDITIONS,
    PAPER_CONDITIONS,
    PAPER_SEEDS,
    PHASE1_VARIANCE_SEEDS,
    SEGMENT_CONDITIONS,
    SEGMENT_COUNTS,
    SEGMENT_GRAPHS,
    SPACES,
    VARIANT_FIELDS,
    Space,
    SpaceError,
    Variant,
    checkpoint_channel,
    checkpoints,
    core,
    default,
    get_space,
    grids_running,
    operators,
    paper,
    phase1_variance,
    segment_variants,
    segments,
    tiny,
)

__all__ = [
    "CHECKPOINT_CHANNEL_CONDITIONS", "CHECKPOINT_CHANNEL_SEEDS", "CHECKPOINT_STUDY_SEEDS",
    "checkpoint_channel", "checkpoints",
    "OPERATOR_GRID_CONDITIONS", "PAPER_CONDITIONS", "PAPER_SEEDS", "PHASE1_VARIANCE_SEEDS",
    "SEGMENT_CONDITIONS",
    "SEGMENT_COUNTS", "SEGMENT_GRAPHS", "SPACES", "VARIANT_FIELDS", "Space", "SpaceError",
    "Variant", "core", "default", "get_space", "grids_running", "operators", "paper",
    "phase1_variance", "segment_variants",
    "segments", "tiny",
]
