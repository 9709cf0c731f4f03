"""Megatron-LM's ``get_grad_norm_fp32`` and ``count_zeros_fp32`` (``megatron.core.optimizer.clip_grads``), on the
fused op.

Same signatures and return types: both return Python floats, as Megatron documents, so each costs ONE host sync
(Megatron's cost too). What they add:

* **Always the gradients as they are now.** Nothing is kept between calls: Megatron rewrites gradients in ways no
  version counter sees (its clip scales them with ``multi_tensor_scale``, and writes through ``.data``,
  ``torch._foreach_mul_`` or an in-place collective bump no ``Tensor._version``), so a kept result could be the one
  from before the clip. Each call makes one fused read of the sums of squares, maxima and zero counts.
* **Accuracy.** Sums are taken in float64 (Megatron accumulates in float32).
* **Graph safety.** Until the final host read, nothing syncs.

Reductions, as in Megatron: DTensor gradients are first summed (maximum for ``inf``) over their own mesh, a
replicated shard counted once, then everything over ``grad_stats_parallel_group``: one SUM all-reduce for a finite
p (the p-th powers and the zero count together), one MAX for inf. ``grad_stats_parallel_group=None`` means the
default group, as in Megatron, when torch.distributed is initialized, and no reduction in a single process.

``count_zeros_fp32`` skips parameters Megatron skips: without a gradient, marked ``shared``, or replicas of a
tensor-parallel group (not ``tensor_model_parallel`` on a rank other than 0 of ``tp_group``, or of
``expert_tp_group`` for expert parameters, those with ``allreduce=False``). Without ``tp_group`` there is no tensor
parallelism here (Megatron would ask its global parallel state instead).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.compat.shards import Shards, local_shards, max_over_meshes, read, sum_counted
from torch_gradstats.ops._transfer import to_host
from torch_gradstats.ops.op import ZERO

__all__ = ["clear_cache", "count_zeros_fp32", "get_grad_norm_fp32"]


def clear_cache() -> None:
    """Does nothing: nothing is kept between calls (each reads the gradients). Kept so that callers of earlier
    versions, which kept the last read, still run."""


def _group(group: Any) -> Any:
    """The group to reduce over, or None for no reduction (a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("grad_stats_parallel_group was given but torch.distributed is not initialized")
        return None
    return group if group is not None else dist.group.WORLD


def _home(shards: Shards) -> torch.device:
    if shards.local:
        if shards.local[0].device.type == "meta":  # the host read would fail inside torch
            raise ValueError("megatron compat: the gradients are meta tensors, which have no values to read")
        return shards.local[0].device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def get_grad_norm_fp32(
    grads_for_norm: list[Tensor] | Tensor,
    norm_type: float = 2,
    grad_stats_parallel_group: Any = None,
) -> float:
    """The p-norm of ``grads_for_norm`` (tensors or DTensors), treated as one vector over every rank of
    ``grad_stats_parallel_group`` (and of each DTensor's mesh).

    One fused read for norm types 2 and inf (another p reads again for the p-th powers), one all-reduce, one host
    sync.

    Returns:
        The norm as a Python float (NaN or inf if a gradient holds one).
    """
    grads = [grads_for_norm] if isinstance(grads_for_norm, Tensor) else list(grads_for_norm)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"get_grad_norm_fp32: norm_type must be a number, got {type(norm_type).__name__}")
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"get_grad_norm_fp32: norm_type must be positive (or inf), got {p}")
    group = _group(grad_stats_parallel_group)
    shards = local_shards(grads, "grads_for_norm")
    home = _home(shards)
    stats = read(shards.local, home)
    if math.isinf(p):
        total = max_over_meshes(stats.amax, shards)
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return to_host([total.reshape(1)], [])[0][0]
    if p == 2.0:
        powers = stats.sumsq
    elif shards.local:
        powers = torch.stack([torch.linalg.vector_norm(t, p, dtype=torch.float64).to(home) ** p for t in shards.local])
    else:
        powers = torch.zeros(0, dtype=torch.float64, device=home)
    total = sum_counted(powers, shards)
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    power_sum = to_host([total.reshape(1)], [])[0][0]
    return power_sum ** (1.0 / p)


def _is_tp_replica(param: Tensor, tp_group: Any, expert_tp_group: Any) -> bool:
    if getattr(param, "tensor_model_parallel", False):
        return False
    group = expert_tp_group if getattr(param, "allreduce", True) is False and expert_tp_group is not None else tp_group
    return group is not None and dist.get_rank(group=group) != 0


@torch.no_grad()
def count_zeros_fp32(
    parameters: list[Tensor] | Tensor,
    grad_stats_parallel_group: Any,
    use_decoupled_grad: bool = False,
    tp_group: Any = None,
    expert_tp_group: Any = None,
) -> float:
    """The number of zero elements in the gradients of ``parameters`` over every rank of
    ``grad_stats_parallel_group``, skipping what Megatron skips (see the module notes).

    Args:
        parameters: a parameter or a list of them.
        grad_stats_parallel_group: the group to sum over (None: the default group, or none in a single process).
        use_decoupled_grad: read ``param.decoupled_grad`` instead of ``param.grad``.
        tp_group, expert_tp_group: the tensor-parallel groups whose rank-0 copy of a replicated parameter counts.

    Returns:
        The count as a Python float: one fused read, one SUM all-reduce and one host sync.
    """
    if isinstance(parameters, (str, bytes)):  # iterated, its characters would be skipped as gradient-less: 0 zeros
        raise TypeError(
            f"count_zeros_fp32: parameters must be a tensor or a list of them, got a {type(parameters).__name__}"
        )
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"count_zeros_fp32: parameters[{i}] must be a torch.Tensor, got a {type(p).__name__}")
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [
        getattr(p, attr)
        for p in params
        if getattr(p, attr, None) is not None
        and not getattr(p, "shared", False)
        and not _is_tp_replica(p, tp_group, expert_tp_group)
    ]
    group = _group(grad_stats_parallel_group)
    shards = local_shards(grads, "gradients of parameters")
    stats = read(shards.local, _home(shards))
    total = sum_counted(stats.counts[:, ZERO].to(torch.float64), shards)  # exact below 2**53
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return to_host([total.reshape(1)], [])[0][0]
