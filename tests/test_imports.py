"""Dependencies run one way (issues 22, 51): core <- analysis <- `tune_spaces` <- `pipelines`,
and within them the layers of docs/design.md ("Layers: which module may import which"),
read from its table: a module imports only modules of its own layer or of a lower one, no
two modules import each other through any chain, and no two of `pmnet`'s subpackages do.
docs/design.md's module map names every module (`test_the_module_map_names_every_module`).

Read from the source with `ast` (nothing is imported or executed): every `import` and
`from ... import` of a module counts, at any depth (inside functions and `if TYPE_CHECKING:`
blocks too), resolved to the module of this repository it names (`from pmnet.train import
run_phase2` -> `pmnet.train`, `from pmnet.train.config import TrainConfig` ->
`pmnet.train.config`). A package's `__init__` is its own module; importing a submodule is
not counted as importing its package's `__init__`. An import inside a function counts like
any other: it runs whenever the function does, so a lazy import that ran up the layers would
still tie the lower module to the upper one (docs/design.md, "Layers").
"""

from __future__ import annotations

import ast
import re
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


# -- the layers of docs/design.md (issue 51) -----------------------------------------------

DESIGN = ROOT / "docs" / "design.md"


def _design_section(title: str) -> str:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _layers() -> list[tuple[int, str, tuple[str, ...]]]:
    """docs/design.md's layer table (`| layer | modules | what the layer is |`): (number,
    what, modules) per row, bottom first."""
    rows = []
    for line in _design_section("Layers: which module may import which").splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|([^|]*)\|\s*([^|]*?)\s*\|", line)
        if m:
            rows.append((int(m[1]), m[3], tuple(re.findall(r"`([\w.]+)`", m[2]))))
    return rows


LAYERS = _layers()


def _covers(entry: str, module: str) -> bool:
    """A table entry names a module and, when it is a package other than the root `pmnet`
    (whose modules sit in many layers: `pmnet` is its `__init__` only), every module in it."""
    return module == entry or (entry != "pmnet" and module.startswith(entry + "."))


def layer_of(module: str, layers=None) -> int | None:
    """The layer of `module`: the row of its longest covering entry (None: no row)."""
    best = None
    for number, _, entries in LAYERS if layers is None else layers:
        for e in entries:
            if _covers(e, module) and (best is None or len(e) > len(best[0])):
                best = (e, number)
    return None if best is None else best[1]


def arrows_up(graph: dict[str, set[str]], layers=None) -> list[str]:
    """Every import from a module to one of a higher layer, named with both layers."""
    out = []
    for m in sorted(graph):
        for t in sorted(graph[m]):
            lm, lt = layer_of(m, layers), layer_of(t, layers)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} (layer {lm}) imports {t} (layer {lt})")
    return out


def _unit(module: str) -> str:
    """What a package-level circle is made of: a subpackage of a root package (`pmnet.train`,
    `pmnet.gpu`, ...) stands for all of its modules; any other module for itself."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[0] / parts[1] / "__init__.py").is_file():
        return ".".join(parts[:2])
    return module


def test_the_layer_table_is_read_and_judges_arrows():
    # a broken reader would pass the tests below: the table holds what they rely on
    assert [n for n, _, _ in LAYERS] == list(range(1, len(LAYERS) + 1)) and len(LAYERS) >= 8
    assert layer_of("pmnet.model") < layer_of("pmnet.train.phases") < layer_of("pipelines.plan")
    assert layer_of("pmnet.config") < layer_of("pmnet.model_files") < layer_of("pmnet.diagnose")
    assert layer_of("pmnet.gpu.cap") < layer_of("pmnet.train") < layer_of("pmnet.gpu_check.run")
    assert layer_of("pmnet.no_such_module") is None  # `pmnet` covers its own __init__ only
    unknown = [e for _, _, entries in LAYERS for e in entries if e not in MODULES]
    assert unknown == [], f"the layer table names modules that do not exist: {unknown}"
    toy = [(1, "low", ("a",)), (2, "high", ("b",))]
    assert arrows_up({"a": {"b"}, "b": {"a"}}, toy) == ["a (layer 1) imports b (layer 2)"]
    assert arrows_up({"a.x": set(), "b.y": {"a.x"}}, toy) == []


def test_every_module_has_a_layer():
    """A new module gets a row (or an entry) in docs/design.md's layer table."""
    assert [m for m in sorted(MODULES) if layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    """No import, at any depth, from a module to one of a higher layer (issue 51: on 59c51a0
    `pmnet.gpu.check` imported `pmnet.train`, whose `phases` imported `pmnet.gpu.cap`, and
    `pmnet.train.phases` -> `pmnet.diagnose` -> `pmnet.train.model_files`)."""
    assert arrows_up(GRAPH) == []


def test_no_import_cycle_among_all_modules():
    """No circle between any modules of `pmnet/`, `pipelines/` and `tune_spaces/`."""
    assert _cycles(GRAPH, set(GRAPH)) == []


def test_no_two_subpackages_of_pmnet_import_each_other():
    """Collapsed to `pmnet`'s subpackages and top-level modules, the graph has no circle
    either (59c51a0: `pmnet.train` <-> `pmnet.gpu`, `pmnet.train` <-> `pmnet.diagnose`)."""
    units: dict[str, set[str]] = {}
    for m, targets in GRAPH.items():
        if _within(m, ("pmnet",)):
            units.setdefault(_unit(m), set()).update(_unit(t) for t in targets)
    for u in units:
        units[u].discard(u)
    assert {"pmnet.train", "pmnet.gpu", "pmnet.report"} <= set(units)
    assert _cycles(units, set(units)) == []


#: the most lines a product module may have (issue 51): past it, split it along its concerns
MAX_MODULE_LINES = 900


def test_no_product_module_is_over_900_lines():
    """Every module of `pmnet/`, `pipelines/` and `tune_spaces/` stays readable in one sitting
    (59c51a0: `pmnet/gpu/check.py` 974, `pmnet/model.py` 919)."""
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for path in MODULES.values()}
    assert sizes["pmnet/model.py"] > 100  # the reader sees the modules
    assert {f: n for f, n in sizes.items() if n > MAX_MODULE_LINES} == {}


# -- the module map (issue 51) -------------------------------------------------------------


def test_the_module_map_names_every_module():
    """docs/design.md names every module of `pmnet/`, `pipelines/` and `tune_spaces/` in
    backticks, by its path (`pmnet/gpu/cap.py`) or its dotted name (`pmnet.gpu.cap`)."""
    text = DESIGN.read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w./]+)`", text))
    missing = []
    for module, path in sorted(MODULES.items()):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in named and module not in named:
            missing.append(rel)
    assert missing == [], f"docs/design.md's module map lacks {missing}"


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
