"""`pmnet` command line: info, episodes, train (phase1 / phase2), evaluate, ltm (save / answer),
diagnose, report, store verify."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _segments(text: str) -> int:
    """argparse type of --segments: the episodes' number of segments, 2..8 (checked before
    any model is loaded or any episode generated)."""
    from pmnet.task import MAX_SEGMENTS, MIN_SEGMENTS

    value = _int(text)
    if not MIN_SEGMENTS <= value <= MAX_SEGMENTS:
        raise argparse.ArgumentTypeError(
            f"segments must be in {MIN_SEGMENTS}..{MAX_SEGMENTS} (segments per memory "
            f"episode), got {value}")
    return value


def cmd_info(args) -> int:
    import torch

    from pmnet.baselines import baseline_parameter_counts
    from pmnet.config import PRESETS, ModelConfig
    from pmnet.model import PMNet
    from pmnet.operators import operator_parameter_counts

    cfg = ModelConfig.from_name(args.preset)

    with torch.device("meta"):  # counts only: no memory, no init cost
        counts = PMNet(cfg).parameter_counts()
    # what each alternative consolidation operator would add (created at Phase 2)
    counts["operators"] = operator_parameter_counts(cfg) if cfg.use_memory else {}
    # what each baseline's carried memory would add (issue 23; created at Phase 2)
    counts["baselines"] = baseline_parameter_counts(cfg) if cfg.use_memory else {}
    # how the preset's training departs from the paper
    notes = list(PRESETS[args.preset].notes)
    memory = _memory_table(args) if (args.memory or args.gpu_mem is not None) else None
    if args.json:
        print(json.dumps({"preset": args.preset, "config": cfg.to_dict(), **counts,
                          "notes": notes, **({"memory": memory} if memory else {})}, indent=2))
        return 0
    print(f"preset {args.preset}")
    for k, v in cfg.to_dict().items():
        print(f"  {k:<22} {v}")
    print(f"  {'n_blocks':<22} {cfg.n_blocks} (groups {cfg.total_groups}, "
          f"slots {cfg.total_slots})")
    if notes:
        print("\nhow this preset departs from the paper:")
        for note in notes:
            print(f"  - {note}")
    total = counts["total"]
    print(f"\n{'subset':<24} {'parameters':>12} {'fraction':>10}")
    print(f"{'total':<24} {total:>12,} {100.0:>9.3f}%")
    for name, n in counts["subsets"].items():
        print(f"{name:<24} {n:>12,} {100 * n / total:>9.3f}%")
    if counts.get("operators"):
        print("\nconsolidation operators (created at Phase 2, trained alone as 'operator_only';"
              "\n% of total + operator)")
        for name, n in counts["operators"].items():
            print(f"{'operator ' + name:<24} {n:>12,} {100 * n / (total + n):>9.3f}%")
    if counts.get("baselines"):
        print("\nbaselines' carried memories (created at Phase 2, trained alone as "
              "'baseline_only';\n% of total + memory; no_reset and no_memory train the "
              "entire model)")
        for name, n in counts["baselines"].items():
            if n:
                print(f"{'baseline ' + name:<24} {n:>12,} {100 * n / (total + n):>9.3f}%")
    if memory:
        _print_memory(memory)
    return 0


def _memory_table(args) -> dict:
    """Per condition, a Phase-2 trial's GPU memory (pmnet.gpu.footprint) at the preset's
    batch in the precision it trains in on a GPU; with --gpu-mem, how many share a card."""
    from pmnet.conditions import CONDITIONS, get_condition
    from pmnet.gpu.footprint import GiB, StepSpec, gpu_share, trial_memory, usable_bytes
    from pmnet.train import TrainConfig

    tcfg = TrainConfig.from_name(args.preset)
    batch = args.batch_size or tcfg.batch_size
    precision = args.precision or tcfg.resolved_precision("gpu")
    names = [c.strip() for c in args.conditions.split(",")] if args.conditions \
        else list(CONDITIONS)
    for name in names:
        get_condition(name)
    card = int(args.gpu_mem * GiB) if args.gpu_mem is not None else None
    rows = {}
    for name in names:
        m = trial_memory(tcfg.model, name, batch_size=batch, precision=precision,
                         spec=StepSpec.from_config(tcfg))
        row = {**{k: m.to_dict()[k] for k in ("saved", "activations", "weights", "gradients",
                                                "optimizer", "context", "peak")},
               "saved_fixed": m.fit.fixed, "saved_per_episode": m.fit.per_episode}
        if card is not None:
            share = gpu_share(m.peak, card)
            row["trials_per_gpu"] = share.trials_per_gpu if share else 0
            row["gpu_share"] = share.fraction if share else None
        rows[name] = row
    return {"batch_size": batch, "precision": precision, "gpu_mem_gib": args.gpu_mem,
            "usable_bytes": usable_bytes(card) if card else None, "conditions": rows}


def _print_memory(memory: dict) -> None:
    from pmnet.gpu.footprint import ACTIVATION_FACTOR, GiB

    gib = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    card = memory["gpu_mem_gib"]
    print(f"\nGPU memory of one Phase-2 trial (pmnet/gpu/footprint.py), batch "
          f"{memory['batch_size']}, {memory['precision']}; GiB; activations = "
          f"{ACTIVATION_FACTOR} x saved for backward")
    head = (f"{'condition':<30} {'saved':>7} {'activ.':>7} {'weights':>7} {'grads':>7} "
            f"{'AdamW':>7} {'context':>7} {'peak':>7}")
    if card is not None:
        head += f" {'per ' + format(card, 'g') + ' GiB GPU':>16} {'GPU share':>9}"
    print(head)
    for name, r in memory["conditions"].items():
        line = (f"{name:<30} {gib(r['saved']):>7} {gib(r['activations']):>7} "
                f"{gib(r['weights']):>7} {gib(r['gradients']):>7} {gib(r['optimizer']):>7} "
                f"{gib(r['context']):>7} {gib(r['peak']):>7}")
        if card is not None:
            share = r["gpu_share"]
            line += (f" {r['trials_per_gpu']:>16} {share:>9g}" if share else
                     f" {'does not fit':>16} {'-':>9}")
        print(line)
    if card is not None:
        print(f"(usable: {memory['usable_bytes'] / GiB:.2f} GiB of the {card:g} GiB card; a "
              "trial asks Ray for its GPU share, so trials sharing a GPU always fit it)")


def cmd_episodes(args) -> int:
    from pmnet import task

    batch = task.make_episodes(args.n, args.seed, stream=args.stream, segments=args.segments)
    if args.out in (None, "-"):
        task.write_jsonl(batch, sys.stdout)
    else:
        n = task.write_jsonl(batch, args.out)
        print(f"wrote {n} episodes to {args.out}", file=sys.stderr)
    return 0


def _train_cfg(args):
    from pmnet.train import TrainConfig, parse_overrides

    return TrainConfig.from_name(args.preset, **parse_overrides(args.set))


def cmd_train(args) -> int:
    from pmnet.train import (
        NOT_LEARNING_EXIT,
        NotLearningError,
        PhasePaused,
        StopAtEpochEnd,
        run_phase1,
        run_phase2,
    )

    cfg = _train_cfg(args)
    if args.max_wall is not None and not (args.max_wall > 0 and math.isfinite(args.max_wall)):
        raise ValueError(f"--max-wall must be a positive number of seconds, got "
                         f"{args.max_wall!r}")
    if args.phase == "phase2" and (args.condition is None or args.phase1 is None
                                   or args.seed is None):
        raise ValueError("train phase2 needs --condition, --seed and --phase1")
    # issue 52 (Phase 1), issue 61 (Phase 2): --max-wall and SIGTERM pause at an epoch end;
    # the same command continues
    stop = StopAtEpochEnd(args.max_wall, sigterm=True)
    try:
        if args.phase == "phase1":
            res = run_phase1(cfg, args.out, stop=stop)
        else:
            # run_phase2 checks condition, seed and the checkpoint's sha256 before any compute
            res = run_phase2(cfg, condition=args.condition, seed=args.seed,
                             phase1_ckpt=args.phase1, out_dir=args.out, stop=stop)
    except NotLearningError as e:  # issue 62: the watchdog stopped it (one line, own code)
        print(f"pmnet: {e}", file=sys.stderr)
        return NOT_LEARNING_EXIT
    if isinstance(res, PhasePaused):
        print(json.dumps({"paused": True, "phase": res.phase, "epochs_done": res.epochs_done,
                          "max_epochs": res.max_epochs, "reason": res.reason,
                          "last_ckpt": res.last_ckpt,
                          "train_time_s": round(res.train_time_s, 1),
                          "continue": "run the same command again (same --out)"},
                         indent=2))
        return 0
    if args.phase == "phase1":
        print(json.dumps({"checkpoint": res["checkpoint"], "sha256": res["sha256"],
                          "train_time_s": round(res["train_time_s"], 1),
                          "test": {k: round(v, 2) for k, v in res["metrics"].items()
                                   if k.endswith("stm") or k.endswith(("add10", "affine10"))}},
                         indent=2))
        return 0
    keys = ("updated_ltm", "initial_ltm", "forced_identity", "fresh_ltm", "mismatched_ltm",
            "seg2_stm", "mean_stm", "updated_ltm_baseline")
    print(json.dumps({"result": str(Path(args.out) / "result.json"),
                      "best_epoch": res["best_epoch"],
                      "test": {k: res["test"].get(k) for k in keys}}, indent=2))
    return 0


def _routing_of(model, cond, path) -> None:
    """A model file meets its condition's routers: a strict-off condition (issue 39) makes
    the routers read u without L; a strict-off model file under another condition is refused
    (its routers were trained without L in u)."""
    if not cond.routing_u_ltm:
        model.routing_u_uses_ltm = False
    elif not model.routing_u_uses_ltm:
        raise ValueError(f"{path} is a strict routing-off model (its routers read u without "
                         f"L); condition {cond.name!r} is not: use its strict-off condition")


def cmd_evaluate(args) -> int:
    from pmnet import task
    from pmnet.evaluate import evaluate
    from pmnet.train import get_condition, load_model_file

    cond = get_condition(args.condition)
    model, payload = load_model_file(args.checkpoint)
    _routing_of(model, cond, args.checkpoint)
    stream = _stream(args.stream, args.n, args.segments, args.test_seed)
    metrics = evaluate(model, stream, consolidation=cond.consolidation,
                       ltm_routing=cond.ltm_routing, progress=True)
    metrics["stream_hash"] = task.content_hash(stream)
    metrics["segments"] = args.segments
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def _stream(name: str, n: int, segments: int, test_seed: int | None = None):
    from pmnet import task

    if name == "test":
        return task.test_stream(n, segments=segments,
                                seed=task.TEST_SEED if test_seed is None else test_seed)
    return task.validation_stream(n, segments=segments)


def cmd_ltm(args) -> int:
    """Save a stream's LTM after every boundary, or answer its final queries from a file."""
    from pmnet import task
    from pmnet.baselines import BASELINE_MODES
    from pmnet.persist import answer_final, consolidate_batch, load_ltm, save_ltm, score_final
    from pmnet.runner import RunOptions
    from pmnet.train import get_condition, load_model_file

    model, _ = load_model_file(args.model)
    if args.action == "save":
        cond = get_condition(args.condition)
        if cond.consolidation in BASELINE_MODES:  # before any compute
            raise ValueError(f"ltm save: {cond.name} is a baseline ({cond.consolidation}); "
                             "what it carries across a boundary is not LTM, so there is no "
                             "LTM file to write")
        if args.out is None:
            raise ValueError("ltm save needs --out FILE")
        _routing_of(model, cond, args.model)
        segments = task.N_SEGMENTS if args.segments is None else args.segments
        stream = _stream(args.stream, args.n, segments, args.test_seed)
        state = consolidate_batch(model, stream, RunOptions(cond.consolidation,
                                                            cond.ltm_routing))
        meta = {"stream": args.stream, "n": args.n, "segments": segments,
                "test_seed": args.test_seed,
                "stream_hash": task.content_hash(stream), "condition": cond.name,
                "consolidation": cond.consolidation, "ltm_routing": cond.ltm_routing,
                "model_file": str(args.model)}
        digest = save_ltm(args.out, model, state, segments=segments, meta=meta)
        print(json.dumps({"ltm": str(args.out), "content_sha256": digest, **meta}, indent=2))
        return 0
    if args.ltm is None:
        raise ValueError("ltm answer needs --ltm FILE")
    # refuses another model, a corrupted file, or another --segments than the file's
    saved = load_ltm(args.ltm, model, segments=args.segments)
    meta = saved.meta
    stream = _stream(meta.get("stream", "test"), int(meta.get("n", saved.n_episodes)),
                     saved.segments, meta.get("test_seed"))
    if task.content_hash(stream) != meta.get("stream_hash"):
        raise ValueError(f"{args.ltm}: its episodes' stream no longer matches the file's "
                         "recorded stream hash")
    logits = answer_final(model, stream, saved.state(model),
                          ltm_routing=bool(meta.get("ltm_routing", True)))
    score = score_final(logits, stream)
    out = {"updated_ltm": score["updated_ltm"], "n": len(stream), "segments": saved.segments,
           "condition": meta.get("condition"), "logits_sha256": score["logits_sha256"]}
    print(json.dumps(out, indent=2))
    return 0


def cmd_diagnose(args) -> int:
    """Route diagnostics of a model file on the validation stream (pmnet.diagnose)."""
    from pmnet.diagnose import diagnose_file, format_diagnostics
    from pmnet.io import atomic_write_json

    diag = diagnose_file(args.checkpoint, n=args.n, condition=args.condition)
    if args.out:
        atomic_write_json(Path(args.out), diag.to_dict())
    print(json.dumps(diag.to_dict(), indent=2) if args.json else format_diagnostics(diag))
    return 0


def cmd_report(args) -> int:
    from pmnet.report import main_report

    paths = main_report(args.run_dir)
    print(json.dumps({k: str(v) for k, v in dict(paths).items()}, indent=2))
    return 0


def cmd_store(args) -> int:
    """`pmnet store verify DIR`: every unit of a durable store read back (pmnet.store_verify);
    exit 0 whole, 1 a unit corrupt or orphaned, 2 not a store."""
    from pmnet.store_verify import verify_command

    return verify_command(args.store_dir, all_units=args.all)


def _add_test_seed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--test-seed", type=_int, default=None, metavar="SEED",
                        help="seed of the test stream (default: the paper's task.TEST_SEED; "
                             "a preset's own is its TrainConfig.test_seed, see `pmnet info`)")


def build_parser() -> argparse.ArgumentParser:
    from pmnet.config import PRESETS  # light: the registry imports no torch

    presets = f"one of {', '.join(PRESETS)} (pmnet.config.PRESETS)"
    p = argparse.ArgumentParser(prog="pmnet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="a preset's config and parameter counts")
    s.add_argument("--preset", default="paper", help=f"{presets}; default: %(default)s")
    s.add_argument("--json", action="store_true")
    s.add_argument("--memory", action="store_true",
                   help="measure each condition's GPU memory per trial (pmnet/gpu/footprint.py; "
                        "seconds per condition on a CPU for the paper model)")
    s.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                   help="with the memory figures, how many trials share a GPU of GIB GiB")
    s.add_argument("--batch-size", type=_int, default=None,
                   help="batch of the memory figures (default: the preset's)")
    s.add_argument("--precision", default=None, choices=("bf16-mixed", "16-mixed", "32-true"),
                   help="precision of the memory figures (default: the preset's on a GPU)")
    s.add_argument("--conditions", default=None,
                   help="conditions of the memory figures (default: the paper's six)")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("episodes", help="write episodes as JSON lines")
    s.add_argument("--n", type=_int, required=True)
    s.add_argument("--seed", type=_int, required=True)
    s.add_argument("--stream", default="train", choices=("train", "val", "test"))
    s.add_argument("--out", default=None, help="file (default: stdout)")
    s.add_argument("--segments", type=_segments, default=2, metavar="T",
                   help="segments per episode, 2..8 (default 2, the paper's)")
    s.set_defaults(fn=cmd_episodes)

    s = sub.add_parser("train", help="run Phase 1 (with Phase 0 if the preset has it) or "
                                     "one Phase-2 trial")
    s.add_argument("phase", choices=("phase1", "phase2"))
    s.add_argument("--preset", default="cpu", help=f"{presets}; default: %(default)s")
    s.add_argument("--out", required=True)
    s.add_argument("--condition")
    s.add_argument("--seed", type=_int)
    s.add_argument("--phase1", help="Phase-1 checkpoint (read-only; sha256 verified)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a TrainConfig field (model.* for model fields)")
    s.add_argument("--max-wall", type=float, default=None, metavar="SECONDS",
                   help="pause at the last epoch end that keeps within this many seconds "
                        "(SIGTERM pauses at the next epoch end); the same command continues "
                        "from --out/phase1_ckpt/last.ckpt (phase2: --out/ckpt/last.ckpt)")
    s.epilog = ("exit codes: 0 finished (or paused: --max-wall, SIGTERM); 2 bad input; 5 not "
                "learning: the watchdog stopped the run, its training loss still at chance "
                "(Phase 2: at its start) once TrainConfig.watchdog_share of its steps were "
                "spent; the last finished epoch's last.ckpt is kept; --set watchdog=false "
                "turns the watchdog off (docs/choices.md, \"The watchdog\")")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("evaluate", help="every metric of a model file on the test stream")
    s.add_argument("checkpoint")
    s.add_argument("--condition", default="consolidator_only")
    s.add_argument("--stream", default="test", choices=("test", "val"))
    s.add_argument("--n", type=_int, default=1000)
    s.add_argument("--segments", type=_segments, default=2, metavar="T",
                   help="evaluate on the fixed stream of T-segment episodes, 2..8 (default 2)")
    _add_test_seed(s)
    s.set_defaults(fn=cmd_evaluate)

    s = sub.add_parser("ltm", help="LTM that outlives the process: save a stream's LTM after "
                                   "every boundary, or answer its final queries from a file")
    s.add_argument("action", choices=("save", "answer"))
    s.add_argument("model", help="a model file (best_model.pt / phase1.pt)")
    s.add_argument("--out", help="save: the LTM file to write (atomically)")
    s.add_argument("--ltm", help="answer: the LTM file to read")
    s.add_argument("--condition", default="consolidator_only",
                   help="save: consolidation and routing of this condition")
    s.add_argument("--stream", default="test", choices=("test", "val"))
    s.add_argument("--n", type=_int, default=1000)
    s.add_argument("--segments", type=_segments, default=None, metavar="T",
                   help="save: episodes of T segments, 2..8 (default 2); answer: refuse a "
                        "file written from another T (default: the file's)")
    _add_test_seed(s)
    s.set_defaults(fn=cmd_ltm)

    s = sub.add_parser("diagnose", help="do a checkpoint's routes matter? margins, random "
                       "routes, removed writes, L's effect on routes (validation stream)")
    s.add_argument("checkpoint", help="a model file (phase1.pt or a Phase-2 best_model.pt)")
    s.add_argument("--n", type=_int, default=1000, help="validation episodes (default 1000)")
    s.add_argument("--out", help="also write the diagnostics as JSON (atomically)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--condition", default=None,
                   help="a phase1.pt read as the start of this Phase-2 condition (its "
                        "Consolidator an identity until trained): the mechanism before training")
    s.set_defaults(fn=cmd_diagnose)

    s = sub.add_parser("report", help="rebuild a pipeline run's report from its results")
    s.add_argument("run_dir")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("store", help="check a durable store: every unit whole, partial, "
                                     "corrupt or orphaned (reads only)")
    s.add_argument("action", choices=("verify",))
    s.add_argument("store_dir", metavar="DIR")
    s.add_argument("--all", action="store_true", help="list whole units too")
    s.set_defaults(fn=cmd_store)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"pmnet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
