"""A training-loop helper that watches gradient health and syncs with the host once per epoch.

:class:`Trainer` runs the usual loop (forward, backward, optimizer step) and, every ``stats_every`` optimizer steps,
reads the gradients once with the fused op (:func:`torch_gradstats.grad_stats`). What it learns stays **on the
device** and is folded into running epoch aggregates: max and mean global norm, worst health, total NaN/Inf counts,
the first step and parameter that went non-finite, skipped steps, and (optionally) one small row per step for plots.
All of it reaches the host in **one** transfer per epoch (or per ``sync_every`` steps): a non-blocking copy into
pinned memory followed by an event wait on CUDA, a plain copy elsewhere. Nothing in the loop calls ``.item()``.

It fixes what the review of the original training helpers found (see the project seeds):

* stats cover the whole epoch, not only the last batch;
* under AMP the stats are taken after ``GradScaler.unscale_``, so the loss scale does not pollute them;
* under gradient accumulation they are taken once per optimizer step, and each micro-batch's loss is weighted by
  its share of the window's samples, so a short last batch (or a short last window) is weighted correctly;
* the epoch loss is averaged per sample, not per batch; an empty data loader is an error, not a silent 0;
* the optional compiled step (``torch.compile``) is cached per model *architecture*, and a compile failure logs a
  warning and falls back to eager instead of being swallowed;
* the device argument is checked up front with a clear message.

Host syncs this module can cost, all documented on the option that causes them:

* one per epoch (``sync_every=None``) or one per ``sync_every`` optimizer steps plus one at the epoch end;
* ``skip_nonfinite=True`` with an optimizer that cannot skip on the device (anything but ``fused=True`` Adam, AdamW,
  SGD, Adagrad): one per optimizer step, to decide whether to call ``optimizer.step()``;
* a :class:`torch.amp.GradScaler` syncs inside ``scaler.step`` for non-fused optimizers (that is the scaler's own
  behaviour, not this module's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import sys
import threading
import types
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from torch_gradstats.health import HealthPolicy
from torch_gradstats.stats import GradStats, grad_stats

__all__ = [
    "EpochSummary",
    "StepRecord",
    "Trainer",
    "clear_compile_cache",
    "format_epoch_table",
    "validate_device",
]

logger = logging.getLogger("torch_gradstats")

LossFn = Callable[[Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------------------- device check
def validate_device(device: torch.device | str | int | None) -> torch.device:
    """Turn ``device`` into a :class:`torch.device` that exists on this machine, or raise a clear error.

    Accepts a ``torch.device``, a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a CUDA index.
    ``"cuda"`` without an index means the current CUDA device.

    Raises:
        ValueError: the string is not a device, or the device type is not available, or the index is out of range.
    """
    if device is None:
        raise ValueError("device is None; pass e.g. 'cpu' or 'cuda:0'")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid device {device!r}: {exc}. Use e.g. 'cpu', 'cuda' or 'cuda:0'.") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(dev)!r} requested but CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use device='cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= count:
            raise ValueError(
                f"device {str(dev)!r} requested but only {count} CUDA device(s) are visible "
                f"(valid: {', '.join(f'cuda:{i}' for i in range(count))})"
            )
        return dev
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise ValueError(f"device {str(dev)!r} requested but the {dev.type!r} backend is not available")
    return dev


# --------------------------------------------------------------------------------------------------- compiled step
def _forward_loss(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> Tensor:
    return loss_fn(model(inputs), targets)


@dataclasses.dataclass
class _CompiledEntry:
    fn: Callable[..., Tensor]
    failed: bool = False


_COMPILE_CACHE: dict[tuple, _CompiledEntry] = {}
_COMPILE_LOCK = threading.Lock()


def _architecture_key(model: nn.Module, loss_fn: LossFn, mode: str | None, backend: Any) -> tuple:
    """What a compiled forward depends on: the model's class, parameter/buffer layout, loss type and options.

    Two instances of one architecture share an entry (dynamo guards handle the rest); a different architecture
    gets its own entry instead of recompiling one singleton (the flaw of the original ``functools.cache``).
    """
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type) for n, p in model.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers())
    loss_key = type(loss_fn) if isinstance(loss_fn, nn.Module) else loss_fn
    return (type(model), params, buffers, loss_key, mode, backend)


def _get_compiled(model: nn.Module, loss_fn: LossFn, mode: str | None, backend: Any) -> _CompiledEntry:
    key = _architecture_key(model, loss_fn, mode, backend)
    with _COMPILE_LOCK:
        entry = _COMPILE_CACHE.get(key)
        if entry is None:
            kwargs: dict[str, Any] = {"backend": backend}
            if mode is not None:
                kwargs["mode"] = mode
            # A code object of its own per architecture: dynamo counts recompiles per code object, so sharing
            # _forward_loss would make architectures share one recompile limit and silently fall back to eager.
            code = _forward_loss.__code__.replace(co_name=f"_forward_loss_{len(_COMPILE_CACHE)}")
            forward = types.FunctionType(code, _forward_loss.__globals__, code.co_name)
            try:
                fn = torch.compile(forward, **kwargs)
            except Exception as exc:  # bad options; compile errors proper surface at the first call
                logger.warning("torch_gradstats: torch.compile(%s) failed (%s); running eagerly", kwargs, exc)
                entry = _CompiledEntry(_forward_loss, failed=True)
            else:
                entry = _CompiledEntry(fn)
            _COMPILE_CACHE[key] = entry
        return entry


def clear_compile_cache() -> None:
    """Forget every compiled train step (e.g. between experiments, or in tests)."""
    with _COMPILE_LOCK:
        _COMPILE_CACHE.clear()


# --------------------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class StepRecord:
    """Gradient stats of one optimizer step on which stats were taken (host-side numbers)."""

    epoch: int
    step: int  #: global optimizer step index (0-based, counts skipped steps too)
    loss: float  #: per-sample mean loss of the samples of this step
    total_norm: float  #: global L2 norm of the gradients (after unscaling, before clipping); NaN/inf if non-finite
    health: float  #: HealthPolicy score, 0.0 when any gradient is non-finite
    nan_count: int
    inf_count: int
    skipped: bool  #: the optimizer step was skipped (non-finite gradients)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class EpochSummary:
    """What one epoch (or, mid-epoch, the epoch so far) did, from one host transfer.

    Norm aggregates cover the steps whose global norm was finite; non-finite steps are counted separately.
    Fields are None when there is nothing to aggregate (e.g. no step had stats).
    """

    epoch: int
    steps: int  #: optimizer steps (skipped ones included)
    batches: int
    samples: int
    loss: float  #: per-sample mean loss over the epoch
    stats_steps: int  #: optimizer steps on which gradient stats were taken
    max_norm: Optional[float]
    mean_norm: Optional[float]
    min_health: Optional[float]
    nan_count: int  #: total NaN gradient elements over the stats steps
    inf_count: int  #: total Inf gradient elements over the stats steps
    nonfinite_steps: int  #: stats steps with any NaN/Inf gradient
    skipped_steps: int  #: optimizer steps skipped because a gradient was non-finite
    first_nonfinite_step: Optional[int]  #: global step of the first non-finite gradient this epoch
    first_nonfinite_param: Optional[str]  #: name of the first parameter (model order) non-finite at that step
    history: list[StepRecord] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of the epoch figures (without the per-step history), for loggers."""
        d = dataclasses.asdict(self)
        d.pop("history")
        return d

    def __str__(self) -> str:
        return format_epoch_table([self])


def _fmt(x: Optional[float], spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def format_epoch_table(summaries: Sequence[EpochSummary]) -> str:
    """A short fixed-width table, one row per epoch summary."""
    header = (
        f"{'epoch':>5} {'steps':>5} {'loss':>9} {'max|g|':>9} {'mean|g|':>9} {'health':>6} "
        f"{'NaN':>6} {'Inf':>6} {'skip':>4}  first non-finite"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        first = "-" if s.first_nonfinite_step is None else f"step {s.first_nonfinite_step}: {s.first_nonfinite_param}"
        lines.append(
            f"{s.epoch:>5} {s.steps:>5} {_fmt(s.loss):>9} {_fmt(s.max_norm):>9} {_fmt(s.mean_norm):>9} "
            f"{_fmt(s.min_health, '.3f'):>6} {s.nan_count:>6} {s.inf_count:>6} {s.skipped_steps:>4}  {first}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- accumulator
# Order of the aggregate fields in the one buffer sent to the host.
_AGG_FIELDS = (
    "loss_sum",
    "norm_sum",
    "norm_max",
    "finite_steps",
    "health_min",
    "nan_total",
    "inf_total",
    "nonfinite_steps",
    "skipped",
    "first_step",
    "first_param",
)
_ROW_FIELDS = ("loss", "total_norm", "health", "nan_count", "inf_count", "skipped")


class _EpochState:
    """Device-side running aggregates of one epoch (float64 0-d tensors; counts are exact below 2**53)."""

    def __init__(self, device: torch.device) -> None:
        def full(v: float) -> Tensor:
            return torch.full((), v, dtype=torch.float64, device=device)

        self.device = device
        self.agg: dict[str, Tensor] = {
            "loss_sum": full(0.0),
            "norm_sum": full(0.0),
            "norm_max": full(-math.inf),
            "finite_steps": full(0.0),
            "health_min": full(math.inf),
            "nan_total": full(0.0),
            "inf_total": full(0.0),
            "nonfinite_steps": full(0.0),
            "skipped": full(0.0),
            "first_step": full(-1.0),
            "first_param": full(-1.0),
        }
        self.rows: list[Tensor] = []  # per stats step, not yet sent to the host
        self.row_steps: list[int] = []  # global step of each pending row (known on the host)
        self.names_log: list[tuple[int, list[str]]] = []  # (first step using it, parameter names) when it changes
        # Host-side counters (from shapes and loop structure; no sync).
        self.steps = 0
        self.batches = 0
        self.samples = 0
        self.stats_steps = 0
        self.history: list[StepRecord] = []

    def add_stats(
        self, step: int, stats: GradStats, health: Tensor, skipped: Tensor, step_loss: Tensor, keep_row: bool
    ) -> None:
        a = self.agg
        norm = stats.total_norm.to(torch.float64)
        nan = stats.nan_count.to(torch.float64)
        inf = stats.inf_count.to(torch.float64)
        finite = torch.isfinite(norm)
        a["norm_sum"] += torch.where(finite, norm, 0.0)
        a["norm_max"] = torch.maximum(a["norm_max"], torch.where(finite, norm, -math.inf))
        a["finite_steps"] += finite.to(torch.float64)
        a["health_min"] = torch.minimum(a["health_min"], health.to(torch.float64))
        a["nan_total"] += nan
        a["inf_total"] += inf
        bad = (nan + inf) > 0
        a["nonfinite_steps"] += bad.to(torch.float64)
        # First non-finite step and, at that step, the first parameter (model order) with a NaN/Inf.
        new = bad & (a["first_step"] < 0)
        first_idx = stats.nonfinite_mask.to(torch.int32).argmax().to(torch.float64)  # argmax: first maximum
        a["first_step"] = torch.where(new, float(step), a["first_step"])
        a["first_param"] = torch.where(new, first_idx, a["first_param"])
        if not self.names_log or self.names_log[-1][1] != stats.names:
            self.names_log.append((step, list(stats.names)))
        self.stats_steps += 1
        if keep_row:
            self.rows.append(torch.stack([step_loss, norm, health.to(torch.float64), nan, inf, skipped]))
            self.row_steps.append(step)

    def name_at(self, step: int, index: int) -> Optional[str]:
        names = None
        for start, ns in self.names_log:
            if start <= step:
                names = ns
        if names is None or not 0 <= index < len(names):
            return None
        return names[index]


# --------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Train a model epoch by epoch while watching its gradients, with one host sync per epoch.

    Args:
        model: the model, already on ``device``.
        optimizer: its optimizer. ``fused=True`` Adam/AdamW/SGD/Adagrad let ``skip_nonfinite`` skip on the device.
        loss_fn: ``loss_fn(outputs, targets)`` returning the **mean** loss over the batch (a 0-d tensor), e.g.
            ``nn.CrossEntropyLoss()``; the helper weights it by batch size to average per sample.
        device: where to train; validated up front (default: the device of the model's first parameter).
        stats_every: take gradient stats every this many optimizer steps (default 1: every step). Forced to 1 when
            ``skip_nonfinite`` is set or a ``scaler`` is given, because skipped steps must then be seen.
        accumulation_steps: micro-batches per optimizer step (gradient accumulation).
        scaler: a :class:`torch.amp.GradScaler` for mixed precision; the stats are taken after ``unscale_``. The
            scaler skips non-finite steps itself.
        amp_dtype: run the forward under ``torch.autocast(device.type, dtype=amp_dtype)`` (e.g. ``torch.bfloat16``).
        max_grad_norm: clip the global L2 norm to this with :func:`torch_gradstats.clip_grad_norm_` (the stats
            come from the same read). Stats report the norm before clipping.
        skip_nonfinite: skip the optimizer step when any gradient is NaN/Inf. With a fused optimizer this is done
            on the device through the optimizer's ``found_inf`` input (no sync); otherwise it costs one host sync
            per optimizer step (a warning says so once).
        compile: run forward+loss through ``torch.compile``, cached per model architecture. A compile failure logs
            a warning and runs eagerly.
        compile_mode, compile_backend: passed to ``torch.compile``. With ``mode="reduce-overhead"`` (CUDA graphs)
            the loss output is consumed before the next call, and ``cudagraph_mark_step_begin`` is called per call.
        health_policy: thresholds of the health score (default :class:`HealthPolicy`).
        sync_every: also sync every this many optimizer steps (logging interval) and log the epoch so far;
            ``None`` (default) syncs only at the epoch end.
        progress: show a tqdm bar; ``None`` (default) shows it when stderr is a terminal and tqdm is installed.
        keep_history: keep one :class:`StepRecord` per stats step in the summary (for plots and logs).
        after_backward: optional ``callback(trainer)`` run once per optimizer step after the gradients are
            accumulated, before the stats; e.g. to inspect or perturb gradients. Under a GradScaler it runs before
            ``unscale_`` (the gradients are still multiplied by the loss scale), so the scaler sees its changes.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        device: torch.device | str | int | None = None,
        stats_every: int = 1,
        accumulation_steps: int = 1,
        scaler: Optional["torch.amp.GradScaler"] = None,
        amp_dtype: Optional[torch.dtype] = None,
        max_grad_norm: Optional[float] = None,
        skip_nonfinite: bool = False,
        compile: bool = False,
        compile_mode: Optional[str] = None,
        compile_backend: Any = "inductor",
        health_policy: Optional[HealthPolicy] = None,
        sync_every: Optional[int] = None,
        progress: Optional[bool] = None,
        keep_history: bool = True,
        after_backward: Optional[Callable[["Trainer"], None]] = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        params = list(model.named_parameters())
        if not params:
            raise ValueError("model has no parameters to train")
        if device is None:
            device = params[0][1].device
        self.device = validate_device(device)
        for name, p in params:
            if not _same_device(p.device, self.device):
                raise ValueError(
                    f"parameter {name!r} is on {p.device} but the trainer's device is {self.device}; "
                    f"move the model first (model.to({str(self.device)!r})) and then create the optimizer"
                )
        for arg, value in (("stats_every", stats_every), ("accumulation_steps", accumulation_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"sync_every must be a positive int or None, got {sync_every!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")

        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.amp_dtype = amp_dtype
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.compile = compile
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        if health_policy is not None and not isinstance(health_policy, HealthPolicy):
            raise TypeError(f"Trainer: health_policy must be a HealthPolicy or None, got {type(health_policy).__name__}")
        self.health_policy = health_policy if health_policy is not None else HealthPolicy()
        self.sync_every = sync_every
        self.progress = progress
        self.keep_history = keep_history
        self.after_backward = after_backward
        # Skipped steps can only be counted if every step is looked at.
        self.must_check_every_step = skip_nonfinite or scaler is not None
        self.stats_every = 1 if self.must_check_every_step else stats_every
        if self.must_check_every_step and stats_every != 1:
            logger.info("torch_gradstats: stats_every=%d ignored: skip_nonfinite/GradScaler need stats every step",
                        stats_every)
        self.accumulation_steps = accumulation_steps
        # Fused Adam/AdamW/SGD/Adagrad accept a device-side found_inf and skip the update in the kernel.
        self.device_side_skip = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if skip_nonfinite and scaler is None and not self.device_side_skip:
            logger.warning(
                "torch_gradstats: skip_nonfinite with %s (not fused) costs one host sync per optimizer step; "
                "create the optimizer with fused=True for a device-side skip",
                type(optimizer).__name__,
            )
        self._optimizer_state_ready = False  # see _optimizer_state_pending
        self.global_step = 0  #: optimizer steps taken so far (skipped ones included)
        self.epoch = 0  #: index of the next epoch
        self._pinned: Optional[Tensor] = None

    # ----------------------------------------------------------------------------------------------- public
    def fit(self, loader: Iterable[Any], epochs: int) -> list[EpochSummary]:
        """Run ``epochs`` epochs over ``loader``; return their summaries."""
        return [self.train_epoch(loader) for _ in range(epochs)]

    def train_epoch(self, loader: Iterable[Any]) -> EpochSummary:
        """Train one epoch over ``loader`` (batches of ``(inputs, targets)``) and return its summary.

        Raises:
            ValueError: the loader yields no batches, or a batch is not an ``(inputs, targets)`` pair.
        """
        length = _safe_len(loader)
        if length == 0:
            raise ValueError(
                "the data loader is empty (len 0): nothing to train on. Check the dataset size, batch_size and "
                "drop_last"
            )
        epoch = self.epoch
        state = _EpochState(self.device)
        self.model.train()
        bar = _make_progress(self.progress, length, f"epoch {epoch}")
        it = iter(loader)
        try:
            while True:
                window = list(itertools.islice(it, self.accumulation_steps))
                if not window:
                    break
                self._optimizer_step(window, state, epoch, bar)
                if self.sync_every is not None and state.steps % self.sync_every == 0:
                    summary = self._sync(state, epoch)
                    logger.info("torch_gradstats: epoch %d, step %d: %s", epoch, self.global_step,
                                summary.to_dict())
                    _progress_postfix(bar, summary)
        finally:
            if bar is not None:
                bar.close()
        if state.batches == 0:
            raise ValueError(
                "the data loader yielded no batches: nothing to train on. Check the dataset size, batch_size and "
                "drop_last"
            )
        summary = self._sync(state, epoch)
        self.epoch += 1
        logger.info("torch_gradstats: epoch %d done: %s", epoch, summary.to_dict())
        return summary

    # ----------------------------------------------------------------------------------------------- internals
    def _forward(self, inputs: Any, targets: Any) -> Tensor:
        if not self.compile:
            return _forward_loss(self.model, inputs, targets, self.loss_fn)
        entry = _get_compiled(self.model, self.loss_fn, self.compile_mode, self.compile_backend)
        if entry.failed:
            return _forward_loss(self.model, inputs, targets, self.loss_fn)
        if self.compile_mode in ("reduce-overhead", "max-autotune"):
            # CUDA-graph modes reuse output buffers across replays: mark each step (the loss is consumed at once).
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return entry.fn(self.model, inputs, targets, self.loss_fn)
        except Exception as exc:
            # If the error was the user's (a shape mismatch, say), the eager run raises it again and compilation
            # stays on for the next call; only a failure of compilation itself falls back, loudly.
            loss = _forward_loss(self.model, inputs, targets, self.loss_fn)
            entry.failed = True
            logger.warning(
                "torch_gradstats: compiled train step failed for %s (%s: %s); falling back to eager for this "
                "architecture",
                type(self.model).__name__,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return loss

    def _optimizer_step(self, window: list[Any], state: _EpochState, epoch: int, bar: Any) -> None:
        step = self.global_step
        batches = [self._to_device(b, i + state.batches) for i, b in enumerate(window)]
        sizes = [_batch_size(x, y) for x, y in batches]
        window_samples = sum(sizes)
        if window_samples == 0:
            raise ValueError(f"optimizer step {step}: every batch of the accumulation window is empty")
        self.optimizer.zero_grad(set_to_none=True)
        step_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        autocast = (
            torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype is not None
            else contextlib.nullcontext()
        )
        for (inputs, targets), n in zip(batches, sizes):
            if n == 0:  # an empty micro-batch adds nothing (and its mean loss would be NaN)
                if bar is not None:
                    bar.update(1)
                continue
            with autocast:
                loss = self._forward(inputs, targets)
            if loss.dim() != 0:
                raise ValueError(
                    f"loss_fn must return a 0-d (mean) loss, got shape {tuple(loss.shape)}; "
                    "use reduction='mean'"
                )
            # Weight each micro-batch by its share of the window's samples: per-sample averaging.
            scaled = loss if n == window_samples else loss * (n / window_samples)
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            step_loss_sum += loss.detach().to(torch.float64) * n
            if bar is not None:
                bar.update(1)
        state.batches += len(batches)
        state.samples += window_samples
        state.agg["loss_sum"] += step_loss_sum

        if self.after_backward is not None:
            # Before unscale_, so a GradScaler sees whatever the callback did to the gradients.
            self.after_backward(self)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # stats must see the true gradients, not loss-scaled ones

        take_stats = self.must_check_every_step or step % self.stats_every == 0
        stats: Optional[GradStats] = None
        if self.max_grad_norm is not None:
            from torch_gradstats.clip import clip_grad_norm_

            stats = clip_grad_norm_(self.model.named_parameters(), self.max_grad_norm)
        elif take_stats:
            stats = grad_stats(self.model.named_parameters())
        has_grads = stats is not None and len(stats.names) > 0

        skipped = torch.zeros((), dtype=torch.float64, device=self.device)
        if has_grads and (self.skip_nonfinite or self.scaler is not None):
            skipped = (stats.nonfinite_count > 0).to(torch.float64)

        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips non-finite steps itself
            self.scaler.update()
        elif self.skip_nonfinite and has_grads:
            if self.device_side_skip and not self._optimizer_state_pending():
                self.optimizer.found_inf = skipped.to(torch.float32)  # type: ignore[attr-defined]
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf  # type: ignore[attr-defined]
            elif not bool(skipped):  # documented host sync: a non-fused optimizer can only be skipped from Python
                self.optimizer.step()
        else:
            self.optimizer.step()
        state.agg["skipped"] += skipped

        if has_grads and take_stats:
            health = stats.health(self.health_policy)
            step_loss = step_loss_sum / window_samples
            state.add_stats(step, stats, health, skipped, step_loss, self.keep_history)
        state.steps += 1
        self.global_step += 1

    def _optimizer_state_pending(self) -> bool:
        """True while a fused SGD with momentum has not yet created its momentum buffers.

        Its first step allocates them uninitialised (``empty_like``) and, told to skip by ``found_inf``, leaves them
        so: a skipped first step would poison every later one. Until the buffers exist, the skip is decided on the
        host (one sync per step, normally just the first).
        """
        if self._optimizer_state_ready:
            return False
        opt = self.optimizer
        if isinstance(opt, torch.optim.SGD):
            for group in opt.param_groups:
                if group.get("momentum", 0) == 0:
                    continue
                for p in group["params"]:
                    if p.grad is not None and "momentum_buffer" not in opt.state.get(p, {}):
                        return True
        self._optimizer_state_ready = True
        return False

    def _to_device(self, batch: Any, index: int) -> tuple[Any, Any]:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"batch {index} is a {type(batch).__name__}; expected an (inputs, targets) pair")
        return tuple(_move(t, self.device) for t in batch)  # type: ignore[return-value]

    def _fetch(self, buf: Tensor) -> list[float]:
        """The one device-to-host transfer: non-blocking copy into pinned memory + event on CUDA."""
        if buf.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() < buf.numel():
                self._pinned = torch.empty(max(buf.numel(), 256), dtype=buf.dtype, pin_memory=True)
            host = self._pinned[: buf.numel()]
            host.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
        else:
            host = buf.to("cpu")
        return host.tolist()

    def _sync(self, state: _EpochState, epoch: int) -> EpochSummary:
        parts = [torch.stack([state.agg[k] for k in _AGG_FIELDS])] + state.rows
        values = self._fetch(torch.cat(parts))
        agg = dict(zip(_AGG_FIELDS, values[: len(_AGG_FIELDS)]))
        width = len(_ROW_FIELDS)
        flat = values[len(_AGG_FIELDS):]
        for i, step in enumerate(state.row_steps):
            row = dict(zip(_ROW_FIELDS, flat[i * width:(i + 1) * width]))
            state.history.append(
                StepRecord(
                    epoch=epoch,
                    step=step,
                    loss=row["loss"],
                    total_norm=row["total_norm"],
                    health=row["health"],
                    nan_count=int(row["nan_count"]),
                    inf_count=int(row["inf_count"]),
                    skipped=bool(row["skipped"]),
                )
            )
        state.rows, state.row_steps = [], []
        finite_steps = int(agg["finite_steps"])
        first_step = int(agg["first_step"])
        return EpochSummary(
            epoch=epoch,
            steps=state.steps,
            batches=state.batches,
            samples=state.samples,
            loss=agg["loss_sum"] / state.samples if state.samples else math.nan,
            stats_steps=state.stats_steps,
            max_norm=agg["norm_max"] if finite_steps else None,
            mean_norm=agg["norm_sum"] / finite_steps if finite_steps else None,
            min_health=agg["health_min"] if state.stats_steps else None,
            nan_count=int(agg["nan_total"]),
            inf_count=int(agg["inf_total"]),
            nonfinite_steps=int(agg["nonfinite_steps"]),
            skipped_steps=int(agg["skipped"]),
            first_nonfinite_step=first_step if first_step >= 0 else None,
            first_nonfinite_param=state.name_at(first_step, int(agg["first_param"])) if first_step >= 0 else None,
            history=list(state.history),
        )


# --------------------------------------------------------------------------------------------------- helpers
def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _move(x: Any, device: torch.device) -> Any:
    if isinstance(x, Tensor):
        # non_blocking only overlaps when the source is pinned (DataLoader(pin_memory=True)); harmless otherwise.
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return type(x)(_move(t, device) for t in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


def _first_batched_tensor(x: Any) -> Optional[Tensor]:
    """The first tensor with a batch dimension in ``x`` (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(x, Tensor):
        return x if x.dim() > 0 else None
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for item in items:
        found = _first_batched_tensor(item)
        if found is not None:
            return found
    return None


def _batch_size(inputs: Any, targets: Any) -> int:
    for x in (inputs, targets):
        t = _first_batched_tensor(x)
        if t is not None:
            return int(t.shape[0])  # from the shape: no sync
    for x in (inputs, targets):
        try:
            return len(x)
        except TypeError:
            pass
    raise ValueError("cannot tell the batch size: neither inputs nor targets is a tensor with a batch dimension")


def _safe_len(loader: Iterable[Any]) -> Optional[int]:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _make_progress(progress: Optional[bool], total: Optional[int], desc: str) -> Any:
    """A tqdm bar, or None: off when asked, when stderr is not a terminal (auto mode), or without tqdm."""
    if progress is False or (progress is None and not _stderr_isatty()):
        return None
    try:
        from tqdm.auto import tqdm  # lazy: tqdm is optional
    except ImportError:
        if progress:
            logger.warning("torch_gradstats: progress=True but tqdm is not installed (pip install tqdm)")
        return None
    return tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True)


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _progress_postfix(bar: Any, summary: EpochSummary) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{summary.loss:.4g}", max_norm=_fmt(summary.max_norm), skipped=summary.skipped_steps)
