"""A trial's GPU memory cap (issue 36, finding 3): the trial's share of the card, enforced by
the caching allocator and checked by the trial.

Planning packs trials onto a card by their predicted peaks (`pmnet.gpu.footprint.gpu_share`),
and Ray places fractional GPU requests so that they sum to at most one card; nothing made a
trial stay within its share. `GpuMemoryCap` sets the trial's process to
`torch.cuda.set_per_process_memory_fraction`: the allocator refuses (out of memory, in this
trial only) any segment beyond the share of the card's usable memory, less the CUDA context
the allocator does not see. The limit holds for every segment, CUDA-graph private pools
included (they never use expandable segments and `empty_cache` does not free them). The
trial records its cap and its measured peaks (`gpu_memory` in result.json).
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from pmnet.gpu.footprint import CUDA_CONTEXT_BYTES, usable_bytes


def memory_cap_bytes(share: float, card_bytes: int, context: int = CUDA_CONTEXT_BYTES) -> int:
    """What the allocator of a trial holding `share` of a card of `card_bytes` may reserve:
    its share of the usable memory (`footprint.usable_bytes`, what planning packs) less
    its CUDA context."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"a GPU share must be in (0, 1], got {share!r}")
    cap = int(share * usable_bytes(card_bytes)) - int(context)
    if cap <= 0:
        raise ValueError(f"a share of {share} of a {card_bytes / 2**30:.1f} GiB card leaves "
                         "nothing beyond the CUDA context")
    return cap


def memory_cap_fraction(share: float, card_bytes: int,
                        context: int = CUDA_CONTEXT_BYTES) -> float:
    """`memory_cap_bytes` as the fraction of the card's total that
    `torch.cuda.set_per_process_memory_fraction` takes."""
    return memory_cap_bytes(share, card_bytes, context) / card_bytes


def apply_memory_cap(device: torch.device, share: float | None) -> dict | None:
    """Cap this process's allocator on `device` at the trial's share (None: no share, or a
    CPU device: nothing to do). Returns what was set, the record the trial keeps."""
    device = torch.device(device)
    if share is None or device.type != "cuda":
        return None
    total = int(torch.cuda.get_device_properties(device).total_memory)
    fraction = memory_cap_fraction(share, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    torch.cuda.reset_peak_memory_stats(device)
    return {"share": float(share), "card_bytes": total, "fraction": fraction,
            "cap_bytes": memory_cap_bytes(share, total)}


def measured_peaks(device: torch.device) -> dict[str, int]:
    """The allocator's peaks on `device` since the cap was set."""
    return {"peak_allocated": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device))}


def check_within_cap(record: dict) -> dict:
    """The trial's check: its reserved peak against its cap (the allocator enforces the cap;
    this records the margin it had)."""
    out = dict(record)
    out["within_cap"] = out["peak_reserved"] <= out["cap_bytes"]
    out["headroom_bytes"] = out["cap_bytes"] - out["peak_reserved"]
    return out


class GpuMemoryCap(Callback):
    """Sets the trial's memory cap when training starts on a GPU and records its peaks when
    it ends (`record`: None on a CPU or without a share)."""

    def __init__(self, share: float | None):
        self.share = share
        self.record: dict | None = None

    def setup(self, trainer, pl_module, stage):
        if self.record is None:
            self.record = apply_memory_cap(trainer.strategy.root_device, self.share)

    def teardown(self, trainer, pl_module, stage):
        if self.record is not None:
            self.record = check_within_cap(
                {**self.record, **measured_peaks(trainer.strategy.root_device)})
