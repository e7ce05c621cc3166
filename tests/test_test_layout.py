"""The layout of the tests themselves (issue 47): shared helpers live in `tests/support/`
(or fixtures in `tests/conftest.py`), so no test module imports another; one free-port
helper; the CPU's name read in one place (`pmnet.hardware.cpu_kind`)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _is_test_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return (parts[0] == "tests" and len(parts) >= 2 and parts[1].startswith("test_")) or \
        (len(parts) == 1 and parts[0].startswith("test_") and (TESTS / f"{parts[0]}.py").exists())


def test_no_test_module_imports_another():
    offending = [f"{p.relative_to(REPO)}:{line}: {mod}"
                 for p in sorted(TESTS.rglob("*.py"))
                 for line, mod in _imported_modules(p) if _is_test_module(mod)]
    assert offending == [], ("move what is shared into tests/support/ (or a fixture into "
                             "tests/conftest.py):\n" + "\n".join(offending))


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    """Not vacuous: each way of importing a test module is found."""
    for line in ("from tests.test_pipeline import cli", "import tests.test_stats",
                 "from tests import test_faults", "from .test_pipeline import cli"):
        path = TESTS / "_layout_probe.py"
        try:
            path.write_text(line + "\n")
            assert any(_is_test_module(m) for _, m in _imported_modules(path)), line
        finally:
            path.unlink(missing_ok=True)
    assert not _is_test_module("tests.support.pipeline")


def _returns_a_bound_port(fn: ast.FunctionDef) -> bool:
    """`return <socket>.getsockname()[1]` somewhere in `fn`: a port helper."""
    return any(isinstance(n, ast.Return) and n.value is not None
               and ast.unparse(n.value).endswith(".getsockname()[1]") for n in ast.walk(fn))


def test_one_free_port_helper():
    found = [f"{p.relative_to(REPO)}:{fn.lineno} {fn.name}"
             for p in sorted(TESTS.rglob("*.py"))
             for fn in ast.walk(ast.parse(p.read_text()))
             if isinstance(fn, ast.FunctionDef) and _returns_a_bound_port(fn)]
    assert found == ["tests/support/net.py:8 free_port"], found


def test_the_cpu_name_is_read_in_one_place():
    needle = "model" + " name"  # not this file
    readers = sorted(str(p.relative_to(REPO)) for d in ("pmnet", "pipelines", "tune_spaces",
                                                        "benchmarks", "tests", "experiments")
                     for p in (REPO / d).rglob("*.py")
                     if needle in (t := p.read_text(errors="replace"))
                     and "/proc/" + "cpuinfo" in t)
    assert readers == ["pmnet/hardware.py"], readers
