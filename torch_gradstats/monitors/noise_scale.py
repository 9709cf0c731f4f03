"""The gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A).

Two squared gradient norms measured on every step, one from a small batch (B_small samples) and one from a big
batch (B_big samples) of the same step, give unbiased estimates of the true gradient's squared norm and of the
per-sample gradient covariance's trace:

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

Each is smoothed by its own bias-corrected EMA, and B_simple = tr(Sigma) / |G|^2 is the ratio of the two smoothed
estimates (the per-step ratio would be dominated by its noisy denominator).

Where the two norms come from:

* data-parallel training: :func:`noise_scale_hook`, a DDP communication hook wrapping the default all-reduce. It
  reads each bucket with the fused op before its all-reduce (this rank's gradient, B_small = ``local_batch_size``)
  and after it (the averaged gradient, B_big = ``local_batch_size`` x the group's size), and folds the step in once
  every bucket of the step has been reduced. No host sync, no extra collective.
* gradient accumulation: :meth:`NoiseScale.micro_batch` around each micro-batch's backward reads that micro-batch's
  gradient (B_small = ``local_batch_size``, the micro-batch size), and :meth:`NoiseScale.step` reads the
  accumulated gradient (B_big = micro-batches x ``local_batch_size``) and folds the step in;
  :meth:`NoiseScale.discard_window` gives up a window after an exception.

Under AMP, ``NoiseScale(..., scaler=scaler)`` divides the readings of gradients of the scaled loss (the hook's,
:meth:`NoiseScale.micro_batch`'s) by the scale's square on the device; :meth:`NoiseScale.step` then reads the
unscaled ``.grad``, after ``scaler.unscale_`` (``_grad_scaler.py``, which reads GradScaler's private
``_scale`` and ``_per_optimizer_states``: the public ``get_scale()`` syncs).

Every figure stays on the device; ``to_dict()`` brings the three to the host in one transfer. The state (the two
EMAs and their bias correction) is one float64 tensor, and :meth:`NoiseScale.update` folds a step in with one op,
``torch_gradstats::noise_scale_step`` (:mod:`torch_gradstats.ops.policy_ops`), which updates it in place.

This module holds the estimator and the accumulation window; NoiseScale's other jobs are its bases and helpers in
modules of their own: ``_noise_scale_ddp.py`` (:func:`noise_scale_hook` and the bookkeeping of a DDP step's
buckets), ``_grad_scaler.py`` (the GradScaler) and ``_noise_scale_checkpoint.py`` (``state_dict``,
``load_state_dict``, deep copies and pickling).
"""

import logging
import numbers
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch_gradstats.monitors._grad_scaler import check_unscaled, unscaled
from torch_gradstats.monitors._noise_scale_checkpoint import Checkpoints
from torch_gradstats.monitors._noise_scale_ddp import DDPStep, noise_scale_hook
from torch_gradstats.ops import policy_ops as ops
from torch_gradstats.ops._transfer import to_device, to_host
from torch_gradstats.stats._params import check_grads, named_params, stats_on_home

__all__ = ["NoiseScale", "noise_scale_hook"]

logger = logging.getLogger(__name__)

#: A micro-batch's gradient is read by one op call per this many bytes, instead of one per parameter.
_MICRO_FLUSH_BYTES = 32 * 2**20

KEYS = ("noise/b_simple", "noise/grad_sq", "noise/trace_sigma")
_FIGURE_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))  # read by the op as they are


def _as_sq(value: Tensor | float, what: str) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(
                f"NoiseScale.update: {what} must be a floating-point tensor of one element, got dtype "
                f"{value.dtype} and shape {tuple(value.shape)}"
            )
        if value.device.type == "meta":  # the state would be made there, and every later step and read would fail
            raise ValueError(f"NoiseScale.update: {what} is a meta tensor, which has no value (gradients of a model on "
                             f"the meta device); pass the squared norms of a real step")
        return value.detach().reshape(()).to(torch.float64)  # the EMAs must not chain every step's autograd graph
    if isinstance(value, (int, float, numbers.Real)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"NoiseScale.update: {what} must be a tensor or a float, got a {type(value).__name__}")


def _params_of(params: Any, caller: str) -> list[tuple[str, Tensor]]:
    """The distinct tensors of ``params`` (a module, or what grad_stats accepts) with their names, in order: a tied
    one once, under its first name."""
    if isinstance(params, nn.Module):
        params = params.named_parameters()
    out: dict[int, tuple[str, Tensor]] = {}
    for name, p in named_params(params, caller=caller):
        out.setdefault(id(p), (name, p))
    return list(out.values())


def _ddp_ranks(params: Any, ns: "NoiseScale") -> int:
    """How many ranks' gradients ``.grad`` of ``params`` averages: a ``DistributedDataParallel`` module's group size
    (DDP all-reduces the accumulated gradients at the window's last backward), 1 for anything else. A DDP module
    whose comm hook (``_comm_hooks``, where DDP keeps them) folds into ``ns`` already is refused."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(params, DistributedDataParallel):
        return 1
    if any(hook is noise_scale_hook and state is ns for hook, state in getattr(params, "_comm_hooks", ())):
        raise ValueError(
            "NoiseScale.step: this NoiseScale is also the DDP module's noise_scale_hook, which folds every step in "
            "already; use one of the two (the hook, or micro_batch() and step() without it)"
        )
    return dist.get_world_size(params.process_group)


def _sumsq(tensors: list[Tensor], names: list[str], caller: str) -> Tensor:
    """Sum of squares of every element of ``tensors`` (0-d float64): one op call per device. When the op refuses a
    gradient (sparse, an integer dtype), the error names its parameter."""
    try:
        return stats_on_home(tensors, False)[0][0].sum()
    except (TypeError, ValueError, RuntimeError):
        try:
            check_grads(names, tensors)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("grad_stats:", f"{caller}:", 1)) from None
        raise


class NoiseScale(Checkpoints, DDPStep):
    """Smoothed estimates of |G|^2, tr(Sigma) and the simple noise scale B_simple = tr(Sigma) / |G|^2.

    Args:
        local_batch_size: samples in the small batch: one rank's batch per optimizer step (DDP hook) or one
            micro-batch (:meth:`micro_batch`). A positive int.
        ema: decay of the two EMAs, in [0, 1). Both start at zero and are divided by ``1 - ema**steps`` (bias
            correction), so every step seen so far is weighted by ``ema**age``: 0.99 averages over about 200 steps,
            enough to bring the noisy per-step estimates within a few percent (docs/noise_scale.md). A step whose
            estimates are not finite (a NaN or Inf gradient) is left out, on the device: it changes nothing.
        process_group: the group given to ``DistributedDataParallel`` (None: the default group). The hook
            all-reduces over it in DDP's place, so it must be DDP's own. Used by :func:`noise_scale_hook` only.
        scaler: the ``torch.amp.GradScaler`` whose ``scale(loss)`` the backward passes run on, or None. The hook
            and :meth:`micro_batch` then read gradients of the scaled loss and divide their squared norms by the
            scale's square, on the device (the scale as it is during that backward); :meth:`step` reads the
            true gradients, so it must run after ``scaler.unscale_(optimizer)`` and before ``scaler.update()`` (with
            several optimizers, after the ``unscale_`` of each one holding a parameter of ``params``: the check sees
            only that the scaler unscaled one of them).

    Reading: :attr:`b_simple`, :attr:`grad_sq`, :attr:`trace_sigma` are 0-d float64 tensors on the gradients'
    device (NaN before the first step); reading one as a number is the one host sync. :meth:`to_dict` gives all
    three as floats in one transfer.
    """

    def __init__(self, local_batch_size: int, *, ema: float = 0.99, process_group: Any = None,
                 scaler: Any = None) -> None:
        if isinstance(local_batch_size, bool) or not isinstance(local_batch_size, (int, numbers.Integral)):
            raise TypeError(f"NoiseScale: local_batch_size must be an int, got a {type(local_batch_size).__name__}")
        if local_batch_size < 1:
            raise ValueError(f"NoiseScale: local_batch_size must be >= 1, got {local_batch_size}")
        if isinstance(ema, bool) or not isinstance(ema, (int, float, numbers.Real)):
            raise TypeError(f"NoiseScale: ema must be a float, got a {type(ema).__name__}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"NoiseScale: ema must be in [0, 1), got {ema}")
        if scaler is not None and not callable(getattr(scaler, "is_enabled", None)):
            raise TypeError(f"NoiseScale: scaler must be a torch.amp.GradScaler or None, got a {type(scaler).__name__}")
        self.local_batch_size: int = int(local_batch_size)
        self.scaler = scaler
        self.ema: float = float(ema)
        self.process_group = process_group
        self.steps: int = 0  # steps given to update (a host counter: no sync)
        # The EMAs of |G|^2 and tr(Sigma), and the EMA of ones over the same steps, 1 - ema**(steps folded in): the
        # bias correction, on the device because a step with a non-finite estimate is left out there (no host read
        # decides it). One packed float64 tensor, made on the device of the first step; the three are its views.
        self._state: Tensor | None = None
        self._grad_sq_ema: Tensor | None = None
        self._trace_ema: Tensor | None = None
        self._weight: Tensor | None = None
        self._lock = threading.Lock()  # bucket callbacks and autograd hooks can run on other threads
        self._clear_ddp_step()  # no DDP step in flight (DDPStep: its buckets, their squared norms)
        # The accumulation window: micro-batches finished since the last step(), and the sum of their squared norms.
        self._micro_batches = 0
        self._micro_sq: Tensor | None = None

    # ------------------------------------------------------------------------------------------- the estimates
    def _smoothed(self, ema: Tensor | None) -> Tensor:
        if ema is None or self._weight is None:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return ema / self._weight  # NaN while every step so far was left out

    @property
    def grad_sq(self) -> Tensor:
        """The smoothed estimate of |G|^2, the true gradient's squared norm (0-d float64 tensor)."""
        return self._smoothed(self._grad_sq_ema)

    @property
    def trace_sigma(self) -> Tensor:
        """The smoothed estimate of tr(Sigma), the per-sample gradient covariance's trace (0-d float64 tensor)."""
        return self._smoothed(self._trace_ema)

    @property
    def b_simple(self) -> Tensor:
        """The simple noise scale tr(Sigma) / |G|^2 from the two smoothed estimates (0-d float64 tensor)."""
        if self._grad_sq_ema is None or self._trace_ema is None:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self._trace_ema / self._grad_sq_ema  # the bias corrections cancel

    def to_dict(self) -> dict[str, float]:
        """``{"noise/b_simple", "noise/grad_sq", "noise/trace_sigma"}`` as floats: one host transfer (NaN, and no
        transfer, before the first step)."""
        if self._grad_sq_ema is None:
            return dict.fromkeys(KEYS, float("nan"))
        values, _ = to_host([self.b_simple, self.grad_sq, self.trace_sigma], [])
        return dict(zip(KEYS, values, strict=True))

    # ------------------------------------------------------------------------------------------- folding a step
    def update(self, small_sq: Tensor | float, big_sq: Tensor | float, *, big_batch_size: int) -> None:
        """Fold one step's pair of squared norms into the EMAs (on their device, no host sync).

        ``small_sq`` is |G_small|^2 over ``local_batch_size`` samples, ``big_sq`` is |G_big|^2 over
        ``big_batch_size`` samples of the same step, both of mean (not summed) per-sample gradients. The hook and
        :meth:`step` call this; call it directly where the two norms come from elsewhere.
        """
        if isinstance(big_batch_size, bool) or not isinstance(big_batch_size, (int, numbers.Integral)):
            raise TypeError(f"NoiseScale.update: big_batch_size must be an int, got a {type(big_batch_size).__name__}")
        if big_batch_size <= self.local_batch_size:
            raise ValueError(
                f"NoiseScale.update: big_batch_size must exceed local_batch_size ({self.local_batch_size}), "
                f"got {big_batch_size}"
            )
        b_small, b_big = float(self.local_batch_size), float(int(big_batch_size))
        state = self._state
        # Two float tensors of one element on the state's device (metadata checks only) go to the op as they are.
        if not (state is not None and isinstance(small_sq, Tensor) and isinstance(big_sq, Tensor)
                and small_sq.numel() == 1 and big_sq.numel() == 1 and small_sq.dtype in _FIGURE_DTYPES
                and big_sq.dtype in _FIGURE_DTYPES and small_sq.device == state.device
                and big_sq.device == state.device):
            small_sq, big_sq = self._figures(small_sq, big_sq)
        with self._lock:
            self._fold(small_sq, big_sq, b_small, b_big)

    def _figures(self, small_sq: Tensor | float, big_sq: Tensor | float) -> tuple[Tensor, Tensor]:
        """The step's squared norms as float64 0-d tensors on one device (a number joins the other's device)."""
        small = _as_sq(small_sq, "small_sq")
        big = _as_sq(big_sq, "big_sq")
        if isinstance(small_sq, Tensor) and isinstance(big_sq, Tensor) and small.device != big.device:
            raise ValueError(f"NoiseScale.update: small_sq is on {small.device} but big_sq is on {big.device}")
        device = big.device if isinstance(big_sq, Tensor) else small.device
        return to_device(small, device), to_device(big, device)

    def _fold(self, small_sq: Tensor, big_sq: Tensor, b_small: float, b_big: float) -> None:
        """One step into the EMAs, on the device (the op leaves out a step whose estimates are not finite: one NaN
        or Inf gradient would otherwise make every later estimate NaN)."""
        device = big_sq.device
        if self._state is None:
            self._set_state(torch.zeros(ops.NOISE_STATE, dtype=torch.float64, device=device))
        elif self._state.device != device:  # a state loaded on another device: moved once
            self._set_state(self._state.to(device) if device.type == "cpu" else to_device(self._state, device))
        assert self._state is not None
        ops.noise_scale_step(self._state, small_sq, big_sq, b_small, b_big, self.ema)
        self.steps += 1

    def _set_state(self, state: Tensor) -> None:
        if state.is_inference():  # made under torch.inference_mode: every later step updates it, in any mode
            with torch.inference_mode(False):
                state = state.clone()
        self._state = state
        self._grad_sq_ema, self._trace_ema, self._weight = state[0], state[1], state[2]

    # ------------------------------------------------------------------------------------------- accumulation
    @contextmanager
    def micro_batch(self, params: Any) -> Iterator[None]:
        """Read the gradient of the backward pass run inside this block: one micro-batch of an accumulation window.

        ``params``: a module or what :func:`~torch_gradstats.grad_stats` accepts. Gradient hooks on those
        parameters see each backward's contribution before it is added to ``.grad``; the contributions of one
        parameter within the block are summed (a block may run several ``backward()`` calls: its gradient is their
        sum), and the block's gradient is read when it exits, by one op call per 32 MiB. So the block holds one
        gradient's worth of memory until it exits (the first micro-batch's gradients are copied into ``.grad``
        instead of moved, while held). Scale each micro-batch's loss by ``1 / micro-batches`` as usual (``.grad`` is
        then the mean gradient of the window). The block counts as a micro-batch when it exits without an exception.
        """
        named = [(n, p) for n, p in _params_of(params, "NoiseScale.micro_batch") if p.requires_grad]
        tensors = [p for _, p in named]
        if not tensors:
            raise ValueError("NoiseScale.micro_batch: params holds no tensor that requires grad")
        held: dict[int, Tensor] = {}  # parameter index -> the sum of its contributions in this block
        lock = threading.Lock()

        def hook_of(index: int) -> Any:
            def hook(grad: Tensor) -> None:
                with lock:
                    held[index] = grad if index not in held else held[index] + grad

            return hook

        handles = [p.register_hook(hook_of(i)) for i, p in enumerate(tensors)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if not held:
            logger.warning("NoiseScale.micro_batch: no gradient reached the parameters in this block")
            return
        sums, chunk, chunk_names, chunk_bytes = [], [], [], 0
        for index in sorted(held):
            grad = held[index]
            chunk.append(grad)
            chunk_names.append(named[index][0])
            chunk_bytes += grad.numel() * grad.element_size()
            if chunk_bytes >= _MICRO_FLUSH_BYTES:
                sums.append(_sumsq(chunk, chunk_names, "NoiseScale.micro_batch"))
                chunk, chunk_names, chunk_bytes = [], [], 0
        if chunk:
            sums.append(_sumsq(chunk, chunk_names, "NoiseScale.micro_batch"))
        held.clear()
        total = torch.stack([to_device(t, sums[0].device) for t in sums]).sum() if len(sums) > 1 else sums[0]
        total = unscaled(self.scaler, total)  # the block's backward ran on the scaled loss
        with self._lock:
            self._micro_sq = total if self._micro_sq is None else self._micro_sq + total
            self._micro_batches += 1

    def step(self, params: Any) -> None:
        """Fold an accumulation window in: ``.grad`` of ``params`` is the big batch, the micro-batches read by
        :meth:`micro_batch` since the last call are the small ones. Call it before ``optimizer.zero_grad()``. As in
        :meth:`micro_batch`, only the tensors that require grad are read (a frozen one's stale ``.grad`` is not).

        With ``k`` micro-batches whose losses were scaled by ``1/k``, micro-batch ``j`` contributed ``g_j / k``, so
        the mean of ``|g_j|^2`` is ``k`` times the sum of the contributions' squared norms, and B_big is
        ``k * local_batch_size``. Under DDP, give ``micro_batch`` and ``step`` the ``DistributedDataParallel`` module
        itself: each micro-batch is read before DDP's all-reduce (this rank's), ``.grad`` after it is the mean over the
        group's ranks, and B_big is ``k * local_batch_size * ranks`` (given its ``.module`` or parameters, ``step``
        cannot tell that ``.grad`` was averaged, and takes ``k * local_batch_size``). One op call on the accumulated
        gradients, no host sync. With a ``scaler``, call it after ``scaler.unscale_(optimizer)`` and before
        ``scaler.update()`` (``ValueError`` otherwise, the window kept)."""
        # The parameters micro_batch reads (those that require grad): a frozen one's .grad, left from before it was
        # frozen, is no part of this window's big batch.
        named = [(n, p.grad) for n, p in _params_of(params, "NoiseScale.step")
                 if p.requires_grad and p.grad is not None]
        grads = [g for _, g in named]
        ranks = _ddp_ranks(params, self)  # DDP's .grad is the mean over its ranks' windows: a bigger big batch
        check_unscaled(self.scaler)
        with self._lock:
            k, micro = self._micro_batches, self._micro_sq
            self._micro_batches, self._micro_sq = 0, None
        if k < 2 or micro is None:
            raise ValueError(
                f"NoiseScale.step: needs at least 2 micro-batches read by micro_batch() since the last step, got {k}"
            )
        if not grads:
            raise ValueError("NoiseScale.step: no parameter in params that requires grad has a gradient")
        big = _sumsq(grads, [n for n, _ in named], "NoiseScale.step")
        self.update(micro * k, big, big_batch_size=k * self.local_batch_size * ranks)

    def discard_window(self) -> int:
        """Drop the accumulation window in progress: the micro-batches read by :meth:`micro_batch` since the last
        :meth:`step` are forgotten, and the next window starts empty. Returns how many were dropped (a host
        counter: no sync). Call it when a loop gives a window up after an exception (a micro-batch that raised, an
        out-of-memory error it skips past) and clears the gradients: the micro-batches read before the failure
        would otherwise be counted with the next window's. The EMAs and :attr:`steps` are untouched. Thread-safe,
        like :meth:`micro_batch` and :meth:`step`; a DDP step in flight (:func:`noise_scale_hook`) is not a window
        and is left alone."""
        with self._lock:
            dropped = self._micro_batches
            self._micro_batches, self._micro_sq = 0, None
        if dropped:
            logger.debug("NoiseScale.discard_window: %d micro-batch(es) dropped", dropped)
        return dropped

    def __repr__(self) -> str:
        return f"NoiseScale(local_batch_size={self.local_batch_size}, ema={self.ema}, steps={self.steps})"
