"""PMNet with routed short-term memory (STM), long-term memory (LTM) and the Consolidator.

The whole model, top to bottom, in one file; the decoder's standard pieces it is built from
(RMSNorm, RoPE, sliding-window attention with flash-attn or SDPA, the SwiGLU MLP) are in
`pmnet.backbone`. Equation numbers refer to
`consolidator-paper.tex` ("Consolidator: Learning Persistent Routed Memory Across Context
Boundaries"); PMNet details the paper defers to its predecessor follow `pmnet-mechanics.md`.

Shapes: B batch, T tokens in the chunk, H hidden, K = branch (child slots per group),
P = phase_dim (d_m), G_b = K**b groups in block b, Hr read heads.

Memory lifecycle (Section 3.1), driven through an explicit `MemoryState`:

    state = model.init_state(B)                         # empty KV, STM, occupancy; zero LTM
    logits, state = model(tokens, state, ltm_routing=True)   # process a chunk: writes STM,
                                                        # reads M = (S + L) mod 2pi  (Eq. 3)
    state = model.consolidate(state, mode="learned")    # Eq. 8 (or mode="identity")
    state = state.clear_context()                       # drop KV + STM + occupancy, keep LTM

Besides the Consolidator (`learned`) and raw accumulation (`identity`), the boundary can use
an alternative consolidation operator (`ema`, `overwrite`, `linear`, `gru`; the paper's
Limitations name them as untested), defined in `pmnet.operators`. A Phase-1 checkpoint has
none: Phase 2 adds one to `model.operators` (`pmnet.operators.add_operator(model, name)`)
and then calls `consolidate(state, mode=name)`.

Every operation returns a new state; no tensor of a state is modified in place, so a
state can be branched (auxiliary trajectories) without leaking into the original.

Speed (issue 20): the maths is the paper's, written with few kernels, because a step of this
model is thousands of small ops. Three autograd Functions with hand-written backward passes
(`backbone.rms_norm`, `phase_softmax`, `scale_grad`), projections that share an input run as one
matmul (q/k/v, gate/up, the key/value maps of every read module of a block), RoPE tables
cached per model, and nothing in a forward pass waits for the device (no `.item()`).
`tests/test_model_fused.py` checks the whole model against the literal code it replaced
(`tests/oracle/model_235df21.py`), forward values and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from pmnet.backbone import MLP, Attention, RMSNorm, rope_tables, signed_sin
from pmnet.config import ModelConfig

TWO_PI = 2.0 * math.pi


def wrap(x: Tensor) -> Tensor:
    """Phase wrapping `x mod 2pi` into [0, 2pi)."""
    return torch.remainder(x, TWO_PI)


def phasor(x: Tensor) -> Tensor:
    """[sin x ; cos x] along the last dim: (..., P) -> (..., 2P)."""
    return torch.cat([torch.sin(x), torch.cos(x)], dim=-1)


def angle_diff(x: Tensor) -> Tensor:
    """The shortest-arc representative of the angle x: (x + pi) mod 2pi - pi, in [-pi, pi)."""
    return wrap(x + math.pi) - math.pi


# -----------------------------------------------------------------------------------------
# Fused operations: one autograd node each, backward written by hand (the backbone's
# `rms_norm` is in pmnet/backbone.py)
# -----------------------------------------------------------------------------------------


class _PhaseSoftmax(torch.autograd.Function):
    """p = softmax over `dim` of c * sum_m cos(q_m - k_m) with c = gain / sqrt(P) (the phase
    attention scores of the read and write modules; gain 1 everywhere in the paper); q
    broadcasts against k.

    Backward: with s the scores and g_s = softmax'(g_p), d s / d k_m = c sin(q_m - k_m)
    and d s / d q_m = -c sin(q_m - k_m), so g_k = sin(q - k) c g_s and g_q is
    -g_k summed back to q's shape. Saves q, k and p; q - k is recomputed."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, dim: int, gain: float = 1.0) -> Tensor:
        s = torch.cos(q - k).sum(-1) / math.sqrt(k.shape[-1])
        p = torch.softmax(s if gain == 1.0 else s * gain, dim=dim)  # gain 1: the paper's ops
        ctx.save_for_backward(q, k, p)
        ctx.dim, ctx.gain = dim, gain
        return p

    @staticmethod
    @once_differentiable
    def backward(ctx, g_p: Tensor):
        q, k, p = ctx.saved_tensors
        g_s = torch._softmax_backward_data(g_p, p, ctx.dim, p.dtype)
        if ctx.gain != 1.0:
            g_s = g_s * ctx.gain
        g_k = torch.sin(q - k) * (g_s / math.sqrt(k.shape[-1]))[..., None]
        g_q = -g_k.sum_to_size(q.shape) if ctx.needs_input_grad[0] else None
        return g_q, (g_k if ctx.needs_input_grad[1] else None), None, None


def phase_softmax(q: Tensor, k: Tensor, dim: int, gain: float = 1.0) -> Tensor:
    """softmax_dim( gain * sum_m cos(q_m - k_m) / sqrt(P) ): (..., P) against (..., P) -> (...)."""
    return _PhaseSoftmax.apply(q, k, dim, gain)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def scale_grad(x: Tensor, scale: Tensor) -> Tensor:
    """Straight-through gradient scaling: forward value is exactly `x`, gradient is `scale * g`."""
    return _ScaleGrad.apply(x, scale)


# -----------------------------------------------------------------------------------------
# Memory state
# -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryState:
    """Non-parametric state of a batch of memory episodes (one row per episode).

    kv[l]   : (k, v), each (B, n_kv_head, T_cache, head_dim), or None   -- KV cache, layer l
    stm[b]  : (B, G_b, K, P)  routed short-term memory of block b       -- S in the paper
    occ[b]  : (B, G_b) bool   groups written in the current segment    -- O in Eq. 8
    ltm[b]  : (B, G_b, K, P)  long-term memory of block b               -- L in the paper
    pos     : tokens seen since the KV cache was last cleared (RoPE positions restart at 0)
    routes  : diagnostics of the last chunk, n_blocks + 1 tensors (B, T): routes[b] is the
              group each token visited in block b; routes[b + 1] % K is the child chosen by
              block b's router (routes[n_blocks] holds the deepest block's choice)
    carry   : a baseline's carried state (`pmnet.baselines`: memory tokens (B, M, H) or a
              recurrent state (B, G)), None for PMNet's own lifecycle and before a baseline's
              first segment; like LTM it survives clear_context
    """

    kv: tuple
    stm: tuple[Tensor, ...]
    occ: tuple[Tensor, ...]
    ltm: tuple[Tensor, ...]
    pos: int = 0
    routes: tuple = ()
    carry: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.ltm[0].shape[0] if self.ltm else 0

    def clear_context(self) -> MemoryState:
        """Boundary reset: clear KV cache, STM and occupancy; keep LTM."""
        return replace(
            self,
            kv=tuple(None for _ in self.kv),
            stm=tuple(torch.zeros_like(s) for s in self.stm),
            occ=tuple(torch.zeros_like(o) for o in self.occ),
            pos=0,
            routes=(),
        )

    def clear_kv(self) -> MemoryState:
        """Clear only the KV cache (STM and LTM stay): the query sees memory, not tokens."""
        return replace(self, kv=tuple(None for _ in self.kv), pos=0)

    def fresh_ltm(self) -> MemoryState:
        """Replace LTM by the zero phase vector (the paper's fresh-LTM control)."""
        return replace(self, ltm=tuple(torch.zeros_like(x) for x in self.ltm))

    def detach(self) -> MemoryState:
        """Cut the autograd graph through every tensor (truncated BPTT)."""
        kv = tuple(None if c is None else (c[0].detach(), c[1].detach()) for c in self.kv)
        return replace(
            self,
            kv=kv,
            stm=tuple(s.detach() for s in self.stm),
            occ=self.occ,
            ltm=tuple(x.detach() for x in self.ltm),
            carry=None if self.carry is None else self.carry.detach(),
        )

    def detach_ltm(self) -> MemoryState:
        """Detach only LTM (the paper's `detach_long_term_between_sleeps`) and a baseline's
        carried state, the other path across a boundary."""
        return replace(self, ltm=tuple(x.detach() for x in self.ltm),
                       carry=None if self.carry is None else self.carry.detach())

    def with_ltm(self, ltm: tuple[Tensor, ...]) -> MemoryState:
        return replace(self, ltm=tuple(ltm))



# -----------------------------------------------------------------------------------------
# Memory modules
# -----------------------------------------------------------------------------------------


class MemoryWrite(nn.Module):
    """Routed soft write of one hierarchy block (Eq. 1-2, Eq. 9 for the routing state).

    Parameters: norm, W_q (H->P), W_k (2P->P) for slot keys, W_v (H->P, no bias),
    W_o (P->P, bias; init N(0, 0.02), zero bias).

    `dims` < P (`ModelConfig.write_dims`, not in the paper): the written value keeps its
    first `dims` phase dims and is zero in the rest, so the block stores at most K x dims
    phases per group; the scores p, and with them the router's gradient through
    delta = p v, are unchanged.
    """

    def __init__(self, cfg: ModelConfig, dims: int | None = None):
        super().__init__()
        P = cfg.phase_dim
        self.P = P
        dims = P if dims is None else dims
        # (P,) 1 for the written dims, 0 for the rest; a constant, not in the state dict
        self.register_buffer("dims_mask", (torch.arange(P) < dims).float() if dims < P
                             else None, persistent=False)
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.w_q = nn.Linear(cfg.hidden, P)
        self.w_k = nn.Linear(2 * P, P)
        self.w_v = nn.Linear(cfg.hidden, P, bias=False)
        self.w_o = nn.Linear(P, P)
        self.gain = cfg.route_gain  # 1 in the paper

    def forward(self, h: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """h: (B, T, H) hidden; a: (B, T, K, P) routing state of the visited group's slots.

        Returns delta (B, T, K, P) = p_j * pi tanh(W_o W_v RMSNorm(h))  (Eq. 2) and
        scores p (B, T, K).
        """
        x = self.norm(h)
        q = math.pi * torch.tanh(self.w_q(x).float())  # (B, T, P)
        v = math.pi * torch.tanh(self.w_o(self.w_v(x)).float())  # (B, T, P)
        if self.dims_mask is not None:
            v = v * self.dims_mask  # only the first `dims` phase dims are written
        k = math.pi * torch.tanh(self.w_k(phasor(a)).float())  # (B, T, K, P)
        p = phase_softmax(q[:, :, None, :], k, dim=-1, gain=self.gain)  # (B, T, K)
        delta = p[..., None] * v[:, :, None, :]  # (B, T, K, P)
        return delta, p


class MemoryRead(nn.Module):
    """Read of the visited group's K slots (every layer), Hr phase-attention heads.

    Keys/values from [sin; cos] of (memory state + static slot embedding); the memory state
    includes M = (S + L) mod 2pi of every block visited so far (Eq. 3). The features are the
    same for every layer of a block, so `PMNet.forward` maps them for all the block's read
    modules in one matmul (`read_keys_values`) and hands each module its keys and values.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        P, Hr = cfg.phase_dim, cfg.read_heads
        self.P, self.Hr = P, Hr
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.w_q = nn.Linear(cfg.hidden, Hr * P)
        self.w_kv = nn.Linear(2 * P, 2 * Hr * P)
        self.w_out = nn.Linear(Hr * P, cfg.hidden)

    def forward(self, h: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """h: (B, T, H); k, v: (B, T, K, Hr, P) this module's keys (pi tanh applied) and
        values of the visited group's slots (`read_keys_values`) -> (B, T, H)."""
        B, T, K, Hr, P = k.shape
        q = math.pi * torch.tanh(self.w_q(self.norm(h)).float()).view(B, T, 1, Hr, P)
        p = phase_softmax(q, k, dim=2)  # (B, T, K, Hr)
        out = (p[..., None] * v).sum(2)  # (B, T, Hr, P)
        return self.w_out(out.reshape(B, T, Hr * P).to(h.dtype))


def read_keys_values(reads: list[MemoryRead], feat: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Keys and values of several read modules from the same features, in one matmul.

    feat: (B, T, K, 2P) = [sin; cos] of (memory state + slot embeddings) of a block. Each
    module's `w_kv` maps it to (2, Hr, P): keys pi * tanh(.) and values. Returns one
    (k, v) pair of (B, T, K, Hr, P) views per module, in order."""
    B, T, K, P2 = feat.shape
    n, Hr = len(reads), reads[0].Hr
    w = torch.cat([r.w_kv.weight for r in reads]) if n > 1 else reads[0].w_kv.weight
    b = torch.cat([r.w_kv.bias for r in reads]) if n > 1 else reads[0].w_kv.bias
    keys, values = F.linear(feat, w, b).float().view(B, T, K, n, 2, Hr, P2 // 2).unbind(4)
    keys = math.pi * torch.tanh(keys)  # (B, T, K, n, Hr, P)
    return list(zip(keys.unbind(3), values.unbind(3)))


class Consolidator(nn.Module):
    """Shared slot-local gated phase transform C_psi (Eq. 6-7).

    z = [cos S ; sin S]; r = W_d (SiLU(W_g z) * W_u z) + b_d; (c, s) = z (x) r as P complex
    numbers; C(S) = atan2(s, c). W_d = 0 and b_d = (1..1 ; 0..0) make C the identity at init.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        P, C = cfg.phase_dim, cfg.consolidator_hidden
        self.P = P
        self.w_g = nn.Linear(2 * P, C, bias=False)
        self.w_u = nn.Linear(2 * P, C, bias=False)
        self.w_d = nn.Linear(C, 2 * P, bias=True)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        nn.init.zeros_(self.w_d.weight)
        self.w_d.bias.copy_(torch.cat([torch.ones(self.P), torch.zeros(self.P)]))

    @torch.no_grad()
    def reinit(self, std: float, generator: torch.Generator) -> None:
        """Fresh W_g, W_u ~ N(0, std) from `generator`, then the identity start (W_d = 0,
        unit-phasor b_d): C stays exactly the identity whatever `std` is."""
        if not std > 0:
            raise ValueError(f"Consolidator init std must be > 0, got {std!r}")
        for w in (self.w_g.weight, self.w_u.weight):
            w.copy_(torch.randn(w.shape, generator=generator) * std)
        self.reset_identity()

    def forward(self, S: Tensor) -> Tensor:
        """S: (..., P) phases -> C(S): (..., P) phases in [0, 2pi)."""
        with torch.autocast(device_type=S.device.type, enabled=False):
            S = S.float()
            cos_s, sin_s = torch.cos(S), torch.sin(S)
            z = torch.cat([cos_s, sin_s], dim=-1)  # (..., 2P)              Eq. 6
            r = self.w_d(F.silu(self.w_g(z)) * self.w_u(z))  # (..., 2P)    Eq. 7
            r_c, r_s = r[..., : self.P], r[..., self.P :]
            c = cos_s * r_c - sin_s * r_s  # complex product, real part
            s = cos_s * r_s + sin_s * r_c  # imaginary part
            return wrap(torch.atan2(s, c))


# -----------------------------------------------------------------------------------------
# Decoder layer and model
# -----------------------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.block = index // cfg.write_period
        self.is_write = cfg.use_memory and index % cfg.write_period == 0
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.attn = Attention(cfg)
        dims = cfg.write_dims[self.block] if cfg.write_dims and self.is_write else None
        self.write = MemoryWrite(cfg, dims) if self.is_write else None
        self.read = MemoryRead(cfg) if cfg.use_memory else None
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MLP(cfg)


#: The paper's consolidation modes (Eq. 8 with C_psi, and identity accumulation); any other
#: `mode` of `PMNet.consolidate` is an operator the model holds (`pmnet.operators`).
PAPER_MODES = ("learned", "identity")
LogitsMode = Literal["all", "last", "none", "hidden"]
TRAINABLE_SUBSETS = ("entire_model", "all_but_consolidator", "consolidator_only",
                     "memory_consolidator")
#: The trainable subset of the operator conditions: the parameters of the model's operator(s).
OPERATOR_SUBSET = "operator_only"
BASELINE_SUBSET = "baseline_only"  # a baseline's own modules (`pmnet.baselines`)


class RouteProbe(Protocol):
    """An intervention on the routed writes of a forward pass, for route diagnostics
    (`pmnet.diagnose`); set as `model.probe`, None (the default) in training and evaluation.

    routing_uses_ltm(b): whether block b's routing state adds L (Eq. 9) when ltm_routing is on;
    routing_u_uses_ltm (optional attribute, True when absent): whether the latent state u that
        carries the visited blocks' memory down to deeper routers (Eq. 1) includes L. False
        is the "strict" routing-off intervention: no router sees L, directly or through u
        (reads still see M = S + L, and through the hidden state so do later queries);
    on_write(b, delta, p): the delta block b writes (B, T, K, P), given its scores p (B, T, K);
    choose(b, p): the child (B, T) each token descends to from block b (top-1: p.argmax(-1));
    ltm_gradient (optional attribute, None when absent): "routing" or "memory" lets the
        gradient reach L through one of its two uses only, the other seeing L detached (the
        forward pass is unchanged): "routing" the direct term of Eq. 9 (the routing state a,
        hence this block's soft write weights p and its write), "memory" M = S + L of Eq. 3
        (the reads, and through u the deeper blocks). The two gradients sum to the whole
        (`pmnet.diagnose.consolidator_gradient`).
    """

    def routing_uses_ltm(self, block: int) -> bool: ...

    def on_write(self, block: int, delta: Tensor, p: Tensor) -> Tensor: ...

    def choose(self, block: int, p: Tensor) -> Tensor: ...


class PMNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)  # tied with the output head
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        if cfg.use_memory:
            # static slot embeddings e_{b,g,j}: (G_b, K, P) per block, N(0, 0.02)
            self.slot_emb = nn.ParameterList(
                nn.Parameter(torch.empty(cfg.n_groups(b), cfg.branch, cfg.phase_dim))
                for b in range(cfg.n_blocks)
            )
            self.consolidator = Consolidator(cfg)
        else:
            self.slot_emb = nn.ParameterList()
            self.consolidator = None
        # alternative consolidation operators, added at Phase 2 (`pmnet.operators`; empty
        # here, so a Phase-1 model's parameters and state dict are those of the paper)
        self.operators = nn.ModuleDict()
        # the carried memories of the baselines (`pmnet.baselines`, issue 23), added at
        # Phase 2 like the operators; empty in a Phase-1 model
        self.baselines = nn.ModuleDict()
        # RoPE tables of positions 0 .. max_chunk - 1 as (T, 1, head_dim): constants, not in
        # the state dict; positions beyond them are computed on the fly
        cos, sin = rope_tables(torch.arange(cfg.max_chunk), cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos[:, None], persistent=False)
        self.register_buffer("rope_sin", signed_sin(sin)[:, None], persistent=False)
        # indices of each block's layers (every layer has a read module when memory is on):
        # their keys and values are computed together, once per block
        self.block_layers = [[i for i in range(cfg.n_layer) if i // cfg.write_period == b]
                             for b in range(cfg.n_blocks)] if cfg.use_memory else []
        self.probe: RouteProbe | None = None  # route diagnostics only (pmnet.diagnose)
        # whether the latent state u that the routers read carries L (Eq. 1; True: the paper's
        # model, in every condition of the paper). False is the trained "strict routing off"
        # of issue 39 (`Condition.routing_u_ltm`): with `ltm_routing=False` no router sees L,
        # directly or through u; the reads keep M = S + L. Not a parameter: set at Phase 2
        # by `pmnet.train.init_phase2`, kept in a trained model's file (`model_files`).
        self.routing_u_uses_ltm: bool = True
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
        for e in self.slot_emb:
            nn.init.normal_(e, 0.0, std)
        if self.consolidator is not None:
            self.consolidator.reset_identity()

    # ---------------------------------------------------------------- state management
    def init_state(self, batch_size: int, device=None) -> MemoryState:
        """Empty KV cache, STM and occupancy; LTM at the zero phase vector."""
        cfg = self.cfg
        device = device if device is not None else self.embed.weight.device
        shapes = [(batch_size, cfg.n_groups(b), cfg.branch, cfg.phase_dim)
                  for b in range(cfg.n_blocks)] if cfg.use_memory else []
        zeros = tuple(torch.zeros(s, device=device) for s in shapes)
        occ = tuple(torch.zeros(s[:2], dtype=torch.bool, device=device) for s in shapes)
        return MemoryState(kv=(None,) * cfg.n_layer, stm=zeros, occ=occ,
                           ltm=tuple(torch.zeros_like(z) for z in zeros), pos=0)

    def consolidate(self, state: MemoryState, *, mode: str) -> MemoryState:
        """Boundary update of LTM (Eq. 8). Does not clear anything: call clear_context().

        L+ = (L + C(S)) mod 2pi for occupied groups (learned), (L + S) mod 2pi (identity),
        the operator's L+ = f(S, L) for an operator mode (ema, overwrite, linear, gru; the
        model must hold it, see `pmnet.operators.add_operator`), L unchanged for groups not
        written in this segment.
        """
        if mode not in PAPER_MODES and mode not in self.operators:
            held = "".join(f", {n!r}" for n in self.operators)
            raise ValueError(f"consolidation mode {mode!r} is not one this model has ('learned', "
                             f"'identity'{held}); an alternative operator needs "
                             f"pmnet.operators.add_operator(model, {mode!r}) first")
        if not self.cfg.use_memory:
            raise ValueError("consolidate() needs a model built with use_memory=True")
        new_ltm = []
        for S, O, L in zip(state.stm, state.occ, state.ltm):
            if mode in self.operators:
                new = self.operators[mode](S, L)  # (B, G, K, P), wrapped
                new_ltm.append(torch.where(O[:, :, None, None], new, L))
                continue
            C = self.consolidator(S) if mode == "learned" else S  # (B, G, K, P)
            new_ltm.append(torch.where(O[:, :, None, None], wrap(L + C), L))
        return state.with_ltm(tuple(new_ltm))

    # ---------------------------------------------------------------- forward
    def _check_inputs(self, tokens: Tensor | None, state: MemoryState,
                      embeds: Tensor | None = None) -> tuple[int, int]:
        """(B, T) of the chunk, or ValueError naming what is wrong with the inputs."""
        cfg = self.cfg
        if embeds is not None:
            if tokens is not None:
                raise ValueError("give tokens or embeds, not both")
            if not isinstance(embeds, Tensor) or embeds.dim() != 3 \
                    or embeds.shape[-1] != cfg.hidden:
                shape = tuple(embeds.shape) if isinstance(embeds, Tensor) else type(embeds)
                raise ValueError(f"embeds must have shape (batch, time, {cfg.hidden}), got "
                                 f"{shape}")
            B, T = embeds.shape[:2]
        else:
            if not isinstance(tokens, Tensor):
                raise ValueError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
            if tokens.dim() != 2:
                raise ValueError(
                    f"tokens must have shape (batch, time), got {tuple(tokens.shape)}")
            if tokens.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
            B, T = tokens.shape
        if T == 0 or B == 0:
            raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
        if T > cfg.max_chunk:
            raise ValueError(f"chunk of {T} tokens exceeds max_chunk={cfg.max_chunk}")
        if cfg.use_memory and state.batch_size != B:
            raise ValueError(f"state batch size {state.batch_size} != tokens batch size {B}")
        if len(state.kv) != cfg.n_layer:
            raise ValueError(
                f"state has {len(state.kv)} KV entries, model has {cfg.n_layer} layers"
            )
        return B, T

    def check_token_ids(self, tokens: Tensor) -> None:
        """ValueError unless every id lies in [0, vocab_size). Reads the ids back to the host
        (a device sync on a GPU), so `forward` does not call it: there an out-of-range id
        fails in the embedding lookup (on the CPU as this ValueError, on CUDA as a device
        assert). The task's episodes are in range by construction."""
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}), got "
                             f"[{lo}, {hi}]")

    def _embed(self, tokens: Tensor) -> Tensor:
        try:
            return self.embed(tokens)
        except IndexError:  # the CPU kernel's range check: say what was wrong
            self.check_token_ids(tokens)
            raise

    def _rope(self, pos: int, T: int, device) -> tuple[Tensor, Tensor]:
        """cos and signed sin tables (T, 1, head_dim) of positions pos .. pos + T - 1."""
        if pos + T <= self.rope_cos.shape[0]:
            return self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        cos, sin = rope_tables(torch.arange(pos, pos + T, device=device), self.cfg.head_dim,
                               self.cfg.rope_theta)
        return cos[:, None], signed_sin(sin)[:, None]

    def forward(
        self,
        tokens: Tensor,
        state: MemoryState,
        *,
        ltm_routing: bool,
        logits: LogitsMode = "all",
        embeds: Tensor | None = None,
    ) -> tuple[Tensor | None, MemoryState]:
        """Process one chunk of tokens: causal attention over the KV cache, routed STM
        writes (Eq. 1-2, Eq. 9 when `ltm_routing`), reads of M = (S + L) mod 2pi (Eq. 3).

        tokens: (B, T) ids. Returns logits (B, T, V) / (B, V) / None (or, for "hidden", the
        normed last hidden states (B, T, H)) and the new state. `ltm_routing=False` removes
        only the direct L term of Eq. 9 from the routing state. `embeds` (B, T, H): input
        embeddings in place of token ids (tokens=None; the baselines put memory embeddings
        around a chunk's tokens, `pmnet.baselines`).
        """
        if not isinstance(ltm_routing, bool):
            raise ValueError(f"ltm_routing must be True or False, got {ltm_routing!r}")
        if logits not in ("all", "last", "none", "hidden"):
            raise ValueError(f"logits must be 'all', 'last', 'none' or 'hidden', got {logits!r}")
        B, T = self._check_inputs(tokens, state, embeds)
        cfg = self.cfg
        K, P = cfg.branch, cfg.phase_dim
        h = self._embed(tokens.long()) if embeds is None else embeds  # (B, T, H)
        dev = h.device
        cos, sin = self._rope(state.pos, T, dev)
        kv = list(state.kv)
        stm, occ = list(state.stm), list(state.occ)

        if cfg.use_memory:
            group = torch.zeros(B, T, dtype=torch.long, device=dev)  # visited group, block b
            u = torch.zeros(B, T, K, P, device=dev)  # memory state carried from blocks above
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()  # (T, T)
        read_kv = {}  # layer index -> (keys, values) of its read module, for this block
        routes = []
        probe = self.probe
        # strict routing off (the model's own, or a probe's): routers get u without L
        # (u_route); reads keep u
        strict = not self.routing_u_uses_ltm or (
            probe is not None and not getattr(probe, "routing_u_uses_ltm", True))
        u_route = torch.zeros(B, T, K, P, device=dev) if strict and cfg.use_memory else None
        for layer in self.layers:
            a_out, kv[layer.index] = layer.attn(layer.attn_norm(h), cos, sin, kv[layer.index])
            h = h + a_out
            if layer.write is not None:
                b = layer.block
                G = cfg.n_groups(b)
                # static slot embeddings e_{b,g,j} of each token's group: (B, T, K, P)
                e = F.embedding(group, self.slot_emb[b].view(G, K * P)).view(B, T, K, P)
                L_tok = _gather_groups(state.ltm[b], group)  # (B, T, K, P)  L_{b,g,j}
                L_route = L_mem = L_tok
                path = None if probe is None else getattr(probe, "ltm_gradient", None)
                if path is not None:  # the gradient through one use of L (diagnostics)
                    L_route = L_tok if path == "routing" else L_tok.detach()
                    L_mem = L_tok if path == "memory" else L_tok.detach()
                with_l = ltm_routing and (probe is None or probe.routing_uses_ltm(b))
                u_r = u if u_route is None else u_route
                a = u_r + e + L_route if with_l else u_r + e  # routing state  Eq. 1 / Eq. 9
                delta, p = layer.write(h, a)  # (B, T, K, P), (B, T, K)        Eq. 2
                if probe is not None:
                    delta = probe.on_write(b, delta, p)
                # (B, T, G) one-hot of each token's group, without F.one_hot's host-side check
                onehot = (group[..., None] == torch.arange(G, device=dev)).to(delta.dtype)
                written = onehot.sum(1)  # (B, G) tokens of each row written to each group
                if self.training and delta.requires_grad:
                    # gradient of each delta scaled by 1/sqrt(#tokens of this row in its group)
                    count = written.gather(1, group)  # (B, T)
                    delta = scale_grad(delta, count.rsqrt()[..., None, None])
                flat = delta.reshape(B, T, K * P).float()
                # segmented causal prefix sum per (row, group), one batched matmul:
                # running[t] = sum_{t' <= t, group[t'] == group[t]} delta[t']
                # and the per-group chunk totals; fp32 under any autocast (bmm would be bf16)
                same = (group[:, :, None] == group[:, None, :]) & causal  # (B, T, T)
                with torch.autocast(device_type=dev.type, enabled=False):
                    running = torch.bmm(same.float(), flat).view(B, T, K, P)
                    total = torch.bmm(onehot.float().transpose(1, 2), flat).view(B, G, K, P)
                S_tok = _gather_groups(stm[b], group) + running  # STM of the token's group
                M_tok = S_tok + L_mem  # (B, T, K, P)  Eq. 3; mod 2pi is implicit: M is
                u = wrap(u + M_tok)  # only seen through sin/cos, u is wrapped to stay small
                if u_route is not None:
                    u_route = wrap(u_route + S_tok)
                feat = phasor(u + e)  # (B, T, K, 2P) read features for this block's layers
                idx = self.block_layers[b]
                read_kv = dict(zip(idx, read_keys_values([self.layers[i].read for i in idx],
                                                         feat)))
                stm[b] = wrap(stm[b] + total)  # state after the chunk
                occ[b] = occ[b] | (written > 0)  # (B, G)
                routes.append(group)
                # hard top-1 descent to the next block
                group = group * K + (p.argmax(-1) if probe is None else probe.choose(b, p))
                if b + 1 == cfg.n_blocks:
                    routes.append(group)
            if layer.read is not None:
                h = h + layer.read(h, *read_kv[layer.index])
            h = h + layer.mlp(layer.mlp_norm(h))

        new_state = replace(state, kv=tuple(kv), stm=tuple(stm), occ=tuple(occ),
                            pos=state.pos + T, routes=tuple(routes))
        if logits == "none":
            return None, new_state
        if logits == "hidden":
            return self.norm(h), new_state
        if logits == "last":
            h = h[:, -1]
        out = F.linear(self.norm(h), self.embed.weight)  # tied output head
        return out, new_state

    # ---------------------------------------------------------------- parameter subsets
    def memory_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Memory read/write/routing parameters (every read and write module, slot embeddings)."""
        return [(n, p) for n, p in self.named_parameters()
                if ".read." in n or ".write." in n or n.startswith("slot_emb.")]

    def trainable_subset(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """Named trainable subsets of Table "Parameter-isolation conditions"."""
        cons = [(n, p) for n, p in self.named_parameters() if n.startswith("consolidator.")]
        if name == "entire_model":
            return list(self.named_parameters())
        if name == "all_but_consolidator":
            return [(n, p) for n, p in self.named_parameters()
                    if not n.startswith("consolidator.")]
        if name == "consolidator_only":
            return cons
        if name == "memory_consolidator":
            return self.memory_parameters() + cons
        if name == OPERATOR_SUBSET:
            return [(n, p) for n, p in self.named_parameters() if n.startswith("operators.")]
        if name == BASELINE_SUBSET:
            return [(n, p) for n, p in self.named_parameters() if n.startswith("baselines.")]
        raise ValueError(
            f"unknown trainable subset {name!r}; known: "
            f"{', '.join(TRAINABLE_SUBSETS + (OPERATOR_SUBSET, BASELINE_SUBSET))}"
        )

    def parameter_counts(self) -> dict:
        """total; `subsets`: the paper's trainable subsets (plus `operator_only` when the model
        has an operator). What each alternative operator would add:
        `pmnet.operators.operator_parameter_counts`."""
        total = sum(p.numel() for p in self.parameters())
        subsets = {s: sum(p.numel() for _, p in self.trainable_subset(s))
                   for s in TRAINABLE_SUBSETS} if self.cfg.use_memory else {}
        if len(self.operators):
            subsets[OPERATOR_SUBSET] = sum(p.numel()
                                           for _, p in self.trainable_subset(OPERATOR_SUBSET))
        if len(self.baselines):
            subsets[BASELINE_SUBSET] = sum(p.numel()
                                           for _, p in self.trainable_subset(BASELINE_SUBSET))
        return {"total": total, "subsets": subsets}


def _gather_groups(x: Tensor, group: Tensor) -> Tensor:
    """x: (B, G, K, P) per-group state, group: (B, T) -> (B, T, K, P) each token's group state."""
    B, G, K, P = x.shape
    idx = group[:, :, None].expand(B, group.shape[1], K * P)
    return torch.gather(x.reshape(B, G, K * P), 1, idx).view(B, -1, K, P)
