"""pyproject.toml (issue 47): metadata that setuptools will keep building after its
deprecation deadlines, and the Python the tested dependencies need."""

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_is_an_spdx_expression_with_its_file():
    """A TOML-table `license` is deprecated by setuptools, which stops building it on
    2027-02-18; PEP 639's SPDX string needs setuptools >= 77 and names its files."""
    meta = PROJECT["project"]
    assert meta["license"] == "MIT"
    assert all((ROOT / f).is_file() for f in meta["license-files"])
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    build = PROJECT["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in build), build


def test_requires_python_is_what_the_tested_stack_needs():
    """pandas 3.1 and numpy 2.4 (the tested versions, docker/constraints.txt) need 3.11: a
    lower bound below it would let pip pick untested releases; ruff targets the same."""
    assert PROJECT["project"]["requires-python"] == ">=3.11"
    assert PROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert sys.version_info >= (3, 11)
