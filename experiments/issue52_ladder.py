"""The scale ladder (issue 52, item 3): each rung's committed store read together.

For every rung (a preset with a committed store of the `ladder` grid, or issue 39's `cpu`
store, whose `checkpoints`/`checkpoint_channel` grids ran the same arms):
- Phase-1 STM per family on the test stream, beside each family's output-set baseline;
- forced identity's initial-mapping recall (every trial's evaluation; its ratio to seg-1 STM);
- each arm's updated-LTM recall per family against its baseline, on validation (the best
  epoch's, what choices and the capability gate read) and on the test stream;
- the Phase-2 learning curve (validation updated LTM per epoch, mean over checkpoints);
- one figure: validation updated-LTM recall of each arm against parameters on a log axis,
  every checkpoint a point, the paper's figure (its test stream, one checkpoint) beside
  them, and an OLS trend in log10(parameters) (every checkpoint a point, so a rung weighs
  as many checkpoints as it has) with its 95% band where two or more rungs
  have the arm; where the trend crosses the output-set baseline + 10 pp is printed.
- the same trend on ADD10 alone, against that family's baseline + 10 pp: the family every
  rung's backbone learned, so its trend is not held down by an unlearned AFFINE10.

Writes `experiments/results/issue52/ladder/ladder.md`, `ladder.png`, `ladder.json`.

    .venv/bin/python experiments/issue52_ladder.py
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pmnet.io import atomic_write_text  # noqa: E402
from tune_spaces.grids import LADDER_CONDITIONS  # noqa: E402

OUT = ROOT / "experiments" / "results" / "issue52" / "ladder"
RESULTS = ROOT / "experiments" / "results"
#: rung -> its store (the rungs in order of size; a rung whose store is absent is skipped)
RUNGS = {"cpu": RESULTS / "issue39" / "store",
         "small": RESULTS / "issue52" / "store-small",
         "medium": RESULTS / "issue52" / "store-medium"}
#: the arms each rung reports, in table order: the `ladder` grid's
ARMS = LADDER_CONDITIONS
FAMILIES = ("add10", "affine10")
#: the paper's single checkpoint (test stream; `../shared/spec/paper-aggregates.csv`):
#: Consolidator only, updated LTM, routing on: 87.02 (ADD10 99.01, AFFINE10 74.80)
PAPER_PARAMS = 29_950_000
PAPER = {"consolidator_only": 87.02, "consolidator_only_routing_off": 87.02 - 42.64}
#: the capability gate of issues 44 and 52: the output-set baseline + 10 pp
MARGIN = 10.0


def _params(preset: str) -> int:
    import torch

    from pmnet.config import ModelConfig
    from pmnet.model import PMNet

    with torch.device("meta"):
        return PMNet(ModelConfig.from_name(preset)).parameter_counts()["total"]


def read_rung(store: Path) -> dict:
    """Phase-1 test STM per checkpoint and every ladder arm's trials of a store."""
    phase1 = {}
    for d in sorted(store.glob("phase1-p1s*")):
        f = d / "phase1_metrics.json"
        if f.is_file() and (d / "stage1.json").is_file():  # committed units only
            t = json.loads(f.read_text())["test"]
            phase1[int(d.name.split("p1s")[1])] = t
    trials = []
    for f in sorted((store / "results").glob("*.json")):
        r = json.loads(f.read_text())
        if r.get("condition") in ARMS:
            trials.append(r)
    return {"phase1": phase1, "trials": trials}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _stm_baseline(metrics: dict, fam: str) -> float | None:
    """The output-set baseline of `mean_stm_<fam>`: its own key where the metrics have it,
    else the mean of the segments' baselines."""
    if metrics.get(f"mean_stm_{fam}_baseline") is not None:
        return metrics[f"mean_stm_{fam}_baseline"]
    segs = [metrics.get(f"seg{t}_stm_{fam}_baseline") for t in (1, 2)]
    return None if None in segs else sum(segs) / 2


def summarise(rung: str, data: dict) -> dict:
    p1 = data["phase1"]
    out = {"rung": rung, "checkpoints": sorted(p1), "phase1": {}, "arms": {}}
    for fam in FAMILIES:
        out["phase1"][fam] = {
            "stm": _mean(t.get(f"mean_stm_{fam}") for t in p1.values()),
            # the two segments' mean baseline, as `mean_stm_<fam>` is the two segments' mean
            # STM (it read segment 1's alone until issue 61 corrected it)
            "baseline": _mean(_stm_baseline(t, fam) for t in p1.values()),
            "per_checkpoint": {k: t.get(f"mean_stm_{fam}") for k, t in p1.items()}}
    out["phase1"]["mean"] = _mean(t.get("mean_stm") for t in p1.values())
    by_arm = defaultdict(list)
    for r in data["trials"]:
        by_arm[r["condition"]].append(r)
    for arm in ARMS:
        rs = by_arm.get(arm, [])
        if not rs:
            continue
        per_ckpt = defaultdict(list)
        for r in rs:
            per_ckpt[r["phase1_seed"]].append(r)
        a = {"trials": len(rs), "checkpoints": sorted(per_ckpt), "val": {}, "test": {},
             "val_per_checkpoint": {}, "curve": []}
        a["val_per_checkpoint_family"] = {f: {} for f in FAMILIES}
        for k, group in per_ckpt.items():
            a["val_per_checkpoint"][k] = _mean(r["val"]["updated_ltm"] for r in group)
            for f in FAMILIES:
                a["val_per_checkpoint_family"][f][k] = _mean(
                    r["val"].get(f"updated_ltm_{f}") for r in group)
        for key in ("updated_ltm", *(f"updated_ltm_{f}" for f in FAMILIES)):
            a["val"][key] = _mean(r["val"].get(key) for r in rs)
        a["val"]["baseline"] = _mean(r["val"].get("updated_ltm_baseline") for r in rs)
        for key in ("updated_ltm", "forced_identity_initial", "seg1_stm",
                    *(f"updated_ltm_{f}" for f in FAMILIES),
                    *(f"updated_ltm_{f}_baseline" for f in FAMILIES), "updated_ltm_baseline"):
            a["test"][key] = _mean(r["test"].get(key) for r in rs)
        ratio = [r["test"]["forced_identity_initial"] / r["test"]["seg1_stm"] for r in rs
                 if r["test"].get("seg1_stm")]
        a["test"]["identity_over_stm"] = _mean(ratio)
        epochs = max(len(r["history"]) for r in rs)
        for e in range(epochs):
            a["curve"].append(_mean(r["history"][e].get("val/updated_ltm") for r in rs
                                    if e < len(r["history"])))
        out["arms"][arm] = a
    return out


def _where_gate(above: bool, cross: float | None) -> str:
    """Where a trend meets the capability gate, in words. `cross` is where the fitted line
    meets the gate: upward for a rising trend below it at the smallest size, downward for a
    falling trend above it there; None where it never meets it."""
    if above:
        if cross is None:
            return "already above it at the smallest size measured, and not falling"
        if not math.isfinite(cross):
            return "above it at the smallest size measured, and falling too slowly to leave it"
        return (f"above it at the smallest size measured, but falling: the trend drops below "
                f"it at {_size(cross)}")
    if cross is None:
        return "the trend never reaches it (slope <= 0)"
    if not math.isfinite(cross):
        return "the trend is too flat to reach it at any size"
    return f"the trend reaches it at {_size(cross)}"


def _size(params: float) -> str:
    """A parameter count in words: exact below the paper's size, else in powers of ten
    with its multiple of the paper's."""
    if params < PAPER_PARAMS:
        return f"{params:,.0f} parameters"
    return f"{params:.2g} parameters, {params / PAPER_PARAMS:.2g} times the paper's size"


def _what_ci_excludes(lo: float, hi: float) -> str:
    """What a slope's 95% CI rules out, not only its point."""
    if lo > 0:
        return "the CI excludes a flat or falling trend"
    if hi < 0:
        return "the CI excludes a flat or rising trend"
    return (f"the CI does not exclude a flat trend; it excludes a rise steeper than "
            f"{hi:+.1f} and a fall steeper than {lo:+.1f} pp per 10x")


def _gate_crossing(b0: float, b1: float, level: float,
                   smallest: float) -> tuple[bool, float | None]:
    """(above the gate at the smallest size, where the line meets the gate or None)."""
    above = b0 + b1 * math.log10(smallest) >= level
    if (above and b1 >= 0) or (not above and b1 <= 0):
        return above, None
    exponent = (level - b0) / b1  # log10 of the size where the line meets the gate
    return above, math.inf if exponent > 300 else 10.0 ** exponent


def trend(points: list[tuple[float, float]]):
    """OLS of recall on log10(parameters) over checkpoint points; None with < 2 sizes.
    Returns the statsmodels fit; `_gate_crossing` reads where it meets a gate."""
    if len({p for p, _ in points}) < 2:
        return None
    import numpy as np
    import statsmodels.api as sm

    x = np.log10([p for p, _ in points])
    y = np.array([v for _, v in points])
    return sm.OLS(y, sm.add_constant(x)).fit()


def _trend_line(arm: str, pts: list[tuple[float, float]], base: float | None):
    """One arm's trend in words, its summary for ladder.json (None below two sizes or
    without a baseline) and the fit (None likewise)."""
    fit = trend(pts) if base is not None else None
    if fit is None:
        return (f"- {arm}: {len({p for p, _ in pts})} rung(s) measured; a trend needs two.",
                None, None)
    b0, b1 = fit.params
    lo, hi = fit.conf_int()[1]
    level = base + MARGIN
    above, cross = _gate_crossing(b0, b1, level, min(p for p, _ in pts))
    summary = {"slope_per_decade": b1, "ci": [lo, hi], "crosses_gate_at": cross,
               "above_gate_at_smallest": above, "gate": level}
    return (f"- {arm}: {b1:+.1f} pp per 10x parameters (95% CI {lo:+.1f} to {hi:+.1f}); "
            f"baseline + 10 pp = {level:.1f}%: {_where_gate(above, cross)}; "
            + _what_ci_excludes(lo, hi), summary, fit)


def fmt(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def main() -> int:
    rungs = {}
    for name, store in RUNGS.items():
        if (store / "store.json").is_file():
            data = read_rung(store)
            if data["phase1"]:
                rungs[name] = summarise(name, data)
                rungs[name]["params"] = _params(name)
    lines = ["# The scale ladder (issue 52)", "",
             "Written by `.venv/bin/python experiments/issue52_ladder.py` from the committed "
             "stores (" + ", ".join(f"`{RUNGS[n].relative_to(ROOT)}`" for n in rungs) + "). "
             "Recall in %. Validation: the best epoch's (1,000 episodes, about +-3 pp); test: "
             "each preset's own test stream. Means over checkpoints (and Phase-2 seeds).", "",
             "## Phase 1 (test stream)", "",
             "| rung | parameters | checkpoints | ADD10 STM (baseline) | AFFINE10 STM "
             "(baseline) | mean STM |", "|---|---:|---|---|---|---:|"]
    for n, r in rungs.items():
        p = r["phase1"]
        lines.append(f"| {n} | {r['params']:,} | {len(r['checkpoints'])} | "
                     f"{fmt(p['add10']['stm'])} ({fmt(p['add10']['baseline'])}) | "
                     f"{fmt(p['affine10']['stm'])} ({fmt(p['affine10']['baseline'])}) | "
                     f"{fmt(p['mean'])} |")
    lines += ["", "## Phase 2: each arm per family", "",
              "| rung | arm | trials (checkpoints) | val updated LTM (baseline; gate +10) | "
              "val ADD10 / AFFINE10 | test updated LTM | test ADD10 (base) | test AFFINE10 "
              "(base) | forced identity initial / seg-1 STM |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n, r in rungs.items():
        for arm, a in r["arms"].items():
            v, t = a["val"], a["test"]
            gate = "**passes**" if (v["updated_ltm"] or 0) >= (v["baseline"] or 0) + MARGIN \
                else "below"
            lines.append(
                f"| {n} | {arm} | {a['trials']} ({len(a['checkpoints'])}) | "
                f"{fmt(v['updated_ltm'])} ({fmt(v['baseline'])}; {gate}) | "
                f"{fmt(v['updated_ltm_add10'])} / {fmt(v['updated_ltm_affine10'])} | "
                f"{fmt(t['updated_ltm'])} | {fmt(t['updated_ltm_add10'])} "
                f"({fmt(t['updated_ltm_add10_baseline'])}) | {fmt(t['updated_ltm_affine10'])} "
                f"({fmt(t['updated_ltm_affine10_baseline'])}) | "
                f"{fmt(t['forced_identity_initial'])} / {fmt(t['seg1_stm'])} "
                f"({fmt(t['identity_over_stm'], 2)}) |")
    lines += ["", "## Phase-2 learning curves (validation updated LTM per epoch, mean)", ""]
    for n, r in rungs.items():
        for arm, a in r["arms"].items():
            lines.append(f"- {n}, {arm}: " + ", ".join(fmt(x) for x in a["curve"]))
    lines += ["", "## Trend against parameters (validation, checkpoint means)", ""]
    trends, fits = {}, {}
    for arm in ARMS:
        pts = [(r["params"], v) for r in rungs.values() if arm in r["arms"]
               for v in r["arms"][arm]["val_per_checkpoint"].values() if v is not None]
        base = _mean(r["arms"][arm]["val"]["baseline"] for r in rungs.values()
                     if arm in r["arms"])
        line, trends[arm], fit = _trend_line(arm, pts, base)
        lines.append(line)
        if fit is not None:
            fits[arm] = (pts, fit)
    lines += ["", "## Trend on ADD10 alone (validation, checkpoint means)", "",
              "ADD10 is the family every rung's backbone learned (Phase-1 STM above its "
              "baseline at every rung); AFFINE10, half of every episode, was learned on few "
              "checkpoints, so the overall gate mixes the Consolidator with the backbone. "
              "The family's gate is its own output-set baseline (test stream) + 10 pp.", ""]
    family_trends = {}
    for arm in ARMS:
        pts = [(r["params"], v) for r in rungs.values() if arm in r["arms"]
               for v in r["arms"][arm]["val_per_checkpoint_family"]["add10"].values()
               if v is not None]
        base = _mean(r["arms"][arm]["test"]["updated_ltm_add10_baseline"]
                     for r in rungs.values() if arm in r["arms"])
        line, family_trends[arm], _ = _trend_line(arm, pts, base)
        lines.append(line)
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_text(OUT / "ladder.md", "\n".join(lines) + "\n")
    atomic_write_text(OUT / "ladder.json", json.dumps(
        {"rungs": rungs, "trends": trends, "trends_add10": family_trends},
        indent=1, sort_keys=True, default=str) + "\n")
    _figure(rungs, fits)
    print((OUT / "ladder.md").read_text())
    return 0


def _figure(rungs: dict, fits: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colors = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    bases = []
    for i, arm in enumerate(ARMS):
        xs, ys = [], []
        for r in rungs.values():
            if arm in r["arms"]:
                a = r["arms"][arm]
                bases.append(a["val"]["baseline"])
                for v in a["val_per_checkpoint"].values():
                    xs.append(r["params"] * (1 + 0.05 * (i - 1.5)))
                    ys.append(v)
        if xs:
            ax.scatter(xs, ys, s=14, alpha=0.6, color=colors[arm], label=arm)
        if arm in fits:
            pts, fit = fits[arm]
            grid = np.linspace(np.log10(min(p for p, _ in pts)), np.log10(PAPER_PARAMS), 50)
            pred = fit.get_prediction(np.column_stack([np.ones_like(grid), grid]))
            band = pred.conf_int(alpha=0.05)
            ax.plot(10 ** grid, pred.predicted_mean, color=colors[arm], lw=1)
            ax.fill_between(10 ** grid, band[:, 0], band[:, 1], color=colors[arm], alpha=0.12)
    for arm, v in PAPER.items():
        ax.scatter([PAPER_PARAMS], [v], marker="*", s=120, color=colors[arm],
                   edgecolor="k", zorder=5)
    ax.annotate("paper (test stream,\none checkpoint)", (PAPER_PARAMS, 87.02),
                textcoords="offset points", xytext=(-95, -4), fontsize=7)
    base = _mean(bases)
    if base is not None:
        ax.axhline(base, color="k", ls="--", lw=0.8, label="output-set baseline (val)")
        ax.axhline(base + MARGIN, color="tab:red", ls=":", lw=0.8, label="baseline + 10 pp")
    ax.set_ylim(0, 100)  # recall; a band past it is clipped
    ax.set_xscale("log")
    ax.set_xlabel("parameters (log)")
    ax.set_ylabel("validation updated-LTM recall (%)")
    ax.set_title("Where does the Consolidator start to learn the update? (issue 52)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(OUT / "ladder.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
