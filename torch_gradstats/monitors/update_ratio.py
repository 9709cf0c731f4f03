"""Measured update-to-weight ratios around an optimizer step: :class:`UpdateRatio` and its device-side
:class:`UpdateStats`.

:class:`UpdateRatio` measures ``||Δw|| / ||w||`` around an optimizer step: before the step it copies the weights
once (one ``torch._foreach_copy_`` into buffers it keeps between steps), after the step it turns the copy into
``w_before - w_after`` in place (one ``torch._foreach_sub_``) and reads the differences and the new weights in one
op call. Memory cost: one copy of the measured parameters (``UpdateRatio.nbytes``: the sum of their sizes, in their
own dtypes, on their own devices), kept between steps to avoid reallocating it; :meth:`UpdateRatio.release` frees it.
Since the buffers have the weights' dtype, a float16/bfloat16 ``Δw`` is rounded to it: each ``||Δw||`` is within the
dtype's unit roundoff (2^-11, 2^-8) of the exact one, and much closer in practice (docs/integrations.md); float32
buffers would double the snapshot of 16-bit weights.

The figures stay on the device: :attr:`UpdateStats.ratios` reads them there, and
:func:`~torch_gradstats.monitors.updates.grad_and_weight_stats` (``update=``) reports them in its one transfer. Under
FSDP2 (DTensor parameters) or with ``group=`` (plain shards), the updates are reduced across ranks as the gradients are.

Split from ``updates`` (past 500 lines: a second job, measuring the step; ``updates`` keeps the statistics read with
the gradients and the report of both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.monitors._weight_reads import check_named, device_ratio, local_view, reduce_figures
from torch_gradstats.stats._params import ParamsLike, dtensor_types, named_params, stats_on_home, unique_names

__all__ = ["UpdateRatio", "UpdateStats"]


def _names_like_grad_stats(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Unique names that agree with ``grad_stats`` (which names only the parameters with a gradient) for the
    parameters that have one; the others get names unique around them. Differs from ``unique_names`` of all the
    names only when a name repeats and a gradient is missing."""
    given = [n for n, _ in named]
    with_grad = [i for i, (_, p) in enumerate(named) if p.grad is not None]
    out = dict(zip(with_grad, unique_names([given[i] for i in with_grad])))
    taken, given_set = set(out.values()), set(given)
    for i, name in enumerate(given):
        if i in out:
            continue
        unique, k = name, 0
        while unique in taken or (unique != name and unique in given_set):
            k += 1
            unique = f"{name}#{k}"
        taken.add(unique)
        out[i] = unique
    return [out[i] for i in range(len(given))]


# ---------------------------------------------------------------------------------------------- UpdateRatio
@dataclass
class UpdateStats:
    """One measured optimizer step, as device tensors (float64 ``[P]``): ``delta_sumsq`` is ``||w_before -
    w_after||²`` and ``weight_sumsq`` is ``||w_after||²`` of each parameter, named by ``names``."""

    names: list[str]
    delta_sumsq: Tensor
    weight_sumsq: Tensor

    @property
    def ratios(self) -> Tensor:
        """float64 ``[P]``: ``||Δw|| / ||w||`` (weights after the step), on the device; 0 for an all-zero weight
        that did not change (as in the report)."""
        return device_ratio(self.delta_sumsq, self.weight_sumsq)


class UpdateRatio:
    """Measure the true ``||Δw|| / ||w||`` of each parameter around an optimizer step.

    Example::

        ratio = UpdateRatio(model.named_parameters())    # once
        ...
        with ratio:                  # snapshot: one foreach copy of the weights
            optimizer.step()
        ratio.stats.ratios           # device tensor, no sync; or grad_and_weight_stats(..., update=ratio.stats)

    Or without ``with``: :meth:`snapshot` before the step, :meth:`measure` after it. The ratio's denominator is the
    norm of the weights *after* the step (so a zero-initialised bias gets a finite ratio after its first update).

    Memory: :attr:`nbytes`, one copy of the parameters in their own dtypes, kept between steps (:meth:`release`
    frees it). So ``w_before - w_after`` is rounded to the weights' dtype: for float16/bfloat16 weights each ``||Δw||``
    is within that dtype's unit roundoff (2^-11, 2^-8) of the exact one (docs/integrations.md). A step that changes no
    weight (skipped by a GradScaler or a guard), and a parameter the optimizer skips (no ``.grad``), measure 0.
    Parameters are read through ``.detach()`` (DTensors through their local shard) and never modified. ``group``:
    the process group over which plain-tensor parameters are shards of one set (as in ``grad_and_weight_stats``).
    The parameters measured are those given here: for layers unfrozen later, give every parameter (a frozen one
    measures 0) or make a new ``UpdateRatio`` when the trained set changes (what the callbacks do).
    """

    def __init__(self, params: ParamsLike, *, group: Any = None) -> None:
        self._named = named_params(params, "UpdateRatio")
        if not self._named:
            raise ValueError("UpdateRatio: no parameters given")
        self.names = unique_names([n for n, _ in self._named])
        self.group = group
        self._buffers: list[Tensor] | None = None
        self._armed = False
        self.stats: UpdateStats | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the snapshot buffers: those allocated, or before the first snapshot those it will allocate (one
        copy of each parameter's local shard: a DTensor's local tensor, not its global size)."""
        if self._buffers is not None:
            return sum(b.numel() * b.element_size() for b in self._buffers)
        dt = dtensor_types()
        return sum(t.numel() * t.element_size() for t in (local_view(p, dt) for _, p in self._named))

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the current weights (one foreach copy into kept buffers). Call right before ``optimizer.step()``."""
        dt = dtensor_types()
        local = [local_view(p, dt) for _, p in self._named]
        if self._buffers is None or any(b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
                                        for b, t in zip(self._buffers, local)):
            with torch.inference_mode(False):  # ordinary tensors: every later snapshot writes them, in any mode
                self._buffers = [torch.empty_like(t) for t in local]
        torch._foreach_copy_(self._buffers, local)
        self._armed = True

    @torch.no_grad()
    def measure(self) -> UpdateStats:
        """After the step: ``||Δw||²`` and ``||w||²`` of each parameter from one op call (device tensors)."""
        if not self._armed or self._buffers is None:
            raise RuntimeError("UpdateRatio.measure() called without a snapshot() before the optimizer step")
        dt = dtensor_types()
        local = [local_view(p, dt) for _, p in self._named]
        self._armed = False
        try:
            torch._foreach_sub_(self._buffers, local)  # buffers := w_before - w_after
        except RuntimeError:  # NotImplementedError too: a dtype without subtraction (float8)
            self._named_failure(local)
            raise
        n = len(local)
        tensors = self._buffers + local
        try:
            (sumsq, amax, counts), _ = stats_on_home(tensors, False)  # buffers and weights share devices and order
        except (TypeError, ValueError, RuntimeError):
            check_named("UpdateRatio", list(zip(self.names, local)))  # the same failure, named by parameter
            raise
        originals = [p for _, p in self._named]
        any_dt = bool(dt) and any(isinstance(p, dt) for p in originals)
        sumsq, *_ = reduce_figures(originals + originals, sumsq, amax, counts, self.group, any_dt)
        # Named as grad_and_weight_stats names the gradients now, so the report pairs each update with its own
        # parameter even when a name repeats and a gradient is missing.
        self.names = _names_like_grad_stats(self._named)
        self.stats = UpdateStats(self.names, sumsq[:n], sumsq[n:])
        return self.stats

    def _named_failure(self, local: list[Tensor]) -> None:
        """After the subtraction failed: the parameter that changed shape or device since the snapshot, or has a
        dtype the op refuses, named (metadata only; only on failure, so a step pays no loop over the parameters)."""
        assert self._buffers is not None
        for name, b, t in zip(self.names, self._buffers, local):
            if b.shape != t.shape or b.device != t.device:
                raise ValueError(
                    f"UpdateRatio.measure: parameter {name!r} changed between snapshot() and measure(), from "
                    f"{tuple(b.shape)} on {b.device} to {tuple(t.shape)} on {t.device}; snapshot() again"
                )
        check_named("UpdateRatio", list(zip(self.names, local)))

    def release(self) -> None:
        """Free the snapshot buffers (the next snapshot allocates them again)."""
        self._buffers = None
        self._armed = False

    def __enter__(self) -> UpdateRatio:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self.snapshot()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.measure()
        else:
            self._armed = False
