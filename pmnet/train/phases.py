"""Running the phases: `run_phase1` (Phase 0 if the preset has it, then Phase 1) and
`run_phase2` (one condition x seed from the Phase-1 checkpoint), `warm_compile` (a
condition's compiled steps, once, for the trials that follow), and the Lightning trainer
they share (checkpoints, early stopping, loggers, the device and precision recorded)."""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from pmnet import task
from pmnet.baselines import BASELINE_MODES, add_baseline, reset_baseline
from pmnet.conditions import WATCHDOG_FIELDS, Condition, get_condition, seed_problem
from pmnet.evaluate import COPY_CHANCE, COPY_LEARNED_X_CHANCE
from pmnet.gpu.cap import GpuMemoryCap
from pmnet.io import atomic_write_json
from pmnet.model import PMNet
from pmnet.model_files import (
    MODEL_FORMAT,
    PHASE1_FORMAT,
    load_model_file,
    save_model_file,
    verify_phase1,
)
from pmnet.operators import OPERATORS, add_operator
from pmnet.train.checkpoints import (
    AtomicCheckpointIO,
    LastCheckpoint,
    _best_epoch,
    checkpoint_epoch,
)
from pmnet.train.compiled_steps import fresh_compile_state, release_compiled_steps
from pmnet.train.config import ACCELERATORS, TrainConfig
from pmnet.train.copy_probe import CopyProbe
from pmnet.train.data import CopyBatches, EpisodeData, _loader
from pmnet.train.modules import Phase0Module, Phase1Module, Phase2Module
from pmnet.train.pause import Phase1Paused, PhasePaused, StopAtEpochEnd
from pmnet.train.watchdog import NotLearning, NotLearningError, check_point


def _setup_threads(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.compile:  # a reused process starts from no compiled code (issue 36, finding 2)
        fresh_compile_state()


def evaluation_inference_mode(cfg: TrainConfig) -> bool:
    """Lightning's `inference_mode` for validation and test: off (plain `no_grad`) when the
    evaluation step is compiled (issue 36, finding 4). Its CUDA graphs share a tree and a
    memory pool with the training step's, and tensors made under inference mode inside
    them break later training replays (pytorch#135892, #166792); `no_grad` computes the
    same numbers. Eager evaluation keeps Lightning's default."""
    return "eval" not in cfg.compile


#: where a resumed phase's earlier metrics.csv waits until its kept rows are written back
RESUMED_METRICS = "metrics-resumed.csv"


def kept_metrics(log_dir: Path, last_ckpt: Path) -> list[dict] | None:
    """The CSV rows a phase resumed from `last_ckpt` keeps: those of the epochs the checkpoint
    holds (0..its epoch; not a test pass's, which runs again), from the log directory's
    metrics.csv, which is first renamed to RESUMED_METRICS (Lightning's CSVLogger deletes a
    metrics.csv it finds). A resume cut short before the rows were written back left that
    file: it is read again. None (nothing touched) when the checkpoint's epoch is
    unreadable."""
    epoch = checkpoint_epoch(last_ckpt)
    if epoch is None:
        return None
    cur, old = log_dir / "metrics.csv", log_dir / RESUMED_METRICS
    if not old.is_file():
        if not cur.is_file():
            return []
        os.replace(cur, old)
    with old.open(newline="") as f:
        rows = list(csv.DictReader(f))
    kept = []
    for row in rows:
        row = {k: v for k, v in row.items() if k is not None and v not in ("", None)}
        try:
            if int(float(row.get("epoch", "nan"))) > epoch:
                continue
        except ValueError:  # no epoch: a row of no epoch in particular (none are written)
            continue
        if not any(k.startswith("test/") for k in row):  # the test pass runs again
            kept.append(row)
    return kept


class ContinuedCSVLogger(CSVLogger):
    """Lightning's CSVLogger for a phase resumed in the same directory (issue 52): the rows
    of the epochs its checkpoint holds (`kept_metrics`) are written first, so one
    metrics.csv holds the whole history however many sittings made it (the plain logger
    deletes the file and starts again at the resumed epoch)."""

    def __init__(self, save_dir: str, name: str, kept_rows: list[dict]):
        super().__init__(save_dir, name=name, version="")
        self._kept_rows = list(kept_rows)

    @property
    def experiment(self):
        first = self._experiment is None
        exp = super().experiment
        if first:
            if self._kept_rows:
                exp.metrics = self._kept_rows + exp.metrics
                exp.save()
                self._kept_rows = []
            (Path(self.log_dir) / RESUMED_METRICS).unlink(missing_ok=True)
        return exp


def _trainer(cfg: TrainConfig, out_dir: Path, *, max_epochs: int, monitor: str | None,
             patience: int, callbacks, loggers, progress, ckpt_dir: Path | None,
             max_steps: int = -1, name: str = "logs", accelerator: str = "auto",
             resume_from: Path | None = None) -> tuple[L.Trainer, ModelCheckpoint | None]:
    """The Lightning trainer of a phase. With a monitored metric: best.ckpt (written when the
    metric improves), last.ckpt (every epoch, see LastCheckpoint) and early stopping, all
    acting at train-epoch end in this order; the caller's callbacks come after them, so the
    selecting ModelCheckpoint is the trainer's `checkpoint_callback` ("best"). A phase
    resumed from `resume_from` keeps its CSV log's earlier rows (`kept_metrics`). With
    `cfg.watchdog` every phase's trainer carries the watchdog (`NotLearning`, issue 62): a
    phase not learning ends its fit with `NotLearningError`."""
    cbs = []
    ckpt = None
    if monitor is not None:
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=monitor, mode="max",
                               save_top_k=1, save_last=False, enable_version_counter=False,
                               save_on_train_epoch_end=True)
        cbs += [EarlyStopping(monitor=monitor, mode="max", patience=patience,
                              check_on_train_epoch_end=True),
                ckpt, LastCheckpoint(ckpt, ckpt_dir)]
    if cfg.watchdog:
        cbs.append(NotLearning(cfg.watchdog_share, cfg.watchdog_margin, ckpt_dir=ckpt_dir))
    cbs += list(callbacks)
    kept_rows = None if resume_from is None else kept_metrics(out_dir / name, resume_from)
    if progress is None:
        progress = os.isatty(2)
    trainer = L.Trainer(
        max_epochs=max_epochs, max_steps=max_steps, accelerator=accelerator, devices=1,
        precision=cfg.resolved_precision(None if accelerator == "auto" else accelerator),
        gradient_clip_val=cfg.grad_clip,
        gradient_clip_algorithm="norm", callbacks=cbs, plugins=[AtomicCheckpointIO()],
        logger=[CSVLogger(str(out_dir), name=name, version="") if kept_rows is None
                else ContinuedCSVLogger(str(out_dir), name, kept_rows)] + list(loggers),
        enable_progress_bar=bool(progress), enable_model_summary=False,
        num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1,
        log_every_n_steps=10, enable_checkpointing=ckpt is not None,
        default_root_dir=str(out_dir), inference_mode=evaluation_inference_mode(cfg),
    )
    return trainer, ckpt


def run_phase0(cfg: TrainConfig, model: PMNet, out_dir: str | Path, *, loggers=(),
               progress: bool | None = None, accelerator: str = "auto") -> dict:
    """Phase 0, the copy warm start, on `model` in place: `cfg.phase0_steps` steps of the copy
    task (batch `batch_size`, `phase0_copy_len`-byte payloads, rate `phase0_lr` or
    `phase1_lr`, `phase0_lr_schedule` after `warmup_steps`), logged in `phase0_logs/`, its
    success test read as it trains (`CopyProbe`: held-out per-position copy accuracy).
    Writes and returns `phase0_metrics.json`'s record: the last training loss and the copy
    accuracy's curve and last reading (docs/choices.md, "The Phase-0 recipe")."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m0 = Phase0Module(cfg, model, cfg.phase0_lr or cfg.phase1_lr)
    probe = CopyProbe(cfg.phase0_copy_len, cfg.phase0_steps)
    tr, _ = _trainer(cfg, out_dir, max_epochs=1, monitor=None, patience=1,
                     callbacks=(probe,), loggers=loggers, progress=progress, ckpt_dir=None,
                     name="phase0_logs", accelerator=accelerator)
    data = _loader(CopyBatches(cfg.phase0_steps, cfg.batch_size, cfg.phase0_copy_len,
                               cfg.phase1_seed))
    tr.fit(m0, train_dataloaders=data)
    phase0 = {"phase0/final_loss": float(tr.callback_metrics.get("train/loss", float("nan"))),
              **probe.metrics()}
    if cfg.watchdog and probe.curve and check_point(
            cfg.phase0_steps, cfg.watchdog_share, "phase0") is not None:
        acc, bar = probe.curve[-1]["acc"], COPY_LEARNED_X_CHANCE * COPY_CHANCE
        if not acc >= bar:  # the success test (docs/choices.md, "The Phase-0 recipe")
            raise NotLearningError(
                f"not learning: Phase 0 ended at step {cfg.phase0_steps} with held-out copy "
                f"accuracy {100 * acc:.1f}% (chance {100 * COPY_CHANCE:.1f}%; its success "
                f"test: at least {COPY_LEARNED_X_CHANCE:g}x chance, {100 * bar:.1f}%), so it "
                "is no warm start; no checkpoint is kept. `--set watchdog=false` turns the "
                "watchdog off", phase=0, step=cfg.phase0_steps, planned=cfg.phase0_steps,
                mean=acc, line=COPY_CHANCE, threshold=bar, line_kind="copy accuracy")
    # the record as phase0_metrics.json holds it (keys sorted): a Phase 1 continued from
    # its last.ckpt reads it back from there, and the checkpoint file it writes must have the
    # bytes of one uninterrupted run's
    phase0 = json.loads(json.dumps(_jsonable(phase0), sort_keys=True))
    atomic_write_json(out_dir / "phase0_metrics.json", phase0)
    return phase0


def run_phase1(cfg: TrainConfig, out_dir: str | Path, *, callbacks=(), loggers=(),
               progress: bool | None = None, accelerator: str = "auto",
               stop: StopAtEpochEnd | None = None) -> dict | Phase1Paused:
    """Phase 0 (if the preset has it) and Phase 1. Writes `phase1.pt` and its sha256.

    `accelerator`: "cpu" or "gpu" (where the caller was given to train, e.g. what Ray gave
    the task), or "auto" (Lightning's choice). The device and precision used are recorded.

    `stop` (issue 52, `pmnet.train.pause`): a deadline or stop request that ends this
    sitting at an epoch boundary; the result is then a `Phase1Paused` (no test pass, no
    phase1.pt, no phase1_metrics.json), and calling run_phase1 again on `out_dir` (or a
    copy of it) continues from `phase1_ckpt/last.ckpt`. Without `stop` the result is
    always the finished run's dict.

    With `cfg.watchdog` (issue 62) a Phase 0 or Phase 1 that is not learning raises
    `NotLearningError` (`pmnet.train.watchdog`): no phase1.pt, phase1_metrics.json or
    phase0_metrics.json is written; `phase1_ckpt/last.ckpt` keeps the last finished epoch."""
    _check_accelerator(accelerator)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    _setup_threads(cfg)
    t0 = time.time()
    L.seed_everything(cfg.phase1_seed, workers=True, verbose=False)
    model = PMNet(cfg.model)
    for n, p in model.named_parameters():  # the Consolidator is frozen in Phases 0 and 1
        p.requires_grad_(not n.startswith("consolidator."))
    phase0 = {}
    last = out_dir / "phase1_ckpt" / "last.ckpt"
    phase0_file = out_dir / "phase0_metrics.json"
    if cfg.phase0_steps > 0 and last.is_file():
        # resuming Phase 1: its checkpoint (weights, optimiser, RNG) replaces whatever Phase 0
        # would produce, so Phase 0 is not run again; its recorded metrics are kept
        phase0 = json.loads(phase0_file.read_text()) if phase0_file.is_file() else {}
    elif cfg.phase0_steps > 0:
        phase0 = run_phase0(cfg, model, out_dir, loggers=loggers, progress=progress,
                            accelerator=accelerator)
    module = Phase1Module(cfg, model, cfg.phase1_lr)
    module.attempt_start = t0  # a checkpoint's time includes this attempt's Phase 0 and set-up
    data = EpisodeData(cfg, cfg.phase1_seed + 1_000_000, cfg.phase1_episodes_per_epoch)
    # the stop callback is a Checkpoint callback after LastCheckpoint: it acts once the
    # epoch's last.ckpt is written
    trainer, ckpt = _trainer(cfg, out_dir, max_epochs=cfg.phase1_max_epochs,
                             monitor="val/mean_stm", patience=cfg.phase1_patience,
                             callbacks=[*callbacks, *([stop] if stop is not None else [])],
                             loggers=loggers, progress=progress,
                             ckpt_dir=out_dir / "phase1_ckpt", name="phase1_logs",
                             accelerator=accelerator,
                             resume_from=last if last.is_file() else None)
    trainer.fit(module, datamodule=data, ckpt_path=str(last) if last.is_file() else None,
                weights_only=True)
    if stop is not None and stop.paused_at is not None:
        release_compiled_steps()
        return Phase1Paused(epoch=stop.paused_at, max_epochs=cfg.phase1_max_epochs,
                            reason=str(stop.reason), last_ckpt=str(last),
                            train_time_s=module.prior_time_s + (time.time() - t0))
    trainer.test(module, datamodule=data, ckpt_path="best", verbose=False, weights_only=True)
    train_time = module.prior_time_s + (time.time() - t0)  # earlier attempts included
    meta = {"phase": 1, "train_config": cfg.to_dict(), "test": module.test_metrics,
            "history": module.history, "phase0": phase0, "train_time_s": train_time,
            "best_epoch": _best_epoch(ckpt), **trained_on(trainer)}
    ckpt_path = out_dir / "phase1.pt"
    # the file holds what training computes, not how it ran (train_time_s and the threads
    # are in phase1_metrics.json): a checkpoint trained twice alike is byte-identical, one
    # sha256, whether it trained alone or beside others, on whichever run's root
    file_meta = {k: v for k, v in meta.items() if k not in WALL_CLOCK_FIELDS}
    file_meta["train_config"] = {k: v for k, v in meta["train_config"].items()
                                 if k not in RUN_ONLY_CONFIG_FIELDS}
    # through JSON and back (issue 52): pickle shares a string it meets twice by object
    # identity, so a history half restored from last.ckpt (a resumed or continued run)
    # pickled differently from one built in one sitting; after the round trip the bytes
    # depend on the content only
    digest = save_model_file(ckpt_path, module.model, fmt=PHASE1_FORMAT,
                             meta=json.loads(json.dumps(_jsonable(file_meta))))
    atomic_write_json(out_dir / "phase1_metrics.json", _jsonable(meta))
    routes = phase1_route_diagnostics(cfg, module.model, out_dir)
    release_compiled_steps()
    return {"checkpoint": str(ckpt_path), "sha256": digest, "metrics": module.test_metrics,
            "train_time_s": train_time, "threads": torch.get_num_threads(),
            **trained_on(trainer),
            **({"routes": routes} if routes is not None else {})}


ROUTES_FILE = "route_diagnostics.json"
#: Phase-1 metadata kept out of the checkpoint file (it is in phase1_metrics.json): wall time
#: differs between two trainings of the same checkpoint, which must share one sha256
WALL_CLOCK_FIELDS = frozenset({"train_time_s"})
#: TrainConfig fields kept out of the checkpoint file's `train_config` (they are in
#: phase1_metrics.json, and a store unit's provenance): how a run scheduled the training, not
#: what it computed. Threads: 2 for a checkpoint trained alone on 2 cores, 1 in a wave of
#: two, the same weights (issue 53); the watchdog's settings (issue 62): whether a run is
#: stopped, so a checkpoint file written before they existed keeps its bytes
RUN_ONLY_CONFIG_FIELDS = frozenset({"threads", *WATCHDOG_FIELDS})


def phase1_route_diagnostics(cfg: TrainConfig, model: PMNet, out_dir: Path) -> dict | None:
    """Do the trained checkpoint's routes matter? `pmnet.diagnose` on the validation stream
    (`val_episodes`), written to `route_diagnostics.json` beside the checkpoint; None for a
    model without memory."""
    from pmnet.diagnose import diagnose

    if not model.cfg.use_memory:
        return None
    device = next(model.parameters()).device
    stream = task.validation_stream(cfg.val_episodes)
    d = diagnose(model.to(device), stream, checkpoint=str(out_dir / "phase1.pt"),
                 batch_size=cfg.eval_batch_size).to_dict()
    atomic_write_json(out_dir / ROUTES_FILE, _jsonable(d))
    return d


def init_consolidator(model: PMNet, cfg: TrainConfig, seed: int) -> None:
    """The Consolidator's Phase-2 start: with `consolidator_init_std` > 0, fresh W_g / W_u
    drawn from the Phase-2 seed (so seeds differ in more than data order) and the exact
    identity start (W_d = 0, unit-phasor b_d); with 0, the checkpoint's Consolidator as is."""
    if cfg.consolidator_init_std > 0:
        model.consolidator.reinit(cfg.consolidator_init_std,
                                  torch.Generator().manual_seed(seed))


def init_operator(model: PMNet, cfg: TrainConfig, name: str, seed: int) -> None:
    """Create the consolidation operator `name` for an operator condition (a Phase-1
    checkpoint has none) and set its start, mirroring `init_consolidator`: its random
    matrices from N(0, consolidator_init_std) drawn from the Phase-2 seed when that std is
    > 0, else from N(0, model.init_std) drawn from `phase1_seed` (so every seed starts from
    the same operator, as every seed starts from the checkpoint's Consolidator); then the
    parameters that make it an exact identity consolidation (L + S)."""
    op = add_operator(model, name)
    if cfg.consolidator_init_std > 0:
        std, gen_seed = cfg.consolidator_init_std, seed
    else:
        std, gen_seed = cfg.model.init_std, cfg.phase1_seed
    op.reset(std, torch.Generator().manual_seed(gen_seed))


def init_baseline(model: PMNet, cfg: TrainConfig, mode: str, seed: int) -> None:
    """Create the carried memory of baseline `mode` (issue 23; a Phase-1 checkpoint has
    none) with its start drawn from the Phase-2 seed (`pmnet.baselines.reset_baseline`);
    nothing for the baselines without parameters."""
    module = add_baseline(model, mode)
    if module is not None:
        reset_baseline(module, cfg.model, torch.Generator().manual_seed(seed))


def init_phase2(model: PMNet, cfg: TrainConfig, cond: Condition, seed: int) -> None:
    """A Phase-2 trial's start from the loaded Phase-1 model: the operator or baseline its
    condition uses, else the Consolidator's start (`init_consolidator`); a strict-off
    condition's routers read u without L (`PMNet.routing_u_uses_ltm`)."""
    model.routing_u_uses_ltm = cond.routing_u_ltm
    if cond.consolidation in OPERATORS:  # the Consolidator stays as stored (frozen, unused)
        init_operator(model, cfg, cond.consolidation, seed)
    elif cond.consolidation in BASELINE_MODES:  # likewise
        init_baseline(model, cfg, cond.consolidation, seed)
    else:
        init_consolidator(model, cfg, seed)


#: the keys of a Phase-2 result.json (run_phase2); a caller's `record` adds others
RESULT_KEYS = frozenset({
    "condition", "seed", "preset", "phase1_sha256", "best_epoch", "trainable_params",
    "total_params", "trainable_fraction", "consolidation", "ltm_routing", "routing_u_ltm",
    "objective", "select", "val", "test", "test_seed", "test_stream_hash", "train_time_s",
    "history", "best_model", "config", "device", "precision", "last_epoch", "test_last",
    "gpu_memory"})


def run_phase2(cfg: TrainConfig, *, condition: str, seed: int, phase1_ckpt: str | Path,
               out_dir: str | Path, callbacks=(), loggers=(), resume_from=None,
               progress: bool | None = None, record: dict | None = None,
               accelerator: str = "auto", gpu_share: float | None = None,
               stop: StopAtEpochEnd | None = None) -> dict | PhasePaused:
    """Train one Phase-2 trial (condition x seed) from the Phase-1 checkpoint; evaluate the
    selected checkpoint on the fixed test stream; write `result.json` and return it.

    `stop` (issue 61): a deadline or stop request that ends this sitting at an epoch
    boundary, as for Phase 1; the result is then a `PhasePaused` (phase 2; no test pass, no
    result.json) and calling run_phase2 again on `out_dir` (or a copy of it) continues from
    `ckpt/last.ckpt`. Its checkpoints hold the trainable parameters only (the frozen ones are
    the verified Phase-1 file's: `Phase2Module`).

    With `cfg.watchdog` (issue 62) a Phase 2 that is not learning raises `NotLearningError`
    (`pmnet.train.watchdog`): no result.json is written; `ckpt/last.ckpt` keeps the last
    finished epoch.

    `accelerator`: "cpu" or "gpu" (where the caller was given to train: a Ray trial passes
    what Ray gave it), or "auto" (Lightning's choice). result.json records the device and
    precision the trainer used (`device`, `precision`).

    `record`: extra keys written into result.json as given (a caller's provenance, e.g. the
    pipeline's variant name and overrides); they may not replace a key of the result.

    `gpu_share`: the fraction of its GPU the trial was given (Ray's share): on a GPU the
    allocator is capped at it (`GpuMemoryCap`) and result.json records the cap and the
    measured peaks (`gpu_memory`)."""
    cond = get_condition(condition)  # validate everything before any compute
    _check_accelerator(accelerator)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if seed_problem(seed):
        raise ValueError(seed_problem(seed))
    record = dict(record or {})
    clash = sorted(set(record) & RESULT_KEYS)
    if clash:
        raise ValueError(f"run_phase2: record may not replace result key(s) {clash}")
    digest = verify_phase1(phase1_ckpt)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    _setup_threads(cfg)
    t0 = time.time()
    L.seed_everything(seed, workers=True, verbose=False)  # init order, data, dropout
    model, _ = load_model_file(phase1_ckpt, expect_config=cfg.model)
    init_phase2(model, cfg, cond, seed)
    module = Phase2Module(cfg, model, cond, phase1_sha256=digest)
    module.attempt_start = t0  # a checkpoint's time includes this attempt's set-up
    data = EpisodeData(cfg, seed, cfg.episodes_per_epoch, segments=cfg.segments,
                       families=cfg.phase2_families)
    cap = GpuMemoryCap(gpu_share)
    last = out_dir / "ckpt" / "last.ckpt"
    if resume_from is None and last.is_file():
        resume_from = last
    trainer, ckpt = _trainer(cfg, out_dir, max_epochs=cfg.max_epochs,
                             monitor=f"val/{module.select}", patience=cfg.patience,
                             callbacks=[cap, *callbacks, *([stop] if stop is not None else [])],
                             loggers=loggers, progress=progress,
                             ckpt_dir=out_dir / "ckpt", accelerator=accelerator,
                             resume_from=Path(resume_from) if resume_from else None)
    # weights_only=True: a checkpoint is data, never code, whatever torch's default or
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says (everything saved is tensors and plain types)
    trainer.fit(module, datamodule=data, ckpt_path=str(resume_from) if resume_from else None,
                weights_only=True)
    if stop is not None and stop.paused_at is not None:
        release_compiled_steps()
        return PhasePaused(epoch=stop.paused_at, max_epochs=cfg.max_epochs,
                           reason=str(stop.reason), last_ckpt=str(last),
                           train_time_s=module.prior_time_s + (time.time() - t0), phase=2)
    # the last epoch's weights on the test stream too, beside the validation-selected ones
    # (issue 21: a selection that picks an early epoch is then visible); the same numbers
    # when the last epoch is the selected one
    best_epoch = _best_epoch(ckpt)
    last_epoch = int(module.history[-1]["epoch"]) if module.history else None
    test_last = None
    if last_epoch is not None and best_epoch != last_epoch:
        trainer.test(module, datamodule=data, ckpt_path=None, verbose=False)
        test_last = dict(module.test_metrics)
    trainer.test(module, datamodule=data, ckpt_path="best", verbose=False, weights_only=True)
    if test_last is None:
        test_last = dict(module.test_metrics)
    counts = model.parameter_counts()
    trainable = sum(p.numel() for _, p in model.trainable_subset(cond.subset))
    best_model = out_dir / "best_model.pt"
    save_model_file(best_model, module.model, fmt=MODEL_FORMAT,
                    meta={"condition": condition, "seed": seed, "phase1_sha256": digest})
    val_best = {k[4:]: v for k, v in (module.history[_best_index(module.history,
                                                                 module.select)]
                                      if module.history else {}).items()
                if k.startswith("val/")}
    result = {
        "condition": condition, "seed": seed, "preset": cfg.preset, "phase1_sha256": digest,
        "best_epoch": best_epoch, "last_epoch": last_epoch, "trainable_params": trainable,
        "total_params": counts["total"], "trainable_fraction": trainable / counts["total"],
        "consolidation": cond.consolidation, "ltm_routing": cond.ltm_routing,
        "routing_u_ltm": cond.routing_u_ltm, "objective": cond.objective, "select": cond.select,
        "val": val_best, "test": module.test_metrics, "test_last": test_last,
        "test_seed": cfg.test_seed,
        "test_stream_hash": task.content_hash(task.test_stream(cfg.test_episodes,
                                                               segments=cfg.segments,
                                                               seed=cfg.test_seed)),
        # earlier attempts (up to the checkpoint this one resumed from) plus this one
        "train_time_s": module.prior_time_s + (time.time() - t0), "history": module.history,
        "best_model": str(best_model), "config": cfg.flat(), **trained_on(trainer),
        "gpu_memory": cap.record,  # the GPU cap and peaks (None on a CPU or without a share)
    }
    result = _jsonable({**result, **record})
    atomic_write_json(out_dir / "result.json", result)
    release_compiled_steps()
    return result


def warm_compile(cfg: TrainConfig, *, condition: str, phase1_ckpt: str | Path,
                 seed: int = 0, accelerator: str = "cpu") -> float:
    """Compile a Phase-2 condition's steps once, so that its trials find them in the
    on-disk cache (`use_compile_cache`) instead of each compiling them again.

    Builds the trial's module as `run_phase2` does (checkpoint, Consolidator or operator
    start, frozen subset) on the trial's device in the trial's precision (`accelerator`,
    `TrainConfig.resolved_precision`: the graphs differ by device and autocast) and runs
    one training step (forward and backward, no update) on the first batch of the seed's
    stream, and when "eval" compiles one validation and one test batch; nothing is written
    but the cache. The graphs depend on the condition, the config, the device and the
    shapes, not on the seed or the weights. Returns the seconds it took."""
    t0 = time.time()
    cond = get_condition(condition)
    _check_accelerator(accelerator)
    if "phase2" not in cfg.compile and "eval" not in cfg.compile:
        return 0.0
    _setup_threads(cfg)
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    precision = cfg.resolved_precision("gpu" if device.type == "cuda" else "cpu")
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    model, _ = load_model_file(phase1_ckpt, expect_config=cfg.model)
    init_phase2(model, cfg, cond, seed)
    module = Phase2Module(cfg, model, cond).to(device).train()
    batch = task.train_episodes(seed, 0, cfg.batch_size, segments=cfg.segments).to(device)
    with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
        module.objective(batch)  # eager first: a config error surfaces here, not in a trace
        loss = module.step_fn(module.objective, train=True)(batch)["loss"]
    loss.backward()
    if "eval" in cfg.compile:
        module.eval()
        for stream, full in ((task.validation_stream, False), (task.test_stream, True)):
            episodes = stream(min(cfg.eval_batch_size, cfg.val_episodes if not full
                                  else cfg.test_episodes), segments=cfg.segments)
            # under no_grad, as the trainer evaluates (`evaluation_inference_mode`): the
            # grad mode is part of a compiled graph's guards
            with torch.no_grad(), torch.autocast(device.type, dtype=half or torch.bfloat16,
                                                 enabled=half is not None):
                module.step_fn(module._outcomes, train=False)(episodes.to(device), full)
    return time.time() - t0


def _check_accelerator(accelerator: str) -> None:
    if accelerator not in ("auto", *ACCELERATORS):
        raise ValueError(f"accelerator must be 'auto' or one of {ACCELERATORS}, got "
                         f"{accelerator!r}")


def device_name(device: torch.device) -> str:
    """`NVIDIA GeForce RTX 4090 (cuda:0)`, or `cpu (<CPU model>)`."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    from pmnet.hardware import cpu_kind

    return f"{device.type} ({cpu_kind()})"


def trained_on(trainer: L.Trainer) -> dict[str, str]:
    """Where and how a trainer actually trained: `device` (its root device, named) and
    `precision` (Lightning's precision plugin: `bf16-mixed`, `32-true`, ...)."""
    return {"device": device_name(trainer.strategy.root_device),
            "precision": str(trainer.precision)}


def _best_index(history: list[dict], select: str) -> int:
    key = f"val/{select}"
    vals = [h.get(key, float("-inf")) for h in history]
    return max(range(len(vals)), key=lambda i: vals[i])


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj
