"""Host-side summary of gradient statistics: :class:`GradReport`, made by :meth:`GradStats.report`.

Everything here is plain Python numbers that already crossed to the host in the one transfer of
:meth:`torch_gradstats.stats.gradients.GradStats.report`; nothing in this module touches a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from torch_gradstats.ops.op import INF, NAN, ZERO
from torch_gradstats.stats.exponents import ExponentHistogram
from torch_gradstats.stats.health import HealthPolicy

__all__ = ["STYLES", "GradReport", "GroupReport"]

_DEFAULT_POLICY = HealthPolicy()
_T = TypeVar("_T")


def _nan_max(values: Sequence[float]) -> float:
    """max() that propagates NaN (Python's max does not)."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values)


def _nan_min(values: Sequence[float]) -> float:
    if any(math.isnan(v) for v in values):
        return math.nan
    return min(values)


# ---------------------------------------------------------------------------------------------- GradReport
@dataclass
class GradReport:
    """Host-side summary of a :class:`GradStats` (plain Python numbers), made by :meth:`GradStats.report`.

    Attributes:
        total_norm: global L2 norm (what ``torch.nn.utils.clip_grad_norm_`` returns); NaN/inf if any gradient has one.
        inf_norm: max |g| over all gradients (NaN if any NaN).
        numel: total number of gradient elements.
        zero_count, nan_count, inf_count: totals over all gradients.
        zero_fraction: ``zero_count / numel`` (0.0 when empty).
        norms: parameter name -> L2 norm of its gradient, in model order.
        zero_counts, nan_counts, inf_counts: parameter name -> count, in model order.
        nonfinite: names of the parameters whose gradient has a NaN or Inf, in model order.
        first_nonfinite: the first of them, or None.
        health: health score under the policy given to report() (default HealthPolicy()).
        vanishing, exploding: names of the parameters the policy calls vanishing / exploding.
        min_norm, max_norm: smallest and largest per-parameter norm (NaN if any is NaN; 0.0 when empty).
        top_norms: the k largest ``(name, norm)``, largest first; NaN norms sort first.
        nonfinite_ranks: parameter name -> [the lowest global rank whose local gradient had a NaN/Inf]
            (distributed path only).
        clip_coef: the coefficient :func:`~torch_gradstats.clip_grad_norm_` multiplied the gradients by (at most
            1.0), or None for statistics that were not clipped.
        clipped_norm: the total norm after that clip (``clip_coef`` times the norm it clipped with), or None.
        groups: the per-group figures when the report was made with ``groups=`` (see :meth:`GradStats.grouped`).
        extra: more figures that came in the same transfer (``report(extra=...)``), e.g. the step policies'
            ``guard/...`` and ``clip/...``; empty by default.
        exponent_histogram: the global exponent histogram when the statistics were read with
            ``histogram=True`` (see :mod:`torch_gradstats.stats.exponents`), else None.
    """

    total_norm: float
    inf_norm: float
    numel: int
    zero_count: int
    nan_count: int
    inf_count: int
    zero_fraction: float
    norms: dict[str, float]
    zero_counts: dict[str, int]
    nan_counts: dict[str, int]
    inf_counts: dict[str, int]
    nonfinite: list[str]
    first_nonfinite: str | None
    health: float
    vanishing: list[str]
    exploding: list[str]
    min_norm: float
    max_norm: float
    top_norms: list[tuple[str, float]]
    nonfinite_ranks: dict[str, list[int]]
    clip_coef: float | None = None
    clipped_norm: float | None = None
    groups: GroupReport | None = None
    extra: dict[str, float] = field(default_factory=dict)
    exponent_histogram: ExponentHistogram | None = None

    @classmethod
    def _build(
        cls,
        names: list[str],
        sumsq: list[float],
        amax: list[float],
        total_sumsq: float,
        counts: list[list[int]],
        numel: list[int],
        rank_nonfinite: list[int] | None,
        k: int,
        policy: HealthPolicy | None,
        counted: list[bool] | None = None,
    ) -> GradReport:
        policy = policy or _DEFAULT_POLICY
        norm_list = [math.sqrt(s) if not math.isnan(s) else math.nan for s in sumsq]
        zeros = [c[ZERO] for c in counts]
        nans = [c[NAN] for c in counts]
        infs = [c[INF] for c in counts]
        nonfinite = [n for n, a, b in zip(names, nans, infs) if a + b > 0]
        # The totals count each row that counts (``total_sumsq`` already does): a tied parameter's copies once.
        def whole(rows: list[_T]) -> list[_T]:
            return rows if counted is None else [r for r, c in zip(rows, counted) if c]

        total_numel, whole_amax, whole_zeros = sum(whole(numel)), whole(amax), sum(whole(zeros))
        vanishing_mask, exploding_mask = policy.classify_host(norm_list)
        # NaN sorts as the largest: a NaN norm is the first thing a reader must see.
        order = sorted(
            range(len(names)),
            key=lambda i: (0, 0.0) if math.isnan(norm_list[i]) else (1, -norm_list[i]),
        )
        ranks: dict[str, list[int]] = {}
        if rank_nonfinite is not None:
            ranks = {n: [r] for n, r in zip(names, rank_nonfinite) if r >= 0}
        return cls(
            total_norm=math.sqrt(total_sumsq) if not math.isnan(total_sumsq) else math.nan,
            inf_norm=_nan_max(whole_amax) if whole_amax else 0.0,
            numel=total_numel,
            zero_count=whole_zeros,
            nan_count=sum(whole(nans)),
            inf_count=sum(whole(infs)),
            zero_fraction=whole_zeros / total_numel if total_numel else 0.0,
            norms=dict(zip(names, norm_list)),
            zero_counts=dict(zip(names, zeros)),
            nan_counts=dict(zip(names, nans)),
            inf_counts=dict(zip(names, infs)),
            nonfinite=nonfinite,
            first_nonfinite=nonfinite[0] if nonfinite else None,
            health=policy.score_host(norm_list),
            vanishing=[n for n, m in zip(names, vanishing_mask) if m],
            exploding=[n for n, m in zip(names, exploding_mask) if m],
            min_norm=_nan_min(norm_list) if norm_list else 0.0,
            max_norm=_nan_max(norm_list) if norm_list else 0.0,
            top_norms=[(names[i], norm_list[i]) for i in order[: max(k, 0)]],
            nonfinite_ranks=ranks,
        )

    def _add_unattributed(self, name: str, sumsq: float, amax: float, counts: list[int], numel: int) -> None:
        """Figures of gradients no row holds (``GradStats.unattributed``): into the totals (``total_norm`` already
        has them) and listed under ``name`` with the per-parameter figures; not in the per-parameter summaries
        (health, vanishing/exploding, min/max, top norms), which stay those of parameters, as on the device."""
        self.numel += numel
        self.zero_count += counts[ZERO]
        self.nan_count += counts[NAN]
        self.inf_count += counts[INF]
        self.zero_fraction = self.zero_count / self.numel if self.numel else 0.0
        self.inf_norm = _nan_max([self.inf_norm, amax])
        self.norms[name] = math.sqrt(sumsq) if not math.isnan(sumsq) else math.nan
        self.zero_counts[name], self.nan_counts[name], self.inf_counts[name] = counts[ZERO], counts[NAN], counts[INF]
        if counts[NAN] + counts[INF] > 0:
            self.nonfinite.append(name)
            self.first_nonfinite = self.nonfinite[0]

    def __str__(self) -> str:
        lines = [
            f"gradients: {len(self.norms)} tensors, {self.numel:,} elements   health {self.health:.3f}",
            (
                f"  total norm {self.total_norm:.4g}   inf norm {self.inf_norm:.4g}   "
                f"min/max tensor norm {self.min_norm:.4g} / {self.max_norm:.4g}"
            ),
            (
                f"  zeros {self.zero_count:,} ({100.0 * self.zero_fraction:.2f}%)   NaN {self.nan_count:,}   "
                f"Inf {self.inf_count:,}"
            ),
        ]
        if self.nonfinite:
            more = f" (+{len(self.nonfinite) - 1} more)" if len(self.nonfinite) > 1 else ""
            lines.append(f"  first non-finite: {self.first_nonfinite}{more}")
        if self.top_norms:
            width = max(len(n) for n, _ in self.top_norms)
            lines.append(f"  {'largest norms'.ljust(width)}  norm")
            for name, norm in self.top_norms:
                flag = ""
                if name in self.nan_counts and self.nan_counts[name] + self.inf_counts[name] > 0:
                    flag = f"  NaN {self.nan_counts[name]} Inf {self.inf_counts[name]}"
                lines.append(f"  {name.ljust(width)}  {norm:.4g}{flag}")
        return "\n".join(lines)

    def to_dict(
        self, prefix: str = "", per_param: bool = True, style: str = "default"
    ) -> dict[str, float | int | str | None]:
        """Flat dict for loggers (TensorBoard, W&B, JSON lines): numbers, except ``first_nonfinite`` (a parameter
        name or None; skip it when every value must be a scalar, e.g. for ``SummaryWriter.add_scalar``).

        Args:
            prefix: prepended to every key (e.g. ``"grad/"``).
            per_param: include the per-parameter keys (``norm/<name>``, or the style's own).
            style: whose key names (see :data:`STYLES`): ``"default"``, this library's own figures (with
                ``clip_coef`` and ``clipped_norm`` after :func:`~torch_gradstats.clip_grad_norm_`, the group
                keys of a report made with ``groups=``, and ``underflow/<format>`` and ``overflow/<format>`` for
                fp16, bf16, fp8_e4m3 and fp8_e5m2 when the statistics were read with ``histogram=True``);
                ``"lightning"``, ``grad_2.0_norm/<name>`` and
                ``grad_2.0_norm_total`` as ``lightning.pytorch.utilities.grad_norm(module, 2)`` (nothing when no
                gradient was read, as there); ``"hf"``, ``grad_norm`` (the pre-clip total norm the transformers
                Trainer logs); ``"megatron"``, ``grad-norm`` and ``num-zeros``; ``"composer"``,
                ``l2_norm/grad/global`` and ``l2_norm/grad/<name>``. The framework styles hold those keys only,
                then :attr:`extra`.

        Every style ends with :attr:`extra`'s figures under their own names, without ``prefix``: they are named by
        what made them (``guard/skipped``, ``clip/coef``...), and read the same beside any style or prefix.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"to_dict: prefix must be a str, got a {type(prefix).__name__}")
        if style != "default":
            styled = {prefix + key: value for key, value in self._styled(style, per_param).items()}
            return {**styled, **self.extra}
        out: dict[str, float | int | str | None] = {
            "total_norm": self.total_norm,
            "inf_norm": self.inf_norm,
            "numel": self.numel,
            "zero_count": self.zero_count,
            "nan_count": self.nan_count,
            "inf_count": self.inf_count,
            "zero_fraction": self.zero_fraction,
            "health": self.health,
            "min_norm": self.min_norm,
            "max_norm": self.max_norm,
            "num_tensors": len(self.norms),
            "num_nonfinite_tensors": len(self.nonfinite),
            "num_vanishing_tensors": len(self.vanishing),
            "num_exploding_tensors": len(self.exploding),
            "first_nonfinite": self.first_nonfinite,
        }
        if self.clip_coef is not None:
            out["clip_coef"] = self.clip_coef
        if self.clipped_norm is not None:
            out["clipped_norm"] = self.clipped_norm
        if self.exponent_histogram is not None:
            out.update(self.exponent_histogram.fractions())
        if per_param:
            for name, norm in self.norms.items():
                out[f"norm/{name}"] = norm
        if self.groups is not None:
            out.update(self.groups.to_dict())
        return {**{prefix + key: value for key, value in out.items()}, **self.extra}


    def _styled(self, style: str, per_param: bool) -> dict[str, float | int | str | None]:
        if not isinstance(style, str):
            raise TypeError(f"to_dict: style must be a str, one of {', '.join(STYLES)}; got a {type(style).__name__}")
        out: dict[str, float | int | str | None] = {}
        if style == "lightning":
            if self.norms:  # grad_norm returns {} when no parameter has a gradient
                if per_param:
                    out.update({f"grad_2.0_norm/{name}": norm for name, norm in self.norms.items()})
                out["grad_2.0_norm_total"] = self.total_norm
        elif style == "hf":
            out["grad_norm"] = self.total_norm
        elif style == "megatron":
            out["grad-norm"] = self.total_norm
            out["num-zeros"] = self.zero_count
        elif style == "composer":
            out["l2_norm/grad/global"] = self.total_norm
            if per_param:
                out.update({f"l2_norm/grad/{name}": norm for name, norm in self.norms.items()})
        else:
            raise ValueError(f"to_dict: style must be one of {', '.join(STYLES)}; got {style!r}")
        return out


#: The key styles of :meth:`GradReport.to_dict`.
STYLES = ("default", "lightning", "hf", "megatron", "composer")


# ---------------------------------------------------------------------------------------------- GroupReport
@dataclass
class GroupReport:
    """Host-side per-group figures (plain Python numbers), made by :meth:`GroupStats.report`.

    Attributes:
        norms: group -> L2 norm of its gradients, in first-seen order.
        max_abs: group -> max |g| (NaN if the group holds a NaN).
        zero_counts, nan_counts, inf_counts, numel: group -> count.
        weight_norms: group -> L2 norm of its weights (None unless grouped from ``grad_and_weight_stats``).
        lr_update_ratios: group -> ``sqrt(sum lr_p² ||g_p||²) / ||w||``, plain SGD's update over the weights
            (None without an optimizer).
        update_ratios: group -> measured ``||Δw|| / ||w_after||`` (None without a measured update).

    The weight and update figures of a group cover the same parameters: the group's parameters with a gradient.
    """

    norms: dict[str, float]
    max_abs: dict[str, float]
    zero_counts: dict[str, int]
    nan_counts: dict[str, int]
    inf_counts: dict[str, int]
    numel: dict[str, int]
    weight_norms: dict[str, float] | None = None
    lr_update_ratios: dict[str, float] | None = None
    update_ratios: dict[str, float] | None = None

    @property
    def nonfinite(self) -> list[str]:
        """Groups holding a NaN or Inf, in order."""
        return [n for n in self.norms if self.nan_counts[n] + self.inf_counts[n] > 0]

    def to_dict(self, prefix: str = "") -> dict[str, float | int]:
        """``group/<g>/norm``, ``group/<g>/max_abs``, ``group/<g>/nonfinite`` (NaN + Inf elements) for every group,
        then, where present, ``group/<g>/weight_norm``, ``group/<g>/lr_update_ratio``, ``group/<g>/update_ratio``.

        Args:
            prefix: prepended to every key (a str).
        """
        if not isinstance(prefix, str):  # an f-string would have written "None" into every key
            raise TypeError(f"GroupReport.to_dict: prefix must be a str, got a {type(prefix).__name__}")
        out: dict[str, float | int] = {}
        for n in self.norms:
            out[f"{prefix}group/{n}/norm"] = self.norms[n]
            out[f"{prefix}group/{n}/max_abs"] = self.max_abs[n]
            out[f"{prefix}group/{n}/nonfinite"] = self.nan_counts[n] + self.inf_counts[n]
        for key, values in (("weight_norm", self.weight_norms), ("lr_update_ratio", self.lr_update_ratios),
                            ("update_ratio", self.update_ratios)):
            for n, v in (values or {}).items():
                out[f"{prefix}group/{n}/{key}"] = v
        return out
