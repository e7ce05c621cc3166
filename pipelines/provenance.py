"""What ran: the code's git commit and the versions of the packages that matter."""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> dict[str, str]:
    def run(*args):
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = run("rev-parse", "HEAD")
    dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    return {"git_commit": commit or "unknown", "git_dirty": str(dirty).lower()}


def package_versions() -> dict[str, str]:
    return {"python": platform.python_version(),
            **{pkg: version(pkg)
               for pkg in ("torch", "lightning", "ray", "mlflow", "numpy", "pandas")}}


def device_kind(accelerator: str = "cpu") -> str:
    """What a unit trains on: the GPU's name (`accelerator` "gpu"), else this machine's CPU
    (`pmnet.hardware.cpu_kind`, the one place the project reads the CPU's name)."""
    if accelerator == "gpu":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - provenance only: never fail a unit for it
            pass
    from pmnet.hardware import cpu_kind

    return cpu_kind()
