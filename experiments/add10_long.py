"""The decisive test at the paper's Phase-2 budget (issue 61): the Consolidator alone, routing
on and routing off, trained on ADD10 episodes only, read on the validation stream.

Each run is a `pmnet train phase2` directory under `experiments/results/add10-long/<rung>/`
named `<condition>-p1s<k>-s<seed>` (the recipe: `tune_spaces.grids.ADD10_LONG_RECIPE`; the
command that made each is in its `run.json`). A run that has not finished holds
`ckpt/last.ckpt` (the Consolidator's weights and moments only, ~0.2 MB) and continues with
the same command; a finished one holds `result.json`.

What this script reads, per run, validation stream only:
- the curve: updated-LTM recall on ADD10 and AFFINE10 at every validation (500 steps);
- forced identity on the same Phase-1 checkpoint and routing (the Consolidator replaced by
  the identity, which is where its training starts: W_d = 0), ADD10 and AFFINE10;
- the gate: best validation ADD10 >= the family's output-set baseline (50%) + 10 pp.
The test stream is read only by a finished run's own test pass (`result.json`: the table's
test column), and is not used here to choose anything.

For each routing-on run that passes the gate, the mechanism before the effect (`pmnet
diagnose`'s measurements, 1,000 validation episodes): under forced identity, where training
starts, and under the selected weights (`diagnose/<rung>-p1s<k>-<condition>-start.json`,
`-epoch<E>.json`): how many of segment 2's shared-address tokens L sends down another path
than segment 1's, whether the query's path reaches what segment 2 wrote, the recall lost
without L's routing term at each block, and the Consolidator's gradient through the routing
path against the memory path.

Writes `experiments/results/add10-long/summary.md`, `summary.json` and `curves.png`.

    .venv/bin/python experiments/add10_long.py
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pmnet.io import atomic_write_json, atomic_write_text  # noqa: E402

OUT = ROOT / "experiments" / "results" / "add10-long"
#: the Phase-1 checkpoint of each run, by rung and Phase-1 seed
PHASE1 = {
    "cpu": ROOT / "experiments" / "results" / "issue39" / "store" / "phase1-p1s{k}" / "phase1.pt",
    "small": (ROOT / "experiments" / "results" / "issue52" / "store-small" / "phase1-p1s{k}"
              / "phase1.pt"),
    "medium": (ROOT / "experiments" / "results" / "issue52" / "store-medium" / "phase1-p1s{k}"
               / "phase1.pt"),
}
STEPS_PER_EPOCH = 500  # ADD10_LONG_RECIPE: 32,000 episodes of batch 64
EPISODES_PER_EPOCH = 32_000
ADD10_BASELINE = 50.0  # two rules' answers, never equal on ADD10 (pmnet.task)
GATE_PP = 10.0
ADD, AFF = "val/updated_ltm_add10", "val/updated_ltm_affine10"


def runs() -> list[Path]:
    return sorted(p for p in OUT.glob("*/*-p1s*-s*") if p.is_dir())


def parse(run: Path) -> dict:
    cond, rest = run.name.rsplit("-p1s", 1)
    k, seed = rest.split("-s")
    return {"rung": run.parent.name, "condition": cond, "phase1_seed": int(k),
            "seed": int(seed), "dir": str(run.relative_to(ROOT))}


def curve(run: Path) -> list[dict]:
    """Validation rows of the run's Lightning CSV log (one per epoch)."""
    path = run / "logs" / "metrics.csv"
    if not path.is_file():
        return []
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if r.get(ADD):
                rows.append({"epoch": int(r["epoch"]), "step": int(r["step"]) + 1,
                             "add10": float(r[ADD]), "affine10": float(r[AFF]),
                             "updated_ltm": float(r["val/updated_ltm"])})
    return rows


def forced_identity(rung: str, k: int, condition: str) -> dict:
    """Validation updated-LTM recall with the Consolidator forced to the identity, on the
    run's Phase-1 checkpoint and routing (`pmnet.evaluate`), cached beside the runs."""
    cache = OUT / "forced_identity.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    from pmnet.conditions import get_condition

    routing = get_condition(condition).ltm_routing
    key = f"{rung}/p1s{k}/routing_{'on' if routing else 'off'}"
    if key not in known:
        from pmnet import task
        from pmnet.evaluate import evaluate
        from pmnet.model_files import load_model_file

        model, _ = load_model_file(PHASE1[rung].as_posix().format(k=k))
        m = evaluate(model, task.validation_stream(1000), consolidation="identity",
                     ltm_routing=routing, full=False, stm=False)
        known[key] = {"add10": m["updated_ltm_add10"], "affine10": m["updated_ltm_affine10"],
                      "updated_ltm": m["updated_ltm"]}
        atomic_write_json(cache, known)
    return known[key]


def inference_routing(run: Path, rung: str, k: int, epoch: int) -> dict:
    """The run's selected weights (`ckpt/best.ckpt`, validation ADD10) evaluated on the
    validation stream with L's direct routing term on and off at inference: does the
    Consolidator's gain need the routing channel? Cached by run and epoch."""
    cache = OUT / "inference_routing.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    key = f"{run.parent.name}/{run.name}/epoch{epoch}"
    if key not in known:
        from pmnet import task
        from pmnet.evaluate import evaluate
        from pmnet.model_files import load_phase2_progress

        model = load_phase2_progress(PHASE1[rung].as_posix().format(k=k),
                                     run / "ckpt" / "best.ckpt")
        val = task.validation_stream(1000)
        known[key] = {}
        for routing in (True, False):
            m = evaluate(model, val, consolidation="learned", ltm_routing=routing, full=False,
                         stm=False)
            known[key][f"routing_{'on' if routing else 'off'}"] = {
                "add10": m["updated_ltm_add10"], "affine10": m["updated_ltm_affine10"]}
        atomic_write_json(cache, known)
    return known[key]


def mechanism(run: Path, rung: str, k: int, condition: str, epoch: int,
              finished: bool) -> dict:
    """`pmnet diagnose` at the start (forced identity: the Phase-1 checkpoint read as the
    start of `condition`) and under the selected weights of epoch `epoch`; cached files.
    A reading made while the run was under way is kept; a finished run adds the reading of
    its final selection (the end of training), if that is another epoch."""
    from pmnet import task
    from pmnet.conditions import get_condition
    from pmnet.diagnose import diagnose, diagnose_file
    from pmnet.model_files import load_phase2_progress

    phase1 = PHASE1[rung].as_posix().format(k=k)
    out = {}
    done = sorted((OUT / "diagnose").glob(f"{rung}-p1s{k}-{condition}-epoch*.json"),
                  key=lambda p: int(p.stem.rsplit("epoch", 1)[-1]))
    # the selected weights' reading is kept once made (a run paused mid-sitting was read at
    # the best epoch it had then; the file names the epoch)
    reads = ["start", *(p.stem.rsplit("-", 1)[-1] for p in done)]
    if not done or (finished and reads[-1] != f"epoch{epoch}"):
        reads.append(f"epoch{epoch}")
    for when in reads:
        path = OUT / "diagnose" / f"{rung}-p1s{k}-{condition}-{when}.json"
        if not path.is_file():
            if when == "start":
                d = diagnose_file(phase1, n=1000, condition=condition)
            else:
                cond = get_condition(condition)
                d = diagnose(load_phase2_progress(phase1, run / "ckpt" / "best.ckpt"),
                             task.validation_stream(1000), checkpoint=str(run), condition=condition,
                             consolidation="learned", ltm_routing=cond.ltm_routing)
            atomic_write_json(path, d.to_dict())
        out[when] = json.loads(path.read_text())
    return out


def _mechanism_rows(summaries: list[dict]) -> str:
    lines = ["| rung | checkpoint | read | seg-2 shared-address tokens on another path, by "
             "block (%) | query reaches only segment 2's groups, deepest block (%) | recall "
             "lost without L's routing term, by block (pp) | Consolidator gradient: routing "
             "/ memory path |", "|---|---|---|---|---:|---|---|"]
    for s in summaries:
        for when, d in (s.get("mechanism") or {}).items():
            path = d["seg2_path_change"]["shared_prefix"]
            reach = d["query_reach"][-1]["last_only"]
            lost = [x["drop"] for x in d.get("updated_without_ltm_route") or []]
            g = d.get("consolidator_gradient") or {}
            lines.append(
                f"| {s['rung']} | p1s{s['phase1_seed']} | "
                f"{'forced identity' if when == 'start' else 'selected weights, ' + when} | "
                f"{' / '.join(f'{x:.1f}' for x in path)} | {reach:.1f} | "
                f"{' / '.join(f'{x:.1f}' for x in lost) or '-'} | "
                f"{_fmt(g.get('routing'), '.3f')} / {_fmt(g.get('memory'), '.3f')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def summarise(run: Path) -> dict:
    info = parse(run)
    rows = curve(run)
    best = max(rows, key=lambda r: r["add10"]) if rows else None
    result = run / "result.json"
    finished = result.is_file()
    out = {**info, "validations": len(rows), "episodes": len(rows) * EPISODES_PER_EPOCH,
           "finished": finished, "curve": rows,
           "forced_identity": forced_identity(info["rung"], info["phase1_seed"],
                                              info["condition"])}
    if best is not None:
        out.update(best_add10=best["add10"], best_epoch=best["epoch"],
                   affine10_at_best=best["affine10"], last_add10=rows[-1]["add10"],
                   gate=best["add10"] >= ADD10_BASELINE + GATE_PP)
        if (run / "ckpt" / "best.ckpt").is_file():
            out["inference"] = inference_routing(run, info["rung"], info["phase1_seed"],
                                                 best["epoch"])
            if out["gate"] and info["condition"] == "consolidator_only":
                out["mechanism"] = mechanism(run, info["rung"], info["phase1_seed"],
                                             info["condition"], best["epoch"], finished)
    if finished:
        res = json.loads(result.read_text())
        out["stopped"] = ("early stopping" if res["last_epoch"] + 1 < 20 else "640,000 episodes")
        out["test_add10"] = res["test"].get("updated_ltm_add10")
        out["test_forced_identity_add10"] = res["test"].get("forced_identity_add10")
    else:
        out["stopped"] = "paused (continues from ckpt/last.ckpt)"
    return out


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _inference(s: dict) -> str:
    inf = s.get("inference")
    if not inf:
        return "-"
    return f"{inf['routing_on']['add10']:.1f} / {inf['routing_off']['add10']:.1f}"


def table(summaries: list[dict]) -> str:
    lines = ["| rung | arm | checkpoint | episodes | best val ADD10 (epoch) | last | forced "
             "identity ADD10 | selected weights, L routing on / off at inference (ADD10) | "
             "AFFINE10 at best | gate (>= 60.0) | test ADD10, selected weights | state |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---|---:|---|"]
    for s in summaries:
        arm = "routing on" if s["condition"] == "consolidator_only" else "routing off"
        lines.append(
            f"| {s['rung']} | {arm} | p1s{s['phase1_seed']} | {s['episodes']:,} | "
            f"{_fmt(s.get('best_add10'))} ({s.get('best_epoch', '-')}) | "
            f"{_fmt(s.get('last_add10'))} | {_fmt(s['forced_identity']['add10'])} | "
            f"{_inference(s)} | {_fmt(s.get('affine10_at_best'))} | "
            f"{'passes' if s.get('gate') else 'fails'} | {_fmt(s.get('test_add10'))} | "
            f"{s['stopped']} |")
    return "\n".join(lines)


def figure(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = sorted({s["rung"] for s in summaries})
    fig, axes = plt.subplots(1, len(rungs), figsize=(6 * len(rungs), 4), squeeze=False)
    for ax, rung in zip(axes[0], rungs):
        for s in (s for s in summaries if s["rung"] == rung):
            on = s["condition"] == "consolidator_only"
            xs = [r["step"] * 64 / 1000 for r in s["curve"]]
            ax.plot(xs, [r["add10"] for r in s["curve"]], "-o" if on else "--s", ms=3,
                    label=f"{'on' if on else 'off'} p1s{s['phase1_seed']}")
        ax.axhline(ADD10_BASELINE, color="grey", lw=1, label="output-set baseline")
        ax.axhline(ADD10_BASELINE + GATE_PP, color="grey", lw=1, ls=":", label="gate")
        ax.axhline(99.01, color="tab:red", lw=1, ls="-.", label="paper, routing on")
        ax.axhline(52.52, color="tab:purple", lw=1, ls="-.", label="paper, routing off")
        ax.set(title=f"{rung}: Consolidator only, trained on ADD10",
               xlabel="Phase-2 episodes (thousands)", ylabel="validation ADD10 updated LTM (%)",
               ylim=(0, 102))
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    summaries = [summarise(r) for r in runs()]
    atomic_write_json(OUT / "summary.json", summaries)
    mech = _mechanism_rows(summaries)
    atomic_write_text(OUT / "summary.md", "# The Consolidator alone on ADD10, long recipe "
                      "(validation stream)\n\nWritten by `experiments/add10_long.py`.\n\n"
                      + table(summaries) + "\n"
                      + (f"\n## The mechanism (routing on, runs that pass the gate)\n\n{mech}\n"
                         if mech else ""))
    figure(summaries, OUT / "curves.png")
    print(table(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
