"""The learning gate of `make gpu-check` (issue 62), its first piece (`--kinds learning`):
does Phase 0 learn the copy task on the card as the preset trains it?

On a lent H200 the `paper` preset's Phase 0 (compiled, replayed as CUDA graphs, bf16, batch
256) sat at ln 26 for its 4,000 steps. This piece trains Phase 0 (`Phase0Module`, through a
real Lightning trainer as `run_phase1` does: its AdamW, gradient clipping, the rung's
precision and compiled step) at a small shape from one seed, on a ladder of settings, each
rung adding one setting of the preset's Phase-0 recipe to the rung before (`ladder`):
eager fp32 (the reference), bf16, compile, CUDA graphs, the preset's batch. Each rung must
learn the copy: its mean per-position held-out copy accuracy (`pmnet.evaluate.copy_accuracy`,
HELDOUT_N examples never trained on) at least `table.LEARNING["acc_min"]` (1.5x chance,
1/26); and its loss curve must agree with the rung before it (`table.curve_gap`, windowed
means over the second half of training, within `table.LEARNING["curve_tol"]`; the batch
rung, whose curve need not match, must end no worse, `batch_slack`). A rung that does not
fails the table's row that names the phase and the setting it added (exit 1).

The shape, rate and length, and why (measured on this project's 2-core CPU, eager fp32,
issue 62). Phase 0 first learns the payload's letter distribution (loss ln 26 = 3.258, no
memory) and then sits on that plateau until routed writes and reads start to carry the
payload; when it leaves is a symmetry breaking, sensitive to everything:
- the debug model (2 layers) at lr 1e-3, batch 32, 4-byte payloads left it after 200-420
  steps (4 seeds); at lr 2e-3, 3e-3 or 1e-2 not within 400-600 steps, nor at batch 64 and
  lr 3e-3; the `cpu` model at lr 1e-3 after 220 (batch 64) and 380 steps (batch 32), at lr
  2e-3 or 3e-3 not within 400;
- the debug model with 4 layers (`LEARN_MODEL`: 4 memory blocks, a write every layer), lr
  1e-3, a constant rate after 20 warmup steps, batch 32, 4-byte payloads: it leaves at about
  step 200 (two seeds, with and without attention dropout 0.1, fp32 and bf16) and ends 600
  steps at loss 2.81-2.84 and 8.4-8.7% held-out accuracy (chance 3.8%); 800 steps: 2.76,
  8.8-10.9%. Runs that stay on the plateau read 3.1-4.4%. At batch 128 and 256 the 2-layer
  model left the plateau earlier (about step 250 and 220) than at 32;
- with Phase 0's cosine decay over 400 steps it had barely left it (3.19, 6.4%): the gate
  keeps the rate constant after its warmup (`phase0_lr_schedule="constant"`, the `paper`
  preset's Phase-0 recipe), the rate is still scheduled by Lightning outside the compiled
  step.
So a rung runs LEARN_STEPS (800) on a card, LEARN_STEPS_CPU (600, about a minute a rung on
one idle core) in the self-test, which runs two rungs: eager and compiled fp32 (the CPU
trains fp32, and has no CUDA graphs; the preset's batch runs on a card only). The gate's
model keeps the preset's attention dropout (the paper's 0.1), so a dropout RNG that does not
advance under CUDA graphs is in what it trains.

`fit` (a phase module's steps through a real trainer, the per-step losses) is shared with
tests/test_train_compiled.py.
"""

from __future__ import annotations

import dataclasses
import time

from pmnet.gpu_check.table import NA_CPU

#: the gate's model: the debug model with 4 layers (4 memory blocks, a write every layer;
#: the preset's attention dropout)
LEARN_MODEL = {"n_layer": 4}
#: payload bytes of the gate's copy task (Phase 0's `phase0_copy_len`)
LEARN_COPY_LEN = 4
#: the gate's rate (Phase 0's `phase0_lr`; constant after the warmup), warmup steps and
#: batch (every rung but `batch`)
LEARN_LR = 1e-3
LEARN_WARMUP = 20
LEARN_BATCH = 32
#: steps per rung on a GPU and in the CPU self-test
LEARN_STEPS = 800
LEARN_STEPS_CPU = 600
#: the seed of the rungs' model and training batches, and of the held-out copy batch (a
#: seed training never draws: its batches are seeds LEARN_SEED * 1_000_003 + step)
LEARN_SEED = 0
HELDOUT_N = 2048


@dataclasses.dataclass(frozen=True)
class Rung:
    """One setting of the ladder: what it adds to the rung before (`setting`), and how it
    trains."""

    setting: str  # "reference", "bf16", "compile", "cuda graphs" or "batch"
    compiled: bool
    cuda_graphs: bool
    precision: str  # Lightning's: "32-true", "bf16-mixed", "16-mixed"
    batch: int

    @property
    def label(self) -> str:
        parts = ["compiled" if self.compiled else "eager",
                 *(["CUDA graphs"] if self.cuda_graphs else []),
                 "fp32" if self.precision == "32-true" else self.precision.split("-")[0],
                 f"batch {self.batch}"]
        return ", ".join(parts)


def ladder(cuda: bool, precision: str, compiled: bool, cuda_graphs: bool,
           preset_batch: int, batch: int = LEARN_BATCH) -> tuple[list[Rung], dict[str, str]]:
    """The rungs, each adding one of the preset's Phase-0 settings to the rung before:
    eager fp32, then its half precision (`precision`, as it resolves on a GPU), compile (if
    the preset compiles Phase 0), CUDA graphs (on a card, if the preset replays them) and
    its batch (on a card, if it differs from the gate's). Also the settings not run, and
    why."""
    rungs = [Rung("reference", False, False, "32-true", batch)]
    skipped: dict[str, str] = {}
    last = rungs[0]

    def add(setting: str, **change) -> None:
        nonlocal last
        last = dataclasses.replace(last, setting=setting, **change)
        rungs.append(last)

    if precision != "32-true":
        add("bf16" if precision.startswith("bf16") else "fp16", precision=precision)
    else:
        skipped["bf16"] = f"the preset trains in fp32 on a {'GPU' if cuda else 'CPU'}"
    if compiled:
        add("compile", compiled=True)
    else:
        skipped["compile"] = "the preset does not compile Phase 0"
    if not cuda:
        skipped["cuda graphs"] = NA_CPU
    elif compiled and cuda_graphs:
        add("cuda graphs", cuda_graphs=True)
    else:
        skipped["cuda graphs"] = "the preset's Phase 0 runs no CUDA graphs"
    if not cuda:
        skipped["batch"] = f"{NA_CPU}: the preset's batch {preset_batch} is run on a card"
    elif preset_batch != batch:
        add("batch", batch=preset_batch)
    else:
        skipped["batch"] = f"the preset's batch is the gate's ({batch})"
    return rungs, skipped


def fit(module, data, *, precision: str, accelerator: str, grad_clip: float,
        callbacks=()) -> list[float]:
    """Train `module` on `data` (a DataLoader, one epoch) as the phases' trainer does
    (`pmnet.train.phases._trainer`: its precision, gradient clipping by norm, the module's
    optimiser and schedule; no logger, checkpoint or evaluation) and return the loss of
    every step: Lightning's copy of the step's loss (`outputs["loss"]`), kept on the
    device and read once at the end."""
    import lightning as L
    import torch

    kept: list = []

    class _Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kept.append(outputs["loss"].detach().float().reshape(()))

    trainer = L.Trainer(
        max_epochs=1, accelerator=accelerator, devices=1, precision=precision,
        gradient_clip_val=grad_clip, gradient_clip_algorithm="norm",
        callbacks=[_Losses(), *callbacks], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, log_every_n_steps=10)
    trainer.fit(module, train_dataloaders=data)
    return torch.stack(kept).cpu().tolist() if kept else []


def gate_config(preset_cfg, rung: Rung, steps: int):
    """The TrainConfig of a rung: the preset's optimiser settings (betas, weight decay,
    clipping) on the gate's model (with the preset's attention dropout), rate, warmup, copy
    length, batch and steps, compiled (Phase 0's step) or not."""
    from pmnet.config import ModelConfig

    model = dataclasses.replace(ModelConfig.from_name("debug"), **LEARN_MODEL,
                                attn_dropout=preset_cfg.model.attn_dropout)
    return dataclasses.replace(
        preset_cfg, model=model, phase0_lr=LEARN_LR, phase0_lr_schedule="constant",
        warmup_steps=LEARN_WARMUP,
        batch_size=rung.batch, episodes_per_epoch=max(rung.batch, preset_cfg.batch_size),
        phase1_episodes_per_epoch=max(rung.batch, preset_cfg.batch_size),
        phase0_steps=steps, phase0_copy_len=LEARN_COPY_LEN,
        compile=("phase0",) if rung.compiled else (), cuda_graphs=rung.cuda_graphs)


def train_rung(preset_cfg, rung: Rung, steps: int, seed: int = LEARN_SEED) -> dict:
    """Phase 0 of the gate's model for `steps` steps at `rung`'s settings, from `seed`, on
    this process's device: the losses, the held-out per-position copy accuracy (in the
    rung's precision, eager), the time and dynamo's graph breaks."""
    import torch
    from torch._dynamo.utils import counters

    from pmnet import task
    from pmnet.evaluate import COPY_HELDOUT_SEED, copy_accuracy
    from pmnet.model import PMNet
    from pmnet.train import Phase0Module
    from pmnet.train.compiled_steps import fresh_compile_state
    from pmnet.train.data import CopyBatches, _loader

    cfg = gate_config(preset_cfg, rung, steps)
    cuda = torch.cuda.is_available()
    fresh_compile_state()  # every rung compiles afresh (the on-disk cache may serve it)
    counters.clear()
    torch.manual_seed(seed)
    model = PMNet(cfg.model)
    for n, p in model.named_parameters():  # as run_phase1: the Consolidator frozen
        p.requires_grad_(not n.startswith("consolidator."))
    module = Phase0Module(cfg, model, cfg.phase0_lr)
    data = _loader(CopyBatches(steps, rung.batch, cfg.phase0_copy_len, seed), pin_memory=cuda)
    t0 = time.time()
    losses = fit(module, data, precision=rung.precision, accelerator="gpu" if cuda else "cpu",
                 grad_clip=cfg.grad_clip)
    wall = time.time() - t0
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(rung.precision)
    held_out = task.make_copy_batch(HELDOUT_N, cfg.phase0_copy_len, COPY_HELDOUT_SEED)
    acc = copy_accuracy(module.model, held_out, autocast_dtype=half)
    return {"setting": rung.setting, "label": rung.label, "batch": rung.batch,
            "precision": rung.precision, "compiled": rung.compiled,
            "cuda_graphs": rung.cuda_graphs, "steps": steps, "losses": losses,
            "accuracy": [float(a) for a in acc], "wall_s": wall,
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def run_learning(preset: str, overrides: dict | None = None, batch: int | None = None,
                 steps: int | None = None) -> dict:
    """The gate's piece, in this process: every rung of the ladder, in order (on a card, or
    on the CPU in the self-test)."""
    import torch

    from pmnet.train import COMPILE_STEPS, TrainConfig

    overrides = dict(overrides or {})
    cfg = TrainConfig.from_name(preset, **overrides)
    if "compile" not in overrides:  # the paper preset's compiled steps, as every trial
        cfg = dataclasses.replace(cfg, compile=COMPILE_STEPS)
    cuda = torch.cuda.is_available()
    precision = cfg.resolved_precision("gpu" if cuda else "cpu")
    steps = steps or (LEARN_STEPS if cuda else LEARN_STEPS_CPU)
    rungs, skipped = ladder(cuda, precision, "phase0" in cfg.compile, cfg.cuda_graphs,
                            batch or cfg.batch_size)
    t0 = time.time()
    results = [train_rung(cfg, r, steps) for r in rungs]
    return {"kind": "learning", "preset": preset, "device": "cuda" if cuda else "cpu",
            "steps": steps, "lr": LEARN_LR, "copy_len": LEARN_COPY_LEN,
            "model": LEARN_MODEL, "rungs": results, "skipped": skipped,
            "wall_s": time.time() - t0}
