"""Beyond the paper (issue 11): episodes of T segments. The variants that set ``segments``
and ``ltm_graph`` (:class:`SegmentArm`), and their two families of paired comparisons: full
graph - truncated BPTT at each T, and learned - forced identity at each T and mode."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from pmnet.stats.paired import Comparison, compare_all
from pmnet.stats.variants import _variants, arm_name, by_arm, has_variant_results
from pmnet.stats.vocabulary import ordered_conditions
from pmnet.trial_id import DEFAULT_VARIANT

#: the gradient modes across boundaries (``TrainConfig.ltm_graph``) in display order
SEGMENT_GRAPH_ORDER: tuple[str, ...] = ("full", "truncated", "detached")
#: the paired comparison of the segments grid: the paper's full graph minus truncated BPTT
SEGMENT_COMPARISON: tuple[str, str] = ("full", "truncated")


@dataclass(frozen=True)
class SegmentArm:
    """A variant that sets the episode length: its condition, variant, arm name
    (:func:`by_arm`), T (``segments``) and gradient mode (``ltm_graph``)."""

    condition: str
    variant: str
    arm: str
    segments: int
    ltm_graph: str


def segment_arms(df: pd.DataFrame) -> list[SegmentArm]:
    """The arms of ``df`` with a named variant and a ``segments`` and ``ltm_graph`` value
    (columns :func:`load_results` adds when variants override them), ordered by condition,
    T, gradient mode (:data:`SEGMENT_GRAPH_ORDER`) and variant name."""
    if not has_variant_results(df) or not {"segments", "ltm_graph"} <= set(df.columns):
        return []
    arms: dict[tuple[str, str], SegmentArm] = {}
    for condition, variant, seg, graph in zip(df["condition"], _variants(df), df["segments"],
                                              df["ltm_graph"]):
        if variant == DEFAULT_VARIANT or (condition, variant) in arms:
            continue
        try:
            t = float(seg)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(t) or t != int(t) or not isinstance(graph, str):
            continue
        arms[(condition, variant)] = SegmentArm(condition, variant,
                                                arm_name(condition, variant), int(t), graph)
    rank = {c: i for i, c in enumerate(ordered_conditions(c for c, _ in arms))}
    graph_rank = {g: i for i, g in enumerate(SEGMENT_GRAPH_ORDER)}
    return sorted(arms.values(), key=lambda a: (rank[a.condition], a.segments,
                                                graph_rank.get(a.ltm_graph, len(graph_rank)),
                                                a.ltm_graph, a.variant))


def segment_comparisons(df: pd.DataFrame, metric: str = "updated_ltm"
                        ) -> tuple[Comparison, ...]:
    """For each condition and T with exactly one variant of each mode of
    :data:`SEGMENT_COMPARISON`: that pair's paired comparison on ``metric``, between the
    arms of :func:`by_arm`. The label names the condition when ``df`` has more than one."""
    arms = segment_arms(df)
    a_mode, b_mode = SEGMENT_COMPARISON
    several = len({a.condition for a in arms}) > 1
    out = []
    for key in dict.fromkeys((a.condition, a.segments) for a in arms):
        group = [a for a in arms if (a.condition, a.segments) == key]
        first = [a for a in group if a.ltm_graph == a_mode]
        second = [a for a in group if a.ltm_graph == b_mode]
        if len(first) != 1 or len(second) != 1:
            continue
        prefix = f"{key[0]}, " if several else ""
        out.append(Comparison(f"{prefix}T = {key[1]}: {a_mode} - {b_mode}: {metric}",
                              first[0].arm, metric, second[0].arm, metric, "ours:segments"))
    return tuple(out)


def segment_identity_comparisons(df: pd.DataFrame, metric: str = "updated_ltm"
                                 ) -> tuple[Comparison, ...]:
    """For each arm of :func:`segment_arms` whose condition learns its consolidation (all but
    ``identity_full``): ``metric`` minus ``forced_identity`` in the same trials (the learned
    operator against the same checkpoint with identity consolidation on the same T-segment
    test episodes), the paper's learned - forced identity test at each T and mode. The label
    names the condition when ``df`` has more than one."""
    arms = [a for a in segment_arms(df) if a.condition != "identity_full"]
    several = len({a.condition for a in arms}) > 1
    return tuple(
        Comparison(f"{f'{a.condition}, ' if several else ''}T = {a.segments}, {a.ltm_graph}: "
                   f"learned - forced identity: {metric}",
                   a.arm, metric, a.arm, "forced_identity", "ours:segments")
        for a in arms)


def compare_segments_identity(
    df: pd.DataFrame,
    metric: str = "updated_ltm",
    *,
    expected_seeds: Iterable[int] | None = None,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """:func:`compare_all` over :func:`segment_identity_comparisons` (learned - forced
    identity for every T and mode, paired by seed; Holm over these comparisons only, a family
    of their own), with ``segments`` and ``ltm_graph`` columns. Empty when ``df`` has no
    segment arm."""
    return _compare_segment_family(df, segment_identity_comparisons(df, metric),
                                   ("segments", "ltm_graph"), expected_seeds, alpha)


def compare_segments(
    df: pd.DataFrame,
    metric: str = "updated_ltm",
    *,
    expected_seeds: Iterable[int] | None = None,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """:func:`compare_all` over :func:`segment_comparisons` (full - truncated at each T, paired
    by seed; Holm over these comparisons only, a family of their own), with a ``segments``
    column. Empty when ``df`` has no such pair."""
    return _compare_segment_family(df, segment_comparisons(df, metric), ("segments",),
                                   expected_seeds, alpha)


def _compare_segment_family(df: pd.DataFrame, comparisons: Sequence[Comparison],
                            columns: Sequence[str], expected_seeds: Iterable[int] | None,
                            alpha: float) -> pd.DataFrame:
    """:func:`compare_all` over one family of segment comparisons (its own Holm), with the
    :class:`SegmentArm` fields ``columns`` of each row's first arm added as columns."""
    out = compare_all(by_arm(df), comparisons, expected_seeds=expected_seeds, alpha=alpha)
    arms = {a.arm: a for a in segment_arms(df)}
    for column in columns:
        out[column] = [getattr(arms[c], column) for c in out.get("cond_a", [])]
    return out
