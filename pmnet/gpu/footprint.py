"""A trial's GPU footprint (issue 47; was `pmnet.memory_model`): the peak GPU bytes of one Phase-2
trial, measured on CPU (a memory model of the training step, not PMNet's STM/LTM memory).

A trial's peak on its GPU is

    context + weights + gradients + AdamW state + ACTIVATION_FACTOR x saved(batch)

- `context`: the CUDA context of the trial's process (`CUDA_CONTEXT_BYTES`, an assumption:
  it cannot be measured without a GPU; docs/choices.md, "Memory model").
- `weights`: every parameter in fp32 (mixed precision keeps fp32 master weights).
- `gradients`: one fp32 tensor per trainable parameter (all alive at the end of backward).
- `AdamW state`: two fp32 tensors (exp_avg, exp_avg_sq) per trainable parameter.
- `saved(batch)`: the bytes autograd saves for backward in one training step of the
  condition, measured, not guessed: one real step (`phase2_step`: `pmnet.runner.run_episodes`
  with the options and queries `pmnet.train.Phase2Module.training_step` uses, then its
  losses) runs on CPU under `torch.autograd.graph.saved_tensors_hooks`, and every saved
  tensor's storage is counted once (deduplicated by storage; the parameters' own storages
  are left out: they are `weights`). The step runs at two small batches and the count is
  fitted as `fixed + per_episode x batch` (`SavedFit`): the fixed part is real (bf16 copies
  of the weights that autocast makes once per step for trainable weights, and once per call
  for frozen ones), so scaling one small batch linearly would overstate it.
- `ACTIVATION_FACTOR`: what the allocator holds beyond the saved tensors at the peak of
  backward (the gradients of the activations in flight, temporaries, the caching
  allocator's rounding and fragmentation); see docs/choices.md.

Precision: under `bf16-mixed` / `16-mixed` the step runs under CUDA's autocast rules,
emulated on CPU (`cuda_autocast_on_cpu`): CPU autocast is switched on for its dispatch key,
and for the duration of the measurement every aten op that CUDA's autocast handles gets a
Python kernel on the CPU autocast key that applies CUDA's cast policy for it (`CUDA_POLICY`:
lower precision for matmul-like ops, fp32 for the ops CUDA keeps in fp32 such as `rms_norm`,
`softmax`, `sum`, promotion to the widest type for `atan2`, `cat`-free). Ops that only CPU
autocast handles fall through untouched. The cast cache follows CUDA's rule (one cached
lower-precision copy per fp32 leaf tensor that requires grad, per autocast region; frozen
weights are cast at every use). `32-true` runs in fp32 without autocast.

This module imports no Lightning, Ray or MLflow; it measures whatever `pmnet.model.PMNet`
is at run time (nothing here knows its layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pmnet import task
from pmnet.baselines import add_phase2_module
from pmnet.conditions import Condition, get_condition
from pmnet.config import ModelConfig
from pmnet.model import PMNet
from pmnet.runner import phase2_losses

GiB = 1 << 30

#: The precisions a trial can train in (Lightning's names) and the dtype of their matmuls.
LOWER_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PRECISIONS = ("32-true", *LOWER_PRECISION)

#: Batches of the two measured steps (the fit's two points). Small, so that the paper model
#: measures in seconds on a CPU; `test_saved_bytes_are_linear_in_the_batch` checks the fit
#: predicts a third batch.
PROBE_BATCHES = (2, 4)

#: The per-process CUDA context (driver, cuBLAS / cuDNN handles and workspaces, kernels
#: loaded lazily), which `torch.cuda.memory_allocated` does not see but the card does. An
#: upper bound, not a measurement (no GPU was available): a CUDA 12 context with lazy module
#: loading takes about 0.3-0.6 GiB on Ada / Hopper cards.
CUDA_CONTEXT_BYTES = 1 * GiB

#: Peak dynamic memory / bytes saved for backward. At the peak of backward the caching
#: allocator holds the saved tensors not yet freed, the gradients of the activations in
#: flight (about one layer's activations), kernel temporaries, and its own rounding and
#: fragmentation (blocks rounded to 512 B, large ones carved from 2 / 20 MiB segments).
#: docs/choices.md ("Memory model") gives the reasoning and the CPU measurement behind it.
ACTIVATION_FACTOR = 1.3

#: The part of a card's total memory that trials may plan to fill (the driver, ECC and a
#: display take the rest; `nvidia-smi` reports the card's total).
CARD_USABLE_FRACTION = 0.95

#: Ray represents fractional resources in units of 1/10000: a share is rounded down to it.
SHARE_QUANTUM = 10_000


# -----------------------------------------------------------------------------------------
# CUDA's autocast rules, emulated on CPU
# -----------------------------------------------------------------------------------------

#: CUDA autocast's cast policy per aten op (aten/src/ATen/autocast_mode.{h,cpp}: the
#: `KERNEL_CUDA` registrations of torch 2.4 - 2.13). `tests/test_gpu_footprint.py` checks
#: that every op the installed torch registers on the `AutocastCUDA` key has a policy here.
_LOWER = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "rms_norm", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)
_FP32_APPEND_DTYPE = ("norm.Scalar", "norm.ScalarOpt_dim")
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
            "index_put", "tensordot", "scatter_add")
_BANNED = ("binary_cross_entropy",)

CUDA_POLICY: dict[str, str] = {
    **{op: "lower_precision_fp" for op in _LOWER},
    **{op: "fp32" for op in _FP32},
    **{op: "fp32_set_opt_dtype" for op in _FP32_SET_OPT_DTYPE},
    **{op: "fp32_append_dtype" for op in _FP32_APPEND_DTYPE},
    **{op: "promote" for op in _PROMOTE},
    **{op: "banned" for op in _BANNED},
}


def registered_autocast_ops(key: str) -> set[str]:
    """The aten ops (`name` or `name.overload`) with a kernel on dispatch key `key`
    (`AutocastCUDA`, `AutocastCPU`) in the installed torch."""
    ops = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    return {op.split("::", 1)[1] for op in ops if op.startswith("aten::")}


def _overload(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t) -> bool:
    """CUDA's `is_eligible`: a floating tensor of the autocast device, not float64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """autocast's cast cache: one lower-precision copy per fp32 leaf tensor that requires
    grad, for the whole autocast region (CUDA's `cached_cast`: `can_try_cache`)."""

    def __init__(self):
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, t, dtype: torch.dtype, lower: torch.dtype):
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = (dtype == lower and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view())
        if not cacheable:
            return t.to(dtype)
        hit = self._copies.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        out = t.to(dtype)
        self._copies[id(t)] = (t, out)
        return out

    def clear(self) -> None:
        self._copies.clear()


def _map(args, fn):
    out = []
    for a in args:
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            out.append(type(a)(fn(x) if isinstance(x, torch.Tensor) else x for x in a))
        else:
            out.append(fn(a) if isinstance(a, torch.Tensor) else a)
    return out


def _tensors(args) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _kernel(name: str, policy: str, lower: torch.dtype, cache: _CastCache) -> Callable:
    op = _overload(name)
    no_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    dtype_kwarg = dtype_at is not None and op._schema.arguments[dtype_at].kwarg_only

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(no_autocast):
            if policy == "banned":
                raise RuntimeError(f"aten::{name} is unsafe to autocast on CUDA")
            if policy == "lower_precision_fp":
                cast = functools.partial(cache.cast, dtype=lower, lower=lower)
            elif policy in ("fp32", "fp32_append_dtype"):
                cast = functools.partial(cache.cast, dtype=torch.float32, lower=lower)
            elif policy == "promote":
                to = lower
                for t in _tensors(list(args) + list(kwargs.values())):
                    if _eligible(t) and torch.float32 in (to, t.dtype):
                        to = torch.float32
                cast = functools.partial(cache.cast, dtype=to, lower=lower)
            else:  # fp32_set_opt_dtype: the op's own dtype argument, unless one is given
                first = args[0] if args else None
                if _eligible(first) and dtype_at is not None:
                    if dtype_kwarg:
                        kwargs.setdefault("dtype", None)
                        if kwargs["dtype"] is None:
                            kwargs["dtype"] = torch.float32
                    else:
                        args = list(args) + [None] * max(0, dtype_at + 1 - len(args))
                        if args[dtype_at] is None:
                            args[dtype_at] = torch.float32
                return op(*args, **kwargs)
            args = _map(args, cast)
            kwargs = dict(zip(kwargs, _map(kwargs.values(), cast)))
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_on_cpu(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """CUDA's autocast rules for CPU tensors while the block runs (one autocast region: the
    cast cache lives until the block ends, as in one Lightning training step).

    The installed torch's `AutocastCUDA` registrations that have a policy in `CUDA_POLICY`
    get a Python kernel on `AutocastCPU` applying that policy; every other op CPU autocast
    would cast falls through unchanged. The kernels are removed when the block ends."""
    cache = _CastCache()
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - removed in `finally`
    cuda_ops = registered_autocast_ops("AutocastCUDA")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for name in sorted(cuda_ops & set(CUDA_POLICY)):
                lib.impl(name, _kernel(name, CUDA_POLICY[name], dtype, cache), "AutocastCPU")
            for name in sorted(registered_autocast_ops("AutocastCPU") - cuda_ops):
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            yield
    finally:
        cache.clear()
        lib._destroy()


def precision_context(precision: str) -> contextlib.AbstractContextManager:
    """The autocast region of one training step in `precision` (Lightning's names)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "32-true":
        return contextlib.nullcontext()
    return cuda_autocast_on_cpu(LOWER_PRECISION[precision])


# -----------------------------------------------------------------------------------------
# One training step, and what it saves for backward
# -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    """What decides the memory of a Phase-2 training step besides the model and condition:
    the TrainConfig fields `segments`, `ltm_graph`, `detach_ltm`, `initial_ltm_loss`."""

    segments: int = task.N_SEGMENTS
    ltm_graph: str = "full"
    detach_ltm: bool = False
    initial_ltm_loss: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> StepSpec:
        """From a `pmnet.train.TrainConfig` (read by attribute: no Lightning import here)."""
        return cls(segments=cfg.segments, ltm_graph=cfg.ltm_graph, detach_ltm=cfg.detach_ltm,
                   initial_ltm_loss=float(cfg.initial_ltm_loss))


def phase2_step(model: PMNet, batch, condition: Condition, spec: StepSpec) -> torch.Tensor:
    """The loss of one Phase-2 training step: `runner.phase2_losses`, the objective
    `Phase2Module.training_step` trains on."""
    return phase2_losses(model, batch, condition, detach_ltm=spec.detach_ltm,
                         ltm_graph=spec.ltm_graph,
                         initial_ltm_loss=spec.initial_ltm_loss)["loss"]


def saved_bytes(step: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages that autograd saved for backward while `step()` ran
    and that are still alive when it returns (what backward will read; tensors saved in
    parts of the graph that nothing reaches any more were freed during the step), the
    storages of `exclude` (e.g. the parameters) left out. The graph is freed afterwards."""
    from torch.multiprocessing.reductions import StorageWeakRef

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in skip:
            known = seen.get(ptr)
            if known is None or known[0].expired():  # a new storage at a reused address
                seen[ptr] = (StorageWeakRef(storage), storage.nbytes())
        # detached: the same storage without a grad_fn, so a saved output does not make a
        # reference cycle with its own node (which would keep dead subgraphs alive)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    gc.collect()
    alive = sum(nbytes for ref, nbytes in seen.values() if not ref.expired())
    del loss
    return alive


def build_model(model_cfg: ModelConfig, condition: Condition, seed: int = 0) -> PMNet:
    """The model of a Phase-2 trial on CPU, frozen to the condition's subset, in train mode
    (an operator or baseline condition gets its module, and a strict-off condition its
    routers without L in u, as `pmnet.train.run_phase2` does)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = PMNet(model_cfg)
        add_phase2_module(model, condition.consolidation)
    model.routing_u_uses_ltm = condition.routing_u_ltm  # strict off keeps a second u (issue 39)
    keep = {n for n, _ in model.trainable_subset(condition.subset)}
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    return model.train()


def measure_step(model: PMNet, condition: Condition, spec: StepSpec, batch_size: int,
                 precision: str, seed: int = 0) -> int:
    """Bytes saved for backward by one training step at `batch_size` in `precision`."""
    batch = task.train_episodes(seed, 0, batch_size, segments=spec.segments)
    params = list(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout masks: the count does not depend on them anyway

        def step() -> torch.Tensor:
            with precision_context(precision):
                return phase2_step(model, batch, condition, spec)

        return saved_bytes(step, exclude=params)


@dataclass(frozen=True)
class SavedFit:
    """Bytes saved for backward as `fixed + per_episode x batch`, from two measured steps."""

    fixed: float
    per_episode: float
    probes: tuple[tuple[int, int], ...]  # (batch, measured bytes)

    def at(self, batch_size: int) -> int:
        return int(math.ceil(self.fixed + self.per_episode * batch_size))


# -----------------------------------------------------------------------------------------
# A trial's memory, and packing trials onto a card
# -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialMemory:
    """The peak GPU bytes of one trial of `condition` (see the module docstring)."""

    condition: str
    batch_size: int
    precision: str
    spec: StepSpec
    total_params: int
    trainable_params: int
    weights: int
    gradients: int
    optimizer: int
    saved: int  # bytes saved for backward at `batch_size`
    fit: SavedFit
    context: int = CUDA_CONTEXT_BYTES
    activation_factor: float = ACTIVATION_FACTOR

    @property
    def activations(self) -> int:
        return int(math.ceil(self.saved * self.activation_factor))

    @property
    def peak(self) -> int:
        return self.context + self.weights + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(activations=self.activations, peak=self.peak)
        return d


@functools.lru_cache(maxsize=64)
def saved_fit(model_cfg: ModelConfig, condition: str, spec: StepSpec, precision: str,
              probes: tuple[int, ...] = PROBE_BATCHES) -> SavedFit:
    """Measure the step at the probe batches and fit `fixed + per_episode x batch`
    (cached per process: the paper model takes a few seconds per condition on a CPU)."""
    if len(probes) != 2 or probes[0] == probes[1]:
        raise ValueError(f"two distinct probe batches are needed, got {probes!r}")
    cond = get_condition(condition)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny batches: small ops, and no contention on a busy machine
    try:
        model = build_model(model_cfg, cond)
        points = tuple((b, measure_step(model, cond, spec, b, precision)) for b in probes)
    finally:
        torch.set_num_threads(threads)
    (b1, m1), (b2, m2) = points
    per = (m2 - m1) / (b2 - b1)
    return SavedFit(fixed=max(0.0, m1 - per * b1), per_episode=per, probes=points)


def trial_memory(model_cfg: ModelConfig, condition: str, *, batch_size: int, precision: str,
                 spec: StepSpec = StepSpec()) -> TrialMemory:
    """The peak GPU bytes of a Phase-2 trial of `condition` at `batch_size` in `precision`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    cond = get_condition(condition)
    fit = saved_fit(model_cfg, condition, spec, precision)
    with torch.device("meta"):
        model = PMNet(model_cfg)
        add_phase2_module(model, cond.consolidation)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for _, p in model.trainable_subset(cond.subset))
    fp32 = 4
    return TrialMemory(condition=condition, batch_size=batch_size, precision=precision,
                       spec=spec, total_params=total, trainable_params=trainable,
                       weights=fp32 * total, gradients=fp32 * trainable,
                       optimizer=2 * fp32 * trainable, saved=fit.at(batch_size), fit=fit)


@dataclass(frozen=True)
class Share:
    """How many trials of one kind share a card, and the GPU fraction each asks Ray for."""

    trials_per_gpu: int
    fraction: float  # a multiple of 1/SHARE_QUANTUM, fraction x usable >= peak


def usable_bytes(card_bytes: int) -> int:
    return int(card_bytes * CARD_USABLE_FRACTION)


def gpu_share(peak: int, card_bytes: int) -> Share | None:
    """The largest number n of such trials that fit one card and the fraction of a GPU each
    asks for (1/n rounded down to Ray's resolution, but never below its own peak): any mix of
    trials whose fractions sum to at most 1 then fits the card. None: not even one fits."""
    usable = usable_bytes(card_bytes)
    n = min(usable // peak, SHARE_QUANTUM) if peak > 0 else 0
    while n >= 1:
        fraction = math.floor(SHARE_QUANTUM / n) / SHARE_QUANTUM
        if fraction * usable >= peak:
            return Share(trials_per_gpu=int(n), fraction=fraction)
        n -= 1
    return None


def describe_bytes(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"
