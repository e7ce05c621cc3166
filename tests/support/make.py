"""`make -n` of the repository's Makefile, as a user's shell would run it: run from `make
test`, the child would otherwise inherit the parent make's MAKEFLAGS / MAKELEVEL (its
command-line variables, and "Entering directory" lines in the output)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: what a parent make passes its children through the environment
PARENT_MAKE_VARS = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")


def make_dry_run(*args: str, drop: tuple[str, ...] = ()) -> str:
    """stdout of `make -n ARGS` in the repository (skip without make); `drop` names
    environment variables to leave out besides a parent make's."""
    return make_output("-n", *args, drop=drop)


def make_output(*args: str, drop: tuple[str, ...] = ()) -> str:
    """stdout of `make ARGS` in the repository (skip without make): for targets that only
    print (`help`); `make_dry_run` for the rest."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k not in (*PARENT_MAKE_VARS, *drop)}
    out = subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout
