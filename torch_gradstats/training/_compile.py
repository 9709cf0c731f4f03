"""The optional compiled forward+loss of the Trainer, cached per model architecture."""

from __future__ import annotations

import dataclasses
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "COMPILE_CACHE",
    "CompiledEntry",
    "LossFn",
    "clear_compile_cache",
    "forward_loss",
    "get_compiled",
    "run_forward",
]

logger = logging.getLogger("torch_gradstats")

LossFn = Callable[[Tensor, Tensor], Tensor]


def forward_loss(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> Tensor:
    """The eager forward and loss (what is compiled)."""
    return loss_fn(model(inputs), targets)


@dataclasses.dataclass
class CompiledEntry:
    fn: Callable[..., Tensor]
    failed: bool = False


COMPILE_CACHE: dict[tuple[Any, ...], CompiledEntry] = {}
_COMPILE_LOCK = threading.Lock()


def _architecture_key(model: nn.Module, loss_fn: LossFn, mode: str | None, backend: Any) -> tuple[Any, ...]:
    """What a compiled forward depends on: the model's class, parameter/buffer layout, loss type and options.

    Two instances of one architecture share an entry (dynamo guards handle the rest); a different architecture
    gets its own entry instead of recompiling one singleton (the flaw of a single ``functools.cache``).
    """
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type) for n, p in model.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers())
    loss_key = type(loss_fn) if isinstance(loss_fn, nn.Module) else loss_fn
    return (type(model), params, buffers, loss_key, mode, backend)


def get_compiled(model: nn.Module, loss_fn: LossFn, mode: str | None, backend: Any) -> CompiledEntry:
    """The cached compiled forward for ``model``'s architecture, compiling it on first use."""
    key = _architecture_key(model, loss_fn, mode, backend)
    with _COMPILE_LOCK:
        entry = COMPILE_CACHE.get(key)
        if entry is None:
            kwargs: dict[str, Any] = {"backend": backend}
            if mode is not None:
                kwargs["mode"] = mode
            # A code object of its own per architecture: dynamo counts recompiles per code object, so sharing
            # forward_loss would make architectures share one recompile limit and silently fall back to eager.
            code = forward_loss.__code__.replace(co_name=f"_forward_loss_{len(COMPILE_CACHE)}")
            forward = types.FunctionType(code, forward_loss.__globals__, code.co_name)
            try:
                fn = torch.compile(forward, **kwargs)
            except Exception as exc:  # noqa: BLE001 - bad options; compile errors proper surface at the first call
                logger.warning("torch_gradstats: torch.compile(%s) failed (%s); running eagerly", kwargs, exc)
                entry = CompiledEntry(forward_loss, failed=True)
            else:
                entry = CompiledEntry(fn)
            COMPILE_CACHE[key] = entry
        return entry


def clear_compile_cache() -> None:
    """Forget every compiled train step (e.g. between experiments, or in tests)."""
    with _COMPILE_LOCK:
        COMPILE_CACHE.clear()


def run_forward(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, *, compile: bool, mode: str | None, backend: Any
) -> Tensor:
    """Forward and loss, through the cached compiled step when ``compile`` (eager after a compile failure)."""
    if not compile:
        return forward_loss(model, inputs, targets, loss_fn)
    entry = get_compiled(model, loss_fn, mode, backend)
    if entry.failed:
        return forward_loss(model, inputs, targets, loss_fn)
    if mode in ("reduce-overhead", "max-autotune"):
        # CUDA-graph modes reuse output buffers across replays: mark each step (the loss is consumed at once).
        torch.compiler.cudagraph_mark_step_begin()
    try:
        return entry.fn(model, inputs, targets, loss_fn)
    except Exception as exc:  # noqa: BLE001 - decided below: a user error is raised again by the eager run
        # If the error was the user's (a shape mismatch, say), the eager run raises it again and compilation
        # stays on for the next call; only a failure of compilation itself falls back, loudly.
        loss = forward_loss(model, inputs, targets, loss_fn)
        entry.failed = True
        logger.warning(
            "torch_gradstats: compiled train step failed for %s (%s: %s); falling back to eager for this "
            "architecture",
            type(model).__name__,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return loss
