"""The package's import structure: no import cycles, each module imports only layers below it, no private names
imported across modules. Read from the source with ``ast`` (imports inside functions count too), nothing is run.

The layers (docs/design.md), bottom up: the input checks, the transfer module and the library loader; the
pure-PyTorch fallback; the op; health and the cross-rank reduction; the host-side report; the device-side
statistics; their users (clip, collector, updates); the Trainer; the integrations; and at the top the entry points
(cli, demo, bench, the package's ``__init__``). A module not listed here counts as an entry point: it may
import anything, and nothing listed may import it.
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

LAYERS = {
    "torch_gradstats._extension": 0,
    "torch_gradstats._transfer": 0,
    "torch_gradstats._checks": 0,
    "torch_gradstats._pieces": 0,  # how the pure-PyTorch kernels cut tensors into pieces
    "torch_gradstats._fallback_workspace": 0.5,  # the fallback's per-thread buffers
    "torch_gradstats.fallback": 1,
    "torch_gradstats.fallback_histogram": 1.5,  # the histogram overload's fallback, built on the pieces of fallback
    "torch_gradstats.ops": 2,
    "torch_gradstats.health": 3,
    "torch_gradstats._layout": 0,
    "torch_gradstats._reduce_plan": 2.5,  # what distributed reduces over which group (DTensor planning)
    "torch_gradstats.distributed": 3,
    "torch_gradstats._scalars": 3,
    "torch_gradstats.exponents": 3,  # the host-side exponent histogram that reports hold
    "torch_gradstats.report": 4,
    "torch_gradstats.groups": 4.5,  # per-group figures from per-parameter ones; GradStats.grouped delegates here
    "torch_gradstats._params": 4.8,  # the walk over parameters that stats and its users share
    "torch_gradstats.stats": 5,
    "torch_gradstats.activations": 5,  # and every module of the activations package
    "torch_gradstats.clip": 6,
    "torch_gradstats.compat": 6.5,  # drop-ins that read like stats.py and scale through clip.py
    "torch_gradstats.collector": 6,
    "torch_gradstats.updates": 6,
    "torch_gradstats.noise_scale": 6,
    "torch_gradstats.guard": 6,
    "torch_gradstats.adaptive_clip": 6.5,  # a policy like guard, that clips through clip
    "torch_gradstats.training": 7,  # and every module of the training package
    "torch_gradstats.integrations": 8,  # and every module of the integrations package
}
TOP = 100  # entry points: anything not listed
#: Modules of one package may import each other (cycles are still forbidden).
SAME_LAYER_OK = {
    "torch_gradstats.training",
    "torch_gradstats.integrations",
    "torch_gradstats.activations",
    "torch_gradstats.compat",
}

#: Private names one module may import from another, with the reason. None today: what several modules share is
#: public in the module that owns it (the walk over parameters is torch_gradstats._params's).
ALLOWED_PRIVATE: set[tuple[str, str]] = set()

#: Host reads outside torch_gradstats._transfer, with the reason they are not on a per-step path.
ALLOWED_HOST_READS = {
    # A HealthPolicy field given as a one-element tensor is read once, when the policy is built.
    ("torch_gradstats.health", "item"),
    # The fallback reads a batch's min/max |x| only where the batch is on the CPU: no transfer, no sync.
    ("torch_gradstats.fallback", "tolist"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    assert f"{PACKAGE}.ops" in out, f"no package sources under {ROOT}"  # never check an empty tree
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


def _layer(name: str) -> int:
    for prefix, layer in LAYERS.items():
        if name == prefix or name.startswith(prefix + "."):
            return layer
    return TOP


def _group(name: str) -> str | None:
    return next((g for g in SAME_LAYER_OK if name == g or name.startswith(g + ".")), None)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m in modules:
        for target, _, _ in _imports(m, modules):
            if target != m and not m.startswith(target + "."):  # a parent package is not an import of its child
                graph[m].add(target)
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


def test_the_checker_reads_imports_inside_functions():
    graph = _graph()
    assert "torch_gradstats.distributed" in graph["torch_gradstats.stats"]  # imported inside grad_stats()
    assert "torch_gradstats._transfer" in graph["torch_gradstats.stats"]


# ------------------------------------------------------------------------------------------------- the package
def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_each_module_imports_only_layers_below_it():
    bad = []
    for m, targets in _graph().items():
        for t in targets:
            same_group = _group(m) is not None and _group(m) == _group(t)
            if _layer(t) < _layer(m) or same_group or (_layer(m) == TOP and _layer(t) == TOP):
                continue
            bad.append(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})")
    assert bad == []


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
    """Library modules below the entry points leave device-to-host copies to torch_gradstats._transfer."""
    calls = {"cpu", "item", "tolist", "numpy"}
    bad = []
    for m, path in _modules().items():
        if _layer(m) == TOP or m == "torch_gradstats._transfer":
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
