"""What the tests of the guard and the adaptive clip share: synthetic sequences of gradient norms or losses, and a
context in which any read of a tensor's value into Python raises."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

import torch_gradstats.ops.fallback

KINDS = ["noise", "trend", "rising", "spikes", "plateaus", "nonfinite", "mixed"]


def sequence(kind: str, n: int, seed: int) -> list[float]:
    """Synthetic gradient norms or losses: noise, trends, spikes, plateaus, NaN/inf, and all of them mixed."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, generator=gen, dtype=torch.float64)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    t = torch.arange(n, dtype=torch.float64)
    nan, inf = torch.full((n,), math.nan, dtype=torch.float64), torch.full((n,), math.inf, dtype=torch.float64)
    if kind == "noise":
        x = (0.3 * noise).exp()
    elif kind == "trend":
        x = 5.0 - 4.0 * t / n + 0.05 * noise
    elif kind == "rising":
        x = 1.0 + 0.01 * t + 0.02 * noise
    elif kind == "spikes":
        x = 1.0 + 0.1 * noise
        x = torch.where(u < 0.03, x * 20, x)
    elif kind == "plateaus":  # long runs of equal values (std exactly 0), steps between them, a few bumps
        x = (t // 97).remainder(4) + 1.0
        x = torch.where((u < 0.02) & (t.remainder(97) > 60), x + 0.5, x)
    elif kind == "nonfinite":
        x = 2.0 + 0.2 * noise
        x = torch.where(u < 0.02, nan, x)
        x = torch.where((u >= 0.02) & (u < 0.03), inf, x)
    elif kind == "mixed":
        x = (3.0 - 2.0 * t / n) * (0.2 * noise).exp()
        x = torch.where(u < 0.03, x * 50, x)
        x = torch.where((u >= 0.03) & (u < 0.04), nan, x)
        x = torch.where((t // 150).remainder(3) == 1, torch.full_like(x, 1.75), x)  # plateaus
    else:
        raise AssertionError(kind)
    return x.tolist()


HOST_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[None]:
    """Every way of reading a tensor's value into Python (``Tensor.item``, ``bool()``, ``float()``, ``tolist``,
    ``cpu``, ...) raises inside this context. The pure-PyTorch kernel is told it is on another device: on the CPU it
    reads a batch's min/max |x| (no sync there), elsewhere it reads nothing."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    branches = torch_gradstats.ops.fallback._branches_on_host

    def raiser(name: str):  # type: ignore[no-untyped-def]
        def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError(f"host read: Tensor.{name}")

        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, raiser(name))
        torch_gradstats.ops.fallback._branches_on_host = lambda device: False
        yield
    finally:
        torch_gradstats.ops.fallback._branches_on_host = branches
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
