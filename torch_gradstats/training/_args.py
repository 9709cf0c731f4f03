"""Checks of the Trainer's arguments: TypeError for a wrong type, ValueError for a bad value, each naming the
argument. Integers may be any ``numbers.Integral`` (numpy's included) except bool, and come back as Python ints."""

from __future__ import annotations

import logging
import numbers
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from torch_gradstats.monitors.activations import ActivationWatch
from torch_gradstats.stats.report import GradReport

__all__ = ["GradSink", "WatchSteps", "activation_watch", "check_int", "check_optimizer_and_loss",
           "check_positive_number", "check_sinks", "send_to_sinks"]

logger = logging.getLogger("torch_gradstats")


def check_int(name: str, value: object, *, minimum: int = 1, or_none: bool = False) -> int:
    """``value`` as a Python int >= ``minimum``, or an error naming ``name`` (``or_none``: the message says None is
    accepted too; the caller lets None through)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise TypeError(f"{name} must be {kind}{' or None' if or_none else ''}, got {value!r} "
                        f"({type(value).__name__})")  # fmt: skip
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {int(value)}")
    return int(value)


def check_optimizer_and_loss(optimizer: object, loss_fn: object, model: nn.Module) -> None:
    """An optimizer that can train ``model`` (it holds at least one of its parameters) and a callable ``loss_fn``:
    either mistake would otherwise show at the first step, or never (an optimizer of another model trains nothing)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, targets) -> mean loss, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in held for p in model.parameters()):
        raise ValueError("optimizer holds none of the model's parameters: build it from this model's parameters "
                         "(e.g. torch.optim.AdamW(model.parameters()) after model.to(device))")


def check_positive_number(name: str, value: object) -> float | None:
    """``value`` as a float > 0 (inf allowed), None as None, or an error naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number or None, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not number > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def activation_watch(watch: ActivationWatch | bool | None, model: nn.Module, compile: bool) -> ActivationWatch | None:
    if watch is None or watch is False:
        return None
    if watch is not True and not isinstance(watch, ActivationWatch):
        raise TypeError(
            f"Trainer: watch_activations must be an ActivationWatch, True, False or None, got {type(watch).__name__}"
        )
    if compile:
        raise ValueError(
            "Trainer: watch_activations needs compile=False: the watch's hooks cannot run in a compiled region"
        )
    return ActivationWatch(model) if watch is True else watch


class WatchSteps:
    """Which optimizer step each of an ActivationWatch's steps (its count of the model's forward calls) belonged to.
    The two counts part as soon as a window has several micro-batches or an evaluation forward runs between training
    steps; the Trainer's warnings name both where they differ."""

    KEEP = 4096  # the latest forward calls remembered (a report describes the latest recorded step)

    def __init__(self) -> None:
        self._steps: OrderedDict[int, int] = OrderedDict()
        self._forgotten = -1  # the watch's steps up to this one are no longer remembered

    def note(self, first: int, last: int, optimizer_step: int) -> None:
        """The watch's steps ``first`` to ``last`` were the forwards of ``optimizer_step``."""
        for s in range(first, last + 1):
            self._steps[s] = optimizer_step
        while len(self._steps) > self.KEEP:
            self._forgotten = self._steps.popitem(last=False)[0]

    def words(self, watch_step: int | None) -> str:
        """What to add to a report of ``watch_step``: nothing where it is the optimizer step of that number."""
        if watch_step is None or not self._steps or watch_step <= self._forgotten:
            return ""
        step = self._steps.get(watch_step)
        if step == watch_step:
            return ""
        if step is None:
            return f" (the watch's step {watch_step} was no training step: a forward between optimizer steps)"
        return f" (the watch's step {watch_step}, a forward call of optimizer step {step})"


class GradSink(Protocol):
    """What ``log_to`` accepts (torch_gradstats.integrations defines the same protocol for its sinks)."""

    def log(self, report: GradReport, step: int) -> None: ...


def check_sinks(sinks: Sequence[GradSink]) -> list[GradSink]:
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Sequence):
        raise TypeError(f"log_to must be a list of sinks (objects with a log(report, step) method), got {sinks!r}")
    for i, sink in enumerate(sinks):
        if not callable(getattr(sink, "log", None)):
            raise TypeError(
                f"log_to[{i}] is a {type(sink).__name__} without a log(report, step) method; use e.g. "
                "torch_gradstats.integrations.tensorboard.TensorBoardSink(writer)"
            )
    return list(sinks)


def send_to_sinks(sinks: Sequence[Any], report: Any, step: int) -> None:
    """``sink.log(report, step)`` for every sink, in order. A sink that raises an ``Exception`` does not keep the
    report from the sinks after it: each is still called, then the first error is raised; each failing sink is
    named on the ``torch_gradstats`` logger (a later error with its traceback). A ``KeyboardInterrupt`` stops at
    once."""
    first: Exception | None = None
    for i, sink in enumerate(sinks):
        try:
            sink.log(report, step)
        except Exception as exc:
            logger.error("torch_gradstats: sink [%d] (a %s) raised at step %s: %s: %s", i, type(sink).__name__, step,
                         type(exc).__name__, exc, exc_info=exc if first is not None else None)
            if first is None:
                first = exc
    if first is not None:
        raise first
