"""`pmnet.hardware.cpu_kind`: the CPU's name and its widest unit, from the kernel's cpuinfo."""

from __future__ import annotations

import platform

from pmnet.hardware import cpu_kind

INFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx2 {flags}

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu
"""


def test_name_and_widest_unit(tmp_path):
    path = tmp_path / "cpuinfo"
    for flags, suffix in (("avx512f amx_tile amx_bf16", " AMX"), ("avx512f avx512_bf16",
                                                                   " AVX-512"), ("", "")):
        path.write_text(INFO.format(flags=flags))
        assert cpu_kind(path) == "Intel(R) Xeon(R) Platinum 8488C" + suffix


def test_no_cpuinfo(tmp_path):
    assert cpu_kind(tmp_path / "none") == (platform.processor() or "unknown")


def test_this_machine():
    assert cpu_kind().strip()
