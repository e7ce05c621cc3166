"""Figures on matplotlib's object-oriented API and the Agg canvas (no pyplot, no display):
the paper's paired-seed figures and the training curves. A figure whose data is missing is
skipped with the reason (:class:`FigureResult`) instead of failing."""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pmnet import stats
from pmnet.io import atomic_write_bytes
from pmnet.report.paper_tables import OFF, ON
from pmnet.stats import condition_label


@dataclass
class FigureResult:
    """A built figure, or ``figure=None`` with ``skipped`` saying why."""

    id: str
    title: str
    caption: str
    figure: Figure | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)


def new_figure(n_panels: int, ncols: int | None = None, size=(3.6, 3.1)):
    ncols = ncols or n_panels
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _seed_colors(seeds: Sequence[int]) -> dict[int, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {s: cmap(i % 10) for i, s in enumerate(seeds)}


def _paired_panel(
    ax, df: pd.DataFrame, points: Sequence[tuple[str, str, str]], title: str, colors
) -> tuple[bool, list[int]]:
    """Lines joining one seed's values across ``points`` (condition, metric, tick label).

    Returns (any data drawn, seeds that lack some point). A seed missing a point is drawn
    with its available points (the line breaks at the gap), never dropped.
    """
    series = [stats.seed_values(df, c, m) for c, m, _ in points]
    seeds = sorted(set().union(*[set(s.index) for s in series]))
    x = np.arange(len(points))
    partial = []
    for seed in seeds:
        ys = np.array([float(s.loc[seed]) if seed in s.index else np.nan for s in series])
        if np.isnan(ys).any():
            partial.append(seed)
        ax.plot(x, ys, marker="o", ms=5, lw=1.2, alpha=0.85, color=colors.get(seed),
                label=f"seed {seed}")
    if seeds:
        means = [float(s.mean()) if s.size else np.nan for s in series]
        ax.plot(x, means, marker="_", ms=22, mew=2.5, lw=0, color="black", label="mean")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    if partial:
        ax.text(0.02, 0.02, "incomplete seeds: " + ", ".join(map(str, partial)), fontsize=7,
                transform=ax.transAxes, color="firebrick")
    ax.set_xticks(x, [label for _, _, label in points])
    ax.set_xlim(-0.4, len(points) - 0.6)
    ax.set_ylim(-2, 102)
    ax.set_ylabel("recall (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return bool(seeds), partial


def paired_figure(
    df: pd.DataFrame,
    fig_id: str,
    title: str,
    caption: str,
    panels: Sequence[tuple[str, Sequence[tuple[str, str, str]]]],
    require: Sequence[tuple[str, str]],
    ncols: int | None = None,
) -> FigureResult:
    lacking = [(c, m) for c, m in require if stats.seed_values(df, c, m).size == 0]
    if lacking:
        need = ", ".join(f"{m} of {c}" for c, m in lacking)
        return FigureResult(fig_id, title, caption, skipped=f"no data for {need}")
    seeds = stats.expected_seed_set(df)
    colors = _seed_colors(seeds)
    fig, axes = new_figure(len(panels), ncols)
    result = FigureResult(fig_id, title, caption, figure=fig)
    for ax, (panel_title, points) in zip(axes, panels):
        drawn, partial = _paired_panel(ax, df, points, panel_title, colors)
        if not drawn:
            result.notes.append(f"panel '{panel_title}': no data")
        elif partial:
            verb = "lacks" if len(partial) == 1 else "lack"
            result.notes.append(
                f"panel '{panel_title}': {stats._seed_word(partial)} {verb} some points "
                "(drawn with gaps)"
            )
    handles, labels = axes[-1].get_legend_handles_labels()
    if handles:
        axes[-1].legend(handles, labels, fontsize=7, loc="best", frameon=False)
    fig.suptitle(title, fontsize=11)
    return result


def figure_routing(df: pd.DataFrame) -> FigureResult:
    return paired_figure(
        df,
        "fig-ltm-routing",
        "Direct LTM-conditioned routing (paired seeds)",
        "Lines pair each seed's routing-off and routing-on runs (same Phase-1 checkpoint). "
        "(a) updated-mapping LTM recall; (b) segment-2 immediate STM recall.",
        [
            ("(a) updated-mapping LTM", [(OFF, "updated_ltm", "off"), (ON, "updated_ltm", "on")]),
            ("(b) segment-2 STM", [(OFF, "seg2_stm", "off"), (ON, "seg2_stm", "on")]),
        ],
        require=[(OFF, "updated_ltm"), (ON, "updated_ltm")],
    )


def figure_same_checkpoint(df: pd.DataFrame) -> FigureResult:
    return paired_figure(
        df,
        "fig-consolidator-update",
        "Learned vs forced identity, same checkpoint (Consolidator only)",
        "Each line is one seed's checkpoint evaluated with the learned Consolidator and with "
        "forced identity accumulation, for the initial mapping (after the first consolidation) "
        "and the updated mapping (after the second).",
        [
            ("initial mapping", [(ON, "initial_ltm", "learned"),
                                 (ON, "forced_identity_initial", "identity")]),
            ("updated mapping", [(ON, "updated_ltm", "learned"),
                                 (ON, "forced_identity", "identity")]),
        ],
        require=[(ON, "updated_ltm"), (ON, "forced_identity")],
    )


def figure_content(df: pd.DataFrame) -> FigureResult:
    conditions = [
        c
        for c in (stats.ordered_conditions(df["condition"]) if not df.empty else [])
        if stats.seed_values(df, c, "updated_ltm").size
        and (stats.seed_values(df, c, "mismatched_ltm").size
             or stats.seed_values(df, c, "fresh_ltm").size)
    ]
    caption = (
        "Updated-mapping LTM recall of each seed's checkpoint with its own (correct) experience, "
        "a mismatched donor experience, and fresh (empty) memory."
    )
    title = "Recall requires the correct experience"
    if not conditions:
        return FigureResult("fig-consolidator-content", title, caption,
                            skipped="no condition has updated_ltm with mismatched/fresh LTM")
    panels = [
        (condition_label(c), [(c, "updated_ltm", "correct"), (c, "mismatched_ltm", "mism."),
                              (c, "fresh_ltm", "fresh")])
        for c in conditions
    ]
    return paired_figure(
        df, "fig-consolidator-content", title, caption, panels,
        require=[(c, "updated_ltm") for c in conditions], ncols=min(3, len(panels)),
    )


def figure_dual(df: pd.DataFrame) -> FigureResult:
    full, dual = "learned_full", "learned_full_dual"
    return paired_figure(
        df,
        "fig-dual-objective",
        "Dual objective: pre-consolidation STM and post-reset LTM",
        "Lines pair each seed's updated-LTM-only run with its dual-objective run. "
        "(a) updated-mapping LTM recall; (b) mean immediate STM recall.",
        [
            ("(a) updated-mapping LTM", [(full, "updated_ltm", "LTM only"),
                                         (dual, "updated_ltm", "LTM + STM")]),
            ("(b) mean STM", [(full, "mean_stm", "LTM only"), (dual, "mean_stm", "LTM + STM")]),
        ],
        require=[(full, "updated_ltm"), (dual, "updated_ltm")],
    )


def figure_training_curves(curves: pd.DataFrame | None) -> list[FigureResult]:
    """One figure per phase from long (phase, step/epoch, metric, value) rows.

    Each metric gets a panel; each (condition, seed[, phase1_seed]) a line when those
    columns exist. The x axis is ``step`` where the phase has steps, else ``epoch``, else the
    row order.
    """
    title = "Training curves"
    if curves is None or curves.empty or not {"metric", "value"} <= set(curves.columns):
        return [FigureResult("fig-training", title, "Training curves per phase.",
                             skipped="no training history or metrics CSV found")]
    curves = curves.copy()
    if "phase" not in curves.columns:
        curves["phase"] = "training"
    curves["value"] = pd.to_numeric(curves["value"], errors="coerce")
    curves = curves.dropna(subset=["value"])
    out = []
    for phase in sorted(curves["phase"].astype(str).unique()):
        part = curves[curves["phase"].astype(str) == phase]
        xcol = next(
            (c for c in ("step", "epoch") if c in part.columns
             and pd.to_numeric(part[c], errors="coerce").notna().any()),
            None,
        )
        metrics = sorted(part["metric"].astype(str).unique())
        safe = re.sub(r"[^A-Za-z0-9_-]+", "-", phase)
        fig, axes = new_figure(len(metrics), min(4, len(metrics)), size=(3.3, 2.6))
        groups = [c for c in ("condition", "variant", "seed", stats.PHASE1_SEED)
                  if c in part.columns]
        for ax, metric in zip(axes, metrics):
            sub = part[part["metric"].astype(str) == metric]
            keyed = sub.groupby(groups, dropna=False, sort=True) if groups else [((), sub)]
            for key, run in keyed:
                run = run.sort_values(xcol) if xcol else run
                x = pd.to_numeric(run[xcol], errors="coerce") if xcol else np.arange(len(run))
                key = key if isinstance(key, tuple) else (key,)
                label = " ".join(str(k) for k in key
                                 if k is not None and k == k and k != "") or metric
                ax.plot(x, run["value"], lw=1.1, marker="." if len(run) < 40 else None,
                        label=label)
            ax.set_title(metric, fontsize=9)
            ax.set_xlabel(xcol or "row")
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        handles, labels = axes[0].get_legend_handles_labels()
        if 1 < len(handles) <= 12:
            axes[0].legend(handles, labels, fontsize=6, frameon=False)
        fig.suptitle(f"{title}: {phase}", fontsize=11)
        out.append(FigureResult(f"fig-training-{safe}", f"{title}: {phase}",
                                f"Logged metrics of {phase} against {xcol or 'row order'}.",
                                figure=fig))
    return out


def paper_figures(df: pd.DataFrame) -> list[FigureResult]:
    """The paper's result figures; missing data gives a skipped entry (with the reason)."""
    df = stats.add_derived_metrics(df) if not df.empty else df
    return [figure_routing(df), figure_same_checkpoint(df), figure_content(df), figure_dual(df)]


def make_figures(df: pd.DataFrame, curves: pd.DataFrame | None = None) -> list[FigureResult]:
    """Every figure of the paper's part of a report: the result figures, then the training
    curves."""
    return [*paper_figures(df), *figure_training_curves(curves)]


def figure_bytes(fig: Figure, fmt: str = "png", dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi)
    return buf.getvalue()


def save_figure(result: FigureResult, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write a built figure as PNG and PDF (atomic); returns {"png": path, "pdf": path}."""
    if result.figure is None:
        return {}
    out = Path(out_dir)
    paths = {}
    for fmt in ("png", "pdf"):
        paths[fmt] = atomic_write_bytes(
            out / f"{result.id}.{fmt}", figure_bytes(result.figure, fmt)
        )
    return paths
