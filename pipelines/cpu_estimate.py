"""How long a pipeline of the `paper` preset would run on CPUs: one measured figure, kept here.

`make pipeline PRESET=paper` (a preset built for a GPU: `needs_gpu` in its entry of
`pmnet.config.PRESETS`) where the chosen nodes have no GPU is refused before anything is
written (`pipelines.plan`, exit 2) with this estimate, unless `--allow-cpu-paper` asks for it.

The figure: one training step of the paper model (29.95M parameters) on one two-segment
memory episode, forward and backward in fp32, on the 2-core development VM (Intel Xeon,
Sapphire Rapids class, KVM guest; torch 2.13.0+cpu, 2 threads, idle):

    .venv/bin/python benchmarks/bench_model.py --preset paper --dtypes fp32 --repeats 7 \\
        --wait-idle 300
    -> benchmarks/results/paper-cpu-20261122-032347.json: 4,744.2 ms per step of batch 64

that is 74.1 ms per episode on 2 cores. It leaves out the optimizer step, evaluation and
episode generation, so every estimate built on it is a lower bound; Phase 0 (copy task) and
Phase 1 (one segment) episodes are shorter than the two-segment ones it was measured on,
which makes their part an upper bound; the sum is meant as an order of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Milliseconds of a training step (forward + backward, fp32) per two-segment episode of the
#: paper model, measured on CPU_CORES cores (see the module docstring for the command).
PAPER_MS_PER_EPISODE = 4744.2 / 64
CPU_CORES = 2
MEASURED_ON = ("2-core Intel Xeon VM (Sapphire Rapids class), torch 2.13.0+cpu, fp32, "
               "benchmarks/results/paper-cpu-20261122-032347.json")


@dataclass(frozen=True)
class CpuEstimate:
    """Hours of each part of a pipeline on `cpus` CPUs at the measured cost per episode
    (perfect scaling across cores assumed: optimistic). Phase 1 and each trial run between
    `patience + 1` epochs (early stopping at the first chance) and `max_epochs`."""

    cpus: float
    phase0_h: float
    phase1_h: tuple[float, float]
    stage2_h: tuple[float, float]
    n_trials: int

    @property
    def total_h(self) -> tuple[float, float]:
        return (self.phase0_h + self.phase1_h[0] + self.stage2_h[0],
                self.phase0_h + self.phase1_h[1] + self.stage2_h[1])

    def describe(self) -> str:
        lo, hi = self.total_h
        return (f"at least {_span(lo, hi)} on {self.cpus:g} CPU cores (Phase 0 "
                f"{_span(self.phase0_h, self.phase0_h)}, Phase 1 {_span(*self.phase1_h)}, "
                f"{self.n_trials} Phase-2 trials {_span(*self.stage2_h)}; from "
                f"{PAPER_MS_PER_EPISODE:.1f} ms per episode measured on a {MEASURED_ON})")


def _span(lo: float, hi: float) -> str:
    def one(h: float) -> str:
        if h < 48:
            return f"{h:.0f} h"
        return f"{h / 24:,.0f} days"

    return one(lo) if one(lo) == one(hi) else f"{one(lo)} to {one(hi)}"


def estimate(cfg, *, n_trials: int, cpus: float) -> CpuEstimate:
    """The estimate for TrainConfig `cfg` (read by attribute) and `n_trials` Phase-2 trials on
    `cpus` CPU cores in all."""
    per_core_h = PAPER_MS_PER_EPISODE * CPU_CORES / 1000 / 3600  # core-hours per episode
    hours = lambda episodes: episodes * per_core_h / max(1.0, float(cpus))  # noqa: E731
    phase0 = hours(cfg.phase0_steps * cfg.batch_size)
    p1 = [hours(e * cfg.phase1_episodes_per_epoch)
          for e in (min(cfg.phase1_patience + 1, cfg.phase1_max_epochs), cfg.phase1_max_epochs)]
    p2 = [hours(n_trials * e * cfg.episodes_per_epoch)
          for e in (min(cfg.patience + 1, cfg.max_epochs), cfg.max_epochs)]
    return CpuEstimate(cpus=float(cpus), phase0_h=phase0, phase1_h=(p1[0], p1[1]),
                       stage2_h=(p2[0], p2[1]), n_trials=n_trials)
