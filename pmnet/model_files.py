"""Model files: weights-only `torch.save` payloads (`pmnet-phase1/v1` for a Phase-1
checkpoint, `pmnet-model/v1` for a trained model) written atomically with their sha256 in
`<file>.sha256` beside them, and the one check of a Phase-1 checkpoint (`verify_phase1`).

Below training and the diagnostics, which both read and write these files (issue 51 moved it
here from `pmnet/train/model_files.py`; `pmnet.train` still exports every name)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pmnet.baselines import add_baseline
from pmnet.config import ModelConfig
from pmnet.io import atomic_write_bytes, sha256_file
from pmnet.model import PMNet
from pmnet.operators import add_operator

PHASE1_FORMAT = "pmnet-phase1/v1"
MODEL_FORMAT = "pmnet-model/v1"


def save_model_file(path: Path, model: PMNet, *, fmt: str, meta: dict) -> str:
    """torch.save a weights-only payload atomically; write `<path>.sha256`; return the hash."""
    import io

    buf = io.BytesIO()
    # a strict-off model (issue 39) says so; every other file is byte for byte as before
    strict = {} if model.routing_u_uses_ltm else {"routing_u_uses_ltm": False}
    torch.save({"format": fmt, "model_config": model.cfg.to_dict(),
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "meta": meta, **strict}, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    atomic_write_bytes(Path(path), data)
    write_sha256(path, digest)
    return digest


def write_sha256(path: str | Path, digest: str) -> Path:
    """Write `<path>.sha256` beside a file, atomically, in sha256sum's format
    (`<hex>  <name>`); return the sidecar's path. The one writer of these sidecars."""
    sidecar = Path(f"{path}.sha256")
    atomic_write_bytes(sidecar, f"{digest}  {Path(path).name}\n".encode())
    return sidecar


def verify_phase1(path: str | Path, *, expected_sha256: str | None = None,
                  model_config: ModelConfig | None = None) -> str:
    """The one check of a Phase-1 checkpoint; return its sha256, ValueError naming the problem.

    The file is there and its bytes match the sha256 recorded beside it (`<path>.sha256`);
    with `expected_sha256` (the hash a pipeline's Stage 1 recorded for it) they match that
    too; with `model_config` the file also loads weights-only as a model of that config (a
    matching sidecar does not make garbage, or another model's file, a checkpoint)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Phase-1 checkpoint not found: {path}")
    sidecar = Path(f"{path}.sha256")
    if not sidecar.is_file():
        raise ValueError(f"no recorded sha256 beside the Phase-1 checkpoint: {sidecar}")
    fields = sidecar.read_text().split()
    recorded = fields[0] if fields else ""
    actual = sha256_file(path)
    if actual != recorded:
        raise ValueError(f"Phase-1 checkpoint {path} does not match its recorded sha256 "
                         f"(recorded {recorded[:12]}..., actual {actual[:12]}...): refusing it")
    if expected_sha256 is not None and actual != expected_sha256:
        raise ValueError(f"Phase-1 checkpoint {path} has sha256 {actual[:12]}..., not the "
                         f"{expected_sha256[:12]}... recorded for it: refusing it")
    if model_config is not None:
        try:
            load_model_file(path, expect_config=model_config)
        except Exception as e:
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise ValueError(f"Phase-1 checkpoint {path} matches its sha256 but is not a "
                             f"loadable Phase-1 model file for this model config "
                             f"({type(e).__name__}: {first})") from e
    return actual


def load_model_file(path: str | Path, *, expect_config: ModelConfig | None = None) -> tuple:
    """Load a weights-only model file -> (PMNet, payload). Config mismatch is an error."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "model_config" not in payload:
        raise ValueError(f"{path} is not a pmnet model file")
    mcfg = ModelConfig.from_dict(payload["model_config"])
    if expect_config is not None:
        diff = mcfg.differences(expect_config)
        if diff:
            raise ValueError(f"checkpoint {path} was made with a different model config "
                             f"(field: checkpoint vs requested): {diff}")
    model = PMNet(mcfg)
    # a Phase-2 operator model (`operators.<name>.*` keys) gets its operator before the
    # strict load; a Phase-1 checkpoint has none
    for name in sorted({k.split(".")[1] for k in payload["state_dict"]
                        if k.startswith("operators.") and k.count(".") >= 2}):
        add_operator(model, name)
    for name in sorted({k.split(".")[1] for k in payload["state_dict"]
                        if k.startswith("baselines.") and k.count(".") >= 2}):
        add_baseline(model, name)  # a baseline trial's carried memory (issue 23)
    model.load_state_dict(payload["state_dict"])
    strict = payload.get("routing_u_uses_ltm", True)
    if strict is not True and strict is not False:
        raise ValueError(f"{path}: routing_u_uses_ltm must be true or false, got {strict!r}")
    model.routing_u_uses_ltm = strict  # False: a strict-off model's routers read u without L
    return model, payload



def load_phase2_progress(phase1_path: str | Path, ckpt_path: str | Path) -> PMNet:
    """The model a Phase-2 training checkpoint holds (`ckpt/last.ckpt` or `best.ckpt` of a
    running or paused unit): its Phase-1 file's weights with the checkpoint's trainable ones
    on top. A compact checkpoint (`pmnet_compact`: the trainable parameters only) must name
    this Phase-1 file's sha256; a full one replaces every weight. Conditions that add
    modules (operators, baselines) are refused: their modules are made by training."""
    payload = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or "state_dict" not in payload:
        raise ValueError(f"{ckpt_path} is not a Lightning checkpoint")
    state = {k[len("model."):]: v for k, v in payload["state_dict"].items()
             if k.startswith("model.")}
    if any(k.startswith(("operators.", "baselines.")) for k in state):
        raise ValueError(f"{ckpt_path}: an operator or baseline unit; not supported here")
    compact = payload.get("pmnet_compact")
    if compact is not None:
        digest = sha256_file(phase1_path)
        if compact.get("phase1_sha256") != digest:
            raise ValueError(f"{ckpt_path} continues Phase-1 file "
                             f"{str(compact.get('phase1_sha256'))[:12]}, not {phase1_path} "
                             f"({digest[:12]})")
    model, _ = load_model_file(phase1_path)
    missing, unexpected = model.load_state_dict(state, strict=compact is None)
    if unexpected:
        raise ValueError(f"{ckpt_path}: weights this model does not have: {unexpected[:3]}")
    return model
