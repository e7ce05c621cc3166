"""Atomic file writes: a crash never leaves half a file (temporary file beside the target,
fsync, `os.replace`), and hard links made the same way. Used by training checkpoints, results,
reports and the pipeline; and the small JSON files read back (`read_json`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    The temporary file lives in the same directory (same filesystem), so ``os.replace`` is
    atomic: readers see either the old file or the complete new one, never a partial write.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file + fsync + ``os.replace``)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON atomically (non-JSON values via str)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Byte-identical copy that appears at ``dst`` in one step, fsynced before it does."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    return Path(dst)


def read_json(path: str | os.PathLike[str], default: Any = None) -> Any:
    """A JSON file's content, or ``default`` when it is missing or unreadable (not JSON, not
    UTF-8: a torn or damaged file reads as absent, issue 53)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # JSONDecodeError, UnicodeDecodeError
        return default


def atomic_link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> bool:
    """Make ``dst`` a hard link to ``src`` in one step (a link under a temporary name, then
    ``os.replace``): the same bytes under a second name without writing them again. False,
    with ``dst`` untouched, where the filesystem has no hard links."""
    target = Path(dst)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        return False
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return True


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (checkpoints, store units)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
