"""What the Lightning and Hugging Face callbacks share: take the statistics, measure the update, report once."""

from __future__ import annotations

import logging
from typing import Any, Literal

from torch import Tensor, nn

from torch_gradstats._transfer import to_host
from torch_gradstats.health import HealthPolicy
from torch_gradstats.integrations import AnyReport, grad_report
from torch_gradstats.stats import GradStats, grad_stats
from torch_gradstats.updates import GradWeightStats, UpdateRatio, grad_and_weight_stats

logger = logging.getLogger("torch_gradstats")

OnNonfinite = Literal["skip", "stop"] | None


def check_options(every_n_steps: int | None, on_nonfinite: Any) -> None:
    if every_n_steps is not None and (not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool)
                                      or every_n_steps < 1):
        raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
    if on_nonfinite not in (None, "skip", "stop"):
        raise ValueError(f"on_nonfinite must be None, 'skip' or 'stop', got {on_nonfinite!r}")


class StatsTaker:
    """Takes the statistics of one optimizer step and turns them into one report (one host transfer)."""

    def __init__(self, log_weight_norms: bool, log_update_ratio: bool, group: Any, policy: HealthPolicy | None,
                 k: int) -> None:
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
        """The one device-to-host transfer of a logging step."""
        return stats.report(self.k, policy=self.policy)

    @staticmethod
    def nonfinite(stats: GradStats | GradWeightStats) -> bool:
        """Whether any gradient is NaN/Inf: one small device-to-host transfer."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        if not len(g.names):
            return False
        _, (count,) = to_host([], [g.nonfinite_count])
        return count > 0


def describe_nonfinite(report: AnyReport) -> str:
    g = grad_report(report)
    more = f" and {len(g.nonfinite) - 1} more" if len(g.nonfinite) > 1 else ""
    return f"{g.first_nonfinite!r}{more} ({g.nan_count} NaN, {g.inf_count} Inf)"
