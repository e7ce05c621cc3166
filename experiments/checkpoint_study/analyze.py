"""The checkpoint study's analysis (issue 39): what `study.py` has committed so far ->
`experiments/results/issue39/study/analysis/` (summary.md, CSVs, predictor.json, the figure).

    python experiments/checkpoint_study/analyze.py

Everything comes from the library's statistics (`pmnet.stats.checkpoint_distribution`, the
report's `fig-checkpoints`), applied to the study's result files; the predictor's test is the
one pre-registered in docs/results.md ("Pre-registration" and its two amendments):
Spearman's rho between the root's L route change of each Phase-1 checkpoint and its routing
effect, one-sided (rho < 0), p < 0.05, confirmatory on Phase-1 seeds 3..9.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pmnet import stats  # noqa: E402
from pmnet.conditions import ROUTING_PAIRS, STRICT_PAIRS  # noqa: E402
from pmnet.io import atomic_write_text  # noqa: E402
from pmnet.report.figures import save_figure  # noqa: E402
from pmnet.report.studies.checkpoints import figure_checkpoints  # noqa: E402

STUDY = ROOT / "experiments" / "results" / "issue39" / "study"
CONFIRMATORY = tuple(range(3, 10))  # the second amendment: seeds 0..2 are not independent
ROUTING = "routing on - off: updated_ltm"


def load_trials() -> pd.DataFrame:
    files = sorted(p for p in (STUDY / "trials").glob("*.json")
                   if not p.stem.endswith("-diagnose"))
    if not files:
        raise SystemExit(f"no trial results in {STUDY / 'trials'} yet")
    return stats.default_variant(stats.add_derived_metrics(stats.load_results(files)))


def checkpoint_features() -> pd.DataFrame:
    """Per checkpoint: the pre-registered predictor and the secondary ones (Phase-1 route
    diagnostics), and from the routing-on model of seed 42 the recall lost when L leaves the
    root's routing; the routing-off model's loss under strict routing off."""
    rows = []
    for d in sorted((STUDY / "checkpoints").glob("p1s*"), key=lambda p: int(p.name[3:])):
        diag = d / "diagnose.json"
        if not diag.is_file():
            continue
        k = int(d.name[3:])
        g = json.loads(diag.read_text())
        origin = json.loads((d / "origin.json").read_text())
        row = {"phase1_seed": k, "root_l_route_change": g["ltm_route_change"][0],
               "random_route_cost": g["stm_random_routes"]["drop"],
               "root_margin": g["margin_median"][0], "phase1_stm_val": g["stm"]["recall"],
               "strict_route_change": json.dumps([round(x, 1) for x in
                                                  g.get("strict_route_change") or []]),
               "cpu": origin["cpu"], "sha256": origin["sha256"][:12]}
        for cond, key in (("consolidator_only", "on"),
                          ("consolidator_only_routing_off", "off")):
            p2 = STUDY / "trials" / f"{cond}-p{k}-s42-diagnose.json"
            if p2.is_file():
                h = json.loads(p2.read_text())
                if h.get("updated_without_ltm_route"):
                    row["on_root_l_removed_cost"] = h["updated_without_ltm_route"][0]["drop"]
                if h.get("updated_strict_off"):
                    row[f"{key}_strict_off_cost"] = h["updated_strict_off"]["drop"]
        rows.append(row)
    return pd.DataFrame(rows)


#: the channel arms' operators (issue 39, "Can anything use the channel?"), each with its
#: routing-off twin (`pmnet.conditions.ROUTING_PAIRS`), read against the Consolidator's
CONSOLIDATOR = "consolidator_only"
CHANNEL_OPERATORS = ("operator_gru", "memory_consolidator")
#: how well each arm consolidates, on the channel checkpoints: the operator - the Consolidator,
#: same routing (is the operator more capable, i.e. is the comparison worth making?)
LEVEL_COMPARISONS: tuple[stats.Comparison, ...] = tuple(
    stats.Comparison(f"{op} - {CONSOLIDATOR}, routing {r}: updated_ltm",
                     op + suffix, "updated_ltm", CONSOLIDATOR + suffix, "updated_ltm", "")
    for op in CHANNEL_OPERATORS
    for r, suffix in (("on", ""), ("off", "_routing_off")))


#: the conditions only the channel arms train (the Consolidator's two are the core arms)
CHANNEL_ONLY = tuple(c for op in CHANNEL_OPERATORS for c in (op, ROUTING_PAIRS[op]))


def channel_checkpoints(df: pd.DataFrame) -> list[int]:
    """Phase-1 seeds with every arm of the channel question (each operator, routing on and
    off, and the Consolidator's two arms) on at least one common Phase-2 seed."""
    conds = [c for op in (CONSOLIDATOR, *CHANNEL_OPERATORS)
             for c in (op, ROUTING_PAIRS[op])]
    have = df.groupby(["phase1_seed", "seed"]).condition.agg(set)
    return sorted({k for (k, _), got in have.items() if set(conds) <= got})


def routing_interaction(df: pd.DataFrame, op: str, ks: list[int]) -> dict:
    """(op on - off) - (Consolidator on - off) of updated-LTM recall, per checkpoint the mean
    over its Phase-2 seeds (paired by seed), then a one-sample t over the checkpoints: the
    checkpoint is the unit (with equal seeds per checkpoint this is the random-intercept
    estimate). > 0: the operator gains more from routing than the Consolidator does."""
    v = df[df.phase1_seed.isin(ks)].pivot_table(index=["phase1_seed", "seed"],
                                                columns="condition", values="updated_ltm")
    need = [op, ROUTING_PAIRS[op], CONSOLIDATOR, ROUTING_PAIRS[CONSOLIDATOR]]
    v = v.dropna(subset=need)
    d = ((v[op] - v[ROUTING_PAIRS[op]])
         - (v[CONSOLIDATOR] - v[ROUTING_PAIRS[CONSOLIDATOR]]))
    per = d.groupby(level="phase1_seed").mean()
    out = {"operator": op, "k": int(len(per)), "n_pairs": int(len(d)),
           "per_checkpoint": {int(k): float(x) for k, x in per.items()}}
    if len(per) >= 2:
        t = sps.ttest_1samp(per, 0.0)
        ci = t.confidence_interval(0.95)
        out.update(mean=float(per.mean()), se=float(per.std(ddof=1) / math.sqrt(len(per))),
                   ci_low=float(ci.low), ci_high=float(ci.high), p=float(t.pvalue))
    return out


def channel_mechanism(ks: list[int]) -> list[dict]:
    """From each seed-42 model's diagnostics: the updated-LTM recall it loses (pp) with
    routing switched off at inference (the paper's off: L out of each block's own routing),
    with L out of the root's routing only, and under strict routing off (L out of u too),
    and its L route change per block: do the trained models use the channel at all?"""
    rows = []
    for k in ks:
        for op in (CONSOLIDATOR, *CHANNEL_OPERATORS):
            for cond in (op, ROUTING_PAIRS[op]):
                if (h := seed42_diagnostics(cond, k)) is None:
                    continue
                wo = h.get("updated_without_ltm_route") or []
                strict = h.get("updated_strict_off") or {}
                rows.append({
                    "phase1_seed": k, "condition": cond,
                    # a routing-off model has no "updated_ltm" entry: its recall is the
                    # strict-off recall plus what strict off cost it
                    "updated_ltm": ((h.get("updated_ltm") or {}).get("recall")
                                    or strict["recall"] + strict["drop"]),
                    "routing_off_cost": (h.get("updated_routing_off") or {}).get("drop"),
                    "root_l_removed_cost": wo[0]["drop"] if wo else None,
                    "strict_off_cost": strict.get("drop"),
                    "l_route_change": json.dumps([round(x, 1) for x in
                                                  h.get("ltm_route_change") or []])})
    return rows


def channel_section(df: pd.DataFrame, out: Path) -> list[str]:
    """"Can anything use the channel?": on the checkpoints with every channel arm, each
    arm's routing effect and level against the Consolidator's, their interaction, and
    whether the trained models use L's routes at all -> channel.json and summary lines."""
    ks = channel_checkpoints(df)
    if not ks:
        return ["", "Channel arms: no checkpoint has all six arms yet."]
    sub = df[df.phase1_seed.isin(ks)]
    dists, points = stats.checkpoint_distribution(
        sub, (*stats.CHANNEL_COMPARISONS, *LEVEL_COMPARISONS))
    inter = [routing_interaction(df, op, ks) for op in CHANNEL_OPERATORS]
    routing = {c.cond_a: c.label for c in stats.CHANNEL_COMPARISONS}
    eff = stats.checkpoint_frame(points).pivot(index="phase1_seed", columns="label",
                                               values="mean_diff")
    agree = {op: spearman(eff[routing[CONSOLIDATOR]], eff[routing[op]], "two-sided")
             for op in CHANNEL_OPERATORS if routing[op] in eff}
    mech = channel_mechanism(ks)
    levels = (sub.groupby(["condition", "phase1_seed"])[["updated_ltm", "updated_ltm_add10",
                                                          "updated_ltm_affine10", "seg2_stm"]]
              .mean().groupby("condition").mean())
    result = {"checkpoints": ks,
              "phase2_seeds": sorted(int(x) for x in sub.seed.unique()),
              "distribution": stats.checkpoint_frame(dists).to_dict(orient="records"),
              "interaction_vs_consolidator": inter,
              "routing_effect_agreement_with_consolidator": agree,
              "levels_mean_over_checkpoints": levels.round(3).to_dict(orient="index"),
              "mechanism_seed42": mech}
    atomic_write_text(out / "channel.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "channel_effects.csv",
                      stats.checkpoint_frame(points).to_csv(index=False))

    lines = ["", f"## Channel arms (checkpoints {ks})", "", DISTRIBUTION_HEADER,
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             *map(distribution_row, dists)]
    for x in inter:
        lines.append(f"| ({x['operator']} on - off) - (Consolidator on - off) | {x['k']} | "
                     f"{x['n_pairs']} | {fmt(x.get('mean'), '+.2f')} ± {fmt(x.get('se'))} | "
                     f"[{fmt(x.get('ci_low'), '+.2f')}, {fmt(x.get('ci_high'), '+.2f')}] | "
                     f"{fmt(x.get('p'), '.3f')} | | | | |")
    lines += ["", *checkpoint_table(points, ks)]
    lines += ["", "| arm (mean over the checkpoints) | updated LTM | ADD10 | AFFINE10 | "
              "segment-2 STM |", "|---|---:|---:|---:|---:|"]
    for cond, r in levels.iterrows():
        lines.append(f"| {cond} | {r.updated_ltm:.2f} | {r.updated_ltm_add10:.2f} | "
                     f"{r.updated_ltm_affine10:.2f} | {r.seg2_stm:.2f} |")
    lines += ["", "| Phase-1 seed | model (seed 42) | updated LTM | cost: routing off | "
              "cost: L out of the root's routing | cost: strict off | "
              "L route change per block (%) |",
              "|---|---|---:|---:|---:|---:|---|"]
    for m in mech:
        lines.append(f"| {m['phase1_seed']} | {m['condition']} | {m['updated_ltm']:.2f} | "
                     f"{fmt(m['routing_off_cost'], '+.2f')} | "
                     f"{fmt(m['root_l_removed_cost'], '+.2f')} | "
                     f"{fmt(m['strict_off_cost'], '+.2f')} | {m['l_route_change']} |")
    for op, a in agree.items():
        lines.append(f"\nRouting effect, {op} vs the Consolidator across checkpoints: "
                     f"Spearman rho = {fmt(a['rho'], '+.2f')} (n = {a['n']}, p = "
                     f"{fmt(a['p'], '.3f')})")
    return lines


#: the arms with a strict-off twin, by their routing-on name
STRICT_ARMS = tuple(on for on, off in ROUTING_PAIRS.items() if off in STRICT_PAIRS)
#: all of L's routing influence: routing on - strict off, per arm with a strict-off twin
ALL_ROUTING_COMPARISONS: tuple[stats.Comparison, ...] = tuple(
    stats.Comparison(f"routing on - strict off: updated_ltm ({on})", on, "updated_ltm",
                     STRICT_PAIRS[ROUTING_PAIRS[on]], "updated_ltm", "")
    for on in STRICT_ARMS)


def strict_checkpoints(df: pd.DataFrame, on: str) -> list[int]:
    """Phase-1 seeds where arm `on` has its routing-on, routing-off and strict-off models on at
    least one common Phase-2 seed."""
    conds = {on, ROUTING_PAIRS[on], STRICT_PAIRS[ROUTING_PAIRS[on]]}
    have = df.groupby(["phase1_seed", "seed"]).condition.agg(set)
    return sorted({k for (k, _), got in have.items() if conds <= got})


def strict_section(df: pd.DataFrame, out: Path) -> list[str]:
    """What a trained strict-off arm changes: per arm with a strict-off twin, on the
    checkpoints where its three arms ran, routing off - strict off (what L through u is
    worth) and routing on - strict off (all of L's routing influence), with the checkpoint as
    the unit; whether the strict models' routers really ignore L (their diagnostics: strict
    off costs them nothing); and whether the inference-time probe on the routing-off model
    (its strict-off cost) foretells the trained effect -> strict.json and summary lines."""
    arms = {on: strict_checkpoints(df, on) for on in STRICT_ARMS}
    if not any(arms.values()):
        return ["", "Strict-off arms: no checkpoint has them yet."]
    dists, points, probe_vs_trained, sanity = [], [], {}, []
    for on, ks in arms.items():
        if not ks:
            continue
        off = ROUTING_PAIRS[on]
        strict = STRICT_PAIRS[off]
        comps = [c for c in (*stats.STRICT_COMPARISONS, *ALL_ROUTING_COMPARISONS)
                 if c.cond_a in (on, off) and c.cond_b == strict]
        d, p = stats.checkpoint_distribution(df[df.phase1_seed.isin(ks)], comps)
        dists += d
        points += p
        trained = {q.phase1_seed: q.mean_diff for q in p if q.label.startswith("routing off")}
        probe = {}
        for k in ks:
            for cond in (off, strict):
                if (h := seed42_diagnostics(cond, k)) is None:
                    continue
                cost = (h.get("updated_strict_off") or {}).get("drop")
                if cond == off:
                    probe[k] = cost
                else:
                    sanity.append({"phase1_seed": k, "condition": cond,
                                   "strict_off_cost": cost,
                                   "l_route_change": h.get("ltm_route_change")})
        ok = [k for k in ks if k in probe and k in trained and probe[k] is not None]
        probe_vs_trained[on] = {
            "per_checkpoint": [{"phase1_seed": k, "probe_cost_seed42": probe[k],
                                "trained_off_minus_strict": trained[k]} for k in ok],
            "spearman": spearman(pd.Series([probe[k] for k in ok]),
                                 pd.Series([trained[k] for k in ok]), "two-sided")}
    all_ks = sorted({k for ks in arms.values() for k in ks})
    conds = [c for on in arms for c in (on, ROUTING_PAIRS[on], STRICT_PAIRS[ROUTING_PAIRS[on]])]
    levels = (df[df.condition.isin(conds) & df.phase1_seed.isin(all_ks)]
              .groupby(["condition", "phase1_seed"])[["updated_ltm", "updated_ltm_add10",
                                                      "seg2_stm"]]
              .mean().groupby("condition").mean())
    result = {"checkpoints": {on: ks for on, ks in arms.items()},
              "distribution": stats.checkpoint_frame(dists).to_dict(orient="records"),
              "levels_mean_over_checkpoints": levels.round(3).to_dict(orient="index"),
              "probe_vs_trained": probe_vs_trained,
              "strict_models_seed42": sanity}
    atomic_write_text(out / "strict.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "strict_effects.csv",
                      stats.checkpoint_frame(points).to_csv(index=False))
    lines = ["", f"## Strict-off arms (checkpoints {result['checkpoints']})", "",
             DISTRIBUTION_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             *map(distribution_row, dists), "", *checkpoint_table(points, all_ks)]
    lines += ["", "| arm (mean over the checkpoints) | updated LTM | ADD10 | segment-2 STM |",
              "|---|---:|---:|---:|"]
    for cond, r in levels.iterrows():
        lines.append(f"| {cond} | {r.updated_ltm:.2f} | {r.updated_ltm_add10:.2f} | "
                     f"{r.seg2_stm:.2f} |")
    lines += ["", "| Phase-1 seed | strict model (seed 42) | cost: strict off at inference "
              "(0 = its routers ignore L) | L route change per block (%) |",
              "|---|---|---:|---|"]
    for m in sanity:
        lines.append(f"| {m['phase1_seed']} | {m['condition']} | "
                     f"{fmt(m['strict_off_cost'], '+.2f')} | "
                     f"{[round(x, 1) for x in m['l_route_change'] or []]} |")
    for on, v in probe_vs_trained.items():
        a = v["spearman"]
        lines.append(f"\nProbe (seed-42 routing-off model's strict-off cost) vs trained off - "
                     f"strict off, {on}: Spearman rho = {fmt(a['rho'], '+.2f')} (n = {a['n']}, "
                     f"p = {fmt(a['p'], '.3f')})")
    return lines


def spearman(x: pd.Series, y: pd.Series, alternative: str) -> dict:
    ok = x.notna() & y.notna()
    if ok.sum() < 3:
        return {"n": int(ok.sum()), "rho": None, "p": None}
    r = sps.spearmanr(x[ok], y[ok], alternative=alternative)
    return {"n": int(ok.sum()), "rho": float(r.statistic), "p": float(r.pvalue)}


def fmt(x, spec=".2f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


DISTRIBUTION_HEADER = ("| effect (pp) | K | n | mean ± SE (random factor) | 95% CI | p | "
                       "between SD | within SD | positive | signif. + / - |")


def distribution_row(d: stats.EffectDistribution) -> str:
    """One effect's distribution over checkpoints, the columns of DISTRIBUTION_HEADER."""
    return (f"| {d.label} | {d.k} | {d.n} | {fmt(d.estimate, '+.2f')} ± {fmt(d.se)} | "
            f"[{fmt(d.ci_low, '+.2f')}, {fmt(d.ci_high, '+.2f')}] | {fmt(d.p, '.3f')} | "
            f"{fmt(d.sd_between)} | {fmt(d.sd_within)} | {d.positive} / {d.k} | "
            f"{d.positive_significant} / {d.negative_significant} |")


def point_cell(p: stats.CheckpointPoint | None) -> str:
    """One checkpoint's effect: mean [pooled-SD CI] verdict, or "" where it did not run."""
    return "" if p is None else (f"{p.mean_diff:+.2f} [{p.ci_low:+.1f}, {p.ci_high:+.1f}] "
                                 f"{p.verdict}")


def checkpoint_table(points, ks) -> list[str]:
    """A row per checkpoint of `ks`, a column per effect of `points` (in their order)."""
    labels = list(dict.fromkeys(p.label for p in points))
    by = {(p.label, p.phase1_seed): p for p in points}
    return (["| Phase-1 seed | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
            + [f"| {k} | " + " | ".join(point_cell(by.get((lab, k))) for lab in labels) + " |"
               for k in ks])


def seed42_diagnostics(cond: str, k: int) -> dict | None:
    """`pmnet diagnose` of the seed-42 model of `cond` on checkpoint k, if it ran."""
    f = STUDY / "trials" / f"{cond}-p{k}-s42-diagnose.json"
    return json.loads(f.read_text()) if f.is_file() else None


def at_last_epoch(df: pd.DataFrame) -> pd.DataFrame:
    """Every trial scored at its last epoch instead of its selected one: each metric with a
    `last_` twin takes that twin's value (issue 44: a trial selected at epoch 0 says what an
    untrained Consolidator does)."""
    out = df.copy()
    for col in df.columns:
        if col.startswith(stats.LAST_PREFIX) and col[len(stats.LAST_PREFIX):] in df.columns:
            out[col[len(stats.LAST_PREFIX):]] = df[col]
    return out


def sensitivity_section(df: pd.DataFrame, out: Path) -> list[str]:
    """Issue 44's corrections: the core effects on the pre-registered confirmatory
    checkpoints only, every trial at its last epoch, and each arm beside its output-set
    baseline (a comparison of two arms below it compares models that do not use the rule)."""
    core = stats.CHECKPOINT_COMPARISONS
    frames = {"all checkpoints, selected epoch": df,
              "confirmatory 3..9, selected epoch": df[df.phase1_seed.isin(CONFIRMATORY)],
              "all checkpoints, last epoch": at_last_epoch(df)}
    rows, gate_text = [], []
    for analysis, part in frames.items():
        for d in stats.checkpoint_distribution(part, core)[0]:
            gate = stats.capability_gate(part, next(c for c in core if c.label == d.label))
            rows.append((analysis, d))
            gate_text.append(gate.text() if gate else "")
    frame = stats.checkpoint_frame([d for _, d in rows])
    frame.insert(0, "analysis", [a for a, _ in rows])
    frame["arms_vs_baseline"] = gate_text
    atomic_write_text(out / "sensitivity.csv", frame.to_csv(index=False))
    lines = ["", "## Sensitivity (issue 44): confirmatory subset, last epoch, capability",
             "", "| analysis " + DISTRIBUTION_HEADER + " arms vs output-set baseline (%) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (analysis, d), gate in zip(rows, frame["arms_vs_baseline"]):
        lines.append(f"| {analysis} {distribution_row(d)} {gate} |")
    return lines


def main(argv=None) -> int:
    import argparse

    global STUDY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", default=str(STUDY), help="the study directory")
    STUDY = Path(ap.parse_args(argv).study).resolve()
    df = load_trials()
    # a checkpoint enters the channel comparisons only as a whole unit: every channel arm on
    # a common Phase-2 seed (`channel_checkpoints`); a started, unfinished checkpoint's
    # channel trials are listed, not averaged in
    partial = df[df.condition.isin(CHANNEL_ONLY) & ~df.phase1_seed.isin(channel_checkpoints(df))]
    df_all, df = df, df.drop(partial.index)
    left_out = ", ".join(f"{r.condition} p{r.phase1_seed} s{r.seed} {r.updated_ltm:.2f}"
                         for r in partial.itertuples())
    comparisons = (*stats.CHECKPOINT_COMPARISONS,
                   *[c for c in stats.CHANNEL_COMPARISONS if c.label != ROUTING],
                   *stats.STRICT_COMPARISONS)
    dists, points = stats.checkpoint_distribution(df, comparisons)
    out = STUDY / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    dist_df, pts_df = stats.checkpoint_frame(dists), stats.checkpoint_frame(points)
    atomic_write_text(out / "distribution.csv", dist_df.to_csv(index=False))
    atomic_write_text(out / "effects.csv", pts_df.to_csv(index=False))
    feats = checkpoint_features()
    atomic_write_text(out / "checkpoint_features.csv", feats.to_csv(index=False))
    fig = figure_checkpoints(dists, points)
    if fig.figure is not None:
        save_figure(fig, out)

    routing = pts_df[pts_df.label == ROUTING].set_index("phase1_seed")["mean_diff"]
    feats = feats.set_index("phase1_seed")
    feats["routing_effect"] = routing
    conf = feats.loc[[k for k in CONFIRMATORY if k in feats.index]]
    predictor = {
        "pre_registered": "rho(root L route change, routing effect) < 0, one-sided p < 0.05, "
                          "confirmatory on Phase-1 seeds 3..9",
        "confirmatory": spearman(conf["root_l_route_change"], conf["routing_effect"], "less"),
        "all_checkpoints_not_independent": spearman(feats["root_l_route_change"],
                                                    feats["routing_effect"], "less"),
        "sign_rule_X_ge_50": [
            {"phase1_seed": int(k), "x": float(r.root_l_route_change),
             "routing_effect": float(r.routing_effect)}
            for k, r in feats.iterrows()
            if r.root_l_route_change >= 50 and not math.isnan(r.routing_effect)],
        "secondary_two_sided": {
            name: spearman(feats[name], feats["routing_effect"], "two-sided")
            for name in ("random_route_cost", "root_margin", "phase1_stm_val",
                         "on_root_l_removed_cost") if name in feats},
        "checkpoints_with_both_arms": sorted(int(k) for k in routing.index),
    }
    predictor["confirmatory"]["holds"] = (
        predictor["confirmatory"]["rho"] is not None and predictor["confirmatory"]["rho"] < 0
        and predictor["confirmatory"]["p"] < 0.05)
    atomic_write_text(out / "predictor.json", json.dumps(predictor, indent=2) + "\n")

    lines = ["# Checkpoint study (issue 39): analysis of what has run",
             "", f"Trials: {len(df_all)}; checkpoints with both Consolidator arms: "
             f"{predictor['checkpoints_with_both_arms']}", "",
             *([f"Channel trials of checkpoints without every channel arm, left out "
                f"(updated LTM, %): {left_out}", ""] if left_out else []),
             DISTRIBUTION_HEADER + " K for 5 pp | K for 10 pp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in dists:
        lines.append(f"{distribution_row(d)} {d.k_needed_5 or ''} | {d.k_needed_10 or ''} |")
    labels = list(dict.fromkeys(p.label for p in points))
    lines += ["", "| Phase-1 seed | " + " | ".join(labels) + " | root L change (%) | "
              "random-route cost | root margin | Phase-1 STM (val) |",
              "|---|" + "---:|" * (len(labels) + 4)]
    by = {(p.label, p.phase1_seed): p for p in points}
    for k in sorted({p.phase1_seed for p in points}):
        cells = [point_cell(by.get((label, k))) for label in labels]
        f = feats.loc[k] if k in feats.index else None
        extra = ["", "", "", ""] if f is None else [
            fmt(f.root_l_route_change, ".1f"), fmt(f.random_route_cost, "+.1f"),
            fmt(f.root_margin, ".3f"), fmt(f.phase1_stm_val, ".1f")]
        lines.append(f"| {k} | " + " | ".join(cells + extra) + " |")
    c = predictor["confirmatory"]
    lines += ["", f"Predictor (pre-registered, seeds 3..9): n = {c['n']}, rho = "
              f"{fmt(c['rho'], '+.3f')}, one-sided p = {fmt(c['p'], '.3f')}; holds: "
              f"{c['holds']}"]
    lines += channel_section(df, out)
    lines += strict_section(df, out)
    lines += sensitivity_section(df, out)
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
