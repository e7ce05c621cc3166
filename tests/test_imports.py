"""Dependencies run one way (issue 22): core <- analysis <- `tune_spaces` <- `pipelines`.

Read from the source with `ast` (nothing is imported or executed): every `import` and
`from ... import` of a module counts, at any depth (inside functions and `if TYPE_CHECKING:`
blocks too), resolved to the module of this repository it names (`from pmnet.train import
run_phase2` -> `pmnet.train`, `from pmnet.train.config import TrainConfig` ->
`pmnet.train.config`). A package's `__init__` is its own module; importing a submodule is
not counted as importing its package's `__init__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pmnet", "pipelines", "tune_spaces")
#: the model, the task and training: what the analysis layer and the pipeline build on
CORE = ("pmnet.model", "pmnet.operators", "pmnet.task", "pmnet.evaluate", "pmnet.runner",
        "pmnet.train", "pmnet.config", "pmnet.conditions", "pmnet.io", "pmnet.persist")
ANALYSIS = ("pmnet.report", "pmnet.stats")


def _module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for f in sorted((ROOT / package).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


MODULES = _module_files()


def _resolve(name: str) -> str | None:
    """The repository module `name` lies in (a name imported from a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..a import b
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {r for r in map(_resolve, names) if r is not None and r != module}
    return found


GRAPH = {m: _imports(m, f) for m, f in MODULES.items()}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _cycles(graph: dict[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """The import cycles among `nodes` of `graph`: strongly connected components of more
    than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v] & nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _violations(importers, forbidden) -> list[str]:
    return [f"{m} imports {t}" for m in sorted(GRAPH) if _within(m, importers)
            for t in sorted(GRAPH[m]) if _within(t, forbidden)]


def test_the_import_graph_is_read():
    # the reader sees what the tests below rely on (a broken reader would pass them all)
    assert {"pmnet.model", "pmnet.train", "pmnet.train.phases", "pipelines.plan",
            "tune_spaces.grids"} <= set(MODULES)
    assert "pmnet.model" in GRAPH["pmnet.operators"]  # top-level from-import
    assert "pmnet.train.config" in GRAPH["pmnet.train.phases"]
    assert "pmnet.diagnose" in GRAPH["pmnet.train.phases"]  # an import inside a function
    assert "pmnet.train" in GRAPH["pipelines.trial"]  # `from pmnet.train import name`
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(toy, set(toy)) == [["a", "b", "c"]]
    assert _cycles(toy, {"a", "b", "d", "e"}) == []


def test_pmnet_imports_neither_pipelines_nor_tune_spaces():
    assert _violations(("pmnet",), ("pipelines", "tune_spaces")) == []


def test_tune_spaces_imports_nothing_from_pipelines():
    assert _violations(("tune_spaces",), ("pipelines",)) == []


def test_the_core_does_not_import_the_analysis_layer():
    assert _violations(CORE, ANALYSIS) == []


def test_no_import_cycle_among_pmnet_modules():
    assert _cycles(GRAPH, {m for m in GRAPH if _within(m, ("pmnet",))}) == []


def test_pipelines_start_no_mlflow_server_of_their_own():
    """The driver writes the store itself (issue 22): no server or guard module, and the only
    `mlflow server` any pipelines module launches is `make ui`'s (`run.cmd_ui`)."""
    mods = {m for m in GRAPH if _within(m, ("pipelines",))}
    assert mods and not {"pipelines.mlflow_server", "pipelines.mlflow_guard"} & mods
    launches = []
    for path in sorted((ROOT / "pipelines").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.List) and {"mlflow", "server"} <= {
                            e.value for e in node.elts if isinstance(e, ast.Constant)}:
                        launches.append((path.stem, fn.name))
    assert launches == [("run", "cmd_ui")]


def test_no_import_cycle_among_pipelines_modules():
    assert _cycles(GRAPH, {m for m in GRAPH if _within(m, ("pipelines",))}) == []


def test_every_definition_of_pipelines_is_assigned_a_concern():
    """docs/design.md's table of what the lines of `pipelines/` buy stays whole: the
    accounting script exits 1 and names any top-level definition it has no concern for."""
    import subprocess
    import sys

    script = ROOT / "experiments" / "pipeline_lines" / "account.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    total = sum(len(f.read_text().splitlines()) for f in (ROOT / "pipelines").glob("*.py"))
    assert f"**{total:,}**" in out.stdout  # every line of pipelines/ is in the table
