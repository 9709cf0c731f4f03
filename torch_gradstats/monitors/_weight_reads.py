"""The reads :mod:`~torch_gradstats.monitors.updates` and :mod:`~torch_gradstats.monitors.update_ratio` share: a
parameter's tensor as the op reads it (a DTensor's local shard), the op's refusal named by parameter, the reduction
of the figures across ranks, and a ratio of two norms on the device.

Split from ``updates`` with ``update_ratio``: both jobs read weights through one op call in the same way, so these
live once, below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import to_device
from torch_gradstats.ops.op import SUPPORTED_DTYPES

__all__ = ["check_named", "device_ratio", "local_view", "reduce_figures"]


def local_view(t: Tensor, dtensor_types: tuple[type, ...]) -> Tensor:
    """``t`` detached, as the op reads it: a DTensor's local shard, any other tensor itself."""
    t = t.detach()
    return t.to_local() if dtensor_types and isinstance(t, dtensor_types) else t  # type: ignore[attr-defined]


def check_named(what: str, named: Sequence[tuple[str, Tensor]]) -> None:
    """After the op refused its input: the same failure, named by parameter (metadata only)."""
    for name, t in named:
        if t.layout != torch.strided:
            raise ValueError(f"{what}: parameter {name!r} has a {t.layout} tensor; only dense (strided) gradients "
                             "and weights are supported (for nn.Embedding(sparse=True) use sparse=False)")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{what}: parameter {name!r} has a {t.dtype} tensor; expected float16, bfloat16, "
                            "float32 or float64")


def reduce_figures(
    originals: Sequence[Tensor], sumsq: Tensor, amax: Tensor, counts: Tensor, group: Any, any_dtensor: bool,
    meshes: Sequence[Any] = (),
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Global figures across ranks (only when a DTensor is involved or a group is given), numel included;
    ``meshes``: those of DTensor parameters without a gradient here (their reductions still need this rank)."""
    if group is None and not any_dtensor:
        numel = torch.tensor([t.numel() for t in originals], dtype=torch.int64)
        return sumsq, amax, counts, None, to_device(numel, sumsq.device)
    from torch_gradstats.distributed.reduce import reduce_across_ranks  # only on this path

    r = reduce_across_ranks(originals, sumsq, amax, counts, group, meshes=meshes)
    return r.sumsq, r.amax, r.counts, r.rank_nonfinite, r.numel


def device_ratio(num_sumsq: Tensor, den_sumsq: Tensor) -> Tensor:
    """:func:`~torch_gradstats.stats.groups.norm_ratio` elementwise on the device: 0 (not NaN) where both sums are
    0, as the report gives."""
    both_zero = (num_sumsq == 0) & (den_sumsq == 0)
    return torch.where(both_zero, torch.zeros_like(num_sumsq), num_sumsq.sqrt() / den_sumsq.sqrt())
