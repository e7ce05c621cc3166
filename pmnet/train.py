"""Training for every phase with Lightning (Sections 4.4, 5.2, 6; Appendix "Hyperparameters").

Phase 0 (optional warm start): PMNet's copy-paste task; the paper starts from "a PMNet
    copy-task checkpoint" that cannot be downloaded, so we train our own when a preset asks.
Phase 1 (STM pretraining): same-segment rule induction from routed STM: process the
    demonstrations, clear the KV cache, answer the held-out query; the Consolidator is frozen.
    Output: one checkpoint `phase1.pt` (weights-only loadable) with its sha256 beside it.
Phase 2 (consolidation training): the two-segment protocol from that checkpoint, for one of
    the conditions of Table "Parameter-isolation conditions" (`CONDITIONS`) or one of the
    consolidation-operator conditions beyond the paper (`OPERATOR_CONDITIONS`: the operator
    is created fresh at its identity start, `init_operator`, and trained alone); `segments`
    > 2 trains on memory episodes of that many segments, and `ltm_graph` chooses full or
    truncated backpropagation through the boundaries (issue 11; docs/choices.md).

One LightningModule per phase wraps the plain `PMNet`; the loop, clipping, precision,
checkpointing and early stopping are Lightning's. Metrics are named `train/...`,
`val/...`, `test/...`.

Choices the paper leaves open (see docs/choices.md):
- weight decay applies to matrices and embeddings (dim >= 2), not to biases, norms, the
  Consolidator's unit-phasor bias; the slot embeddings (3-D) are decayed like embeddings;
- the cosine decay runs to zero over the maximum budget (max_epochs x steps per epoch);
- Phase 1 uses segment 1 of each generated episode; its training stream is the task's
  train stream at seed `phase1_seed + 1_000_000`, distinct from every Phase-2 seed;
- frozen parameters keep requires_grad=False, are left out of the optimiser, and their
  modules stay in train mode (attention dropout is not switched off by freezing).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, Dataset

from pmnet import task
from pmnet.conditions import (  # noqa: F401
    ALL_CONDITIONS,
    CONDITIONS,
    OPERATOR_CONDITIONS,
    PAPER_SEEDS,
    Condition,
    get_condition,
    seed_problem,
)
from pmnet.config import ModelConfig
from pmnet.evaluate import episode_outcomes, summarize
from pmnet.io import atomic_link, atomic_path, atomic_write_bytes, atomic_write_json
from pmnet.model import OPERATORS, PMNet
from pmnet.runner import LTM_GRAPHS, phase2_losses

PHASE1_FORMAT = "pmnet-phase1/v1"
MODEL_FORMAT = "pmnet-model/v1"


# -----------------------------------------------------------------------------------------
# Conditions (Table "Parameter-isolation conditions")
# -----------------------------------------------------------------------------------------


# `Condition`, `CONDITIONS`, `OPERATOR_CONDITIONS`, `ALL_CONDITIONS`, `get_condition` and
# `PAPER_SEEDS` live in pmnet.conditions.


# -----------------------------------------------------------------------------------------
# Training configuration with named presets
# -----------------------------------------------------------------------------------------

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed")
#: The steps TrainConfig.compile can name: each phase's training step, and the evaluation
#: passes (validation and test) of every phase
COMPILE_STEPS = ("phase0", "phase1", "phase2", "eval")
#: Where a phase trains (Lightning's accelerator names): a caller that knows which device it
#: was given says so (a Ray trial: "gpu" when Ray gave it one); "auto" is Lightning's guess.
ACCELERATORS = ("cpu", "gpu")


@dataclass(frozen=True)
class TrainConfig:
    preset: str
    model: ModelConfig
    # optimisation (paper defaults) ------------------------------------------------------
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 100
    grad_clip: float = 1.0
    batch_size: int = 256
    episodes_per_epoch: int = 100_000
    max_epochs: int = 60
    patience: int = 6
    val_episodes: int = 1000
    test_episodes: int = 1000
    eval_batch_size: int = 250
    precision: str = "auto"  # bf16-mixed on CUDA, 32-true on CPU
    threads: int = 0  # CPU threads for torch (0: leave torch's default)
    # speed (issue 20): the steps that run through `torch.compile` (of COMPILE_STEPS; `off`
    # or an empty list: none) and, on a CUDA device, the compiled steps replayed as CUDA
    # graphs (torch.compile's "reduce-overhead" mode)
    compile: tuple[str, ...] = COMPILE_STEPS
    cuda_graphs: bool = True
    # Phase 0: copy-task warm start (0 steps = off) ---------------------------------------
    phase0_steps: int = 0
    phase0_copy_len: int = 16
    # Phase 1: STM pretraining --------------------------------------------------------------
    phase1_seed: int = 0
    phase1_lr: float = 5e-4
    phase1_max_epochs: int = 60
    phase1_episodes_per_epoch: int = 100_000
    phase1_patience: int = 6
    phase1_curriculum: bool = False  # demos per batch ~ U{1..8} (evaluation always at 8)
    phase1_aux_demo_loss: float = 0.0  # weight of a loss on the answers of demos 2..k
    # Phase 2: grid and lifecycle -----------------------------------------------------------
    seeds: tuple[int, ...] = PAPER_SEEDS
    conditions: tuple[str, ...] = tuple(CONDITIONS)
    # the Phase-1 checkpoints the preset's grids nest their trials under, one per Phase-1
    # seed (issue 21: the checkpoint as the unit of analysis); empty: the paper's design,
    # every trial from the pipeline's one checkpoint (`--phase1-seeds` sets K for one run)
    phase1_seeds: tuple[int, ...] = ()
    detach_ltm: bool = False  # `detach_long_term_between_sleeps` (False in the paper)
    # Phase 2: memory episodes of `segments` segments (2 in the paper; 2..8), and which
    # boundaries the final loss backpropagates through: "full" (every one, the paper),
    # "truncated" (LTM detached after every boundary but the last: truncated BPTT) or
    # "detached" (after every boundary: what detach_ltm=True does; the two cannot disagree)
    segments: int = task.N_SEGMENTS
    ltm_graph: str = "full"
    # Phase 2: the Consolidator's own recipe -----------------------------------------------
    # std of W_g / W_u drawn from the Phase-2 seed at the start of Phase 2 (W_d = 0 and the
    # unit-phasor b_d keep C an exact identity); 0 keeps the checkpoint's Consolidator (the
    # paper's protocol: every seed starts from the same, Phase-1-initialised Consolidator).
    # The operator conditions follow the same recipe: see `init_operator`; their parameters
    # share the Consolidator's learning rate and weight decay below.
    consolidator_init_std: float = 0.0
    consolidator_lr: float = 0.0  # learning rate of the Consolidator's parameters (0: lr)
    consolidator_weight_decay: float | None = None  # None: weight_decay
    # weight of an auxiliary loss on the initial-mapping query after the first boundary
    # (`initial_ltm`) added to the Phase-2 objective; 0 in the paper (Eq. 10 / Eq. 11 only)
    initial_ltm_loss: float = 0.0
    notes: tuple[str, ...] = field(default=(), compare=False)  # how a preset departs

    def __post_init__(self):
        for name in ("lr", "phase1_lr", "grad_clip", "weight_decay", "phase1_aux_demo_loss",
                     "consolidator_init_std", "consolidator_lr", "initial_ltm_loss"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"TrainConfig.{name} must be a number, got {v!r}")
        for name in ("seeds", "conditions", "betas", "notes", "phase1_seeds"):
            if not isinstance(getattr(self, name), (tuple, list)):
                raise ValueError(f"TrainConfig.{name} must be a list, got "
                                 f"{getattr(self, name)!r}")
        if any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers, got {self.betas!r}")
        for name in ("warmup_steps", "phase0_steps", "threads", "phase1_seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative integer, got {v!r}")
        for name in ("batch_size", "episodes_per_epoch", "max_epochs", "patience",
                     "val_episodes", "test_episodes", "eval_batch_size", "phase0_copy_len",
                     "phase1_max_epochs", "phase1_episodes_per_epoch", "phase1_patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("lr", "phase1_lr", "grad_clip"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "phase1_aux_demo_loss", "consolidator_init_std",
                     "consolidator_lr", "initial_ltm_loss"):  # numbers, checked above
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        cwd = self.consolidator_weight_decay
        if cwd is not None and (isinstance(cwd, bool) or not isinstance(cwd, (int, float))
                                or cwd < 0):
            raise ValueError("TrainConfig.consolidator_weight_decay must be None or a number "
                             f">= 0, got {cwd!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas}")
        if isinstance(self.compile, str) or tuple(self.compile) == ("off",):
            # "off" (or one step name given alone) as a --set value or a keyword
            object.__setattr__(self, "compile", () if self.compile in ("off", ("off",))
                               else (self.compile,))
        unknown = [c for c in self.compile if c not in COMPILE_STEPS]
        if unknown or len(set(self.compile)) != len(self.compile):
            raise ValueError(f"TrainConfig.compile must list steps of {COMPILE_STEPS} (or be "
                             f"'off'), each once, got {self.compile!r}")
        object.__setattr__(self, "compile", tuple(self.compile))
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"TrainConfig.cuda_graphs must be true or false, got "
                             f"{self.cuda_graphs!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {PRECISIONS}, "
                             f"got {self.precision!r}")
        if self.episodes_per_epoch < self.batch_size:
            raise ValueError("TrainConfig.episodes_per_epoch must be >= batch_size")
        if self.phase1_episodes_per_epoch < self.batch_size:
            raise ValueError("TrainConfig.phase1_episodes_per_epoch must be >= batch_size")
        if not self.seeds:
            raise ValueError("TrainConfig.seeds is empty: give at least one Phase-2 seed")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"TrainConfig.seeds must be non-negative integers: {self.seeds}")
        if (any(isinstance(k, bool) or not isinstance(k, int) or k < 0
                for k in self.phase1_seeds)
                or len(set(self.phase1_seeds)) != len(self.phase1_seeds)):
            raise ValueError("TrainConfig.phase1_seeds must be distinct non-negative integers: "
                             f"{self.phase1_seeds}")
        for what, value in [("phase1_seed", self.phase1_seed),
                            *(("seeds", s) for s in self.seeds),
                            *(("phase1_seeds", k) for k in self.phase1_seeds)]:
            problem = seed_problem(value, f"TrainConfig.{what}")
            if problem:
                raise ValueError(problem)
        if not self.conditions:
            raise ValueError("TrainConfig.conditions is empty")
        for c in self.conditions:
            get_condition(c)
        seg = self.segments
        if isinstance(seg, bool) or not isinstance(seg, int) or not (
                task.MIN_SEGMENTS <= seg <= task.MAX_SEGMENTS):
            raise ValueError(f"TrainConfig.segments must be an integer in {task.MIN_SEGMENTS}.."
                             f"{task.MAX_SEGMENTS}, got {seg!r}")
        if not isinstance(self.detach_ltm, bool):
            raise ValueError(f"TrainConfig.detach_ltm must be true or false, got "
                             f"{self.detach_ltm!r}")
        if self.ltm_graph not in LTM_GRAPHS:
            raise ValueError(f"TrainConfig.ltm_graph must be one of {LTM_GRAPHS}, got "
                             f"{self.ltm_graph!r}")
        if self.detach_ltm and self.ltm_graph == "truncated":
            raise ValueError("TrainConfig.detach_ltm=true detaches LTM after every boundary "
                             "(ltm_graph='detached'); it cannot be combined with "
                             "ltm_graph='truncated'")
        if self.model.max_chunk < task.SEG_LEN:
            raise ValueError(f"model max_chunk {self.model.max_chunk} < segment length "
                             f"{task.SEG_LEN}")

    @property
    def steps_per_epoch(self) -> int:
        return self.episodes_per_epoch // self.batch_size

    def resolved_precision(self, accelerator: str | None = None) -> str:
        """The precision training runs in: the preset's, or for "auto" bf16-mixed on a GPU and
        32-true on a CPU (`accelerator`: "gpu" or "cpu"; None: a GPU when CUDA is
        available)."""
        if self.precision != "auto":
            return self.precision
        if accelerator is None:
            accelerator = "gpu" if torch.cuda.is_available() else "cpu"
        if accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
        return "bf16-mixed" if accelerator == "gpu" else "32-true"

    @classmethod
    def from_name(cls, name: str, **overrides) -> TrainConfig:
        if name not in TRAIN_PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: "
                             f"{', '.join(sorted(TRAIN_PRESETS))}")
        if "preset" in overrides:
            raise ValueError("'preset' cannot be overridden: choose the preset by name "
                             "(--preset) and change single fields (KEY=VALUE, model.FIELD=...)")
        if "model" in overrides and not isinstance(overrides["model"], ModelConfig):
            raise ValueError("'model' takes a ModelConfig; change single model fields with "
                             "model.FIELD=VALUE")
        model_over = {k[len("model."):]: v for k, v in overrides.items()
                      if k.startswith("model.")}
        rest = {k: v for k, v in overrides.items() if not k.startswith("model.")}
        _check_keys(cls, rest, "TrainConfig")
        cfg = TRAIN_PRESETS[name]()
        if model_over:
            _check_keys(ModelConfig, model_over, "ModelConfig", prefix="model.")
            rest["model"] = dataclasses.replace(cfg.model, **model_over)
        return dataclasses.replace(cfg, **rest) if rest else cfg

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d)
        d["model"] = ModelConfig.from_dict(d["model"])
        for k in LIST_FIELDS:
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def flat(self) -> dict:
        """Flat scalar view for MLflow params (`model.hidden`, `lr`, ...)."""
        out = {}
        for k, v in self.to_dict().items():
            if k == "model":
                out.update({f"model.{mk}": mv for mk, mv in v.items()})
            elif isinstance(v, (list, tuple)):
                out[k] = ",".join(map(str, v))
            else:
                out[k] = v
        return out


def _check_keys(cls, overrides: dict, what: str, prefix: str = "") -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {what} field(s): {', '.join(prefix + k for k in unknown)}")


#: TrainConfig fields holding lists: `--set conditions=a,b` gives ("a", "b")
LIST_FIELDS = ("betas", "seeds", "conditions", "notes", "compile", "phase1_seeds")


def parse_overrides(items: list[str] | None) -> dict:
    """`KEY=VALUE` strings (the CLIs' `--set`) -> `TrainConfig.from_name` overrides.

    VALUE is parsed as JSON when it can be (numbers, booleans, lists -> tuples), else kept as a
    string; `model.FIELD` keys override model fields.
    """
    out: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, text = item.split("=", 1)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text  # a plain string
        key = key.strip()
        if key in LIST_FIELDS and not isinstance(value, list):
            # a bare value is a one-element list; a plain string may list items with commas
            value = ([v.strip() for v in value.split(",") if v.strip()]
                     if isinstance(value, str) else [value])
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def _paper() -> TrainConfig:
    # "Backbone initialization: PMNet copy-task checkpoint, followed by ... Phase 1": that
    # checkpoint cannot be downloaded, so Phase 0 trains our own copy warm start first
    # (4,000 steps of batch 256, 16-byte payloads; why this budget: docs/choices.md).
    # Compiled training and evaluation (on a GPU a step of thousands of small kernels is
    # launch-bound: docs/results.md, "Speed").
    return TrainConfig(preset="paper", model=ModelConfig.from_name("paper"),
                       phase0_steps=4_000, phase0_copy_len=16)


def _debug() -> TrainConfig:
    return TrainConfig(
        preset="debug", model=ModelConfig.from_name("debug"), lr=3e-3, warmup_steps=2,
        batch_size=16, episodes_per_epoch=64, max_epochs=2, patience=2, val_episodes=48,
        test_episodes=48, eval_batch_size=48, phase0_steps=2, phase0_copy_len=8,
        phase1_lr=3e-3, phase1_max_epochs=2, phase1_episodes_per_epoch=64,
        phase1_patience=2, phase1_curriculum=True, seeds=(42, 43), compile=(),
        notes=("tiny model and budgets for tests (eager: compiling would cost more than it "
               "saves)",),
    )


def _cpu() -> TrainConfig:
    """A small-scale reproduction on a 2-core CPU: Phase 1 (~15 min) and the two
    Consolidator-only arms x five seeds (~50 min, two single-threaded trials at a time).
    How each departure was chosen (validation stream only): docs/results.md."""
    return TrainConfig(
        preset="cpu", model=ModelConfig.from_name("cpu"), lr=1e-3, warmup_steps=50,
        batch_size=64, episodes_per_epoch=12_800, max_epochs=10, patience=10,
        val_episodes=1000, test_episodes=2000, eval_batch_size=500, threads=0,
        phase1_lr=1e-3, phase1_max_epochs=40, phase1_episodes_per_epoch=12_800,
        phase1_patience=40, phase1_curriculum=True, phase1_aux_demo_loss=1.0,
        consolidator_init_std=0.18, consolidator_lr=3e-3, consolidator_weight_decay=0.0,
        # compiled: the Phase-2 step only (on 2 cores the compiles of Phase 1 and of the
        # evaluation passes cost more than they save: docs/choices.md, "Speed")
        seeds=PAPER_SEEDS, compile=("phase2",),
        conditions=("consolidator_only", "consolidator_only_routing_off"),
        notes=(
            "small model (hidden 64, 4 layers, a write every layer, phase dim 16; 0.30M)",
            "Phase 1 curriculum: demonstrations per batch drawn from 1..8 (evaluation at 8)",
            "Phase 1 auxiliary loss (weight 1) on the answers of demonstrations 2..k",
            "Phase 1: 8,000 steps of batch 64 (40 epochs x 12.8K episodes), lr 1e-3",
            "Phase 2: 2,000 steps of batch 64 (10 epochs x 12.8K episodes), no early stop",
            "Consolidator: W_g/W_u ~ N(0, 0.18) drawn from the Phase-2 seed (W_d = 0 keeps the "
            "identity start), lr 3e-3, no weight decay (paper: N(0, 0.02), lr 5e-4, decay 0.1)",
            "default grid: the two Consolidator-only arms x seeds 42..46 (GRID=paper runs all "
            "six conditions)",
            "test stream of 2,000 episodes (paper: 1,000)",
        ),
    )


TRAIN_PRESETS = {"paper": _paper, "cpu": _cpu, "debug": _debug}


# -----------------------------------------------------------------------------------------
# Data: procedural streams, one epoch of episodes per Lightning epoch
# -----------------------------------------------------------------------------------------


class EpochBatches(Dataset):
    """Pre-generated batches of one epoch: item i is the i-th EpisodeBatch of the epoch."""

    def __init__(self, episodes, batch_size: int):
        self.episodes, self.batch_size = episodes, batch_size

    def __len__(self) -> int:
        return len(self.episodes) // self.batch_size

    def __getitem__(self, i):
        return self.episodes[i * self.batch_size:(i + 1) * self.batch_size]


class CopyBatches(Dataset):
    def __init__(self, n_steps: int, batch_size: int, length: int, seed: int):
        self.n, self.bs, self.length, self.seed = n_steps, batch_size, length, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return task.make_copy_batch(self.bs, self.length, self.seed * 1_000_003 + i)


def _loader(ds, pin_memory: bool = False) -> DataLoader:
    """Batches in order; `pin_memory` (training on a GPU) puts each batch in page-locked
    memory so that its copy to the device does not block the host."""
    return DataLoader(ds, batch_size=None, shuffle=False, num_workers=0, pin_memory=pin_memory)


def _on_gpu(trainer) -> bool:
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


class EpisodeData(L.LightningDataModule):
    """Training stream per (seed, epoch), fixed validation and test streams, of episodes of
    `segments` segments (Phase 1 always uses the two-segment streams)."""

    def __init__(self, cfg: TrainConfig, seed: int, episodes_per_epoch: int,
                 segments: int = task.N_SEGMENTS):
        super().__init__()
        self.cfg, self.seed, self.n, self.segments = cfg, seed, episodes_per_epoch, segments

    def train_dataloader(self):
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return _loader(EpochBatches(task.train_episodes(self.seed, epoch, self.n,
                                                        segments=self.segments),
                                    self.cfg.batch_size), pin_memory=_on_gpu(self.trainer))

    def val_dataloader(self):
        v = task.validation_stream(self.cfg.val_episodes, segments=self.segments)
        return _loader(EpochBatches(v, min(self.cfg.eval_batch_size, len(v))))

    def test_dataloader(self):
        t = task.test_stream(self.cfg.test_episodes, segments=self.segments)
        return _loader(EpochBatches(t, min(self.cfg.eval_batch_size, len(t))))


# -----------------------------------------------------------------------------------------
# LightningModules
# -----------------------------------------------------------------------------------------


#: torch.compile's backend for the steps (tests use "aot_eager": the same graphs, forward and
#: backward, run by eager kernels, without inductor's code generation)
COMPILE_BACKEND = "inductor"


def compile_step(fn, device: torch.device, cfg: TrainConfig):
    """`torch.compile(fn)` (inductor), on a CUDA device with `cfg.cuda_graphs` in the
    "reduce-overhead" mode: each graph is recorded once per input shape as a CUDA graph and
    replayed, so a step costs a few launches instead of thousands. Every call then first
    marks a new step (`cudagraph_mark_step_begin`): the previous step's outputs (read by
    then) may be overwritten. Compiled graphs go to inductor's on-disk cache (see
    `use_compile_cache`), so another process with the same graphs loads them."""
    graphs = cfg.cuda_graphs and torch.device(device).type == "cuda"
    mode = "reduce-overhead" if graphs and COMPILE_BACKEND == "inductor" else None
    compiled = torch.compile(fn, backend=COMPILE_BACKEND, mode=mode)
    if not graphs:
        return compiled

    @functools.wraps(fn)
    def step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return step


def use_compile_cache(directory: str | Path) -> Path:
    """Point inductor's and Triton's on-disk caches at `directory` (created), for this
    process and the processes it starts: every process of a pipeline then shares the
    compiled graphs, so a graph is compiled once per pipeline, not once per trial."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")
    return directory


def freeze_to_subset(model: PMNet, subset: str) -> list[str]:
    """requires_grad only for the named subset; returns the trainable parameter names."""
    keep = {n for n, _ in model.trainable_subset(subset)}
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    return sorted(keep)


class _PhaseModule(L.LightningModule):
    """Shared optimiser, schedule, device transfer, RNG and history handling."""

    def __init__(self, cfg: TrainConfig, model: PMNet, lr: float):
        super().__init__()
        self.cfg, self.model, self.lr = cfg, model, lr
        self.history: list[dict] = []
        self._val_chunks: dict[str, list] = {}
        # the epoch's training losses, summed on the device (float64, the same sum as adding
        # Python floats) and read back once per epoch: no host sync in a training step
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._steps: dict[str, object] = {}  # step functions, compiled as the config says
        self._demos = task.N_DEMOS  # Phase 1: demonstrations of the current step
        self.test_metrics: dict[str, float] = {}
        # training time across attempts: a checkpoint carries the time spent up to it, so a
        # resumed run's train_time_s adds the earlier attempts (up to their last checkpoint)
        self.prior_time_s = 0.0
        self._attempt_start = time.time()

    def elapsed_s(self) -> float:
        """Seconds of training behind the current state: earlier attempts (as recorded in
        the checkpoint this attempt resumed from) plus this attempt so far."""
        return self.prior_time_s + (time.time() - self._attempt_start)

    def configure_optimizers(self):
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters")
        cfg = self.cfg
        # the Consolidator and the alternative consolidation operators: their own lr / decay
        boundary = ("consolidator.", "operators.")
        cons = [(n, p) for n, p in params if n.startswith(boundary)]
        rest = [(n, p) for n, p in params if not n.startswith(boundary)]
        c_lr = cfg.consolidator_lr or self.lr
        c_wd = cfg.weight_decay if cfg.consolidator_weight_decay is None \
            else cfg.consolidator_weight_decay
        groups = [
            {"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for _, p in cons if p.dim() >= 2], "weight_decay": c_wd, "lr": c_lr},
            {"params": [p for _, p in cons if p.dim() < 2], "weight_decay": 0.0, "lr": c_lr},
        ]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr,
                                betas=tuple(cfg.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warm = self.cfg.warmup_steps

        def schedule(step: int) -> float:  # linear warmup, then cosine decay to zero
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    #: this phase's name in TrainConfig.compile (COMPILE_STEPS)
    phase: str = ""

    def step_fn(self, fn, *, train: bool):
        """`fn` as the steps run it: through `torch.compile` where `TrainConfig.compile` names
        this phase's training step (`train`) or "eval" (`compile_step`), made once per module
        and function."""
        name = fn.__name__
        if name not in self._steps:
            on = (self.phase if train else "eval") in self.cfg.compile
            self._steps[name] = compile_step(fn, self.device, self.cfg) if on else fn
        return self._steps[name]

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch.to(device, non_blocking=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().double()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["pmnet_history"] = list(self.history)
        checkpoint["pmnet_train_time_s"] = self.elapsed_s()
        checkpoint["pmnet_rng"] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":  # the device it trains on only (not every visible GPU)
            checkpoint["pmnet_rng"]["cuda"] = torch.cuda.get_rng_state(self.device)

    def on_load_checkpoint(self, checkpoint):
        if self._trainer is not None and self.trainer.state.fn != "fit":
            return  # loading the best weights for testing keeps the full history
        self.history = list(checkpoint.get("pmnet_history", []))
        self.prior_time_s = float(checkpoint.get("pmnet_train_time_s", 0.0))
        rng = checkpoint.get("pmnet_rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        state = rng.get("cuda")
        if isinstance(state, (list, tuple)):  # written by get_rng_state_all (one per GPU)
            state = state[0] if state else None
        if state is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)

    # evaluation: per-episode outcomes of every batch, summarised once per epoch --------
    def _outcomes(self, batch, full: bool) -> dict:
        """Per-episode outcomes of one evaluation batch (validation: full=False)."""
        raise NotImplementedError

    def on_validation_epoch_start(self):
        self._val_chunks, self._val_batches = {}, []

    on_test_epoch_start = on_validation_epoch_start

    def _collect(self, batch, full: bool) -> None:
        for key, v in self.step_fn(self._outcomes, train=False)(batch, full).items():
            self._val_chunks.setdefault(key, []).append(v.cpu())
        self._val_batches.append(batch.to("cpu"))

    def validation_step(self, batch, batch_idx):
        self._collect(batch, full=False)

    def test_step(self, batch, batch_idx):
        self._collect(batch, full=True)

    def _metrics(self) -> dict[str, float]:
        stream = _concat_batches(self._val_batches)
        return summarize({k: torch.cat(v) for k, v in self._val_chunks.items()}, stream)

    def _record_epoch(self, metrics: dict[str, float]) -> None:
        row = {"epoch": int(self.current_epoch)}
        if self._loss_count:
            row["train/loss"] = float(self._loss_sum) / self._loss_count
            self._loss_sum, self._loss_count = None, 0
        row.update(metrics)
        self.history.append(row)


class Phase0Module(_PhaseModule):
    """PMNet copy-paste warm start: the payload must cross a cleared KV cache in memory."""

    phase = "phase0"

    def copy_loss(self, batch):
        state = self.model.init_state(batch.context.shape[0], device=batch.context.device)
        _, state = self.model(batch.context, state, ltm_routing=False, logits="none")
        logits, _ = self.model(batch.prompt, state.clear_kv(), ltm_routing=False)
        return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(),
                               ignore_index=task.IGNORE_INDEX)

    def training_step(self, batch, batch_idx):
        loss = self.step_fn(self.copy_loss, train=True)(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss


class Phase1Module(_PhaseModule):
    """STM rule induction: demonstrations -> clear KV -> held-out query (Consolidator frozen)."""

    phase = "phase1"

    def demos_at(self, step: int) -> int:
        """The number of demonstrations of training step `step`: N_DEMOS, or with the
        curriculum a draw from U{1..N_DEMOS} deterministic in (Phase-1 seed, step), so a
        resumed run draws what an uninterrupted one would."""
        if not self.cfg.phase1_curriculum:
            return task.N_DEMOS
        g = torch.Generator().manual_seed(self.cfg.phase1_seed * 7919 + step)
        return int(torch.randint(1, task.N_DEMOS + 1, (1,), generator=g))

    def on_train_batch_start(self, batch, batch_idx):
        # drawn here, on the host, before the step (the step itself reads nothing back)
        self._demos = self.demos_at(self.global_step)

    def training_step(self, batch, batch_idx):
        k = self._demos
        # a copy: the batch is a slice of the epoch's tensors, and a compiled step would
        # otherwise specialise on its (varying) offset into them
        context = batch.seg_tokens[:, 0, : task.DEMO_LEN * k].clone()  # (B, 5k)
        query, target = batch.query_tokens[:, 0], batch.target[:, 0]
        step = self.step_fn(self.stm_loss, train=True)
        if self.phase in self.cfg.compile:  # one compiled graph for every number of demos
            torch._dynamo.maybe_mark_dynamic(context, 1)
        loss, query_loss, aux_loss = step(context, query, target)
        self.log("train/query_loss", query_loss)
        if aux_loss is not None and k > 1:
            self.log("train/aux_loss", aux_loss)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/demos", float(k))
        return loss

    def stm_loss(self, context, query, target):
        """(loss, query loss, auxiliary loss or None): the k demonstrations of `context`
        (B, 5k), clear the KV cache, the held-out query; with TrainConfig.phase1_aux_demo_loss
        plus that weight times the loss on the answers of demonstrations 2..k, predicted at
        their delimiters (0 when k = 1: then the loss is the query loss, exactly)."""
        B, n = context.shape
        k = n // task.DEMO_LEN
        aux = self.cfg.phase1_aux_demo_loss > 0
        state = self.model.init_state(B, device=context.device)
        demo_logits, state = self.model(context, state, ltm_routing=False,
                                        logits="all" if aux else "none")
        logits, _ = self.model(query, state.clear_kv(), ltm_routing=False, logits="last")
        query_loss = F.cross_entropy(logits.float(), target)
        if not aux:
            return query_loss, query_loss, None
        # demonstration d (0-based) spans positions 5d .. 5d + 4: its answer at 5d + 4 is
        # predicted at its delimiter 5d + 3; the mean over the B (k - 1) answers of d >= 1,
        # written without data-dependent or sliced shapes (every answer's loss, those of
        # d = 0 masked out, sum / count), so that every k, k = 1 (0 / 1) included, is the
        # same compiled graph
        V = demo_logits.shape[-1]
        pred = demo_logits.view(B, k, task.DEMO_LEN, V)[:, :, 3].float()  # (B, k, V)
        answers = context.view(B, k, task.DEMO_LEN)[:, :, 4]  # (B, k)
        per_answer = F.cross_entropy(pred.transpose(1, 2), answers, reduction="none")
        later = torch.arange(k, device=context.device) >= 1  # demonstrations 2..k
        aux_loss = (per_answer * later).sum() / max(B * (k - 1), 1)
        return query_loss + self.cfg.phase1_aux_demo_loss * aux_loss, query_loss, aux_loss

    def _outcomes(self, batch, full: bool) -> dict:
        return episode_outcomes(self.model, batch, consolidation="learned", ltm_routing=False,
                                ltm=False)

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        m = self._metrics()
        keep = {f"val/{k}": v for k, v in m.items() if not k.startswith("loss_")}
        self.log_dict(keep, prog_bar=False)
        self.log("val/mean_stm_pb", m["mean_stm"], prog_bar=True, logger=False)
        self._record_epoch(keep)

    def on_test_epoch_end(self):
        self.test_metrics = self._metrics()
        self.log_dict({f"test/{k}": v for k, v in self.test_metrics.items()})


VAL_LOGGED = ("updated_ltm", "seg1_stm", "seg2_stm", "mean_stm", "dual", "updated_ltm_add10",
              "updated_ltm_affine10", "updated_ltm_baseline", "loss_updated_ltm")


class Phase2Module(_PhaseModule):
    """Consolidation training for one condition: Eq. 10 (or Eq. 11 for the dual objective)."""

    phase = "phase2"

    def __init__(self, cfg: TrainConfig, model: PMNet, condition: Condition):
        super().__init__(cfg, model, cfg.lr)
        self.condition = condition
        self.trainable = freeze_to_subset(model, condition.subset)

    def training_step(self, batch, batch_idx):
        losses = self.step_fn(self.objective, train=True)(batch)
        for name, value in losses.items():
            self.log(f"train/{name}", value, prog_bar=name == "loss")
        return losses["loss"]

    def objective(self, batch) -> dict[str, torch.Tensor]:
        """The condition's Phase-2 objective on one batch (`runner.phase2_losses`)."""
        cfg = self.cfg
        return phase2_losses(self.model, batch, self.condition, detach_ltm=cfg.detach_ltm,
                             ltm_graph=cfg.ltm_graph, initial_ltm_loss=cfg.initial_ltm_loss)

    def _outcomes(self, batch, full: bool) -> dict:
        c = self.condition
        return episode_outcomes(self.model, batch, consolidation=c.consolidation,
                                ltm_routing=c.ltm_routing, full=full,
                                stm=full or c.objective == "dual")

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        m = self._metrics()
        keep = {f"val/{k}": m[k] for k in VAL_LOGGED if k in m}
        self.log_dict(keep)
        self.log("val/select", m[self.condition.select], prog_bar=True, logger=False)
        self._record_epoch(keep)

    def on_test_epoch_end(self):
        self.test_metrics = self._metrics()
        self.log_dict({f"test/{k}": v for k, v in self.test_metrics.items()
                       if not math.isnan(v)})


def _concat_batches(batches):
    fields = {f.name: torch.cat([getattr(b, f.name) for b in batches])
              for f in dataclasses.fields(batches[0])}
    return type(batches[0])(**fields)


# -----------------------------------------------------------------------------------------
# Checkpoints: weights-only files with a sha256 beside them, written atomically
# -----------------------------------------------------------------------------------------


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_model_file(path: Path, model: PMNet, *, fmt: str, meta: dict) -> str:
    """torch.save a weights-only payload atomically; write `<path>.sha256`; return the hash."""
    import io

    buf = io.BytesIO()
    torch.save({"format": fmt, "model_config": model.cfg.to_dict(),
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "meta": meta}, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    atomic_write_bytes(Path(path), data)
    atomic_write_bytes(Path(f"{path}.sha256"), f"{digest}  {Path(path).name}\n".encode())
    return digest


def verify_phase1(path: str | Path) -> str:
    """Check a Phase-1 checkpoint against the sha256 recorded beside it; return the hash."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Phase-1 checkpoint not found: {path}")
    sidecar = Path(f"{path}.sha256")
    if not sidecar.is_file():
        raise ValueError(f"no recorded sha256 beside the Phase-1 checkpoint: {sidecar}")
    fields = sidecar.read_text().split()
    recorded = fields[0] if fields else ""
    actual = sha256_file(path)
    if actual != recorded:
        raise ValueError(f"Phase-1 checkpoint {path} does not match its recorded sha256 "
                         f"(recorded {recorded[:12]}..., actual {actual[:12]}...): refusing it")
    return actual


def load_model_file(path: str | Path, *, expect_config: ModelConfig | None = None) -> tuple:
    """Load a weights-only model file -> (PMNet, payload). Config mismatch is an error."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "model_config" not in payload:
        raise ValueError(f"{path} is not a pmnet model file")
    mcfg = ModelConfig.from_dict(payload["model_config"])
    if expect_config is not None:
        diff = mcfg.differences(expect_config)
        if diff:
            raise ValueError(f"checkpoint {path} was made with a different model config "
                             f"(field: checkpoint vs requested): {diff}")
    model = PMNet(mcfg)
    # a Phase-2 operator model (`operators.<name>.*` keys) gets its operator before the
    # strict load; a Phase-1 checkpoint has none
    for name in sorted({k.split(".")[1] for k in payload["state_dict"]
                        if k.startswith("operators.") and k.count(".") >= 2}):
        model.add_operator(name)
    model.load_state_dict(payload["state_dict"])
    return model, payload


# -----------------------------------------------------------------------------------------
# Running the phases
# -----------------------------------------------------------------------------------------


def _setup_threads(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic.

    `TorchCheckpointIO` writes the bytes straight into the target, so a crash or a full disk
    in the middle leaves a torn `last.ckpt` that the next resume cannot load. Here
    `torch.save` streams into a temporary file in the same directory, which is fsynced and
    then `os.replace`d onto the target: a reader or a resume sees the old checkpoint or the
    new one, never half of one. Every write also makes a new inode, so a hard link to an
    older checkpoint (see `LastCheckpoint`) is never written through.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as fh:
                torch.save(checkpoint, fh)
                fh.flush()
                os.fsync(fh.fileno())


def _file_identity(path: str | Path) -> tuple[int, int, int, int] | None:
    """(device, inode, mtime_ns, size) of a file, None if there is none: a new atomic write
    always changes it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class LastCheckpoint(Checkpoint):
    """Writes `<dirpath>/last.ckpt`, the state a resume continues from, once per epoch.

    Lightning 2.6's `ModelCheckpoint(save_last=True)` writes last.ckpt only in epochs whose
    top-k checkpoint was saved, and then writes the same state a second time: a resume would
    restart from the best epoch rather than the last, and improving epochs cost two writes.
    This callback runs right after the selecting `ModelCheckpoint` at train-epoch end (both
    after EarlyStopping): if that callback has just written best.ckpt, last.ckpt becomes a
    hard link to it (the same state, no bytes written); otherwise the trainer saves
    last.ckpt (atomically, through `AtomicCheckpointIO`). So each epoch's state is written
    exactly once; only a filesystem without hard links costs a second write.
    """

    def __init__(self, best: ModelCheckpoint, dirpath: str | Path):
        self.best, self.path = best, Path(dirpath) / "last.ckpt"
        self._seen: tuple | None = None

    def _best_identity(self) -> tuple | None:
        return _file_identity(self.best.best_model_path) if self.best.best_model_path else None

    def on_train_start(self, trainer, pl_module):
        self._seen = self._best_identity()  # best.ckpt as it was when this fit (re)started

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        now = self._best_identity()
        if now is not None and now != self._seen:  # best.ckpt was written in this epoch
            self._seen = now
            if atomic_link(self.best.best_model_path, self.path):
                return
        trainer.save_checkpoint(str(self.path))


def _trainer(cfg: TrainConfig, out_dir: Path, *, max_epochs: int, monitor: str | None,
             patience: int, callbacks, loggers, progress, ckpt_dir: Path | None,
             max_steps: int = -1, name: str = "logs",
             accelerator: str = "auto") -> tuple[L.Trainer, ModelCheckpoint | None]:
    """The Lightning trainer of a phase. With a monitored metric: best.ckpt (written when the
    metric improves), last.ckpt (every epoch, see LastCheckpoint) and early stopping, all
    acting at train-epoch end in this order; the caller's callbacks come after them, so the
    selecting ModelCheckpoint is the trainer's `checkpoint_callback` ("best")."""
    cbs = []
    ckpt = None
    if monitor is not None:
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=monitor, mode="max",
                               save_top_k=1, save_last=False, enable_version_counter=False,
                               save_on_train_epoch_end=True)
        cbs += [EarlyStopping(monitor=monitor, mode="max", patience=patience,
                              check_on_train_epoch_end=True),
                ckpt, LastCheckpoint(ckpt, ckpt_dir)]
    cbs += list(callbacks)
    if progress is None:
        progress = os.isatty(2)
    trainer = L.Trainer(
        max_epochs=max_epochs, max_steps=max_steps, accelerator=accelerator, devices=1,
        precision=cfg.resolved_precision(None if accelerator == "auto" else accelerator),
        gradient_clip_val=cfg.grad_clip,
        gradient_clip_algorithm="norm", callbacks=cbs, plugins=[AtomicCheckpointIO()],
        logger=[CSVLogger(str(out_dir), name=name, version="")] + list(loggers),
        enable_progress_bar=bool(progress), enable_model_summary=False,
        num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1,
        log_every_n_steps=10, enable_checkpointing=ckpt is not None,
        default_root_dir=str(out_dir),
    )
    return trainer, ckpt


def run_phase1(cfg: TrainConfig, out_dir: str | Path, *, callbacks=(), loggers=(),
               progress: bool | None = None, accelerator: str = "auto") -> dict:
    """Phase 0 (if the preset has it) and Phase 1. Writes `phase1.pt` and its sha256.

    `accelerator`: "cpu" or "gpu" (where the caller was given to train, e.g. what Ray gave
    the task), or "auto" (Lightning's choice). The device and precision used are recorded."""
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
        m0 = Phase0Module(cfg, model, cfg.phase1_lr)
        tr, _ = _trainer(cfg, out_dir, max_epochs=1, monitor=None, patience=1,
                         callbacks=(), loggers=loggers, progress=progress, ckpt_dir=None,
                         name="phase0_logs", accelerator=accelerator)
        data = _loader(CopyBatches(cfg.phase0_steps, cfg.batch_size, cfg.phase0_copy_len,
                                   cfg.phase1_seed))
        tr.fit(m0, train_dataloaders=data)
        phase0 = {"phase0/final_loss": float(tr.callback_metrics.get("train/loss", float("nan")))}
        atomic_write_json(phase0_file, _jsonable(phase0))
    module = Phase1Module(cfg, model, cfg.phase1_lr)
    data = EpisodeData(cfg, cfg.phase1_seed + 1_000_000, cfg.phase1_episodes_per_epoch)
    trainer, ckpt = _trainer(cfg, out_dir, max_epochs=cfg.phase1_max_epochs,
                             monitor="val/mean_stm", patience=cfg.phase1_patience,
                             callbacks=callbacks, loggers=loggers, progress=progress,
                             ckpt_dir=out_dir / "phase1_ckpt", name="phase1_logs",
                             accelerator=accelerator)
    trainer.fit(module, datamodule=data, ckpt_path=str(last) if last.is_file() else None,
                weights_only=True)
    trainer.test(module, datamodule=data, ckpt_path="best", verbose=False, weights_only=True)
    train_time = module.prior_time_s + (time.time() - t0)  # earlier attempts included
    meta = {"phase": 1, "train_config": cfg.to_dict(), "test": module.test_metrics,
            "history": module.history, "phase0": phase0, "train_time_s": train_time,
            "best_epoch": _best_epoch(ckpt), **trained_on(trainer)}
    ckpt_path = out_dir / "phase1.pt"
    digest = save_model_file(ckpt_path, module.model, fmt=PHASE1_FORMAT, meta=_jsonable(meta))
    atomic_write_json(out_dir / "phase1_metrics.json", _jsonable(meta))
    routes = phase1_route_diagnostics(cfg, module.model, out_dir)
    return {"checkpoint": str(ckpt_path), "sha256": digest, "metrics": module.test_metrics,
            "train_time_s": train_time, **trained_on(trainer),
            **({"routes": routes} if routes is not None else {})}


ROUTES_FILE = "route_diagnostics.json"


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
    op = model.add_operator(name)
    if cfg.consolidator_init_std > 0:
        std, gen_seed = cfg.consolidator_init_std, seed
    else:
        std, gen_seed = cfg.model.init_std, cfg.phase1_seed
    op.reset(std, torch.Generator().manual_seed(gen_seed))


#: the keys of a Phase-2 result.json (run_phase2); a caller's `record` adds others
RESULT_KEYS = frozenset({
    "condition", "seed", "preset", "phase1_sha256", "best_epoch", "trainable_params",
    "total_params", "trainable_fraction", "consolidation", "ltm_routing", "objective",
    "select", "val", "test", "test_stream_hash", "train_time_s", "history", "best_model",
    "config", "device", "precision", "last_epoch", "test_last"})


def run_phase2(cfg: TrainConfig, *, condition: str, seed: int, phase1_ckpt: str | Path,
               out_dir: str | Path, callbacks=(), loggers=(), resume_from=None,
               progress: bool | None = None, record: dict | None = None,
               accelerator: str = "auto") -> dict:
    """Train one Phase-2 trial (condition x seed) from the Phase-1 checkpoint; evaluate the
    selected checkpoint on the fixed test stream; write `result.json` and return it.

    `accelerator`: "cpu" or "gpu" (where the caller was given to train: a Ray trial passes
    what Ray gave it), or "auto" (Lightning's choice). result.json records the device and
    precision the trainer used (`device`, `precision`).

    `record`: extra keys written into result.json as given (a caller's provenance, e.g. the
    pipeline's variant name and overrides); they may not replace a key of the result."""
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
    if cond.consolidation in OPERATORS:  # the Consolidator stays as stored (frozen, unused)
        init_operator(model, cfg, cond.consolidation, seed)
    else:
        init_consolidator(model, cfg, seed)
    module = Phase2Module(cfg, model, cond)
    data = EpisodeData(cfg, seed, cfg.episodes_per_epoch, segments=cfg.segments)
    trainer, ckpt = _trainer(cfg, out_dir, max_epochs=cfg.max_epochs,
                             monitor=f"val/{cond.select}", patience=cfg.patience,
                             callbacks=callbacks, loggers=loggers, progress=progress,
                             ckpt_dir=out_dir / "ckpt", accelerator=accelerator)
    last = out_dir / "ckpt" / "last.ckpt"
    if resume_from is None and last.is_file():
        resume_from = last
    # weights_only=True: a checkpoint is data, never code, whatever torch's default or
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says (everything saved is tensors and plain types)
    trainer.fit(module, datamodule=data, ckpt_path=str(resume_from) if resume_from else None,
                weights_only=True)
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
    val_best = {k[4:]: v for k, v in (module.history[_best_index(module.history, cond)]
                                      if module.history else {}).items()
                if k.startswith("val/")}
    result = {
        "condition": condition, "seed": seed, "preset": cfg.preset, "phase1_sha256": digest,
        "best_epoch": best_epoch, "last_epoch": last_epoch, "trainable_params": trainable,
        "total_params": counts["total"], "trainable_fraction": trainable / counts["total"],
        "consolidation": cond.consolidation, "ltm_routing": cond.ltm_routing,
        "objective": cond.objective, "select": cond.select,
        "val": val_best, "test": module.test_metrics, "test_last": test_last,
        "test_stream_hash": task.content_hash(task.test_stream(cfg.test_episodes,
                                                               segments=cfg.segments)),
        # earlier attempts (up to the checkpoint this one resumed from) plus this one
        "train_time_s": module.prior_time_s + (time.time() - t0), "history": module.history,
        "best_model": str(best_model), "config": cfg.flat(), **trained_on(trainer),
    }
    result = _jsonable({**result, **record})
    atomic_write_json(out_dir / "result.json", result)
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
    if cond.consolidation in OPERATORS:
        init_operator(model, cfg, cond.consolidation, seed)
    else:
        init_consolidator(model, cfg, seed)
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
            with torch.autocast(device.type, dtype=half or torch.bfloat16,
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
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.lower().startswith("model name")), "")
    except OSError:
        pass
    return f"{device.type} ({model or platform.processor() or 'unknown model'})"


def trained_on(trainer: L.Trainer) -> dict[str, str]:
    """Where and how a trainer actually trained: `device` (its root device, named) and
    `precision` (Lightning's precision plugin: `bf16-mixed`, `32-true`, ...)."""
    return {"device": device_name(trainer.strategy.root_device),
            "precision": str(trainer.precision)}


def _best_index(history: list[dict], cond: Condition) -> int:
    key = f"val/{cond.select}"
    vals = [h.get(key, float("-inf")) for h in history]
    return max(range(len(vals)), key=lambda i: vals[i])


def checkpoint_epoch(path: str | Path) -> int | None:
    """The epoch stored in a Lightning checkpoint, read weights-only and memory-mapped, so its
    tensors are not read (cheap even for a paper-size checkpoint); None if unreadable."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(ckpt["epoch"])
    except Exception:
        return None


def _best_epoch(ckpt: ModelCheckpoint | None) -> int | None:
    if ckpt is None or not ckpt.best_model_path:
        return None
    return int(torch.load(ckpt.best_model_path, map_location="cpu", weights_only=True)["epoch"])


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
