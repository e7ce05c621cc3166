"""Deprecations from this project's own code fail the suite (issue 47: the pytest config
hid every DeprecationWarning, which is how setuptools' license deprecation went unseen).

pyproject's `filterwarnings` makes a DeprecationWarning, PendingDeprecationWarning or
FutureWarning attributed to a module of `pmnet`, `pipelines` or `tune_spaces` an error:
one the project raises, or a library's that points at the project's call (stacklevel).
Other libraries' deprecations are shown, or ignored where named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILTERS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"]["filterwarnings"]

PROBE = '''
import warnings


def _warn_from(module, category):
    """warnings.warn as if called in `module` (its frame's __name__ is what filters match)."""
    code = compile("def f():\\n    warnings.warn('old API', CATEGORY)\\n", module, "exec")
    g = {"__name__": module, "warnings": warnings, "CATEGORY": category}
    exec(code, g)
    g["f"]()


def test_ours_deprecation():
    _warn_from("pmnet.probe", DeprecationWarning)


def test_ours_pending():
    _warn_from("tune_spaces", PendingDeprecationWarning)


def test_ours_future():
    _warn_from("pipelines.run", FutureWarning)


def test_theirs():
    _warn_from("somelib.sub", DeprecationWarning)


def test_a_name_that_only_starts_like_ours():
    _warn_from("pmnetwork", DeprecationWarning)
'''


def test_own_deprecations_fail_and_others_do_not(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
                        "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-p",
                        "no:randomly", "-q", "-rfE", str(tmp_path / "test_probe.py")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    failed = set(re.findall(r"FAILED \S+::(\w+)", out))
    assert failed == {"test_ours_deprecation", "test_ours_pending", "test_ours_future"}, out
    assert "DeprecationWarning: old API" in out and "FutureWarning: old API" in out
    assert re.search(r"3 failed, 2 passed", out), out


def test_the_filters_name_the_project_and_hide_nothing_wholesale():
    for package in ("pmnet", "pipelines", "tune_spaces"):
        for category in ("DeprecationWarning", "FutureWarning"):
            assert any(f.startswith(f"error::{category}:") and package in f
                       for f in FILTERS), (package, category)
    for f in FILTERS:
        action, _, rest = f.partition(":")
        if action == "ignore":  # a third-party ignore names the module that warns
            assert rest.split(":")[2:3] not in ([], [""]), f"{f}: name the module"


def test_importing_every_module_raises_no_deprecation_of_ours():
    """Every module of the three packages imports with the project's deprecation filters
    as errors (in a fresh interpreter: nothing imported before)."""
    code = f"""
import importlib, pkgutil, warnings
for f in {FILTERS!r}:
    action, message, category, module = (f.split(":") + ["", "", "", ""])[:4]
    if action == "error" and module:  # the project's own modules
        warnings.filterwarnings("error", category=getattr(__builtins__, category),
                                module=module)
n = 0
for pkg in ("pmnet", "pipelines", "tune_spaces"):
    m = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(m.__path__, pkg + "."):
        importlib.import_module(info.name)
        n += 1
print(n)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ,
                                                 "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-4000:]
    assert int(r.stdout.split()[-1]) > 50
