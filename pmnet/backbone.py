"""The decoder's standard pieces, which PMNet's layers are built from (Section 3.1's backbone;
nothing in this module is specific to PMNet's memory): RMSNorm (a fused autograd Function),
RoPE, causal sliding-window attention with a KV cache (flash-attn when it is installed as
torch custom ops and the inputs are half precision on a capable card, SDPA otherwise), and
the SwiGLU MLP.

Shapes: B batch, T tokens in the chunk, H hidden, D head_dim. Split from `pmnet/model.py`
(issue 51), which keeps PMNet, its memory and the paper's equations; `tests/test_backbone.py`
tests this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from pmnet.config import ModelConfig

try:  # flash-attn is optional (the `flash` extra); used only on CUDA with half precision
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # pragma: no cover - not installed on CPU machines
    flash_attn_func = None



class _RMSNorm(torch.autograd.Function):
    """y = w * x * rsqrt(mean(x^2) + eps) over the last dim, in fp32, returned in x's dtype.

    The weight broadcasts against x (shape (D,), or (H, D) for per-head weights). Backward:
    with xhat = x r, dx = r (g w - xhat mean(g w xhat)), dw = sum of g xhat over x's other
    dims. Saves x and r (not xhat: half the bytes when x is bf16)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.to(_at_least_fp32(x))
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return (xf * r * weight).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):
        x, r, weight = ctx.saved_tensors
        xhat = x.to(r.dtype) * r
        gf = g.to(r.dtype)
        gw = gf * weight
        # gw - xhat * mean(gw xhat) as one addcmul
        dx = r * torch.addcmul(gw, xhat, (gw * xhat).mean(-1, keepdim=True), value=-1.0)
        dw = (gf * xhat).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        return dx.to(x.dtype), dw, None


def _at_least_fp32(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (the same values as `F.rms_norm` in fp32; fp32 inside and
    x's dtype out under autocast, so q and k stay half precision for flash attention)."""
    return _RMSNorm.apply(x, weight, eps)



class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables (T, head_dim) for RoPE, computed in fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                  / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, head_dim)
    return emb.cos(), emb.sin()


def signed_sin(sin: Tensor) -> Tensor:
    """[-sin_1 ; sin_2] of a (..., D) table: rotate_half(x) * sin == roll(x, D/2) * signed_sin,
    with rotate_half(x) = [-x_2 ; x_1] (the same products, bit for bit)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """RoPE over the last dim: x * cos + rotate_half(x) * sin, in fp32, returned in x's dtype.
    x: (..., T, heads, D) or any shape the (T, 1, D) / (T, D) tables broadcast against."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x_2 ; x_1]
    return (x * cos + rolled * sin_signed).to(x.dtype)


class Attention(nn.Module):
    """Causal sliding-window self-attention with RMSNorm on q and k per head, RoPE, KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, x: Tensor, cos: Tensor, sin_signed: Tensor, cache):
        """x: (B, T, H) normed input; cos / sin_signed: (T, 1, head_dim) RoPE tables."""
        cfg = self.cfg
        B, T, _ = x.shape
        nq, nk, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k, v in one matmul; q and k normed per head (their own weights) in one call
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        qk, v = F.linear(x, w).view(B, T, nq + 2 * nk, D).split([nq + nk, nk], dim=2)
        w_norm = torch.cat([self.q_norm.weight.expand(nq, D), self.k_norm.weight.expand(nk, D)])
        qk = apply_rope(rms_norm(qk, w_norm, cfg.rms_eps), cos, sin_signed)
        q, k = (t.transpose(1, 2) for t in qk.split([nq, nk], dim=2))  # (B, heads, T, D)
        v = v.transpose(1, 2)
        if cache is not None:
            k = torch.cat([cache[0].to(k.dtype), k], dim=2)
            v = torch.cat([cache[1].to(v.dtype), v], dim=2)
        keep = cfg.window - 1  # a query sees itself and the window-1 tokens before it
        new_cache = (k[:, :, -keep:], v[:, :, -keep:]) if keep > 0 else None
        dropout = cfg.attn_dropout if self.training else 0.0

        if _flash_ok(q, k, v):
            out = flash_attn_func(  # (B, T, heads, D); bottom-right aligned causal mask
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout,
                causal=True, window_size=(cfg.window - 1, 0),
            ).reshape(B, T, -1)
            return self.o_proj(out), new_cache

        out = attend(q, k, v, cfg.window, dropout).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out), new_cache


#: the device type flash-attn runs on (a test points it at the CPU with a stand-in kernel)
FLASH_DEVICE = "cuda"
#: the torch.library namespace of flash-attn's kernels: from 2.7 on `flash_attn_func` calls
#: `torch.ops.flash_attn._flash_attn_forward` / `_flash_attn_backward`, custom ops that a
#: compiled step traces into its graph (2.6.x calls its C extension from Python, which
#: breaks the graph in every layer)
FLASH_OPS = "flash_attn"
#: the compute capability flash-attn 2 needs (Ampere, sm80, and newer)
FLASH_MIN_CAPABILITY = (8, 0)


def flash_is_custom_op(namespace: str = FLASH_OPS) -> bool:
    """flash-attn's forward and backward kernels are torch custom ops in `namespace`."""
    try:
        ops = getattr(torch.ops, namespace)
        return all(hasattr(ops, n) for n in ("_flash_attn_forward", "_flash_attn_backward"))
    except Exception:  # noqa: BLE001 - no such namespace or op
        return False


#: flash-attn is used only when it is installed and its kernels are custom ops (issue 36)
FLASH_IS_OP = flash_attn_func is not None and flash_is_custom_op()


@torch.compiler.assume_constant_result
def _cuda_capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def flash_capable(device: torch.device) -> bool:
    """A CUDA device of compute capability >= FLASH_MIN_CAPABILITY (flash-attn 2 has no
    kernels for older cards: SDPA runs there); any other device type (a test's stand-in)."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= FLASH_MIN_CAPABILITY


def flash_status() -> str:
    """What the installed flash-attn is, and whether the model uses it (`pmnet info`,
    `make gpu-check`)."""
    if flash_attn_func is None:
        return "not installed (SDPA)"
    try:
        from importlib.metadata import version

        v = version("flash-attn")
    except Exception:  # noqa: BLE001
        v = "unknown version"
    if not FLASH_IS_OP:
        return f"{v}: not a torch custom op, not used (SDPA); install flash-attn>=2.7"
    return f"{v} (torch custom ops)"


def _flash_ok(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """flash-attn is installed as custom ops and q, k, v are half precision on its device
    (what autocast gives: the projections are bf16 and `rms_norm` / RoPE keep their input's
    dtype), a device it has kernels for."""
    return (flash_attn_func is not None and FLASH_IS_OP and q.device.type == FLASH_DEVICE
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
            and flash_capable(q.device))


def attention_mask(n_query: int, n_key: int, window: int | None, device=None) -> Tensor:
    """Boolean (n_query, n_key) mask, bottom-right aligned: the queries are the last
    `n_query` of the `n_key` positions, query i (position n_key - n_query + i) sees key j iff
    0 <= pos_i - j (causal) and, when `window` is given, pos_i - j < window."""
    q_pos = torch.arange(n_key - n_query, n_key, device=device)
    rel = q_pos[:, None] - torch.arange(n_key, device=device)[None, :]  # (n_query, n_key)
    return (rel >= 0) & (rel < window) if window is not None else rel >= 0


def attend(q: Tensor, k: Tensor, v: Tensor, window: int, dropout: float = 0.0) -> Tensor:
    """Causal sliding-window SDPA; q: (B, heads, T, D), k/v: (B, kv_heads, n_cached + T, D).

    When the window does not bind (n_cached + T <= window, always the case for this task's
    segments) it is plain causal attention: SDPA's `is_causal` without a cache (top-left and
    bottom-right alignment coincide when T_q == T_k), a bottom-right causal mask with one
    (`is_causal` would be top-left aligned, wrong for T_q < T_k). Longer inputs get the
    sliding-window mask.
    """
    T, n_key = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if n_key == T and T <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              enable_gqa=gqa)
    mask = attention_mask(T, n_key, window if n_key > window else None, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          enable_gqa=gqa)


class MLP(nn.Module):
    """SwiGLU MLP without bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, torch.cat([self.gate.weight, self.up.weight])).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

