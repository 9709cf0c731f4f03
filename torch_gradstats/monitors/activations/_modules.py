"""Which modules an :class:`~torch_gradstats.ActivationWatch` sees: the user's model inside its wrappers, the paths
without the wrappers' own components, and the selection of modules to watch.

Split from _watch.py, the hooks and the step's bookkeeping: this is the model tree, read once when a watch is made.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TypeAlias

from torch import nn

__all__ = ["ModuleSelection", "is_compiled", "named_modules", "selector", "unwrap"]

#: Which modules to watch: None (the default set), module types, or a predicate on (path, module).
ModuleSelection: TypeAlias = "type | tuple[type, ...] | Callable[[str, nn.Module], bool] | None"

#: A child attribute that a wrapper adds to every path below it (torch.compile, FSDP1, activation checkpointing).
_WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def is_compiled(module: nn.Module) -> bool:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def _is_wrapper_child(parent: nn.Module, attr: str) -> bool:
    if attr in _WRAPPER_ATTRS:
        return True
    # DistributedDataParallel and DataParallel keep the user's model as `.module`.
    return attr == "module" and isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / torch.compile / FSDP1 / checkpoint wrappers."""
    while True:
        children = dict(model.named_children())
        inner = next((c for a, c in children.items() if _is_wrapper_child(model, a)), None)
        if inner is None or len(children) != 1:
            return model
        model = inner


def named_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` with every wrapper's own component left out of the paths (and wrappers skipped)."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if is_compiled(module) and module is not root:
            yield path, module  # one graph: watched as a whole, from outside
            continue
        children = list(module.named_children())
        wrapper = any(_is_wrapper_child(module, a) for a, _ in children)
        if not wrapper:
            yield path, module
        for attr, child in reversed(children):
            if _is_wrapper_child(module, attr):
                stack.append((path, child))
            else:
                stack.append((f"{path}.{attr}" if path else attr, child))


def _default_selection(module: nn.Module) -> bool:
    """Every leaf module, and every module that owns parameters directly (not through its children)."""
    if is_compiled(module):
        return True
    return next(module.children(), None) is None or next(module.parameters(recurse=False), None) is not None


def selector(modules: ModuleSelection) -> Callable[[str, nn.Module], bool]:
    if modules is None:
        return lambda _path, module: _default_selection(module)
    if isinstance(modules, type):
        modules = (modules,)
    if isinstance(modules, tuple):
        if not modules or not all(isinstance(t, type) for t in modules):
            raise TypeError(
                "ActivationWatch: modules must be None, a module type, a non-empty tuple of types or a "
                f"callable (path, module) -> bool, got {modules!r}"
            )
        types = modules
        return lambda _path, module: isinstance(module, types)
    if callable(modules):
        predicate = modules
        return lambda path, module: bool(predicate(path, module))
    raise TypeError(
        "ActivationWatch: modules must be None, a module type, a tuple of types or a callable "
        f"(path, module) -> bool, got {type(modules).__name__}"
    )
