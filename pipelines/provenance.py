"""What ran: the code's git commit and the versions of the packages that matter."""

from __future__ import annotations

import platform
import subprocess
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
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "lightning", "ray", "mlflow", "numpy", "pandas"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out



def cpu_kind() -> str:
    """This machine's CPU model with its widest matrix/vector extension: `Intel(R) Xeon(R)
    Platinum 8480+ AMX`, `... AVX-512`, or the model alone (`/proc/cpuinfo`; elsewhere
    `platform.processor()`). The one place the pipeline reads the CPU's name (unit
    provenance, `pipelines.store`)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.lower().startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                      if ln.lower().startswith("flags")), []))
    extra = " AMX" if "amx_tile" in flags else (" AVX-512" if "avx512f" in flags else "")
    return (name or platform.processor() or "unknown CPU") + extra


def device_kind(accelerator: str = "cpu") -> str:
    """What a unit trains on: the GPU's name (`accelerator` "gpu"), else `cpu_kind()`."""
    if accelerator == "gpu":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - provenance only: never fail a unit for it
            pass
    return cpu_kind()


def torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "missing"
