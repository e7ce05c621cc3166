"""Experiment grids (condition x seed) and trial resources for the pipeline's Stage 2."""

from tune_spaces.grids import (
    PAPER_CONDITIONS,
    PAPER_SEEDS,
    SPACES,
    Space,
    SpaceError,
    core,
    default,
    get_space,
    paper,
    tiny,
)

__all__ = [
    "PAPER_CONDITIONS", "PAPER_SEEDS", "SPACES", "Space", "SpaceError", "core", "default",
    "get_space", "paper", "tiny",
]
