"""Fused gradient clipping: ``torch.nn.utils.clip_grad_norm_`` that also returns the telemetry it computed.

One read of the gradients gives both the clipping norm and the full :class:`~torch_gradstats.stats.gradients.GradStats`
(per-parameter norms, zero/NaN/Inf counts), instead of ``clip_grad_norm_`` plus a second pass for telemetry.

Same clipping rule as PyTorch: ``coef = min(max_norm / (total_norm + 1e-6), 1.0)``, applied in place with
``torch._foreach_mul_`` per (device, dtype) group, with no host sync. A NaN/Inf total norm gives a NaN/0 coefficient
and therefore NaN gradients, exactly as in PyTorch (use ``error_if_nonfinite=True`` or skip the step instead).

Where it differs from PyTorch, on purpose: for ``norm_type`` 2 and inf the total norm is the fused op's float64 one
(for norm_type 2 and depending on the kernel, squares of 16/32-bit gradients summed in float32 over stretches of
at most a few thousand elements, and those partial sums added in float64; see docs/accuracy.md), and the
coefficient stays float64 until the multiply, while PyTorch computes and rounds both in the gradients' dtype. So:

* float32/float64 gradients whose norm PyTorch can represent: the same total norm and clipped gradients to a few
  ulps (a few float32 roundings in the sums) for norm_type 2;
* float32 gradients whose squares overflow float32 (some |g| above about 1.8e19, or a sum of squares above
  3.4e38, e.g. ``torch.full((4,), 1e20)``): PyTorch's total norm is inf, so it multiplies every gradient by 0
  (``error_if_nonfinite=True`` raises instead). Here the total norm is the true, finite one (2e20 in that example),
  ``error_if_nonfinite`` does not raise, and the gradients are scaled to ``max_norm`` (each 1e20 becomes 0.5);
* float16 gradients whose norm exceeds 65504: the same, PyTorch's float16 norm is inf;
* float16 gradients: PyTorch rounds the norms, ``1 / norm`` and the coefficient to float16, we do not, so the
  clipped gradients' norms can differ by up to about 0.2% (more when PyTorch's coefficient is a float16
  subnormal, below 6.1e-5);
* bfloat16 gradients: PyTorch rounds the same figures to bfloat16 (8 significant bits), we do not, so the clipped
  gradients' norms can differ by up to about 0.9%;
* ``norm_type=inf``: max |g| is exact in every dtype, so the total norms agree; PyTorch still rounds the
  coefficient in the gradients' dtype, so float16 and bfloat16 clips differ by up to about 0.17% and 0.58%.

A NaN or Inf *element* gives a non-finite norm in both, with the same effect (NaN gradients, or the error).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import fetch, to_device, to_host
from torch_gradstats.stats._params import ParamsLike, named_params
from torch_gradstats.stats.gradients import GradStats, grad_stats

__all__ = ["clip_grad_norm_"]

try:  # private PyTorch helpers that decide foreach support exactly like clip_grad_norm_ does
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
except ImportError:  # pragma: no cover - older/newer torch without them

    def _device_has_foreach_support(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def _has_foreach_support(tensors: list[Tensor], device: torch.device) -> bool:
        return _device_has_foreach_support(device) and all(type(t) is Tensor for t in tensors)


def _coef_on(coef: Tensor, device: torch.device, cache: dict[torch.device, Tensor]) -> Tensor:
    if device not in cache:
        if device.type == "cpu" and coef.device.type != "cpu":
            # CPU gradients next to accelerator ones: the CPU multiply needs the value now (a host sync).
            cache[device] = fetch(coef)
        else:
            cache[device] = to_device(coef, device)
    return cache[device]


def scale_grads_(grads: Sequence[Tensor], coef: Tensor, foreach: bool | None) -> None:
    """Multiply every gradient by the 0-d ``coef`` in place, grouped by (device, dtype) on metadata only, like
    PyTorch, so each ``_foreach_mul_`` gets a uniform list; ``foreach`` as in ``torch.nn.utils.clip_grad_norm_``."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    cache: dict[torch.device, Tensor] = {}
    for (device, _), device_grads in groups.items():
        c = _coef_on(coef, device, cache)
        if (foreach is None and _has_foreach_support(device_grads, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            torch._foreach_mul_(device_grads, c)
        elif foreach:
            raise RuntimeError(f"clip_grad_norm_: foreach=True was passed, but {device.type} has no foreach support")
        else:
            for g in device_grads:
                g.mul_(c)


def check_writable(named: Sequence[tuple[str, Tensor]], caller: str) -> None:
    """Refuse, before anything is read or written, a gradient that cannot be scaled in place: an inference tensor
    (made under ``torch.inference_mode()``) outside that mode. Scaling it fails part-way, after the gradients before
    it in the list were scaled, with an error that names no parameter. Metadata only. Skipped while Dynamo traces
    (it cannot trace ``is_inference``): a compiled clip stays one graph, and an inference tensor there fails in
    the compiled code instead, as PyTorch's clip does (part-way, with PyTorch's error, which names no parameter)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return
    for name, p in named:
        if isinstance(p.grad, Tensor) and p.grad.is_inference():  # a non-tensor .grad is named by the op's checks
            raise ValueError(
                f"{caller}: the gradient of {name!r} is an inference tensor (made under torch.inference_mode()), "
                "which cannot be scaled in place outside that mode; set it as an ordinary tensor "
                "(p.grad = p.grad.clone() outside inference_mode) or clip inside torch.inference_mode()"
            )


@torch.no_grad()
def clip_grad_norm_(
    params: ParamsLike,
    max_norm: float | Tensor,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    group: Any = None,
    *,
    stats: GradStats | None = None,
    stage_group: Any = None,
    tied: Collection[str] = (),
) -> GradStats:
    """Clip gradients in place like ``torch.nn.utils.clip_grad_norm_`` and return the statistics read on the way.

    Args:
        params: what :func:`~torch_gradstats.grad_stats` accepts (tensors, ``model.parameters()``,
            ``model.named_parameters()``, (name, tensor) pairs; a generator is consumed once).
        max_norm: max total norm of the gradients: a number, or a one-element tensor (e.g. a threshold computed on
            the device, such as :meth:`~torch_gradstats.AdaptiveClip.threshold`'s), used where it is: an
            accelerator's is never read on the host (a CPU one is, to check it is >= 0, which costs no sync).
        norm_type: p of the p-norm; ``2.0`` and ``inf`` use the fused statistics, any other value falls back to
            ``torch.nn.utils.get_total_norm`` (computed in the gradients' dtype, one extra read).
        error_if_nonfinite: raise if the total norm is NaN or Inf, naming the first non-finite parameter. This
            needs the value on the host: it costs ONE host sync (PyTorch's option costs one too). Default: no sync.
        foreach: as in PyTorch: None uses ``torch._foreach_mul_`` where supported, True requires it, False
            multiplies tensor by tensor.
        group: process group over which plain-tensor gradients are shards of one set (FSDP1 flat parameters,
            ZeRO): the clip uses their global norm. DTensor gradients need no group. Only norm types 2 and inf.
        stats: the :func:`~torch_gradstats.grad_stats` of exactly these parameters' gradients, already read (with
            the same ``group``, ``stage_group`` and ``tied``): the clip then uses them instead of reading the
            gradients again.
        stage_group, tied: pipeline parallelism, as in :func:`~torch_gradstats.grad_stats`: the clip uses the norm
            of the whole model, every stage's parameters, a tied one counted once. Only norm types 2 and inf.

    Returns:
        The :class:`~torch_gradstats.GradStats` of the gradients *before* clipping, with ``clip_norm`` (the
        total norm used, float64 0-d), ``clip_coef`` (the clamped coefficient applied) and ``clipped_norm`` (the
        total norm after clipping, ``clip_coef * clip_norm``) set, all device tensors; its report carries
        ``clip_coef`` and ``clipped_norm``. ``clip_norm``
        equals what ``torch.nn.utils.clip_grad_norm_`` returns (as float64), except where PyTorch's norm, computed
        in the gradients' dtype, overflows or rounds (see the module docstring): there ``clip_norm`` is the true
        finite norm, and gradients PyTorch would zero are scaled to ``max_norm`` instead.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the total norm is not finite, which happens only when a gradient
            holds a NaN or Inf (gradients are left untouched), or
            ``foreach=True`` on a device without foreach support.
    """
    if isinstance(max_norm, Tensor):
        if not max_norm.is_floating_point():
            raise TypeError(f"clip_grad_norm_: max_norm as a tensor must be floating point, got {max_norm.dtype}")
        if max_norm.numel() != 1:
            raise ValueError(f"clip_grad_norm_: max_norm must have one element, got shape {tuple(max_norm.shape)}")
        # Read where that costs no sync (a CPU tensor, outside a compiled graph); an accelerator's is never read.
        if max_norm.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_max_norm(float(max_norm.detach().reshape(())))
    else:
        max_norm = _check_max_norm(float(max_norm))
    return clip_with_threshold_(params, max_norm, norm_type, error_if_nonfinite, foreach, group, stats=stats,
                                stage_group=stage_group, tied=tied)


def _check_max_norm(value: float) -> float:
    if not value >= 0.0:  # NaN included
        raise ValueError(
            f"clip_grad_norm_: max_norm must be >= 0, got {value}: a negative one would flip the sign of every "
            "gradient"
        )
    return value


@torch.no_grad()
def clip_with_threshold_(
    params: ParamsLike,
    max_norm: float | Tensor,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    group: Any = None,
    *,
    stats: GradStats | None = None,
    stage_group: Any = None,
    tied: Collection[str] = (),
) -> GradStats:
    """:func:`clip_grad_norm_` without reading a tensor ``max_norm``: for the policies' own thresholds, which are
    never negative and stay unread on the device (a one-element floating-point tensor, or a checked float)."""
    norm_type = float(norm_type)
    named = named_params(params)
    check_writable(named, "clip_grad_norm_")
    if (group is not None or stage_group is not None) and norm_type not in (2.0, math.inf):
        arg = "group" if group is not None else "stage_group"
        raise ValueError(f"clip_grad_norm_: with {arg}=, norm_type must be 2 or inf, got {norm_type}")
    grads = [p.grad for _, p in named if p.grad is not None]
    if stats is None:
        stats = grad_stats(named, group=group, stage_group=stage_group, tied=tied)
    elif not isinstance(stats, GradStats):
        raise TypeError(f"clip_grad_norm_: stats must be a GradStats or None, got a {type(stats).__name__}")
    elif group is None and stage_group is None and len(stats) != len(grads):
        raise ValueError(
            f"clip_grad_norm_: stats must be the GradStats of the {len(grads)} gradients of params, got the "
            f"statistics of {len(stats)}"
        )
    elif group is not None or stage_group is not None:  # reduced across ranks: rows of every rank's parameters
        _check_reduced_stats(stats, [n for n, p in named if p.grad is not None])
    home = stats.device
    if not grads and group is None and stage_group is None:  # else the figures are the other ranks' too
        stats.clip_norm = torch.zeros((), dtype=torch.float64, device=home)
        stats.clip_coef = torch.ones((), dtype=torch.float64, device=home)
        stats.clipped_norm = stats.clip_norm
        return stats

    if norm_type == 2.0:
        total = stats.total_norm
    elif norm_type == math.inf:
        total = stats.inf_norm
    else:
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False, foreach=foreach)
        total = to_device(total.to(torch.float64), home) if total.device != home else total.to(torch.float64)

    if error_if_nonfinite:
        # The one host sync of this option: the total norm and the per-parameter flags in one transfer.
        host, _ = to_host([total.reshape(1), stats.nonfinite_mask], [])
        if not math.isfinite(host[0]):
            bad = [n for n, f in zip(stats.names, host[1:]) if f]
            where = f"; first non-finite gradient: {bad[0]!r} ({len(bad)} in all)" if bad else ""
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
                f"({host[0]}){where}, so it cannot be clipped. Set error_if_nonfinite=False to scale by "
                "the non-finite norm anyway, or skip this step."
            )

    if isinstance(max_norm, Tensor):  # used where it is: moved to the statistics' device without a sync
        if max_norm.device != home and home.type == "cpu":
            raise ValueError(
                f"clip_grad_norm_: max_norm is on {max_norm.device} but the gradients' statistics are on the CPU; "
                "reading it back would sync: pass a number or a tensor on the CPU"
            )
        max_norm = to_device(max_norm.detach().reshape(()), home)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)

    scale_grads_(grads, coef, foreach)
    stats.clip_norm = total
    stats.clip_coef = coef
    stats.clipped_norm = total * coef  # the norm the gradients have now (pre-clip is clip_norm, or total_norm)
    return stats


def _check_reduced_stats(stats: GradStats, local: list[str]) -> None:
    """``stats`` given with ``group=`` / ``stage_group=`` must have a row for each local gradient (rows of the
    other ranks' parameters too, stage suffixes allowed), or count it among the figures no row holds yet."""
    rows = {n.split("@stage", 1)[0] for n in stats.names} | set(stats.names)
    if stats.unattributed is not None:
        rows.update(stats.unattributed.local_names)
    missing = [n for n in local if n not in rows]
    if missing:
        raise ValueError(
            f"clip_grad_norm_: stats has no row for the gradient of {missing[0]!r} ({len(missing)} in all): pass "
            "the GradStats that grad_stats returned for these params with the same group"
        )
