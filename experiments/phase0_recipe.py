"""A copy warm start that learns (issue 61, item 3), judged by held-out per-position copy
accuracy, never by the loss alone.

Two parts, each a set of committed run directories under
`experiments/results/phase0-recipe/`:

1. `phase0`: Phase 0 alone (`pmnet.train.run_phase0`) from a fresh model of a preset's
   shape, one recipe: payload bytes, rate, its shape after warmup, steps, batch. The record
   is `phase0_metrics.json` (the copy-accuracy curve, read every steps/20 on 1,024 held-out
   examples, `pmnet.train.copy_probe`) and `phase0_logs/metrics.csv` (the loss).

       .venv/bin/python experiments/phase0_recipe.py phase0 --preset cpu --copy-len 4 \\
           --lr 1e-3 --schedule constant --steps 800 --seed 0

2. `phase1`: the warm start against scratch at one rung. A warm Phase 1 is `pmnet train
   phase1` with the recipe's Phase 0 first (`--set phase0_steps=...`), into
   `phase1/warm-p1s<k>/`; its scratch partner is the committed checkpoint of the same preset
   and Phase-1 seed (`SCRATCH`), trained without Phase 0. `summary` reads both on the
   validation stream: per-family STM and forced identity's initial-mapping recall with
   routing on against segment 1's STM (the paper's 0.966).

       .venv/bin/python experiments/phase0_recipe.py summary

Writes `summary.md`, `summary.json` and `curves.png` there. Validation only: nothing here
reads a test stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pmnet.evaluate import COPY_LEARNED_X_CHANCE  # noqa: E402
from pmnet.io import atomic_write_json, atomic_write_text  # noqa: E402

OUT = ROOT / "experiments" / "results" / "phase0-recipe"
#: the scratch partner of a warm Phase 1: the committed checkpoint of the same preset and
#: Phase-1 seed, trained without Phase 0 (AMD EPYC, one thread; its provenance.json)
SCRATCH = {"cpu": ROOT / "experiments" / "results" / "issue39" / "store" / "phase1-p1s{k}"}


def run_name(a) -> str:
    return (f"{a.preset}-len{a.copy_len}-lr{a.lr:g}-{a.schedule}-b{a.batch}-{a.steps}steps"
            f"-s{a.seed}")


def cmd_phase0(a) -> None:
    import torch

    from pmnet.model import PMNet
    from pmnet.train import TrainConfig

    cfg = TrainConfig.from_name(a.preset)
    cfg = dataclasses.replace(cfg, phase0_steps=a.steps, phase0_copy_len=a.copy_len,
                              phase0_lr=a.lr, phase0_lr_schedule=a.schedule,
                              batch_size=a.batch, phase1_seed=a.seed, threads=a.threads,
                              warmup_steps=a.warmup, compile=(), watchdog=False)
    out = OUT / "phase0" / run_name(a)
    if (out / "phase0_metrics.json").is_file():
        print(f"{out} exists: nothing to do")
        return
    from pmnet.train.phases import _setup_threads, run_phase0

    _setup_threads(cfg)
    torch.manual_seed(a.seed)
    t0 = time.time()
    m = run_phase0(cfg, PMNet(cfg.model), out, progress=False)
    import platform

    from pipelines.provenance import device_kind

    atomic_write_json(out / "run.json", {
        "command": "experiments/phase0_recipe.py " + " ".join(sys.argv[1:]),
        "preset": a.preset, "copy_len": a.copy_len, "lr": a.lr, "schedule": a.schedule,
        "warmup": a.warmup, "batch": a.batch, "steps": a.steps, "seed": a.seed,
        "threads": a.threads, "wall_s": round(time.time() - t0, 1),
        "cpu": device_kind(), "machine": platform.machine()})
    print(f"{out.name}: loss {m['phase0/final_loss']:.3f}, held-out copy accuracy "
          f"{100 * m['phase0/copy_acc']:.1f}% (chance 3.8%), {time.time() - t0:.0f} s")


def phase0_rows() -> list[dict]:
    rows = []
    for d in sorted((OUT / "phase0").glob("*/phase0_metrics.json")):
        m = json.loads(d.read_text())
        run = json.loads((d.parent / "run.json").read_text())
        curve = m.get("phase0/copy_curve", [])
        chance = m["phase0/copy_chance"]
        left = next((c["step"] for c in curve if c["acc"] >= COPY_LEARNED_X_CHANCE * chance), None)
        rows.append({**run, "name": d.parent.name, "final_loss": m["phase0/final_loss"],
                     "copy_acc": m["phase0/copy_acc"], "chance": chance,
                     "by_position": m["phase0/copy_acc_by_position"], "curve": curve,
                     "learned": m["phase0/copy_acc"] >= COPY_LEARNED_X_CHANCE * chance,
                     "first_learned_step": left})
    return rows


def _phase1_read(ckpt_dir: Path) -> dict:
    """Validation-stream figures of one Phase-1 checkpoint, cached beside it: per-family
    STM (segment 1 and the two-segment mean) and forced identity's initial-mapping recall
    with routing on, and its ratio to segment 1's STM."""
    cache = ckpt_dir / "phase0_recipe_read.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    from pmnet import task
    from pmnet.evaluate import evaluate
    from pmnet.model_files import load_model_file

    model, _ = load_model_file(ckpt_dir / "phase1.pt")
    m = evaluate(model, task.validation_stream(1000), consolidation="identity",
                 ltm_routing=True, full=False)
    keep = {k: m[k] for k in ("seg1_stm", "mean_stm", "mean_stm_add10", "mean_stm_affine10",
                              "seg1_stm_add10", "seg1_stm_affine10", "initial_ltm",
                              "updated_ltm") if k in m}
    keep["identity_initial_over_seg1_stm"] = (m["initial_ltm"] / m["seg1_stm"]
                                              if m.get("seg1_stm") else float("nan"))
    atomic_write_json(cache, keep)
    return keep


def _val_curve(run: Path) -> list[float]:
    """Validation mean STM per epoch of a Phase-1 run (its Lightning CSV log)."""
    import csv

    with (run / "phase1_logs" / "metrics.csv").open(newline="") as f:
        return [round(float(r["val/mean_stm"]), 2) for r in csv.DictReader(f)
                if r.get("val/mean_stm")]


def phase1_rows() -> list[dict]:
    """One row per warm Phase 1 (`phase1/warm-<preset>-p1s<k>`) and its scratch partner:
    the validation curves side by side; where the warm run finished, the checkpoints' reads
    (`_phase1_read`); where it did not (the watchdog stopped it: no phase1.pt), its state."""
    rows = []
    for d in sorted((OUT / "phase1").glob("warm-*-p1s*")):
        preset, k = d.name.split("-")[1], int(d.name.rsplit("p1s", 1)[1])
        scratch_dir = Path(str(SCRATCH[preset]).format(k=k))
        p0 = json.loads((d / "phase0_metrics.json").read_text())
        history = json.loads((scratch_dir / "phase1_metrics.json").read_text())["history"]
        warm_curve = _val_curve(d)
        finished = (d / "phase1.pt").is_file()
        rows.append({
            "preset": preset, "phase1_seed": k, "phase0_copy_acc": p0.get("phase0/copy_acc"),
            "finished": finished, "warm_val_mean_stm": warm_curve,
            "scratch_val_mean_stm": [round(r["val/mean_stm"], 2)
                                     for r in history[:len(warm_curve)]],
            "warm": _phase1_read(d) if finished else None,
            "scratch": _phase1_read(scratch_dir) if finished else None,
            "warm_dir": str(d.relative_to(ROOT)),
            "scratch_dir": str(scratch_dir.relative_to(ROOT))})
    return rows


def cmd_summary(a) -> None:
    p0, p1 = phase0_rows(), phase1_rows()
    lines = ["# A copy warm start that learns (validation and held-out copy examples)", "",
             "Written by `experiments/phase0_recipe.py summary`. Phase 0 is judged by held-out "
             "per-position copy accuracy (chance 1/26 = 3.8%; learned: at least "
             f"{COPY_LEARNED_X_CHANCE}x chance).", "",
             "## Phase 0 recipes", "",
             "| shape | payload | lr, schedule | batch | steps | seed | last loss | held-out "
             "accuracy | by position | first step >= 1.5x chance | learned | CPU, wall |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in p0:
        pos = " ".join(f"{100 * v:.0f}" for v in r["by_position"])
        lines.append(
            f"| {r['preset']} | {r['copy_len']} | {r['lr']:g}, {r['schedule']} | {r['batch']} "
            f"| {r['steps']} | {r['seed']} | {r['final_loss']:.3f} | {100 * r['copy_acc']:.1f}% "
            f"| {pos} | {r['first_learned_step'] or '-'} | {'yes' if r['learned'] else 'no'} "
            f"| {r['cpu']}, {r['wall_s']:.0f} s |")
    if p1:
        lines += ["", "## Phase 1 from the warm start against scratch (validation)", "",
                  "| rung | Phase-1 seed | Phase-0 accuracy | warm: mean STM by epoch "
                  "| scratch, same epochs | warm run | forced identity initial / seg-1 STM, "
                  "routing on (warm / scratch; paper 0.966) |",
                  "|---|---:|---:|---|---|---|---|"]
        for r in p1:
            w, s = r["warm"], r["scratch"]
            ratio = (f"{w['identity_initial_over_seg1_stm']:.2f} / "
                     f"{s['identity_initial_over_seg1_stm']:.2f}" if w else "-")
            lines.append(
                f"| {r['preset']} | {r['phase1_seed']} | {100 * r['phase0_copy_acc']:.1f}% "
                f"| {', '.join(f'{v:.1f}' for v in r['warm_val_mean_stm'])} "
                f"| {', '.join(f'{v:.1f}' for v in r['scratch_val_mean_stm'])} "
                f"| {'finished' if r['finished'] else 'stopped (no phase1.pt)'} | {ratio} |")
    atomic_write_text(OUT / "summary.md", "\n".join(lines) + "\n")
    atomic_write_json(OUT / "summary.json", {"phase0": p0, "phase1": p1})
    _plot(p0)
    print("\n".join(lines))


def _plot(rows: list[dict]) -> None:
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        c = r["curve"]
        ax.plot([p["step"] for p in c], [100 * p["acc"] for p in c],
                label=f"{r['preset']} len {r['copy_len']} lr {r['lr']:g} {r['schedule']} "
                      f"s{r['seed']}")
    ax.axhline(100 / 26, color="k", ls=":", lw=1, label="chance (1/26)")
    ax.axhline(150 / 26, color="grey", ls="--", lw=1, label="1.5x chance")
    ax.set_xlabel("Phase-0 step")
    ax.set_ylabel("held-out copy accuracy, mean over positions (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "curves.png", dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("phase0", help="Phase 0 alone at a preset's shape, one recipe")
    p.add_argument("--preset", required=True)
    p.add_argument("--copy-len", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    sub.add_parser("summary", help="the tables and curves of every committed run")
    a = ap.parse_args(argv)
    {"phase0": cmd_phase0, "summary": cmd_summary}[a.cmd](a)


if __name__ == "__main__":
    main()
