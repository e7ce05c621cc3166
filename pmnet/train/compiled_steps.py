"""The training and evaluation steps through `torch.compile` (issue 20, docs/choices.md
"Speed"): `compile_step`, the on-disk compile cache a pipeline's processes share, and a
trial's fresh compile state (`fresh_compile_state`, `release_compiled_steps`: issue 36)."""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path

import torch

from pmnet.train.config import TrainConfig

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
    # a step that would recompile past dynamo's limit (8 per code object) fails instead of
    # silently running eager from then on (issue 36, finding 2)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
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



def fresh_compile_state() -> None:
    """Start a trial as a fresh process would (issue 36, finding 2): drop the compiled code
    of earlier trials in this process (dynamo's cache entries hang on the step functions'
    code objects, which every trial shares, so a reused Ray actor would otherwise count
    every earlier arm against the recompile limit) and this thread's CUDA-graph trees.
    The on-disk cache is kept: the trial loads its graphs from it."""
    torch._dynamo.reset()


def release_compiled_steps() -> None:
    """At a trial's end, in the thread that ran it: its compiled code, its CUDA-graph trees
    and their private memory pools (per thread, and not freed by `empty_cache` while a
    compiled function holds them), then the allocator's cache. The next trial on a reused
    actor starts on a card that holds nothing of this one. Where CUDA never started there is
    no pool or cache to free, and no full garbage collection is paid (it lengthened every
    trial of a long test process by up to 0.7 s, measured). cuBLAS keeps a workspace (32
    MiB on Hopper) per handle and stream, allocated through the caching allocator and not
    freed by `empty_cache`: they are cleared first (issue 46)."""
    torch._dynamo.reset()
    if torch.cuda.is_initialized():
        gc.collect()  # the graph trees' last references may sit in reference cycles
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private, guarded
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
