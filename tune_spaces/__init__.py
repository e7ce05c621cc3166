"""Experiment grids (condition x seed) and trial resources for the pipeline's Stage 2."""

from tune_spaces.grids import (
    OPERATOR_GRID_CONDITIONS,
    PAPER_CONDITIONS,
    PAPER_SEEDS,
    SPACES,
    Space,
    SpaceError,
    core,
    default,
    get_space,
    operators,
    paper,
    tiny,
)

__all__ = [
    "OPERATOR_GRID_CONDITIONS", "PAPER_CONDITIONS", "PAPER_SEEDS", "SPACES", "Space",
    "SpaceError", "core", "default", "get_space", "operators", "paper", "tiny",
]
