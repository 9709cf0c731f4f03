"""Drop-in replacement for esper-lite's gradient collector (``esper.simic.telemetry.gradient_collector``).

Same public names, signatures, return types and dict keys as the original, with its latest semantics:

* ``gradient_norm`` is the global L2 norm ``sqrt(sum ||g_i||^2)`` (what ``clip_grad_norm_`` returns), not divided by
  the number of tensors;
* a NaN or Inf anywhere makes that tensor's norm, and so ``gradient_norm``, non-finite; a non-finite norm counts as
  exploding and makes ``gradient_health`` 0.0;
* extreme values never overflow (1e20 in float32, 5000 in float16): sums of squares are accumulated in float64
  inside the fused op;
* no gradients at all: norm 0.0, health 1.0, every flag False.

What changed inside: each collection is ONE :func:`torch_gradstats.multi_tensor_stats` call per device (norms and
zero/NaN/Inf counts in one read). There is no ``.double()`` copy of every gradient, no ``torch.cat`` of all of
them, no boolean temporaries the size of the model; ``collect_*_async`` never syncs and each ``materialize_*`` (and
each synchronous ``collect*``) makes one device-to-host transfer. See docs/collector_migration.md.

Health: ``1 - 0.5 * share_vanishing - 0.8 * share_exploding`` clamped to [0, 1], over per-tensor norms, computed
by :class:`torch_gradstats.stats.health.HealthPolicy` with this module's thresholds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TypedDict

import torch
from torch import Tensor, nn

from torch_gradstats.ops._transfer import to_host
from torch_gradstats.stats._params import named_params
from torch_gradstats.stats.gradients import GradStats, grad_stats
from torch_gradstats.stats.health import DEFAULT_EXPLODING_THRESHOLD, DEFAULT_VANISHING_THRESHOLD, HealthPolicy

__all__ = [
    "DEFAULT_EXPLODING_THRESHOLD",
    "DEFAULT_VANISHING_THRESHOLD",
    "DualGradientStats",
    "GradientHealthMetrics",
    "GradientHealthStats",
    "SeedGradientCollector",
    "collect_dual_gradients_async",
    "collect_host_gradients_async",
    "collect_seed_gradients",
    "collect_seed_gradients_async",
    "collect_seed_gradients_only_async",
    "materialize_dual_grad_stats",
    "materialize_grad_stats",
]

ParamIter = Iterator[nn.Parameter] | Iterable[Tensor]
AsyncStats = dict[str, bool | int | float | Tensor]


class GradientHealthStats(TypedDict):
    """Materialized gradient health statistics (what ``collect`` / ``materialize_grad_stats`` return)."""

    gradient_norm: float
    gradient_health: float
    has_vanishing: bool
    has_exploding: bool


@dataclass(slots=True)
class GradientHealthMetrics:
    """Enhanced gradient health metrics (``collect_seed_gradients(..., return_enhanced=True)``).

    Attributes:
        gradient_norm: global L2 norm (NaN/inf if any gradient element is).
        gradient_health: health score in [0, 1]; 0.0 with any non-finite gradient.
        has_vanishing, has_exploding: any tensor norm below / above the thresholds (non-finite counts as exploding).
        min_layer_norm, max_layer_norm: smallest / largest per-tensor norm (NaN if any is NaN).
        norm_ratio: ``max_layer_norm / max(min_layer_norm, 1e-10)``.
        zero_grad_fraction: share of gradient elements exactly zero.
        nan_count, inf_count: number of NaN / Inf gradient elements.
    """

    gradient_norm: float
    gradient_health: float
    has_vanishing: bool
    has_exploding: bool
    min_layer_norm: float
    max_layer_norm: float
    norm_ratio: float
    zero_grad_fraction: float
    nan_count: int
    inf_count: int

    def is_healthy(self, max_norm_ratio: float = 1000.0, max_zero_fraction: float = 0.5) -> bool:
        """True when there is no NaN/Inf, no exploding tensor, and the norm ratio and zero fraction are below the
        given limits."""
        return (
            self.nan_count == 0
            and self.inf_count == 0
            and self.norm_ratio < max_norm_ratio
            and self.zero_grad_fraction < max_zero_fraction
            and not self.has_exploding
        )

    def to_dict(self) -> dict[str, float | int | bool]:
        """Plain dict of the fields (for a telemetry event's data)."""
        return asdict(self)


def _policy(vanishing_threshold: float, exploding_threshold: float) -> HealthPolicy:
    return HealthPolicy(vanishing_threshold=vanishing_threshold, exploding_threshold=exploding_threshold)


def _empty_result() -> GradientHealthStats:
    return {"gradient_norm": 0.0, "gradient_health": 1.0, "has_vanishing": False, "has_exploding": False}


class SeedGradientCollector:
    """Gradient norm, health and vanishing/exploding flags of a set of parameters, with no hooks and no state.

    Call after ``loss.backward()`` (before clipping: "exploding" then means "will be clipped hard").
    """

    __slots__ = ("exploding_threshold", "vanishing_threshold")

    def __init__(
        self,
        vanishing_threshold: float = DEFAULT_VANISHING_THRESHOLD,
        exploding_threshold: float = DEFAULT_EXPLODING_THRESHOLD,
    ):
        """
        Args:
            vanishing_threshold: a tensor whose gradient norm is below this is vanishing (default 1e-7).
            exploding_threshold: a tensor whose gradient norm is above this, or not finite, is exploding
                (default 10.0).
        """
        _policy(vanishing_threshold, exploding_threshold)  # validates both now (TypeError/ValueError naming it)
        self.vanishing_threshold = vanishing_threshold
        self.exploding_threshold = exploding_threshold

    def collect(self, parameters: ParamIter) -> GradientHealthStats:
        """Collect and materialize at once (one host sync). Prefer :meth:`collect_async` inside CUDA streams."""
        return materialize_grad_stats(self.collect_async(parameters))

    def collect_async(self, parameters: ParamIter) -> AsyncStats:
        """Collect as device tensors, without a host sync; pass the result to :func:`materialize_grad_stats`.

        Returns:
            ``{'_empty': True, 'gradient_norm': 0.0, 'gradient_health': 1.0, 'has_vanishing': False,
            'has_exploding': False}`` when no parameter has a gradient, else ``{'_empty': False, '_n_grads': int,
            '_total_squared_norm': f64 0-d, '_all_norms': f64 [n], '_n_vanishing': i64 0-d,
            '_n_exploding': i64 0-d, '_n_nonfinite': i64 0-d}`` (``_n_nonfinite`` is new: tensors with a non-finite
            norm).
        """
        stats = grad_stats(parameters)
        if len(stats) == 0:
            return {"_empty": True, "gradient_norm": 0.0, "gradient_health": 1.0, "has_vanishing": False,
                    "has_exploding": False}
        norms = stats.norms
        vanishing, exploding = _policy(self.vanishing_threshold, self.exploding_threshold).classify(norms)
        return {
            "_empty": False,
            "_n_grads": len(stats),
            "_total_squared_norm": stats.total_sumsq,
            "_all_norms": norms,
            "_n_vanishing": vanishing.sum(),
            "_n_exploding": exploding.sum(),
            "_n_nonfinite": (~torch.isfinite(norms)).sum(),
        }


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _require_keys(d: object, keys: tuple[str, ...], fn: str, maker: str) -> None:
    """TypeError naming ``fn`` and ``maker`` unless ``d`` is a mapping holding every key."""
    if not isinstance(d, Mapping):
        got = "None" if d is None else f"a {type(d).__name__}"
    else:
        missing = [k for k in keys if k not in d]
        if not missing:
            return
        got = f"a {type(d).__name__} without the key(s) {missing}"
    raise TypeError(f"{fn}: expected the dict returned by {maker}(), got {got}")


def materialize_grad_stats(async_stats: AsyncStats) -> GradientHealthStats:
    """Turn :meth:`SeedGradientCollector.collect_async`'s tensors into Python values: ONE device-to-host transfer.

    It waits for the device, so calling it right after the collection is safe (no separate synchronize needed).

    Raises:
        TypeError: ``async_stats`` is not such a dict (a key is missing or holds the wrong type).
    """
    where = "materialize_grad_stats", "collect_async"
    _require_keys(async_stats, ("_empty",), *where)
    if async_stats["_empty"]:
        _require_keys(async_stats, ("gradient_norm", "gradient_health", "has_vanishing", "has_exploding"), *where)
        return {
            "gradient_norm": float(async_stats["gradient_norm"]),
            "gradient_health": float(async_stats["gradient_health"]),
            "has_vanishing": bool(async_stats["has_vanishing"]),
            "has_exploding": bool(async_stats["has_exploding"]),
        }
    _require_keys(async_stats, ("_n_grads", "_total_squared_norm", "_n_vanishing", "_n_exploding"), *where)
    n_grads = async_stats["_n_grads"]
    total_sq = async_stats["_total_squared_norm"]
    n_van_t = async_stats["_n_vanishing"]
    n_exp_t = async_stats["_n_exploding"]
    if not (_is_int(n_grads) and isinstance(total_sq, Tensor) and isinstance(n_van_t, Tensor)
            and isinstance(n_exp_t, Tensor)):  # fmt: skip
        raise TypeError(
            "materialize_grad_stats: expected the dict returned by collect_async(), got one whose '_n_grads' is not "
            "an int or whose '_total_squared_norm', '_n_vanishing' or '_n_exploding' is not a tensor"
        )
    n_grads = int(n_grads)
    n_nonfinite_t = async_stats.get("_n_nonfinite")
    if not isinstance(n_nonfinite_t, Tensor):  # a dict built by older code: derive it from the total
        n_nonfinite_t = (~torch.isfinite(total_sq)).to(torch.int64)
    (total,), (n_van, n_exp, n_nonfinite) = to_host([total_sq], [n_van_t, n_exp_t, n_nonfinite_t])
    norm = total**0.5
    if not math.isfinite(norm):
        n_nonfinite = max(n_nonfinite, 1)
    # Penalties are the defaults; thresholds were already applied on the device.
    health = HealthPolicy().score_from_counts_host(n_van, n_exp, n_nonfinite, n_grads)
    return {
        "gradient_norm": norm,
        "gradient_health": health,
        "has_vanishing": n_van > 0,
        "has_exploding": n_exp > 0,
    }


def collect_seed_gradients(
    seed_parameters: ParamIter,
    vanishing_threshold: float = DEFAULT_VANISHING_THRESHOLD,
    exploding_threshold: float = DEFAULT_EXPLODING_THRESHOLD,
    return_enhanced: bool = False,
) -> GradientHealthStats | GradientHealthMetrics:
    """Collect and materialize gradient statistics (one host sync).

    Returns:
        A :class:`GradientHealthStats` dict, or :class:`GradientHealthMetrics` when ``return_enhanced``.
    """
    policy = _policy(vanishing_threshold, exploding_threshold)  # bad thresholds fail even without gradients
    stats = grad_stats(seed_parameters)
    if len(stats) == 0:
        if return_enhanced:
            return GradientHealthMetrics(
                gradient_norm=0.0,
                gradient_health=1.0,
                has_vanishing=False,
                has_exploding=False,
                min_layer_norm=0.0,
                max_layer_norm=0.0,
                norm_ratio=1.0,
                zero_grad_fraction=0.0,
                nan_count=0,
                inf_count=0,
            )
        return _empty_result()
    return _materialize_enhanced(stats, policy, return_enhanced)


def _materialize_enhanced(
    stats: GradStats, policy: HealthPolicy, return_enhanced: bool
) -> GradientHealthStats | GradientHealthMetrics:
    norms = stats.norms
    vanishing, exploding = policy.classify(norms)
    (total_sq, min_norm, max_norm), (n_van, n_exp, n_nonfinite, zeros, nans, infs, numel) = to_host(
        [stats.total_sumsq, norms.min(), norms.max()],
        [
            vanishing.sum(),
            exploding.sum(),
            (~torch.isfinite(norms)).sum(),
            stats.zero_count,
            stats.nan_count,
            stats.inf_count,
            stats.numel.sum(),
        ],
    )
    gradient_norm = total_sq**0.5
    health = policy.score_from_counts_host(n_van, n_exp, n_nonfinite, len(stats))
    if not return_enhanced:
        return {
            "gradient_norm": gradient_norm,
            "gradient_health": health,
            "has_vanishing": n_van > 0,
            "has_exploding": n_exp > 0,
        }
    return GradientHealthMetrics(
        gradient_norm=gradient_norm,
        gradient_health=health,
        has_vanishing=n_van > 0,
        has_exploding=n_exp > 0,
        min_layer_norm=min_norm,
        max_layer_norm=max_norm,
        norm_ratio=max_norm / max(min_norm, 1e-10) if not math.isnan(min_norm) else float("nan"),
        zero_grad_fraction=zeros / max(numel, 1),
        nan_count=nans,
        inf_count=infs,
    )


def collect_seed_gradients_async(
    seed_parameters: ParamIter,
    vanishing_threshold: float = DEFAULT_VANISHING_THRESHOLD,
    exploding_threshold: float = DEFAULT_EXPLODING_THRESHOLD,
) -> AsyncStats:
    """:meth:`SeedGradientCollector.collect_async` with the given thresholds (no host sync)."""
    collector = SeedGradientCollector(vanishing_threshold=vanishing_threshold, exploding_threshold=exploding_threshold)
    return collector.collect_async(seed_parameters)


# ---------------------------------------------------------------------------------------------- host + seed networks
@dataclass(slots=True)
class DualGradientStats:
    """Gradient norms and element counts of the host and the seed network."""

    host_grad_norm: float
    host_param_count: int
    seed_grad_norm: float
    seed_param_count: int

    @property
    def normalized_ratio(self) -> float:
        """Seed gradient intensity over host gradient intensity, each norm divided by sqrt(its element count).

        For i.i.d. gradient elements of variance s^2 the expected norm is s*sqrt(n), so dividing by sqrt(n) removes
        the size bias. 0.0 when either norm is below 1e-8 or either count is 0.
        """
        eps = 1e-8
        if self.host_grad_norm < eps or self.seed_grad_norm < eps:
            return 0.0
        if self.host_param_count == 0 or self.seed_param_count == 0:
            return 0.0
        seed_intensity = self.seed_grad_norm / self.seed_param_count**0.5
        host_intensity = self.host_grad_norm / self.host_param_count**0.5
        return float(seed_intensity / (host_intensity + eps))


def _squared_sum_async(parameters: ParamIter, device: torch.device | str) -> tuple[Tensor, int]:
    named = named_params(parameters)
    stats = grad_stats(named)
    if len(stats) == 0:
        # A float64 zero on the caller's device, so materialize_dual_grad_stats sees one type either way.
        return torch.zeros((), dtype=torch.float64, device=device), 0
    count = sum(p.grad.numel() for _, p in named if p.grad is not None)
    return stats.total_sumsq, count


def collect_host_gradients_async(
    host_parameters: ParamIter, device: torch.device | str = "cpu"
) -> dict[str, Tensor | int]:
    """Host network's squared gradient norm (float64 0-d tensor, no host sync) and gradient element count.

    Args:
        host_parameters: the host network's parameters.
        device: where the zero goes when no parameter has a gradient.

    Returns:
        ``{'_host_squared_sum': Tensor, '_host_param_count': int}``
    """
    squared, count = _squared_sum_async(host_parameters, device)
    return {"_host_squared_sum": squared, "_host_param_count": count}


def collect_seed_gradients_only_async(
    seed_parameters: ParamIter, device: torch.device | str = "cpu"
) -> dict[str, Tensor | int]:
    """Seed network's squared gradient norm and element count; see :func:`collect_host_gradients_async`.

    Returns:
        ``{'_seed_squared_sum': Tensor, '_seed_param_count': int}``
    """
    squared, count = _squared_sum_async(seed_parameters, device)
    return {"_seed_squared_sum": squared, "_seed_param_count": count}


def collect_dual_gradients_async(
    host_parameters: ParamIter,
    seed_parameters: ParamIter,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor | int]:
    """Both of the above in one dict (no host sync). With several seeds, collect the host once instead.

    Returns:
        ``{'_host_squared_sum', '_host_param_count', '_seed_squared_sum', '_seed_param_count'}``
    """
    return {
        **collect_host_gradients_async(host_parameters, device),
        **collect_seed_gradients_only_async(seed_parameters, device),
    }


def materialize_dual_grad_stats(async_stats: dict[str, Tensor | int]) -> DualGradientStats:
    """Turn the dual dict into :class:`DualGradientStats`: one device-to-host transfer (none for CPU tensors).

    Raises:
        TypeError: ``async_stats`` is not such a dict (a key is missing or holds the wrong type).
    """
    keys = ("_host_squared_sum", "_seed_squared_sum", "_host_param_count", "_seed_param_count")
    _require_keys(async_stats, keys, "materialize_dual_grad_stats", "collect_dual_gradients_async")
    host_sq = async_stats["_host_squared_sum"]
    seed_sq = async_stats["_seed_squared_sum"]
    host_count = async_stats["_host_param_count"]
    seed_count = async_stats["_seed_param_count"]
    if not (_is_int(host_count) and _is_int(seed_count)):
        raise TypeError("materialize_dual_grad_stats: the param counts must be ints")
    host_count, seed_count = int(host_count), int(seed_count)
    values: dict[str, float] = {}
    on_device: list[tuple[str, Tensor]] = []
    for key, v in (("host", host_sq), ("seed", seed_sq)):
        if isinstance(v, Tensor) and v.device.type != "cpu":
            on_device.append((key, v))
        else:
            values[key] = float(v)  # a Python number or a CPU tensor: no device sync
    if len({t.device for _, t in on_device}) == 1:
        fetched, _ = to_host([t for _, t in on_device], [])
        values.update(zip((k for k, _ in on_device), fetched))
    else:  # the two sums on two different accelerators: one transfer each
        for key, t in on_device:
            (values[key],), _ = to_host([t], [])
    return DualGradientStats(
        host_grad_norm=values["host"] ** 0.5,
        host_param_count=host_count,
        seed_grad_norm=values["seed"] ** 0.5,
        seed_param_count=seed_count,
    )
