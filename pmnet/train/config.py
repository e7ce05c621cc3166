"""`TrainConfig`: every training setting, checked when made, built from a named preset of the
one registry (`pmnet.config.PRESETS`: `TrainConfig.from_name`), and the CLIs' `--set
KEY=VALUE` overrides (`parse_overrides`).

The paper's Table "Model, optimization, and hardware settings" is the `paper` preset; how the
other presets depart from it is in each preset's `notes` (printed by `pmnet info`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import torch

from pmnet import task
from pmnet.conditions import CONDITIONS, PAPER_SEEDS, get_condition, seed_problem
from pmnet.config import (  # noqa: F401 - CPU_TEST_SEED, LADDER_TEST_SEEDS: re-exported
    ACCELERATORS,
    CPU_TEST_SEED,
    LADDER_TEST_SEEDS,
    PRESETS,
    ModelConfig,
)
from pmnet.runner import LTM_GRAPHS

#: TrainConfig.lr_schedule (Phase 2) and phase0_lr_schedule: the rate after warmup
LR_SCHEDULES = ("cosine", "constant")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed")
#: The steps TrainConfig.compile can name: each phase's training step, and the evaluation
#: passes (validation and test) of every phase
COMPILE_STEPS = ("phase0", "phase1", "phase2", "eval")


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
    # seed of the fixed test stream (the paper preset keeps `task.TEST_SEED`; a preset whose
    # recipe was chosen after looking at that stream takes a fresh one: docs/choices.md)
    test_seed: int = task.TEST_SEED
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
    # Phase 0's rate (0: phase1_lr) and its shape after warmup (LR_SCHEDULES): "cosine" decays
    # it to zero over phase0_steps; "constant" keeps it (the recipe that leaves the copy
    # task's ln-26 plateau: docs/choices.md, "The Phase-0 recipe")
    phase0_lr: float = 0.0
    phase0_lr_schedule: str = "cosine"
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
    # Phase 2: the rule families of the training episodes (both in the paper). With one family
    # the checkpoint is selected, and early stopping watches, that family's validation recall
    # (`select_metric`); the validation and test streams keep both families, so the other
    # family's recall is still read (docs/choices.md, "Phase 2 on one rule family")
    phase2_families: tuple[str, ...] = task.FAMILIES
    # Phase 2: the learning rate after warmup: "cosine" (decay to zero at the last planned
    # step, every phase of the paper's recipe) or "constant" (the rate stays at `lr` until
    # early stopping or max_epochs end the run: the long recipe of the decisive test)
    lr_schedule: str = "cosine"
    # the watchdog (issue 62, `pmnet.train.watchdog`): every phase stops with
    # NotLearningError once `watchdog_share` of its planned steps is spent and a 50-step
    # window of its training loss is not below its line (chance; Phase 2: its own start)
    # minus `watchdog_margin` nats. It decides whether a run stops, not what it computes:
    # out of the checkpoint file and every config hash, as `threads` (WATCHDOG_FIELDS).
    # Why 0.15 and 0.05 (measured): docs/choices.md, "The watchdog"
    watchdog: bool = True
    watchdog_share: float = 0.15
    watchdog_margin: float = 0.05
    notes: tuple[str, ...] = field(default=(), compare=False)  # how a preset departs

    def __post_init__(self):
        for name in ("lr", "phase1_lr", "grad_clip", "weight_decay", "phase1_aux_demo_loss",
                     "consolidator_init_std", "consolidator_lr", "initial_ltm_loss",
                     "phase0_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"TrainConfig.{name} must be a number, got {v!r}")
        for name in ("seeds", "conditions", "betas", "notes", "phase1_seeds"):
            if not isinstance(getattr(self, name), (tuple, list)):
                raise ValueError(f"TrainConfig.{name} must be a list, got "
                                 f"{getattr(self, name)!r}")
        if any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers, got {self.betas!r}")
        for name in ("warmup_steps", "phase0_steps", "threads", "phase1_seed", "test_seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative integer, got {v!r}")
        for name in ("batch_size", "episodes_per_epoch", "max_epochs", "patience",
                     "val_episodes", "test_episodes", "eval_batch_size", "phase0_copy_len",
                     "phase1_max_epochs", "phase1_episodes_per_epoch", "phase1_patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("lr", "grad_clip"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)!r}")
        # phase1_lr may be 0 (Phases 0 and 1 then update nothing): the watchdog's own check
        for name in ("phase1_lr", "weight_decay", "phase1_aux_demo_loss",
                     "consolidator_init_std", "consolidator_lr",
                     "initial_ltm_loss"):  # numbers, checked above
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
        if not isinstance(self.watchdog, bool):
            raise ValueError(f"TrainConfig.watchdog must be true or false, got "
                             f"{self.watchdog!r}")
        for name, v in (("watchdog_share", self.watchdog_share),
                        ("watchdog_margin", self.watchdog_margin)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"TrainConfig.{name} must be a number, got {v!r}")
        if not 0 < self.watchdog_share <= 1:
            raise ValueError(f"TrainConfig.watchdog_share must be in (0, 1] (a share of the "
                             f"phase's planned steps), got {self.watchdog_share!r}")
        if self.watchdog_margin < 0:
            raise ValueError(f"TrainConfig.watchdog_margin must be >= 0 (nats), got "
                             f"{self.watchdog_margin!r}")
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
        if self.test_seed == task.VAL_SEED:
            raise ValueError(f"TrainConfig.test_seed {self.test_seed} is the validation "
                             "stream's seed (task.VAL_SEED): the test stream must differ")
        for what, value in [("phase1_seed", self.phase1_seed), ("test_seed", self.test_seed),
                            *(("seeds", s) for s in self.seeds),
                            *(("phase1_seeds", k) for k in self.phase1_seeds)]:
            problem = seed_problem(value, f"TrainConfig.{what}")
            if problem:
                raise ValueError(problem)
        if not self.conditions:
            raise ValueError("TrainConfig.conditions is empty")
        for c in self.conditions:
            get_condition(c)
        fams = self.phase2_families
        if isinstance(fams, str):  # one family given alone (a grid variant's scalar value)
            fams = (fams,)
        if (not isinstance(fams, (tuple, list)) or not fams or len(set(fams)) != len(fams)
                or any(f not in task.FAMILIES for f in fams)):
            raise ValueError(f"TrainConfig.phase2_families must list distinct families of "
                             f"{task.FAMILIES}, got {fams!r}")
        object.__setattr__(self, "phase2_families",
                           tuple(f for f in task.FAMILIES if f in fams))
        if self.phase0_lr < 0:
            raise ValueError(f"TrainConfig.phase0_lr must be >= 0 (0: phase1_lr), got "
                             f"{self.phase0_lr!r}")
        if self.phase0_lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.phase0_lr_schedule must be one of {LR_SCHEDULES}, "
                             f"got {self.phase0_lr_schedule!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.lr_schedule must be one of {LR_SCHEDULES}, got "
                             f"{self.lr_schedule!r}")
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

    def select_metric(self, select: str) -> str:
        """The validation metric that selects a Phase-2 checkpoint and that early stopping
        watches: the condition's `select`, or with one training family that family's
        (`updated_ltm` -> `updated_ltm_add10`)."""
        if len(self.phase2_families) == len(task.FAMILIES):
            return select
        return f"{select}_{self.phase2_families[0]}"

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

    @property
    def needs_gpu(self) -> bool:
        """Whether its preset is built for a GPU (`pmnet.config.Preset.needs_gpu`: the pipeline
        refuses to train it on CPUs unless asked); False for a preset the registry no longer
        holds (a config read back from an old file)."""
        preset = PRESETS.get(self.preset)
        return preset is not None and preset.needs_gpu

    @classmethod
    def from_name(cls, name: str, **overrides) -> TrainConfig:
        """The preset `name` of `pmnet.config.PRESETS` (its model and its training settings),
        with `overrides` (TrainConfig fields; `model.FIELD` for a field of its model)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: "
                             f"{', '.join(sorted(PRESETS))}")
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
        preset = PRESETS[name]
        cfg = cls(preset=name, model=preset.model, **preset.train)
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
LIST_FIELDS = ("betas", "seeds", "conditions", "notes", "compile", "phase1_seeds",
               "phase2_families")


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


#: Test streams whose figures earlier `cpu` recipes were read against: `task.TEST_SEED` (every
#: run before issue 21), 3,000,017 (the issue-21 preset with a 20-epoch Phase 1 and the
#: issue-23 baselines), 4,000,037 (the issue-21 search's scratch stream, never read),
#: 5,000,011 (the issue-21 preset with a 40-epoch Phase 1 and every block writing all dims),
#: 7,000,003 (the scratch stream of the session-6 Phase-2 rate check, never read).
RETIRED_TEST_SEEDS = (task.TEST_SEED, 3_000_017, 4_000_037, 5_000_011, 7_000_003)
