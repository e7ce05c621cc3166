"""The training and evaluation steps through `torch.compile` (issue 20, docs/choices.md
"Speed"): `compile_step` and the on-disk compile cache a pipeline's processes share."""

from __future__ import annotations

import functools
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

