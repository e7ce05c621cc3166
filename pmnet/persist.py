"""LTM that outlives the process: save a batch of episodes' long-term memory, restore it in a
new process, and answer the final queries from it (the paper's Limitations: "persistence
across unrelated sessions, serialization, and deployment restarts is not evaluated").

A file (`pmnet-ltm/v1`) holds, loadable with `torch.load(weights_only=True)`:

    format          "pmnet-ltm/v1"
    model_sha256    fingerprint of the model that wrote it (`model_fingerprint`)
    model_config    that model's ModelConfig as a dict
    ltm             one (N, G_b, K, P) float32 tensor per block: L after the last boundary
    content_sha256  sha256 of the LTM tensors' bytes (shapes and dtypes included)
    segments        T, the number of segments of the episodes whose boundaries wrote the LTM
                    (2..8; a file without it was written before the field existed, when every
                    LTM came from two-segment episodes, and reads as 2)
    meta            free-form provenance (stream, n, its content hash, consolidation, routing)

`load_ltm` refuses, with a message naming the problem and before anything is computed: a file
that is not a torch file or is truncated, another format or version, a model whose
fingerprint or config differs, tensors whose bytes no longer match `content_sha256`, and a
segments count other than the one the caller asks for.
Writes are atomic (`pmnet.io`). The episodes themselves are not stored: the queries come from
the same procedural stream (its content hash is checked when the caller gives one).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pmnet.config import ModelConfig
from pmnet.io import atomic_write_bytes
from pmnet.model import MemoryState, PMNet
from pmnet.runner import RunOptions, persistent_state
from pmnet.task import MAX_SEGMENTS, MIN_SEGMENTS, N_SEGMENTS

LTM_FORMAT = "pmnet-ltm/v1"


class LTMFileError(ValueError):
    """An LTM file cannot be used with this model (the message says why)."""


def _tensor_digest(h, t: Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def model_fingerprint(model: PMNet) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        _tensor_digest(h, t)
    return h.hexdigest()


def ltm_digest(ltm: tuple[Tensor, ...] | list[Tensor]) -> str:
    h = hashlib.sha256()
    for t in ltm:
        _tensor_digest(h, t)
    return h.hexdigest()


@dataclass(frozen=True)
class SavedLTM:
    """What `load_ltm` returns: the LTM tensors and the file's provenance."""

    ltm: tuple[Tensor, ...]
    meta: dict
    model_sha256: str
    segments: int = N_SEGMENTS

    @property
    def n_episodes(self) -> int:
        return int(self.ltm[0].shape[0]) if self.ltm else 0

    def state(self, model: PMNet) -> MemoryState:
        """A fresh memory state (empty KV cache and STM) holding this LTM."""
        state = model.init_state(self.n_episodes, device=model.embed.weight.device)
        return state.with_ltm(tuple(x.to(model.embed.weight.device) for x in self.ltm))


def _valid_segments(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and MIN_SEGMENTS <= value <= MAX_SEGMENTS)


def save_ltm(path: str | Path, model: PMNet, state: MemoryState, *, segments: int,
             meta: dict[str, Any] | None = None) -> str:
    """Write `state.ltm` (after the last boundary of episodes of `segments` segments) with
    the model's fingerprint; return the file's content digest. The write is atomic: a crash
    leaves the old file or none."""
    if not _valid_segments(segments):
        raise ValueError(f"segments must be an int in {MIN_SEGMENTS}..{MAX_SEGMENTS}, got "
                         f"{segments!r}")
    if not state.ltm:
        raise LTMFileError("the state holds no LTM (a model built with use_memory=False?)")
    ltm = tuple(x.detach().float().cpu().contiguous() for x in state.ltm)
    digest = ltm_digest(ltm)
    payload = {"format": LTM_FORMAT, "model_sha256": model_fingerprint(model),
               "model_config": model.cfg.to_dict(), "ltm": list(ltm),
               "content_sha256": digest, "segments": int(segments), "meta": dict(meta or {})}
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(Path(path), buf.getvalue())
    return digest


def load_ltm(path: str | Path, model: PMNet, *, segments: int | None = None) -> SavedLTM:
    """Read an LTM file written for `model`; refuse anything else with `LTMFileError`.
    `segments`: refuse a file written from episodes of another number of segments (None:
    accept the file's, `SavedLTM.segments`)."""
    path = Path(path)
    if not path.is_file():
        raise LTMFileError(f"LTM file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile) as e:
        raise LTMFileError(f"{path} is not a readable LTM file (corrupted or truncated?): "
                           f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") != LTM_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise LTMFileError(f"{path} is not a {LTM_FORMAT} file (found format {found!r})")
    try:
        cfg = ModelConfig.from_dict(payload.get("model_config", {}))
    except (TypeError, ValueError) as e:
        raise LTMFileError(f"{path}: its model config is unreadable: {e}") from None
    diff = cfg.differences(model.cfg)
    if diff:
        raise LTMFileError(f"{path} was written by a model with another config "
                           f"(field: file vs this model): {diff}")
    fp = model_fingerprint(model)
    if payload.get("model_sha256") != fp:
        raise LTMFileError(
            f"{path} was written by another model (its weights' sha256 "
            f"{str(payload.get('model_sha256'))[:12]}... differs from this model's {fp[:12]}...)"
            ": LTM is only meaningful to the Consolidator, router and readers that wrote it")
    ltm = payload.get("ltm")
    if not isinstance(ltm, (list, tuple)) or len(ltm) != cfg.n_blocks:
        raise LTMFileError(f"{path}: expected {cfg.n_blocks} LTM tensors, found "
                           f"{len(ltm) if isinstance(ltm, (list, tuple)) else type(ltm)}")
    n = None
    for b, x in enumerate(ltm):
        shape = (cfg.n_groups(b), cfg.branch, cfg.phase_dim)
        if not isinstance(x, Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != shape:
            raise LTMFileError(f"{path}: LTM block {b} has shape "
                               f"{tuple(getattr(x, 'shape', ()))}, expected (N, *{shape})")
        if n is not None and x.shape[0] != n:
            raise LTMFileError(f"{path}: LTM blocks disagree on the number of episodes")
        n = x.shape[0]
    if ltm_digest(ltm) != payload.get("content_sha256"):
        raise LTMFileError(f"{path}: the LTM tensors do not match the content sha256 recorded "
                           "in the file (corrupted): refusing them")
    stored = payload.get("segments", N_SEGMENTS)  # files from before the field: two segments
    if not _valid_segments(stored):
        raise LTMFileError(f"{path}: its segments count {stored!r} is not an int in "
                           f"{MIN_SEGMENTS}..{MAX_SEGMENTS}")
    if segments is not None and segments != stored:
        raise LTMFileError(f"{path} holds the LTM of {stored}-segment episodes, not of "
                           f"{segments}-segment ones: its final queries are another segment's")
    return SavedLTM(ltm=tuple(ltm), meta=dict(payload.get("meta", {})), model_sha256=fp,
                    segments=int(stored))


@contextlib.contextmanager
def _inference(model: PMNet):
    """Evaluation mode and no autograd for the block; the model's mode is restored after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def consolidate_batch(model: PMNet, batch, opts: RunOptions) -> MemoryState:
    """The persistent trajectory up to the final reset: LTM after every boundary."""
    with _inference(model):
        return persistent_state(model, batch, opts)


def answer_final(model: PMNet, batch, state: MemoryState, *, ltm_routing: bool) -> Tensor:
    """The final (last segment's) queries asked of `state`: logits (N, V) at the last
    token."""
    with _inference(model):
        logits, _ = model(batch.query_tokens[:, -1], state, ltm_routing=ltm_routing,
                          logits="last")
    return logits


def score_final(logits: Tensor, batch) -> dict[str, Any]:
    """Recall of the final queries' logits from :func:`answer_final` against the last
    segment's rule (``updated_ltm``, percent), and the sha256 of the float32 logits, the
    fingerprint two runs compare bit for bit."""
    from pmnet.evaluate import digit_prediction

    hits = digit_prediction(logits) == batch.target_digit[:, -1]
    return {"updated_ltm": 100 * hits.float().mean().item(),
            "logits_sha256": hashlib.sha256(logits.float().contiguous().numpy().tobytes()
                                            ).hexdigest()}
