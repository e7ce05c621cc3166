"""Variants (beyond the paper): named Phase-2 overrides of one grid. The default variant's
trials are the paper's; every named variant is an arm of its own (:func:`by_arm`)."""

from __future__ import annotations

import pandas as pd

from pmnet.trial_id import DEFAULT_VARIANT, TrialId


def _variants(df: pd.DataFrame) -> pd.Series:
    if "variant" not in df.columns:
        return pd.Series(DEFAULT_VARIANT, index=df.index, dtype=object)
    return df["variant"].fillna(DEFAULT_VARIANT).astype(str)


def has_variant_results(df: pd.DataFrame) -> bool:
    """Whether any trial in ``df`` ran a named variant (a table without a ``variant`` column,
    like every table written before variants existed, has none)."""
    return not df.empty and bool((_variants(df) != DEFAULT_VARIANT).any())


def default_variant(df: pd.DataFrame) -> pd.DataFrame:
    """The trials of the default variant: what the paper's tables and comparisons read (all
    of ``df`` when no trial has a named variant). ``df.attrs`` is kept."""
    out = df[_variants(df) == DEFAULT_VARIANT]
    out.attrs = dict(df.attrs)
    return out


def arm_name(condition: str, variant: str = DEFAULT_VARIANT) -> str:
    """The arm of a condition's trials of one variant (:attr:`TrialId.arm`): the condition
    itself for the default variant, ``<condition>-<variant>`` otherwise."""
    return TrialId(condition, 0, variant).arm if variant else str(condition)


def by_arm(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``condition`` replaced by each trial's arm (:attr:`TrialId.arm`: the
    condition for the default variant, ``<condition>-<variant>`` otherwise), so that the
    seed-wise statistics (:func:`seed_values`, :func:`summarize`, :func:`paired_comparison`)
    treat each variant as an arm of its own. Without named variants it equals ``df``."""
    out = df.copy()
    variants = _variants(df)
    named = variants != DEFAULT_VARIANT
    if named.any():
        out.loc[named, "condition"] = [arm_name(c, v) for c, v in
                                       zip(out.loc[named, "condition"], variants[named])]
    return out
