"""Experiment grids (condition x variant x seed) and trial resources for the pipeline's
Stage 2."""

from tune_spaces.grids import (
    OPERATOR_GRID_CONDITIONS,
    PAPER_CONDITIONS,
    PAPER_SEEDS,
    SEGMENT_CONDITIONS,
    SEGMENT_COUNTS,
    SEGMENT_GRAPHS,
    SPACES,
    VARIANT_FIELDS,
    Space,
    SpaceError,
    Variant,
    core,
    default,
    get_space,
    operators,
    paper,
    segment_variants,
    segments,
    tiny,
)

__all__ = [
    "OPERATOR_GRID_CONDITIONS", "PAPER_CONDITIONS", "PAPER_SEEDS", "SEGMENT_CONDITIONS",
    "SEGMENT_COUNTS", "SEGMENT_GRAPHS", "SPACES", "VARIANT_FIELDS", "Space", "SpaceError",
    "Variant", "core", "default", "get_space", "operators", "paper", "segment_variants",
    "segments", "tiny",
]
