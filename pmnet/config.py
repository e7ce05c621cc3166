"""Typed model configuration with named presets.

`ModelConfig.from_name("paper")` gives the paper's exact sizes (Appendix "Hyperparameters and
Architecture", Table "Model, optimization, and hardware settings"); `debug` is the tiny model
every test uses; `cpu` is a small model for real runs on a 2-core machine; `small` and
`medium` are the rungs of the scale ladder between `cpu` and `paper` (issue 52).

Every field is validated in `__post_init__`; a bad value raises `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


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
        if name not in PRESETS:
            raise ValueError(
                f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        cfg = dataclasses.replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
        return cfg

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


PRESETS: dict[str, ModelConfig] = {
    # The paper's model: 29.95M parameters, 12 layers, writes at layers 0, 3, 6, 9; RoPE base
    # 1e6 as in the public PMNet reference configuration (the dataclass default stays 1e4).
    "paper": ModelConfig(name="paper", rope_theta=1_000_000.0),
    # Tiny model used by every test: seconds on a CPU.
    "debug": ModelConfig(
        name="debug", n_layer=2, hidden=32, ffn=64, n_head=2, n_kv_head=2, head_dim=16,
        window=16, attn_dropout=0.0, write_period=1, branch=4, phase_dim=8, read_heads=2,
        consolidator_hidden=16, max_chunk=128,
    ),
    # Small model for real runs on a 2-core CPU (see docs/ for how it was sized).
    "cpu": ModelConfig(
        name="cpu", n_layer=4, hidden=64, ffn=192, n_head=4, n_kv_head=4, head_dim=16,
        window=64, attn_dropout=0.0, write_period=1, branch=4, phase_dim=8, read_heads=4,
        consolidator_hidden=32, route_gain=4.0, write_dims=(1, 1, 8, 8), max_chunk=256,
    ),
}
# The scale ladder between `cpu` (0.26M) and `paper` (29.95M), issue 52: where, if anywhere,
# does the Consolidator start to learn the update? Each rung's training preset
# (`pmnet.train.config`) says in its notes how it departs from the paper.
PRESETS.update({
    # `small` (0.94M): the `cpu` model twice as wide (hidden 128, SwiGLU 384, 4 heads of 32),
    # everything else as `cpu` (phase dim 8, route gain 4, write dims 1, 1, 8, 8)
    "small": dataclasses.replace(PRESETS["cpu"], name="small", hidden=128, ffn=384, n_head=4,
                                 n_kv_head=4, head_dim=32),
    # `medium` (7.16M): toward the paper's shape: hidden 256, 8 layers with a write every 2
    # (4 blocks, branch 4), the paper's phase dim 32 and Consolidator hidden 64 (12,352
    # parameters, the paper's), 8 heads of 32, SwiGLU 688 (the paper's 8/3 of hidden); the
    # paper's route gain 1 and every block writing all its dims (docs/choices.md, "The
    # scale ladder"); window, dropout and chunk as `cpu`
    "medium": dataclasses.replace(PRESETS["cpu"], name="medium", n_layer=8, hidden=256,
                                  ffn=688, n_head=8, n_kv_head=8, head_dim=32, write_period=2,
                                  phase_dim=32, consolidator_hidden=64, route_gain=1.0,
                                  write_dims=None),
})
