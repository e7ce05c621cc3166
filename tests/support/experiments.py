"""Load a script of `experiments/` (kept out of the library, so not importable as a package)
as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str) -> ModuleType:
    """`experiments/<name>.py`, executed once as a module named `name` (registered in
    `sys.modules` first, as an import would: a dataclass looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
