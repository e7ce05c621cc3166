"""Do the routes matter (beyond the paper; issue 21)? The route diagnostics each Stage 1
records for its Phase-1 checkpoint (``stage1.json`` "routes", from :mod:`pmnet.diagnose`):
``tab:routes`` and ``data/route_diagnostics.csv``. Read from the pipeline's records, not from
the trials."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.report.cells import NA, Cell, text_cell
from pmnet.report.studies.study import Findings, Study
from pmnet.report.table import Table
from pmnet.report.trials import Trials


def _routes_by_checkpoint(meta: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(Phase-1 seed label, route diagnostics) of each Phase-1 checkpoint whose Stage 1
    recorded them (`stage1.json` "routes", from `pmnet.diagnose` at the end of Phase 1)."""
    out = []
    many = meta.get("phase1_checkpoints")
    if isinstance(many, Mapping):
        for key in sorted(many, key=lambda k: (len(str(k)), str(k))):
            rec = many[key]
            if isinstance(rec, Mapping) and isinstance(rec.get("routes"), Mapping):
                out.append((str(key), rec["routes"]))
    one = meta.get("phase1")
    if not out and isinstance(one, Mapping) and isinstance(one.get("routes"), Mapping):
        out.append((str(one.get("phase1_seed", 0)), one["routes"]))
    return out


ROUTING_ON, ROUTING_OFF = "consolidator_only", "consolidator_only_routing_off"


def routing_effect_by_checkpoint(df: pd.DataFrame, labels: Sequence[str]) -> dict[str, float]:
    """Per Phase-1 checkpoint label: the mean over seeds of the paired routing on - off
    difference of updated-mapping LTM recall (pp), the paper's second headline effect, so
    that a reader can set it beside how much that checkpoint's routes matter (issue 21).
    Trials without a Phase-1 seed (the paper's single checkpoint) belong to the only label;
    a checkpoint without both arms on a common seed is left out."""
    if df.empty or not {"condition", "seed", "updated_ltm"} <= set(df.columns):
        return {}
    df = stats.default_variant(df)
    if stats.PHASE1_SEED in df.columns and df[stats.PHASE1_SEED].notna().any():
        key = df[stats.PHASE1_SEED].map(lambda v: "" if pd.isna(v) else str(int(v)))
    elif len(labels) == 1:
        key = pd.Series(labels[0], index=df.index)
    else:
        return {}
    out = {}
    for label, part in df.groupby(key, sort=True):  # the one paired definition, per checkpoint
        cmp = stats.paired_comparison(part, ROUTING_ON, "updated_ltm", ROUTING_OFF,
                                      "updated_ltm")
        if cmp["n"] > 0:
            out[str(label)] = float(cmp["mean_diff"])
    return out


def _per_block(values: Sequence[Any], fmt: str) -> Cell:
    return text_cell(" / ".join("–" if v is None else format(v, fmt) for v in values))


def table_routes(meta: Mapping[str, Any],
                 routing_effect: Mapping[str, float] | None = None) -> Table | None:
    """Do the hard routes of each Phase-1 checkpoint matter (issue 21, ours)? STM recall on the
    validation stream, with every top-1 route replaced by a random child, with each block's
    writes removed; how often L changes a route; the routing margins; beside them, when the
    trials have both arms, that checkpoint's routing on - off effect (test stream). None when
    no Stage 1 recorded them."""
    checkpoints = _routes_by_checkpoint(meta)
    if not checkpoints:
        return None
    effect = dict(routing_effect or {})
    rows: list[list[Cell]] = []
    for label, d in checkpoints:
        rnd = d["stm_random_routes"]
        rows.append([
            text_cell(label),
            Cell("int", int(d["episodes"])),
            Cell("num", d["stm"]["recall"]),
            Cell("num", rnd["recall"]),
            Cell("num", rnd["drop"], signed=True),
            Cell("num", d["stm_one_path"]["drop"], signed=True) if "stm_one_path" in d else NA,
            _per_block([r["drop"] for r in d["stm_without_block"]], "+.1f"),
            _per_block(d["ltm_route_change"], ".0f"),
            _per_block(d.get("route_concentration") or [None] * int(d["n_blocks"]), ".0f"),
            _per_block(d["margin_median"], ".3f"),
            Cell("num", effect[label], signed=True) if label in effect else NA,
        ])
    return Table(
        "tab:routes",
        "Do the routes matter? Route diagnostics of each Phase-1 checkpoint on the validation "
        "stream (ours, not in the paper; `pmnet diagnose`): immediate STM recall (%), the same "
        "with every top-1 route replaced by a uniform random child and its drop (pp), the "
        "drop with every token sent down one path (child 0 at every block: routes without "
        "content), the drop with block b's writes removed (blocks 0 / 1 / ...), the % of "
        "segment-2 routes that adding L (identity consolidation) changes, the % of a "
        "segment's tokens in its most visited group (100: every token takes one path), and "
        "the median top-1 minus top-2 routing probability per block.",
        ["Phase-1 seed", "Episodes", "STM", "Random routes", "Drop", "One path (drop)",
         "Writes removed (drop)",
         "L changes routes (%)", "Top group (%)", "Margin", "Routing on - off (pp)"],
        rows,
        notes=["A drop is paired (the same episodes); positive means the intervention hurt. "
               "Random routes leave the root group (block 0), which every token visits, as "
               "it is. Near-zero margins mean routes decided by near-ties.",
               "Routing on - off: that checkpoint's mean over Phase-2 seeds of the paired "
               "difference in updated-mapping LTM recall on the test stream (the per-checkpoint "
               "tests are in tab:phase1-checkpoints); blank where the trials lack an arm."],
        align=["l", "r", "r", "r", "r", "r", "l", "l", "l", "l", "r"],
    )


def routes_frame(meta: Mapping[str, Any]) -> pd.DataFrame:
    """One row per (Phase-1 checkpoint, block) of the recorded route diagnostics."""
    rows = []
    for label, d in _routes_by_checkpoint(meta):
        for b in range(int(d["n_blocks"])):
            frm = d["stm_without_blocks_from"][b]
            rows.append({
                "phase1_seed": label, "block": b, "episodes": d["episodes"],
                "stm": d["stm"]["recall"], "stm_random_routes": d["stm_random_routes"]["recall"],
                "random_route_drop": d["stm_random_routes"]["drop"],
                "one_path_drop": (d.get("stm_one_path") or {}).get("drop"),
                "margin_median": d["margin_median"][b], "top_prob_mean": d["top_prob_mean"][b],
                "writes_removed_drop": d["stm_without_block"][b]["drop"],
                "writes_removed_from_drop": None if frm is None else frm["drop"],
                "ltm_route_change": d["ltm_route_change"][b],
                "route_concentration": (d.get("route_concentration") or [None] * (b + 1))[b]})
    return pd.DataFrame(rows)


def _build(trials: Trials) -> Findings:
    labels = [label for label, _ in _routes_by_checkpoint(trials.meta)]
    effect = routing_effect_by_checkpoint(stats.add_derived_metrics(trials.loaded), labels)
    table = table_routes(trials.meta, effect)
    return Findings(tables=[table] if table is not None else [],
                    data={"route_diagnostics.csv": routes_frame(trials.meta)})


STUDY = Study(
    name="route diagnostics",
    grid="",
    recognise=lambda trials: bool(_routes_by_checkpoint(trials.meta)),
    build=_build,
)
