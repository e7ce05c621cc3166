"""Typed model configuration, and the one registry of named presets (`PRESETS`).

A preset (`Preset`) is one entry that gives a named scale whole: its model (`ModelConfig`), its
training settings (the `pmnet.train.TrainConfig` fields it sets) and what the pipeline needs to
know of it (`needs_gpu`, `default_on`). `ModelConfig.from_name(name)` and
`pmnet.train.TrainConfig.from_name(name)` are lookups into it; no other module lists presets.
`paper` is the paper's exact sizes (Appendix "Hyperparameters and Architecture", Table "Model,
optimization, and hardware settings"); `debug` is the tiny model every test uses; `cpu` is a
small model for real runs on a 2-core machine; `small` and `medium` are the rungs of the scale
ladder between `cpu` and `paper` (issue 52). The module imports nothing heavy (no torch), so the
pipeline's command line and the Makefile's help read the registry cheaply.

Every field is validated in `__post_init__`; a bad value raises `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pmnet.conditions import PAPER_SEEDS

#: Where a phase trains (Lightning's accelerator names): a caller that knows which device it
#: was given says so (a Ray trial: "gpu" when Ray gave it one); "auto" is Lightning's guess.
#: (`pmnet.train` re-exports it; a preset's `default_on` is one of them.)
ACCELERATORS = ("cpu", "gpu")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    # backbone ---------------------------------------------------------------------------
    vocab_size: int = 256  # byte level, embeddings tied with the output head
    n_layer: int = 12
    hidden: int = 384
    ffn: int = 1024  # SwiGLU intermediate size
    n_head: int = 12
    n_kv_head: int = 12
    head_dim: int = 64
    window: int = 128  # causal sliding-window attention
    attn_dropout: float = 0.1
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    # memory -----------------------------------------------------------------------------
    write_period: int = 3  # a write module at every layer whose index is divisible by this
    branch: int = 4  # child slots per group; block b has branch**b groups
    phase_dim: int = 32  # d_m in the paper
    read_heads: int = 4
    consolidator_hidden: int = 64  # d_c in the paper
    # gain on the write modules' phase scores before their softmax (Eq. 2): the sharpness of the
    # write weights p_j, whose argmax is the route (1 in the paper; a cpu-preset candidate)
    route_gain: float = 1.0
    # phase dims each block writes into, one entry per block; None = all `phase_dim` in every
    # block (the paper). Fewer in the top blocks (the root is the group every token visits)
    # leave them a store too small to hold the task, so what is remembered must be routed (a
    # cpu-preset choice, docs/choices.md, "Top blocks too small to hold the task"); a limited
    # block's write weights still carry its router's gradient
    write_dims: tuple[int, ...] | None = None
    # limits -----------------------------------------------------------------------------
    max_chunk: int = 512  # longest chunk a single forward call accepts
    use_memory: bool = True  # False builds the same Transformer with no memory (benchmarks)
    init_std: float = 0.02

    # derived ------------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        """Number of memory hierarchy blocks (one per write layer)."""
        return math.ceil(self.n_layer / self.write_period)

    @property
    def write_layers(self) -> tuple[int, ...]:
        return tuple(range(0, self.n_layer, self.write_period))

    def n_groups(self, block: int) -> int:
        return self.branch**block

    @property
    def total_groups(self) -> int:
        return sum(self.n_groups(b) for b in range(self.n_blocks))

    @property
    def total_slots(self) -> int:
        return self.total_groups * self.branch

    def __post_init__(self) -> None:
        positive_ints = (
            "vocab_size", "n_layer", "hidden", "ffn", "n_head", "n_kv_head", "head_dim",
            "window", "write_period", "branch", "phase_dim", "read_heads",
            "consolidator_hidden", "max_chunk",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"ModelConfig.n_head ({self.n_head}) must be a multiple of "
                f"ModelConfig.n_kv_head ({self.n_kv_head})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.branch < 2:
            raise ValueError(f"ModelConfig.branch must be at least 2, got {self.branch}")
        if self.write_period > self.n_layer:
            raise ValueError(
                f"ModelConfig.write_period ({self.write_period}) exceeds n_layer ({self.n_layer})"
            )
        for name in ("attn_dropout", "rms_eps", "rope_theta", "init_std", "route_gain"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"ModelConfig.{name} must be a number, got {v!r}")
            if name != "attn_dropout" and not v > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {v}")
        if isinstance(self.write_dims, list):  # from JSON (a checkpoint's config)
            object.__setattr__(self, "write_dims", tuple(self.write_dims))
        wd = self.write_dims
        if wd is not None and (
                not isinstance(wd, tuple) or len(wd) != self.n_blocks
                or any(isinstance(r, bool) or not isinstance(r, int)
                       or not 1 <= r <= self.phase_dim for r in wd)):
            raise ValueError(f"ModelConfig.write_dims must be None or {self.n_blocks} integers "
                             f"(one per block) in [1, phase_dim={self.phase_dim}], got {wd!r}")
        if not isinstance(self.use_memory, bool):
            raise ValueError(f"ModelConfig.use_memory must be true or false, got "
                             f"{self.use_memory!r}")
        if not 0.0 <= float(self.attn_dropout) < 1.0:
            raise ValueError(f"ModelConfig.attn_dropout must be in [0, 1), got {self.attn_dropout}")

    # presets ------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        """The model of preset `name` (`PRESETS[name].model`), with `overrides` replaced."""
        if name not in PRESETS:
            raise ValueError(
                f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        cfg = PRESETS[name].model
        return dataclasses.replace(cfg, **overrides) if overrides else cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def differences(self, other: ModelConfig) -> dict:
        """{field: (self's value, other's value)} where the two differ (the name aside)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {k: (v, theirs[k]) for k, v in mine.items() if k != "name" and theirs[k] != v}

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**d)



# -- the one preset registry ---------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A named scale, whole: one entry of `PRESETS`.

    `model`: its ModelConfig (named after the preset: model files record the name).
    `train`: the `pmnet.train.TrainConfig` fields it sets besides `preset` and `model`
    (`TrainConfig.from_name(name)` is `TrainConfig(preset=name, model=model, **train)`, which
    checks every value); its `notes` say how the preset departs from the paper.
    `needs_gpu`: built for a GPU: the pipeline refuses to train it on CPUs unless asked
    (`--allow-cpu-paper`, with an estimate of how long it would take; `pipelines.plan`).
    `default_on`: the accelerator ("gpu" / "cpu", ACCELERATORS) on whose nodes the pipeline
    takes this preset when none is given (`default_preset`); at most one preset each.
    """

    name: str
    model: ModelConfig
    train: Mapping[str, Any] = field(default_factory=dict)
    needs_gpu: bool = False
    default_on: str | None = None

    def __post_init__(self) -> None:
        if self.model.name != self.name:
            raise ValueError(f"preset {self.name!r}: its model must be named after it, got "
                             f"ModelConfig.name {self.model.name!r}")
        taken = sorted({"preset", "model"} & set(self.train))
        if taken:
            raise ValueError(f"preset {self.name!r}: train sets {', '.join(taken)}, which the "
                             "preset itself gives")
        if self.default_on is not None and self.default_on not in ACCELERATORS:
            raise ValueError(f"preset {self.name!r}: default_on must be None or one of "
                             f"{ACCELERATORS}, got {self.default_on!r}")
        object.__setattr__(self, "train", types.MappingProxyType(dict(self.train)))

    @property
    def notes(self) -> tuple[str, ...]:
        """How the preset departs from the paper (its TrainConfig's `notes`)."""
        return tuple(self.train.get("notes", ()))


def default_preset(accelerator: str) -> str:
    """The name of the preset the pipeline takes on nodes of `accelerator` ("gpu": a node of
    the cluster has a GPU; "cpu": none has) when no preset is given: the one whose
    `default_on` is it."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    names = [p.name for p in PRESETS.values() if p.default_on == accelerator]
    if len(names) != 1:
        raise ValueError(f"{len(names)} presets are the default on {accelerator!r} nodes "
                         f"({', '.join(names) or 'none'}); exactly one must be")
    return names[0]


#: The `cpu` preset's test stream: a seed no earlier run of this project used (its recipe
#: and model were chosen after earlier runs had read the streams of
#: `pmnet.train.config.RETIRED_TEST_SEEDS`).
CPU_TEST_SEED = 6_000_029

# The paper's model: 29.95M parameters, 12 layers, writes at layers 0, 3, 6, 9; RoPE base 1e6
# as in the public PMNet reference configuration (the dataclass default stays 1e4).
# "Backbone initialization: PMNet copy-task checkpoint, followed by ... Phase 1": that
# checkpoint cannot be downloaded, so Phase 0 trains our own copy warm start first: 4,000
# steps of batch 256 with the recipe that learned the copy on a CPU (4-byte payloads, lr 1e-3
# constant after the warmup: held-out copy accuracy 100% at `medium`, the paper's memory
# geometry; 16-byte payloads at lr 5e-4 with a cosine stayed at chance on an H200), judged
# by held-out copy accuracy (docs/choices.md, "The Phase-0 recipe"). Compiled training and
# evaluation (on a GPU a step of thousands of small kernels is launch-bound: docs/results.md,
# "Speed").
_PAPER = Preset(
    "paper", ModelConfig(name="paper", rope_theta=1_000_000.0),
    train=dict(phase0_steps=4_000, phase0_copy_len=4, phase0_lr=1e-3,
               phase0_lr_schedule="constant", notes=(
                   "Phase 0 (the copy warm start the paper downloads; ours trained first): "
                   "4-byte payloads at lr 1e-3 constant, the recipe that learned the copy "
                   "whole at `medium` on a CPU; the paper's checkpoint recipe is not stated, "
                   "and 16-byte payloads at lr 5e-4 with a cosine did not learn on an H200 "
                   "(docs/log/phase0-recipe.md)",)),
    needs_gpu=True, default_on="gpu",
)

# Tiny model and budgets used by every test: seconds on a CPU.
_DEBUG = Preset(
    "debug", ModelConfig(
        name="debug", n_layer=2, hidden=32, ffn=64, n_head=2, n_kv_head=2, head_dim=16,
        window=16, attn_dropout=0.0, write_period=1, branch=4, phase_dim=8, read_heads=2,
        consolidator_hidden=16, max_chunk=128,
    ),
    train=dict(
        lr=3e-3, warmup_steps=2,
        batch_size=16, episodes_per_epoch=64, max_epochs=2, patience=2, val_episodes=48,
        test_episodes=48, eval_batch_size=48, phase0_steps=2, phase0_copy_len=8,
        phase1_lr=3e-3, phase1_max_epochs=2, phase1_episodes_per_epoch=64,
        phase1_patience=2, phase1_curriculum=True, seeds=(42, 43), compile=(),
        notes=("tiny model and budgets for tests (eager: compiling would cost more than it "
               "saves)",),
    ),
)

# A small-scale reproduction on a 2-core CPU with the Phase-1 checkpoint as the unit of
# analysis (issue 21): a small model (see docs/ for how it was sized), three Phase-1
# checkpoints (~40 min for the three, trained at once) and, from each, the two
# Consolidator-only arms x two seeds (3.3-3.8 min per trial, two at a time; measured in
# docs/results.md). How each departure was chosen (validation stream only): docs/results.md.
_CPU = Preset(
    "cpu", ModelConfig(
        name="cpu", n_layer=4, hidden=64, ffn=192, n_head=4, n_kv_head=4, head_dim=16,
        window=64, attn_dropout=0.0, write_period=1, branch=4, phase_dim=8, read_heads=4,
        consolidator_hidden=32, route_gain=4.0, write_dims=(1, 1, 8, 8), max_chunk=256,
    ),
    train=dict(
        lr=1e-3, warmup_steps=50,
        batch_size=64, episodes_per_epoch=12_800, max_epochs=5, patience=5,
        val_episodes=1000, test_episodes=2000, test_seed=CPU_TEST_SEED, eval_batch_size=500,
        threads=0, phase1_lr=1e-3, phase1_max_epochs=40, phase1_episodes_per_epoch=12_800,
        phase1_patience=20, phase1_curriculum=True, phase1_aux_demo_loss=1.0,
        consolidator_init_std=0.18, consolidator_lr=3e-3, consolidator_weight_decay=0.0,
        # compiled: the Phase-2 step only (on 2 cores the compiles of Phase 1 and of the
        # evaluation passes cost more than they save: docs/choices.md, "Speed")
        seeds=PAPER_SEEDS[:2], compile=("phase2",), phase1_seeds=(0, 1, 2),
        conditions=("consolidator_only", "consolidator_only_routing_off"),
        notes=(
            "small model (hidden 64, 4 layers, a write every layer, phase dim 8; 0.26M): "
            "phase dim 8 so that the routed blocks hold what the root group cannot (issue 21)",
            "route gain 4: the write scores are multiplied by 4 before the phase softmax "
            "(paper: 1), so that routes are decided rather than near-ties (issue 21)",
            "blocks 0 and 1 write 1 of their 8 phase dims (paper: all), so that what is "
            "remembered must be stored in the routed blocks below them (issue 21)",
            "Phase 1 curriculum: demonstrations per batch drawn from 1..8 (evaluation at 8)",
            "Phase 1 auxiliary loss (weight 1) on the answers of demonstrations 2..k",
            "Phase 1: 8,000 steps of batch 64 (40 epochs x 12.8K episodes), lr 1e-3: at 20 "
            "epochs random routes cost 3-7 pp on two of three checkpoints (issue 21)",
            "three Phase-1 checkpoints (Phase-1 seeds 0, 1, 2; the paper: one), each a "
            "random factor of the analysis",
            "Phase 2: 1,000 steps of batch 64 (5 epochs x 12.8K episodes), no early stop",
            "Consolidator: W_g/W_u ~ N(0, 0.18) drawn from the Phase-2 seed (W_d = 0 keeps the "
            "identity start), lr 3e-3, no weight decay (paper: N(0, 0.02), lr 5e-4, decay 0.1)",
            "default grid: 3 Phase-1 checkpoints x the two Consolidator-only arms x seeds "
            "42, 43 (GRID=paper runs all six conditions)",
            f"test stream of 2,000 episodes (paper: 1,000) drawn from seed {CPU_TEST_SEED:,} "
            "(paper: 2,000,003), used by no earlier run",
        ),
    ),
    default_on="cpu",
)


def _rung(name: str, test_seed: int, model_notes: tuple[str, ...],
          phase1_note: str | None = None, *, train: Mapping[str, Any] | None = None,
          **model: Any) -> Preset:
    """A rung of the scale ladder (issue 52): the `cpu` model with the fields `model`
    changed, and the `cpu` preset's recipe (Phase 1, Phase 2, grid, Phase-1 checkpoints) with
    `train` changed and its own test stream `test_seed`; `model_notes` replace the `cpu`
    model's notes (the first three), the rest are the `cpu` recipe's, with `phase1_note` in
    place of its Phase-1 budget's where `train` changes that budget."""
    cpu = _CPU.train
    recipe = tuple((phase1_note or n) if n.startswith("Phase 1: ") else n
                   for n in cpu["notes"][3:] if not n.startswith("test stream"))
    return Preset(
        name, dataclasses.replace(_CPU.model, name=name, **model),
        train={**cpu, "test_seed": test_seed, **(train or {}),
               "notes": (*model_notes, *recipe,
                         f"test stream of 2,000 episodes (paper: 1,000) drawn from seed "
                         f"{test_seed:,} (paper: 2,000,003), used by no earlier run")},
    )


# The scale ladder between `cpu` (0.26M) and `paper` (29.95M), issue 52: where, if anywhere,
# does the Consolidator start to learn the update? Each rung has a fresh test stream, used by
# no earlier run: the rungs' shapes were set after issue 39's `cpu` figures on CPU_TEST_SEED
# had been read (docs/choices.md, "The scale ladder").
LADDER: tuple[Preset, ...] = (
    # `small` (0.94M): the `cpu` model twice as wide (hidden 128, SwiGLU 384, 4 heads of 32),
    # everything else as `cpu` (phase dim 8, route gain 4, write dims 1, 1, 8, 8), and a 1.5x
    # Phase-1 schedule, chosen on the validation curve of one run of this shape and recipe at
    # Phase-1 seed 0 (issue 52's W128: AFFINE10 still rising at 8K steps, where the `cpu`
    # schedule ends)
    _rung("small", 8_000_009, (
        "small model (hidden 128, SwiGLU 384, 4 heads of 32, 4 layers, a write every layer, "
        "phase dim 8; 0.94M): the `cpu` model twice as wide, the first rung of the scale "
        "ladder (issue 52)",
        "route gain 4 (paper: 1) and blocks 0 and 1 writing 1 of their 8 phase dims (paper: "
        "all), as `cpu` (issue 21)",
    ), phase1_note=(
        "Phase 1: 12,000 steps of batch 64 (60 epochs x 12.8K episodes, cosine to 0 at the "
        "end, no early stop), lr 1e-3: at the `cpu` preset's 8,000 steps this shape's "
        "validation AFFINE10 recall was still rising from its output-set baseline (issue 52)"),
        train=dict(phase1_max_epochs=60, phase1_patience=60),
        hidden=128, ffn=384, n_head=4, n_kv_head=4, head_dim=32),
    # `medium` (7.16M): toward the paper's shape: hidden 256, 8 layers with a write every 2
    # (4 blocks, branch 4), the paper's phase dim 32 and Consolidator hidden 64 (12,352
    # parameters, the paper's), 8 heads of 32, SwiGLU 688 (the paper's 8/3 of hidden); the
    # paper's route gain 1 and every block writing all its dims (docs/choices.md, "The
    # scale ladder"); window, dropout and chunk as `cpu`
    _rung("medium", 9_000_011, (
        "medium model (hidden 256, SwiGLU 688, 8 heads of 32, 8 layers, a write every 2 "
        "layers: 4 blocks of branch 4; 7.16M; paper: hidden 384, 12 layers, a write every 3)",
        "the paper's phase dim 32 and Consolidator hidden 64 (12,352 Consolidator parameters, "
        "the paper's)",
        "the paper's route gain 1 and every block writing all 32 phase dims, not the `cpu` "
        "preset's gain 4 and write dims 1, 1, 8, 8: issue 21 found the gain slowed Phase 1 "
        "and the write limit cost 9-16 pp of Phase-1 STM and most of what Phase 2 learned "
        "(docs/results.md, \"Routes (issue 21)\"); a rung toward the paper keeps the paper's",
        "window 64, no attention dropout (paper: 128, 0.1), as `cpu`",
    ), n_layer=8, hidden=256, ffn=688, n_head=8, n_kv_head=8, head_dim=32, write_period=2,
        phase_dim=32, consolidator_hidden=64, route_gain=1.0, write_dims=None),
)
#: The test streams of the ladder's rungs, by name (from their entries above)
LADDER_TEST_SEEDS: dict[str, int] = {p.name: p.train["test_seed"] for p in LADDER}

#: The one preset registry: a new preset is one entry here (its model, its training settings,
#: what the pipeline needs to know of it). Its order is the order `--help` lists them in.
PRESETS: dict[str, Preset] = {p.name: p for p in (_PAPER, _CPU, _DEBUG, *LADDER)}
