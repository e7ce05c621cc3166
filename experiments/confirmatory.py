"""The pre-registered claims of issue 61 (docs/preregistration.md), read from the confirmatory
store, exactly as pre-registered. Written at stop 69, before any confirmatory result.

Which checkpoints: Phase-1 seeds 3, 4, 5, ... in order, until K = 5 are taken; a landed
checkpoint whose validation ADD10 STM (at its selected epoch) is below 99% is reported and
replaced by the next seed; a seed not yet landed holds its place as pending. A claim over
the K checkpoints gets a verdict only when all K have what it reads; until then it is
pending, with what is in so far.

The claims (each on the test stream, except claim 3's validation reading):

1. Capability (ADD10): the Consolidator alone, routing on (`add10-long`), updated-LTM ADD10
   recall >= 60.0% (the family's output-set baseline, 50%, + 10 pp) on every checkpoint.
2. Direct LTM routing helps (ADD10): routing on - routing off, paired by checkpoint, mean > 0
   with the one-sided paired t-test at alpha 0.05; the two-sided 95% CI and what it excludes.
   Judged only if claim 1 holds.
3. The mechanism is the routing channel: on every checkpoint the routing-on arm's selected
   weights lose >= 10 pp of ADD10 recall with L's direct routing term removed from every
   block (`pmnet diagnose` of the trial's best model on 1,000 validation episodes, which the
   grid runs as the trial lands: `updated_routing_off_by_family.add10.drop`).
4. Both families (secondary; `both-long`): routing on, updated-LTM recall >= the output-set
   baseline + 10 pp on every checkpoint, reported per family beside each family's baseline.

    .venv/bin/python experiments/confirmatory.py [--store DIR]

writes `<store>-claims.md` beside the store and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pmnet.io import atomic_write_text  # noqa: E402
from pmnet.store_layout import StoreLayout  # noqa: E402
from pmnet.trial_id import TrialId  # noqa: E402
from tune_spaces.grids import CONFIRMATORY_PHASE1_GATE  # noqa: E402

STORE = ROOT / "experiments" / "results" / "confirmatory-medium"
FIRST_SEED, K = 3, 5
GATE_P1 = CONFIRMATORY_PHASE1_GATE  # validation ADD10 STM >= 99% at the selected epoch
STM_MIN = GATE_P1.minimum
GATE = 60.0  # ADD10's output-set baseline (50%) + 10 pp
GATE_PP = 10.0
MECHANISM_PP = 10.0
ALPHA = 0.05
SEED = 42  # the Phase-2 seed on every checkpoint
ON, OFF = "consolidator_only", "consolidator_only_routing_off"
ADD10_VARIANT, BOTH_VARIANT = "add10-long", "both-long"
FAMILIES = ("add10", "affine10")


@dataclass
class Checkpoint:
    """One Phase-1 seed's place in the study and what its units hold."""

    seed: int
    state: str  # "taken", "pending" (not landed), "replaced" (landed, STM below STM_MIN)
    stm_add10: float | None = None  # validation, at the selected epoch
    on: float | None = None  # test updated-LTM ADD10, routing on
    off: float | None = None  # the same, routing off
    on_baseline: float | None = None  # the routing-on trial's ADD10 output-set baseline
    mechanism_drop: float | None = None  # claim 3: ADD10 pp lost without L's routing term
    both: dict[str, float] = field(default_factory=dict)  # claim 4: overall and per family


@dataclass
class Verdict:
    claim: str
    verdict: str  # "holds", "does not hold", "pending", "not judged"
    detail: str


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _test(store: StoreLayout, condition: str, variant: str, k: int) -> dict | None:
    res = _json(store.result(TrialId(condition, SEED, variant, k)))
    return None if res is None else res["test"]


def read_checkpoint(store: StoreLayout, k: int) -> Checkpoint:
    """Checkpoint `k` as its units stand: its validation ADD10 STM when landed, each arm's
    test recall and the mechanism reading when their units have landed."""
    if not store.stage1_json(k).is_file():
        return Checkpoint(k, "pending")
    stm = GATE_P1.reading(json.loads((store.phase1_dir(k) / "phase1_metrics.json").read_text()))
    c = Checkpoint(k, "taken" if stm >= STM_MIN else "replaced", stm_add10=stm)
    on, off = _test(store, ON, ADD10_VARIANT, k), _test(store, OFF, ADD10_VARIANT, k)
    if on is not None:
        c.on, c.on_baseline = on["updated_ltm_add10"], on["updated_ltm_add10_baseline"]
        diag = _json(store.diagnostics(TrialId(ON, SEED, ADD10_VARIANT, k))) or {}
        by_family = diag.get("updated_routing_off_by_family") or {}
        if "add10" in by_family:
            c.mechanism_drop = by_family["add10"]["drop"]
    if off is not None:
        c.off = off["updated_ltm_add10"]
    both = _test(store, ON, BOTH_VARIANT, k)
    if both is not None:
        for name, suffix in (("overall", ""), *((f, f"_{f}") for f in FAMILIES)):
            c.both[name] = both[f"updated_ltm{suffix}"]
            c.both[f"{name} baseline"] = both[f"updated_ltm{suffix}_baseline"]
    return c


def choose(store: StoreLayout, first: int = FIRST_SEED, k: int = K) -> list[Checkpoint]:
    """Seeds first, first + 1, ... until `k` are taken or pending; the replaced ones are
    listed in place (reported, not counted)."""
    out, seed = [], first
    while sum(c.state != "replaced" for c in out) < k:
        out.append(read_checkpoint(store, seed))
        seed += 1
    return out


def paired_test(diffs: list[float], alpha: float = ALPHA) -> dict:
    """One-sided paired t-test (mean > 0) of per-checkpoint differences, with the two-sided
    1 - alpha CI of the mean (statsmodels)."""
    from statsmodels.stats.weightstats import DescrStatsW

    d = DescrStatsW(diffs)
    t, p, df = d.ttest_mean(0.0, alternative="larger")
    lo, hi = d.tconfint_mean(alpha=alpha)
    return {"n": len(diffs), "mean": float(d.mean), "sd": statistics.stdev(diffs),
            "t": float(t), "p": float(p), "df": float(df), "ci": (float(lo), float(hi))}


def _excludes(lo: float, hi: float) -> str:
    if lo > 0:
        return f"excludes 0 and every effect below {lo:+.1f} pp"
    if hi < 0:
        return f"excludes 0 and every effect above {hi:+.1f} pp"
    return f"includes 0; excludes effects below {lo:+.1f} and above {hi:+.1f} pp"


def judge(cps: list[Checkpoint]) -> list[Verdict]:
    """The four claims over the taken checkpoints, as pre-registered."""
    taken = [c for c in cps if c.state != "replaced"]
    landed = [c for c in taken if c.state == "taken"]

    def every(name: str, values: list[float | None], ok) -> Verdict:
        have = [v for v in values if v is not None]
        per = ", ".join("-" if v is None else f"{v:.1f}" for v in values)
        if len(have) < len(taken):
            return Verdict(name, "pending", f"{len(have)} of {len(taken)} checkpoints in ({per})")
        return Verdict(name, "holds" if all(ok(v) for v in have) else "does not hold", per)

    c1 = every(f"1. routing on, test ADD10 >= {GATE:.1f}% on every checkpoint",
               [c.on if c.state == "taken" else None for c in taken], lambda v: v >= GATE)
    pairs = [(c.on, c.off) for c in landed if c.on is not None and c.off is not None]
    name2 = "2. routing on - off (test ADD10), one-sided paired t, alpha 0.05"
    if c1.verdict == "does not hold":
        c2 = Verdict(name2, "not judged", "claim 1 does not hold: an arm below its shortcut "
                                          "gets no verdict")
    elif len(pairs) < len(taken) or c1.verdict == "pending":
        c2 = Verdict(name2, "pending", f"{len(pairs)} of {len(taken)} pairs in")
    elif len({a - b for a, b in pairs}) == 1:
        c2 = Verdict(name2, "not judged", f"every difference is {pairs[0][0] - pairs[0][1]:+.1f} "
                                          "pp: with SD 0 the t-test is undefined")
    else:
        r = paired_test([a - b for a, b in pairs])
        lo, hi = r["ci"]
        c2 = Verdict(name2, "holds" if r["mean"] > 0 and r["p"] < ALPHA else "does not hold",
                     f"mean {r['mean']:+.1f} pp (SD {r['sd']:.1f}, n {r['n']}), t({r['df']:.0f}) "
                     f"= {r['t']:.2f}, one-sided p = {r['p']:.2g}; 95% CI [{lo:+.1f}, "
                     f"{hi:+.1f}] {_excludes(lo, hi)}")
    c3 = every(f"3. routing on loses >= {MECHANISM_PP:.0f} pp of ADD10 without L's routing "
               "term (validation)",
               [c.mechanism_drop if c.state == "taken" else None for c in taken],
               lambda v: v >= MECHANISM_PP)
    c4 = every(f"4. both families, routing on: updated LTM >= baseline + {GATE_PP:.0f} pp "
               "(test; margin shown)",
               [c.both["overall"] - c.both["overall baseline"] if c.both else None
                for c in taken], lambda v: v >= GATE_PP)
    return [c1, c2, c3, c4]


def _cell(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(cps: list[Checkpoint], verdicts: list[Verdict], store: Path) -> str:
    where = store.relative_to(ROOT) if store.is_relative_to(ROOT) else store
    lines = [f"# The pre-registered claims, read from `{where}`", "",
             "Written by `experiments/confirmatory.py` (docs/preregistration.md).", "",
             "| Phase-1 seed | state | val ADD10 STM | routing on, test ADD10 | routing off | "
             "on - off | ADD10 lost without L's routing term (val, pp) | both families: "
             "overall / ADD10 / AFFINE10 (baselines) |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for c in cps:
        diff = None if c.on is None or c.off is None else c.on - c.off
        both = "-" if not c.both else " / ".join(
            f"{c.both[f]:.1f} ({c.both[f + ' baseline']:.1f})" for f in ("overall", *FAMILIES))
        lines.append(f"| {c.seed} | {c.state} | {_cell(c.stm_add10)} | {_cell(c.on)} | "
                     f"{_cell(c.off)} | {_cell(diff, '+.1f')} | {_cell(c.mechanism_drop)} | "
                     f"{both} |")
    lines += ["", "| claim | verdict | detail |", "|---|---|---|"]
    lines += [f"| {v.claim} | **{v.verdict}** | {v.detail} |" for v in verdicts]
    lines += ["", next_command(cps, where)]
    return "\n".join(lines) + "\n"


def next_command(cps: list[Checkpoint], store: Path) -> str:
    """The command that trains what is missing: the seeds taken or pending (a replaced one
    may stay listed, the grid's Phase-1 gate holds it back, but it is left out)."""
    seeds = ",".join(str(c.seed) for c in cps if c.state != "replaced")
    return (f"What is missing trains with `make pipeline PRESET=medium GRID=add10_long "
            f"PHASE1_SEEDS={seeds} STORE={store} STAGE1_CPUS=2 MAX_WALL=...` (then "
            f"`GRID=both_long` on the same seeds for claim 4).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=STORE)
    a = ap.parse_args(argv)
    if not (a.store / "store.json").is_file():
        print(f"{a.store}: not a store (no store.json)", file=sys.stderr)
        return 2
    cps = choose(StoreLayout(a.store))
    text = markdown(cps, judge(cps), a.store.resolve())
    atomic_write_text(a.store.with_name(a.store.name + "-claims.md"), text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
