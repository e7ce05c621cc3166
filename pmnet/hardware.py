"""What this machine's CPU is, in words, for the records and benchmarks (no torch import)."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_kind(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name and its widest matrix/vector unit: `Intel(R) Xeon(R) Platinum
    8488C AMX`, `AMD EPYC 9654 96-Core Processor AVX-512`, or the bare name; where there is
    no /proc/cpuinfo (macOS, Windows), `platform.processor()` or `unknown`."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or "unknown"
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    name = name or platform.processor() or "unknown"
    if "amx_tile" in flags:
        return f"{name} AMX"
    if "avx512f" in flags:
        return f"{name} AVX-512"
    return name
