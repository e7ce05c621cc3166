"""Data for every phase: procedural streams, one epoch of episodes per Lightning epoch.

Training episodes are keyed by (seed, epoch), so every condition with the same seed sees the
same episodes; the validation and test streams are fixed (`pmnet.task`).
"""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader, Dataset

from pmnet import task
from pmnet.train.config import TrainConfig


class EpochBatches(Dataset):
    """Pre-generated batches of one epoch: item i is the i-th EpisodeBatch of the epoch."""

    def __init__(self, episodes, batch_size: int):
        self.episodes, self.batch_size = episodes, batch_size

    def __len__(self) -> int:
        return len(self.episodes) // self.batch_size

    def __getitem__(self, i):
        return self.episodes[i * self.batch_size:(i + 1) * self.batch_size]


class CopyBatches(Dataset):
    def __init__(self, n_steps: int, batch_size: int, length: int, seed: int):
        self.n, self.bs, self.length, self.seed = n_steps, batch_size, length, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return task.make_copy_batch(self.bs, self.length, self.seed * 1_000_003 + i)


def _loader(ds, pin_memory: bool = False) -> DataLoader:
    """Batches in order; `pin_memory` (training on a GPU) puts each batch in page-locked
    memory so that its copy to the device does not block the host."""
    return DataLoader(ds, batch_size=None, shuffle=False, num_workers=0, pin_memory=pin_memory)


def _on_gpu(trainer) -> bool:
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


class EpisodeData(L.LightningDataModule):
    """Training stream per (seed, epoch), fixed validation and test streams, of episodes of
    `segments` segments (Phase 1 always uses the two-segment streams). `families`: the rule
    families of the training episodes (Phase 2 may train on one: `phase2_families`); the
    validation and test streams always hold both."""

    def __init__(self, cfg: TrainConfig, seed: int, episodes_per_epoch: int,
                 segments: int = task.N_SEGMENTS, families: tuple[str, ...] = task.FAMILIES):
        super().__init__()
        self.cfg, self.seed, self.n, self.segments = cfg, seed, episodes_per_epoch, segments
        self.families = tuple(families)

    def train_dataloader(self):
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return _loader(EpochBatches(task.train_episodes(self.seed, epoch, self.n,
                                                        segments=self.segments,
                                                        families=self.families),
                                    self.cfg.batch_size), pin_memory=_on_gpu(self.trainer))

    def val_dataloader(self):
        v = task.validation_stream(self.cfg.val_episodes, segments=self.segments)
        return _loader(EpochBatches(v, min(self.cfg.eval_batch_size, len(v))))

    def test_dataloader(self):
        t = task.test_stream(self.cfg.test_episodes, segments=self.segments,
                              seed=self.cfg.test_seed)
        return _loader(EpochBatches(t, min(self.cfg.eval_batch_size, len(t))))

