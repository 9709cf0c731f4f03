"""Counting host reads in tests: a dispatch mode that sees every read of a tensor value into Python, and a helper
that counts the transfer points and those reads inside a callback's hooks."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor value into Python (.item(), bool(), float(): aten::_local_scalar_dense) and copies to
    the CPU from another device (none exist on a CPU-only run, but the mode would see them)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        to_host = (
            func is torch.ops.aten._to_copy.default and args and args[0].device.type != "cpu"
            and str(kwargs.get("device", "")) == "cpu"
        )
        if func is torch.ops.aten._local_scalar_dense.default or to_host:
            self.count += 1
        return func(*args, **kwargs)


def instrument(cb: Any, hooks: tuple[str, ...]) -> dict[str, int]:
    """Count a callback's transfer points (``report``: one packed copy; ``check``: the one-value non-finite check)
    and every host read made anywhere inside the given hooks (``reads``)."""
    counts = {"report": 0, "check": 0, "reads": 0}
    taker = cb.taker
    real_report, real_check = taker.report, taker.nonfinite

    def report(stats: Any) -> Any:
        counts["report"] += 1
        return real_report(stats)

    def check(stats: Any) -> bool:
        counts["check"] += 1
        return real_check(stats)

    taker.report, taker.nonfinite = report, check
    for hook in hooks:
        real = getattr(cb, hook)

        def wrapped(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            with HostReads() as mode:
                out = _real(*args, **kwargs)
            counts["reads"] += mode.count
            return out

        setattr(cb, hook, wrapped)
    return counts


def fallback_kernel_files() -> set[str]:
    """The files of the pure-PyTorch kernel, whose ``tolist()`` of a CPU batch is a read of host memory (no sync)."""
    from torch_gradstats.ops import _fallback_batch, fallback, fallback_histogram

    return {os.path.abspath(m.__file__) for m in (fallback, _fallback_batch, fallback_histogram) if m.__file__}


class AllHostReads(HostReads):
    """:class:`HostReads`, and also every call of ``Tensor.item``, ``Tensor.tolist`` and ``Tensor.numpy``, patched
    for as long as the mode is on (a read that bypasses the dispatcher is still seen).

    Not counted: the pure-PyTorch kernel's own ``tolist()`` of a CPU tensor (TORCH_GRADSTATS_FORCE_FALLBACK=1), a
    read of host memory that waits for no device (it picks its path from a CPU tensor's range; docs/design.md)."""

    _PATCHED = ("item", "tolist", "numpy")

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._real = {name: getattr(torch.Tensor, name) for name in self._PATCHED}
        for name, real in self._real.items():
            def counting(t: torch.Tensor, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                in_kernel = sys._getframe(1).f_code.co_filename in fallback_kernel_files()
                if not (in_kernel and t.device.type == "cpu"):
                    self.count += 1
                return _real(t, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)
        super().__exit__(*exc)
