"""The one interface of a study beyond the paper: :class:`Study` and what it adds to a report,
:class:`Findings`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from pmnet.report.figures import FigureResult
from pmnet.report.table import Table
from pmnet.report.trials import Trials


@dataclass
class Findings:
    """What a study adds to a report.

    ``tables`` follow the paper's tables (in the order of :data:`pmnet.report.studies.STUDIES`),
    ``figures`` the paper's figures (before the training curves). ``comparisons``: each
    family of paired comparisons (a :func:`pmnet.stats.compare_all` frame, with its own Holm
    correction) by its file name under ``data/``; an empty family writes no file, and the
    unpaired seeds of every family are listed under "Missing results". ``data``: other frames
    written under ``data/`` by file name. ``missing``: lines for "Missing results".
    """

    tables: list[Table] = field(default_factory=list)
    figures: list[FigureResult] = field(default_factory=list)
    comparisons: dict[str, pd.DataFrame] = field(default_factory=dict)
    data: dict[str, pd.DataFrame] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Study:
    """A study beyond the paper, as the report sees it.

    ``name``: what it is called (docs, the registry); ``grid``: the ``tune_spaces`` grid that
    runs it ("" when its results come from any grid); ``recognise(trials)``: whether the
    trials (or the pipeline's records in ``trials.meta``) hold its results;
    ``build(trials)``: its :class:`Findings`, called only when it recognised them. A report
    without a study's results is exactly the report without that study.
    """

    name: str
    grid: str
    recognise: Callable[[Trials], bool]
    build: Callable[[Trials], Findings]
