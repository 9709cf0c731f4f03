"""NoiseScale under DDP: :func:`noise_scale_hook`, a communication hook wrapping the default all-reduce, and the
bookkeeping of the step in flight (:class:`DDPStep`, a base of NoiseScale): the buckets launched and reduced, and
their squared norms summed, until the last one folds the step in. Split from noise_scale.py (past 500 lines): a
second job, data-parallel training, beside the estimator and the accumulation window.

The hook reads each bucket with the fused op before its all-reduce (this rank's gradient, B_small =
``local_batch_size``) and after it (the averaged gradient, B_big = ``local_batch_size`` x the group's size). No host
sync, no extra collective.
"""

import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.monitors._grad_scaler import unscaled
from torch_gradstats.ops.op import multi_tensor_stats

__all__ = ["DDPStep", "noise_scale_hook"]

# This module deliberately has no `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] objects, and string annotations fail that check.


class DDPStep:
    """One DDP step in flight, for :func:`noise_scale_hook`: buckets launched / reduced, and their squared norms
    summed so far. A base of :class:`~torch_gradstats.monitors.noise_scale.NoiseScale`, which holds the attributes
    declared here and folds the step in with ``update``."""

    local_batch_size: int
    process_group: Any
    scaler: Any
    _lock: threading.Lock
    _launched: int
    _reduced: int
    _last_launched: bool
    _local_sq: Tensor | None
    _big_sq: Tensor | None

    if TYPE_CHECKING:
        def update(self, small_sq: Tensor | float, big_sq: Tensor | float, *, big_batch_size: int) -> None: ...

    def _clear_ddp_step(self) -> None:
        """No bucket of a step launched yet (under the lock, or before the instance is shared)."""
        self._launched = self._reduced = 0
        self._last_launched = False
        self._local_sq = self._big_sq = None

    def _bucket_launched(self, local_sq: Tensor, is_last: bool) -> None:
        with self._lock:
            self._local_sq = local_sq if self._local_sq is None else self._local_sq + local_sq
            self._launched += 1
            self._last_launched = self._last_launched or is_last

    def _bucket_reduced(self, big_sq: Tensor, world: int) -> None:
        # Buckets' all-reduces may complete in any order (a process group can run several at once), so the step is
        # folded by whichever callback completes the set, once the last bucket has been launched.
        with self._lock:
            self._big_sq = big_sq if self._big_sq is None else self._big_sq + big_sq
            self._reduced += 1
            if not (self._last_launched and self._reduced == self._launched):
                return
            local, big = self._local_sq, self._big_sq
            self._clear_ddp_step()
        assert local is not None and big is not None
        self.update(local, big, big_batch_size=self.local_batch_size * world)


def noise_scale_hook(state: DDPStep, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the default all-reduce (``allreduce_hook``), plus the noise scale's two readings.

    ``ddp_model.register_comm_hook(ns, noise_scale_hook)`` with ``ns = NoiseScale(local_batch_size)``. Each bucket
    is read by the fused op before the all-reduce (this rank's gradient) and, in a ``.then`` callback, after it
    (the average over ranks); when every bucket of the step is reduced, the step is folded into ``state``. The
    gradients DDP produces are exactly those of the default hook. No host sync, no extra collective.

    Args:
        state: the :class:`~torch_gradstats.NoiseScale` (given to ``register_comm_hook``).
        bucket: the bucket DDP hands the hook.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if not isinstance(state, DDPStep):  # NoiseScale is the only DDPStep
        raise TypeError(
            f"noise_scale_hook: the hook's state must be a NoiseScale (register_comm_hook(ns, noise_scale_hook)), "
            f"got a {type(state).__name__}"
        )
    world = dist.get_world_size(state.process_group)  # host-side, no collective
    if world < 2:
        raise ValueError(
            "noise_scale_hook: the process group has 1 rank, so the big batch is the small one; the noise scale "
            "needs 2 or more ranks (or, in one process, NoiseScale.micro_batch() and step())"
        )
    buffer = bucket.buffer()
    # Read before the all-reduce: the default hook divides the buffer in place.
    state._bucket_launched(unscaled(state.scaler, multi_tensor_stats(buffer).sumsq.sum()), bucket.is_last())
    # A CUDA future runs its callbacks on streams of its own; the readings after the all-reduce go back to the
    # backward's stream (after a wait for the callback's), so the sums and the EMAs only ever see one stream.
    stream = torch.cuda.current_stream(buffer.device) if buffer.device.type == "cuda" else None
    fut = allreduce_hook(state.process_group, bucket)

    def after(f: torch.futures.Future[torch.Tensor]) -> Tensor:
        reduced = f.value()
        if stream is None:
            state._bucket_reduced(unscaled(state.scaler, multi_tensor_stats(reduced).sumsq.sum()), world)
        else:
            stream.wait_stream(torch.cuda.current_stream(reduced.device))
            with torch.cuda.stream(stream):
                state._bucket_reduced(unscaled(state.scaler, multi_tensor_stats(reduced).sumsq.sum()), world)
        return reduced

    return fut.then(after)
