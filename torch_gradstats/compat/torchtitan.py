"""torchtitan's ``clip_grad_norm_`` (``torchtitan.distributed.utils``), on the fused op.

Same signature and return value: ``clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
foreach=None, pp_mesh=None, ep_enabled=False)`` clips the gradients in place and returns the total norm of all of
them, over every rank, as a plain (never DTensor) 0-d tensor in the gradients' dtype on their device:

* DTensor gradients count as the full tensors they are shards of (torchtitan makes its DTensor norm full);
* ``pp_mesh``: each pipeline stage holds other parameters, so the norm is combined over the pipeline mesh, the sum
  of p-th powers for a finite p and the maximum for ``inf``;
* ``ep_enabled``: expert and dense parameters live on different meshes; each mesh is reduced over its own ranks and
  the results combined, which is what this function does for any mix of meshes, so the switch only checks that
  every gradient is a DTensor, as torchtitan requires.

What differs, on purpose: the gradients are read once by the fused op (for ``norm_type`` 2 and inf; another p reads
them a second time for the p-th powers), sums are taken in float64 and the result is cast to the gradients' dtype
at the end, so a norm whose float32 squares would overflow stays finite (see :mod:`torch_gradstats.policies.clip`).
Collectives: one SUM (MAX for inf) all-reduce per dimension of each DTensor mesh and one over ``pp_mesh``, the
same count as torchtitan's. Every rank must pass gradients on the same meshes, in the same order.

No host sync, except with ``error_if_nonfinite=True``: deciding to raise needs the value on the host, one sync, as
in torch. The check runs on the total after the reductions, so every rank sees the same value and raises together.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.compat.shards import local_shards, max_over_meshes, read, sum_counted
from torch_gradstats.ops._transfer import to_host
from torch_gradstats.policies.clip import scale_grads_

__all__ = ["clip_grad_norm_"]

def _result_dtype(grads: list[Tensor]) -> torch.dtype:
    """The dtype torch.nn.utils.get_total_norm returns: the promotion of the gradients' dtypes."""
    if not grads:
        return torch.get_default_dtype()
    dtype = grads[0].dtype
    for g in grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    return dtype


def _home(local: list[Tensor], pp_mesh: Any) -> torch.device:
    if local:
        return local[0].device
    if pp_mesh is not None and pp_mesh.device_type != "cpu":
        return torch.device(pp_mesh.device_type, torch.get_device_module(pp_mesh.device_type).current_device())
    return torch.device("cpu")


@torch.no_grad()
def total_norm(grads: list[Any], norm_type: float, pp_mesh: Any = None) -> Tensor:
    """The p-norm of ``grads`` over every rank that holds a part of them, float64 0-d, no host sync."""
    shards = local_shards(grads, "grads")
    home = _home(shards.local, pp_mesh)
    if math.isinf(norm_type):
        total = max_over_meshes(read(shards.local, home).amax, shards)
        if pp_mesh is not None and pp_mesh.size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        return total
    if norm_type == 2.0:
        powers = read(shards.local, home).sumsq
    elif shards.local:
        powers = torch.stack(
            [torch.linalg.vector_norm(t, norm_type, dtype=torch.float64).to(home) ** norm_type for t in shards.local]
        )
    else:
        powers = torch.zeros(0, dtype=torch.float64, device=home)
    total = sum_counted(powers, shards)
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: Any = None,
    ep_enabled: bool = False,
) -> Tensor:
    """Clip the gradients of ``parameters`` in place to a total norm of at most ``max_norm``; return that norm.

    Args:
        parameters: a tensor or an iterable of tensors (plain or DTensor); those without ``.grad`` are skipped.
        max_norm: the largest total norm allowed.
        norm_type: p of the p-norm, ``inf`` for the largest magnitude. 2 and inf take one fused read.
        error_if_nonfinite: raise RuntimeError if the total norm is NaN or infinite (gradients untouched). Costs
            one host sync; without it there is none.
        foreach: None uses ``torch._foreach_mul_`` where supported, True requires it, False multiplies one by one.
        pp_mesh: the pipeline-parallel DeviceMesh: the norm is combined over its stages.
        ep_enabled: expert parallelism is on: every gradient must be a DTensor (expert ones on their mesh).

    Returns:
        The total norm, a plain 0-d tensor in the gradients' (promoted) dtype on their device, the same on every
        rank. The gradients were multiplied by ``min(max_norm / (total + 1e-6), 1)``.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    # A NaN max_norm would make every gradient NaN, a negative one flip their signs.
    if not isinstance(max_norm, Tensor):
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
            raise TypeError(f"clip_grad_norm_: max_norm must be a real number, got a {type(max_norm).__name__}")
        if not max_norm >= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be >= 0 (or inf), got {max_norm}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"clip_grad_norm_: norm_type must be a real number, got a {type(norm_type).__name__}")
    norm_type = float(norm_type)
    if not norm_type > 0:  # also rejects NaN
        raise ValueError(f"clip_grad_norm_: norm_type must be positive (or inf), got {norm_type}")
    grads = [p.grad for p in params if p.grad is not None]
    if ep_enabled:
        from torch.distributed.tensor import DTensor

        for i, g in enumerate(grads):
            if not isinstance(g, DTensor):
                raise TypeError(
                    f"clip_grad_norm_: with ep_enabled=True every gradient must be a DTensor; gradient {i} is a "
                    f"{type(g).__name__}"
                )
    total = total_norm(grads, norm_type, pp_mesh)
    if error_if_nonfinite:
        value = to_host([total.reshape(1)], [])[0][0]  # the one host sync of this option
        if not math.isfinite(value):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {value}, not finite, so "
                "they cannot be clipped; pass error_if_nonfinite=False to scale them by it anyway, or skip the step"
            )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_grads_(local_shards(grads, "grads").local, coef, foreach)
    return total.to(_result_dtype(grads))
