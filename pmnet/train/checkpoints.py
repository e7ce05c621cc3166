"""Lightning's training checkpoints (`best.ckpt`, `last.ckpt`): written atomically, the
last one once per epoch, and the epoch read back from one."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from pmnet.io import atomic_link, atomic_path


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, made atomic.

    `TorchCheckpointIO` writes the bytes straight into the target, so a crash or a full disk
    in the middle leaves a torn `last.ckpt` that the next resume cannot load. Here
    `torch.save` streams into a temporary file in the same directory, which is fsynced and
    then `os.replace`d onto the target: a reader or a resume sees the old checkpoint or the
    new one, never half of one. Every write also makes a new inode, so a hard link to an
    older checkpoint (see `LastCheckpoint`) is never written through.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as fh:
                torch.save(checkpoint, fh)
                fh.flush()
                os.fsync(fh.fileno())


def _file_identity(path: str | Path) -> tuple[int, int, int, int] | None:
    """(device, inode, mtime_ns, size) of a file, None if there is none: a new atomic write
    always changes it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class LastCheckpoint(Checkpoint):
    """Writes `<dirpath>/last.ckpt`, the state a resume continues from, once per epoch.

    Lightning 2.6's `ModelCheckpoint(save_last=True)` writes last.ckpt only in epochs whose
    top-k checkpoint was saved, and then writes the same state a second time: a resume would
    restart from the best epoch rather than the last, and improving epochs cost two writes.
    This callback runs right after the selecting `ModelCheckpoint` at train-epoch end (both
    after EarlyStopping): if that callback has just written best.ckpt, last.ckpt becomes a
    hard link to it (the same state, no bytes written); otherwise the trainer saves
    last.ckpt (atomically, through `AtomicCheckpointIO`). So each epoch's state is written
    exactly once; only a filesystem without hard links costs a second write.
    """

    def __init__(self, best: ModelCheckpoint, dirpath: str | Path):
        self.best, self.path = best, Path(dirpath) / "last.ckpt"
        self._seen: tuple | None = None

    def _best_identity(self) -> tuple | None:
        return _file_identity(self.best.best_model_path) if self.best.best_model_path else None

    def on_train_start(self, trainer, pl_module):
        self._seen = self._best_identity()  # best.ckpt as it was when this fit (re)started

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        now = self._best_identity()
        if now is not None and now != self._seen:  # best.ckpt was written in this epoch
            self._seen = now
            if atomic_link(self.best.best_model_path, self.path):
                return
        trainer.save_checkpoint(str(self.path))

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        relocate_best_state(checkpoint, self.best)


def relocate_best_state(checkpoint: dict, best: ModelCheckpoint) -> None:
    """A checkpoint directory that was moved (copied to another run directory or machine,
    issue 52) resumes as it would have in place: the selecting ModelCheckpoint's saved state
    names its old directory, and Lightning then drops the best score it holds (the next
    epoch would count as an improvement whatever its metric, and best.ckpt would point into
    the old directory). Rewrites, in the loaded `checkpoint` (before the callbacks' states
    are restored from it), that state's directory and paths to `best.dirpath`. A checkpoint
    restored where it was written is left as it is."""
    state = (checkpoint.get("callbacks") or {}).get(best.state_key)
    if not isinstance(state, dict) or not best.dirpath or not state.get("dirpath"):
        return
    old, new = str(state["dirpath"]), str(best.dirpath)
    if old == new:
        return

    def moved(path):
        if isinstance(path, str) and path and os.path.dirname(path) == old:
            return os.path.join(new, os.path.basename(path))
        return path

    state["dirpath"] = new
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in state:
            state[key] = moved(state[key])
    if isinstance(state.get("best_k_models"), dict):
        state["best_k_models"] = {moved(k): v for k, v in state["best_k_models"].items()}


def _checkpoint_field(path: str | Path, read):
    """`read(checkpoint)` of a Lightning checkpoint loaded weights-only and memory-mapped, so
    its tensors are not read (cheap even for a paper-size checkpoint); None if the file is
    missing or unreadable or lacks the field."""
    try:
        return read(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception:
        return None


def checkpoint_epoch(path: str | Path) -> int | None:
    """The epoch stored in a Lightning checkpoint; None if unreadable."""
    return _checkpoint_field(path, lambda ckpt: int(ckpt["epoch"]))


def checkpoint_origin(path: str | Path) -> str | None:
    """The sha256 of the Phase-1 file a Phase-2 checkpoint was trained from (a compact
    checkpoint's `pmnet_compact`, `Phase2Module.on_save_checkpoint`); None when missing,
    unreadable or not compact."""
    return _checkpoint_field(path, lambda ckpt: str(ckpt["pmnet_compact"]["phase1_sha256"]))


def _best_epoch(ckpt: ModelCheckpoint | None) -> int | None:
    if ckpt is None or not ckpt.best_model_path:
        return None
    return int(torch.load(ckpt.best_model_path, map_location="cpu", weights_only=True)["epoch"])


