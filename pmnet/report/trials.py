"""The trials of one report, scoped once for the core tables and every study (:class:`Trials`).

The paper's tables read one Phase-1 checkpoint and one variant: with trials from K Phase-1
checkpoints, those of the reference checkpoint (the smallest Phase-1 seed); with named
variants, those of the default variant. :meth:`Trials.build` does that scoping and says so in
the report's notes; the core tables and every study then read the frame they need from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.report.context import CheckpointView, Context
from pmnet.report.paper_tables import UNIT_LABELS


@dataclass
class Trials:
    """What a report reads.

    ``loaded``: every trial as loaded (``attrs``: failed trials, warnings); ``derived``: the
    same with derived metrics filled, every variant, only the reference Phase-1 checkpoint's
    trials when there are several; ``base``: the paper's trials, the default variant of
    ``derived``. ``comparisons``: the paper's family over ``base`` (None when there is no
    paper part: only named variants ran). ``notes``: the lines at the top of the report that
    say how the trials were scoped.
    """

    loaded: pd.DataFrame
    derived: pd.DataFrame
    base: pd.DataFrame
    seeds: list[int]
    paper: stats.PaperReference | None
    meta: Mapping[str, Any]
    comparisons: pd.DataFrame | None
    notes: list[str] = field(default_factory=list)
    checkpoints: CheckpointView | None = None  # K >= 2 Phase-1 checkpoints: every one
    #: `pmnet diagnose` of the trials that have it (`pmnet.stats.load_diagnostics`: a run's
    #: or store's `diagnostics/`), one row per trial; empty without any
    diagnostics: pd.DataFrame = field(default_factory=lambda: stats.diagnostics_frame({}))

    @property
    def paper_part(self) -> bool:
        """Whether the paper's tables have trials to read (False: only named variants ran)."""
        return self.comparisons is not None

    @cached_property
    def ctx(self) -> Context:
        """The cell builder over ``base`` that the paper's tables and their studies share."""
        return Context(self.base, self.paper, self.comparisons, self.seeds, self.checkpoints)

    @classmethod
    def build(
        cls,
        df: pd.DataFrame,
        *,
        seeds: Sequence[int],
        paper: stats.PaperReference | None = None,
        meta: Mapping[str, Any] | None = None,
        comparisons: pd.DataFrame | None = None,
        paper_note: str | None = None,
        diagnostics: pd.DataFrame | None = None,
    ) -> Trials:
        """Scope ``df`` (a tidy frame of :func:`stats.load_results`). ``comparisons``: the
        paper's family if already computed over the scoped ``base``; ``paper_note``: a line
        about the paper's numbers, placed among the scoping notes; ``diagnostics``: the
        trials' diagnostics (:func:`stats.load_diagnostics`)."""
        notes: list[str] = []
        derived = stats.add_derived_metrics(df) if not df.empty else df.copy()
        derived.attrs = dict(df.attrs)
        view = None
        if stats.has_phase1_variance(derived):  # K Phase-1 checkpoints
            reference = stats.reference_phase1_seed(derived)
            every = stats.default_variant(derived)
            view = CheckpointView.build(every, UNIT_LABELS)
            derived = stats.at_phase1_seed(derived, reference)
            k = stats.phase1_seeds(df)
            notes.append(
                f"Trials from {len(k)} Phase-1 checkpoints (phase1_seed "
                f"{', '.join(str(s) for s in k)}), the unit of analysis: the headline and "
                "claims tables give each paired effect with the checkpoint as a random factor "
                "and every checkpoint's own value beside it. The paper-layout tables after them, "
                f"the result figures and the missing-results list are one checkpoint's view, "
                f"phase1_seed {reference} (the smallest: the paper's fixed-checkpoint "
                "analysis); tab:phase1-variance, tab:phase1-checkpoints and the training "
                "curves use every checkpoint.")
        if paper_note:
            notes.append(paper_note)
        # named variants (beyond the paper): the paper's tables read the default variant's
        # trials only; the variants have tables of their own. Without variants nothing changes.
        has_variants = stats.has_variant_results(derived)
        base = stats.default_variant(derived) if has_variants else derived
        paper_part = not has_variants or not base.empty
        if has_variants:
            n_named = int((derived["variant"] != "").sum())
            notes.append(
                f"{n_named} trial(s) ran named variants (Phase-2 overrides; section Tables, "
                "tab:segments): the paper's tables and comparisons read only the "
                f"{len(base)} trial(s) of the default variant"
                + ("." if paper_part else ", and there are none, so they are left out."))
        if paper_part and comparisons is None:
            comparisons = stats.compare_all(base, expected_seeds=seeds)
        return cls(df, derived, base, list(seeds), paper, dict(meta or {}),
                   comparisons if paper_part else None, notes, view,
                   diagnostics if diagnostics is not None else stats.diagnostics_frame({}))
