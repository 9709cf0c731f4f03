"""What the Lightning and Hugging Face callbacks share: take the statistics, measure the update, report once."""

from __future__ import annotations

import logging
import numbers
from typing import Any, Literal

import torch
from torch import Tensor, nn

from torch_gradstats._transfer import to_host
from torch_gradstats.groups import GroupBy, group_names
from torch_gradstats.health import HealthPolicy
from torch_gradstats.integrations import AnyReport, grad_report
from torch_gradstats.report import STYLES
from torch_gradstats.stats import GradStats, grad_stats
from torch_gradstats.updates import GradWeightStats, UpdateRatio, grad_and_weight_stats

logger = logging.getLogger("torch_gradstats")

OnNonfinite = Literal["skip", "stop"] | None


def check_key_style(key_style: Any) -> str | None:
    """Validate a callback's ``key_style``: None or one of ``GradReport.to_dict``'s styles."""
    if key_style is not None and not isinstance(key_style, str):
        raise TypeError(f"key_style must be None or one of {', '.join(STYLES)}, got a {type(key_style).__name__}")
    if key_style is not None and key_style not in STYLES:
        raise ValueError(f"key_style must be None or one of {', '.join(STYLES)}, got {key_style!r}")
    return key_style


def styled_keys(report: AnyReport, key_style: str | None, per_param: bool) -> dict[str, float]:
    """The numbers of ``key_style``'s keys (none for None or ``"default"``: those are the callbacks' own keys)."""
    if key_style is None or key_style == "default":
        return {}
    return {k: float(v) for k, v in grad_report(report).to_dict(per_param=per_param, style=key_style).items()
            if isinstance(v, (int, float))}


def check_options(every_n_steps: Any, on_nonfinite: Any) -> int | None:
    """Validate the options the callbacks share; returns ``every_n_steps`` as a Python int (or None)."""
    if on_nonfinite is not None and not isinstance(on_nonfinite, str):
        raise TypeError(f"on_nonfinite must be None, 'skip' or 'stop', got {on_nonfinite!r} "
                        f"({type(on_nonfinite).__name__})")
    if on_nonfinite not in (None, "skip", "stop"):
        raise ValueError(f"on_nonfinite must be None, 'skip' or 'stop', got {on_nonfinite!r}")
    if every_n_steps is None:
        return None
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, numbers.Integral):
        raise TypeError(f"every_n_steps must be a positive int (or numpy integer) or None, got {every_n_steps!r} "
                        f"({type(every_n_steps).__name__})")
    if every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
    return int(every_n_steps)


class StatsTaker:
    """Takes the statistics of one optimizer step and turns them into one report (one host transfer)."""

    def __init__(self, log_weight_norms: bool, log_update_ratio: bool, group: Any, policy: HealthPolicy | None,
                 k: int, group_by: GroupBy | None = None) -> None:
        if group_by is not None:
            group_names([], group_by)  # a wrong kind of group_by is named now, not at the first logging step
        self.group_by = group_by
        self.log_weight_norms = log_weight_norms
        self.log_update_ratio = log_update_ratio
        self.group = group
        self.policy = policy
        self.k = k
        self.ratio: UpdateRatio | None = None

    @staticmethod
    def trainable(module: nn.Module) -> list[tuple[str, Tensor]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def take(self, module: nn.Module, optimizer: Any) -> GradStats | GradWeightStats:
        """Device statistics of the gradients (and weights, with learning rates) of ``module``; no host sync."""
        params = self.trainable(module)
        if self.log_weight_norms or self.log_update_ratio:
            return grad_and_weight_stats(params, optimizer=optimizer, group=self.group)
        return grad_stats(params, group=self.group)

    def snapshot(self, module: nn.Module) -> None:
        if self.ratio is None:
            self.ratio = UpdateRatio(self.trainable(module), group=self.group)
            logger.info("torch_gradstats: measuring update ratios keeps one copy of the weights (%.1f MiB)",
                        self.ratio.nbytes / 2**20)
        self.ratio.snapshot()

    def measure(self, stats: GradStats | GradWeightStats) -> None:
        if self.ratio is not None and isinstance(stats, GradWeightStats):
            stats.update = self.ratio.measure()

    def report(self, stats: GradStats | GradWeightStats) -> AnyReport:
        """The one device-to-host transfer of a logging step (with the groups' figures, when grouping)."""
        groups = stats.grouped(self.group_by) if self.group_by is not None else None
        return stats.report(self.k, policy=self.policy, groups=groups)

    @staticmethod
    def nonfinite(stats: GradStats | GradWeightStats) -> bool:
        """Whether any gradient is NaN/Inf: one small device-to-host transfer."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        if not len(g.names):
            return False
        _, (count,) = to_host([], [g.nonfinite_count])
        return count > 0

    @staticmethod
    def describe_nonfinite(stats: GradStats | GradWeightStats) -> str:
        """The first non-finite parameter by name, with the counts, as :func:`describe_nonfinite` words them.

        One more small transfer: made only on a step already found non-finite, so a healthy step pays nothing."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        mask = g.nonfinite_mask
        first_index = mask.to(torch.int32).argmax()  # argmax returns the first maximum: model order
        _, (first, n_bad, nan, inf) = to_host([], [first_index, mask.sum(), g.nan_count, g.inf_count])
        return _describe(g.names[first], n_bad, nan, inf)


def describe_nonfinite(report: AnyReport) -> str:
    """``'<first non-finite parameter>' and N more (a NaN, b Inf)`` from a report already on the host."""
    g = grad_report(report)
    return _describe(g.first_nonfinite, len(g.nonfinite), g.nan_count, g.inf_count)


def _describe(first: str | None, n_tensors: int, nan: int, inf: int) -> str:
    more = f" and {n_tensors - 1} more" if n_tensors > 1 else ""
    return f"{first!r}{more} ({nan} NaN, {inf} Inf)"
