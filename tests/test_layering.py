"""The package's import structure, read from the source with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` count too); nothing is run.

Each folder of ``torch_gradstats/`` is a floor (docs/design.md), bottom up: ``ops`` (the op, its kernels' loader,
the fallback, the checks, the one host transfer), ``distributed`` (figures across ranks), ``stats`` (statistics with
names, reports, groups, health), ``policies`` (clipping, the spike guard, adaptive clipping), ``monitors`` and
``compat`` (beside each other: activations, update ratios, noise scale; drop-ins for other frameworks),
``training``, ``integrations``, ``cli``; then the package's own modules (its ``__init__``, which only re-exports, and
the documented module paths kept at the top); ``bench`` last. A module imports only floors below its own, or modules
of its own folder; importing ``a.b.c`` runs the ``__init__`` of ``a.b`` too, so that counts as an import of it, and
there is no import cycle, not even through an ``__init__``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = "torch_gradstats"
# The package the tests import (the source tree, or site-packages when the tests run against an installed wheel).
_SPEC = importlib.util.find_spec(PACKAGE)
assert _SPEC is not None and _SPEC.submodule_search_locations, f"{PACKAGE} is not importable"
ROOT = Path(next(iter(_SPEC.submodule_search_locations)))

#: The floor of each folder; "" is the package's own top-level modules.
FLOORS = {
    "ops": 0,
    "distributed": 1,
    "stats": 2,
    "policies": 3,
    "monitors": 4,
    "compat": 4,
    "training": 5,
    "integrations": 6,
    "cli": 7,
    "": 8,
    "bench": 9,
}
MAX_TOP_LEVEL_FILES = 8
MAX_MODULE_LINES = 600

#: Private names one module may import from another, with the reason. None today: what several modules share is
#: public in the module that owns it (the walk over parameters is torch_gradstats.stats._params's).
ALLOWED_PRIVATE: set[tuple[str, str]] = set()

#: Host reads outside torch_gradstats.ops._transfer, with the reason they are not on a per-step path.
ALLOWED_HOST_READS = {
    # A HealthPolicy field given as a one-element tensor is read once, when the policy is built.
    ("torch_gradstats.stats.health", "item"),
    # The fallback reads a batch's min/max |x| only where the batch is on the CPU: no transfer, no sync.
    ("torch_gradstats.ops.fallback", "tolist"),
    ("torch_gradstats.ops._fallback_batch", "tolist"),
    # A DeviceMesh's rank list is a CPU tensor (metadata, no transfer), read once per mesh and kept.
    ("torch_gradstats.distributed._reduce_plan", "tolist"),
    # A sink writes a figure someone put in report.extra as a numpy scalar or a one-element tensor as the number it
    # holds (integrations.sinks.plain_values); the package's own figures are plain Python numbers already.
    ("torch_gradstats.integrations.sinks", "item"),
}
#: Floors whose modules may read the host freely: the entry points, not a per-step path.
HOST_READ_FREE_FLOORS = {"cli", "", "bench"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    assert f"{PACKAGE}.ops.op" in out, f"no package sources under {ROOT}"  # never check an empty tree
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, modules: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of a package module in ``name``."""
    tree = ast.parse(modules[name].read_text(), filename=str(modules[name]))
    here = name if _is_package(name, modules) else name.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:  # `from package import module`
                    found.append((sub, None, node.lineno))
                else:
                    found.append((base, alias.name, node.lineno))
    return found


def _folder(name: str) -> str:
    """The top-level folder a module lives in ("" for the package's own modules)."""
    parts = name.split(".")
    if len(parts) == 1:
        return ""
    return parts[1] if (ROOT / parts[1]).is_dir() else ""


def _floor(name: str) -> int:
    folder = _folder(name)
    assert folder in FLOORS, f"the folder torch_gradstats/{folder}/ has no floor: add it to FLOORS and docs/design.md"
    return FLOORS[folder]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: what it names, and the ``__init__`` of every package on the way
    that is not already its own ancestor (an ancestor is running already when the module runs)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m in modules:
        own = set(_ancestors(m))
        for target, attr, _ in _imports(m, modules):
            if target == m:
                continue
            if target in own and attr is None:
                continue  # `import torch_gradstats.x` inside torch_gradstats: the parent runs already
            graph[m].add(target)  # names taken from an ancestor's __init__ are an import of it
            graph[m].update(a for a in _ancestors(target) if a not in own)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# ------------------------------------------------------------------------------------------------- the checker
def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_reads_imports_inside_functions_and_through_init():
    graph = _graph()
    deps = graph["torch_gradstats.stats.gradients"]
    assert "torch_gradstats.distributed.reduce" in deps  # imported inside grad_stats()
    assert "torch_gradstats.distributed" in deps  # ... which runs distributed/__init__.py
    assert "torch_gradstats.ops._transfer" in deps
    assert "torch_gradstats.stats" not in deps  # its own package runs already


def test_the_checker_sees_a_cycle_through_an_init():
    """A module that takes a name from its own package's ``__init__``, which imports it back, is a cycle."""
    graph = {
        "torch_gradstats.integrations": {"torch_gradstats.integrations.files"},
        "torch_gradstats.integrations.files": {"torch_gradstats.integrations"},
    }
    assert _cycles(graph) == [["torch_gradstats.integrations", "torch_gradstats.integrations.files"]]


# ------------------------------------------------------------------------------------------------- the package
def test_every_folder_has_a_floor():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FLOORS) - {""}


def test_the_top_level_keeps_few_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, top


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_each_module_imports_only_floors_below_or_its_own_folder():
    bad = []
    for m, targets in _graph().items():
        for t in targets:
            if _floor(t) < _floor(m) or _folder(t) == _folder(m):
                continue
            bad.append(f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})")
    assert bad == []


def test_package_inits_only_re_export():
    """An ``__init__.py`` holds a docstring, imports and ``__all__``: no definitions, no logic."""
    bad = []
    for path in _modules().values():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str):
                continue  # the docstring
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                continue
            bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {type(node).__name__}")
    assert bad == []


def test_no_module_is_too_long():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_private_names_imported_across_modules():
    modules = _modules()
    bad = []
    for m in modules:
        for target, attr, line in _imports(m, modules):
            if attr is None or not attr.startswith("_") or attr.startswith("__") or target == m:
                continue
            if (target, attr) not in ALLOWED_PRIVATE:
                bad.append(f"{modules[m].relative_to(ROOT.parent)}:{line} imports {attr} from {target}")
    assert bad == []


def test_only_transfer_moves_values_to_the_host():
    """Library modules below the entry points leave device-to-host copies to torch_gradstats.ops._transfer."""
    calls = {"cpu", "item", "tolist", "numpy"}
    bad = []
    for m, path in _modules().items():
        if _folder(m) in HOST_READ_FREE_FLOORS or m == "torch_gradstats.ops._transfer":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in calls
                and (m, node.func.attr) not in ALLOWED_HOST_READS
            ):
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} calls .{node.func.attr}()")
    assert bad == []
