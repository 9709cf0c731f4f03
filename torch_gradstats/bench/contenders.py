"""What each contender runs, and how to check that what it returns is right (so that what is timed is correct).

==================  =====================================================================================
contender           what it runs
==================  =====================================================================================
fused               ``torch_gradstats.multi_tensor_stats`` (sumsq, amax, zero/NaN/Inf counts per tensor)
fused_raw_op        ``torch.ops.torch_gradstats.multi_tensor_stats`` called directly (no Python wrapper)
grad_stats          ``torch_gradstats.grad_stats`` on parameters whose ``.grad`` are the tensors
fallback            the pure-PyTorch kernel (``fallback.fallback_multi_tensor_stats``, the op's
                    CompositeExplicitAutograd kernel) called directly, whatever kernel the op dispatches to
foreach_norm        ``torch._foreach_norm`` alone (per-tensor L2 norms only)
composite           ``_foreach_norm`` + per tensor ``(g == 0).sum()``, ``isnan(g).sum()``, ``isinf(g).sum()``
compiled_composite  ``torch.compile`` of per tensor norm, amax and the 3 counts (compile time reported apart)
lightning_grad_norm Lightning's ``grad_norm``: per parameter ``p.grad.norm(2)``, then the total norm from a
                    tensor built of those values (one host sync per parameter); a labelled re-implementation
                    when lightning is not installed
get_total_norm      ``torch.nn.utils.get_total_norm`` (torch >= 2.6; one global norm)
orig_collector      the original gradient collector: float64 copy of every gradient, ``_foreach_norm``,
                    ``torch.cat`` of all gradients, three masks, one ``.tolist()``
ceiling_sum         ``torch.sum`` over one flat float32 buffer of the same bytes (read-bandwidth ceiling)
ceiling_copy        a device-to-device copy of that buffer (reads and writes the bytes)
==================  =====================================================================================
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops.fallback import fallback_multi_tensor_stats
from torch_gradstats.ops.op import multi_tensor_stats, reference_multi_tensor_stats
from torch_gradstats.stats.gradients import grad_stats

from .workloads import GradsAsModule, Sample

FUSED, RAW_OP, GRAD_STATS, FALLBACK = "fused", "fused_raw_op", "grad_stats", "fallback"
FOREACH, COMPILED = "foreach_norm", "compiled_composite"
SUM_CEILING, COPY_CEILING = "ceiling_sum", "ceiling_copy"

#: What a contender's output says, in comparable float64 terms; see :func:`check_contender`.
Facts = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way of computing (some of) the statistics.

    ``graph_safe``: can be captured in a CUDA graph (no host sync, no pageable host-to-device copy), so its device
    time can be measured without host cost. ``compiled``: ``torch.compile``'d, compiled afresh for each point.
    ``facts`` turns its output (and the sample) into comparable figures for :func:`check_contender`.
    """

    name: str
    fn: Callable[[Sample], object]
    facts: Callable[[Sample, Any], Facts]
    graph_safe: bool = True
    compiled: bool = False

    def __call__(self, sample: Sample) -> object:
        return self.fn(sample)


# ------------------------------------------------------------------------------------------------ the functions
def original_collector(
    grads: Sequence[Tensor], vanishing_threshold: float = 1e-7, exploding_threshold: float = 5.0
) -> list[float]:
    """Baseline: the work done by the original gradient collector, step by step, so its cost can be measured.

    Every gradient is upcast to a float64 copy before ``_foreach_norm`` (its overflow fix), the per-parameter norms
    are stacked and summarised, all gradients are concatenated into one flat buffer that three elementwise masks
    (== 0, isnan, isinf) are counted over, and the eight summary scalars come back to the host in one ``.tolist()``:
    ``[total sumsq, min norm, max norm, n vanishing, n exploding, zeros, NaNs, Infs]``.
    """
    float64_copies = [g.double() for g in grads]
    norms = torch.stack(torch._foreach_norm(float64_copies, ord=2))
    summary = [
        (norms**2).sum(),
        norms.min(),
        norms.max(),
        (norms < vanishing_threshold).sum().float(),
        (norms > exploding_threshold).sum().float(),
    ]
    flat = torch.cat([g.view(-1) for g in grads])
    summary += [(flat == 0).sum().float(), torch.isnan(flat).sum().float(), torch.isinf(flat).sum().float()]
    return torch.stack(summary).tolist()


def composite_stats(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Per tensor: L2 norm, max |x| and zero/NaN/Inf counts in plain torch ops (what the compiled contender runs)."""
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=_acc(t.dtype)) for t in tensors])
    amax = torch.stack([t.abs().amax().to(torch.float64) for t in tensors])
    counts = torch.stack([torch.stack([(t == 0).sum(), t.isnan().sum(), t.isinf().sum()]) for t in tensors])
    return norms, amax, counts


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grad_norm_reimplementation(module: GradsAsModule, norm_type: float = 2.0) -> dict[str, Tensor]:
    """What ``lightning.pytorch.utilities.grad_norm`` does (used only when lightning is not installed): the norm of
    each parameter's gradient, then the total norm of a host-built tensor of those values (a sync per parameter)."""
    norm_type = float(norm_type)
    norms = {f"grad_{norm_type}_norm/{name}": p.grad.data.norm(norm_type)
             for name, p in module.named_parameters() if p.grad is not None}  # fmt: skip
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor([v.item() for v in norms.values()]).norm(norm_type)
    return norms


@functools.cache
def lightning_grad_norm() -> tuple[Callable[..., dict[str, Tensor]], str]:
    """Lightning's ``grad_norm`` and where it came from (imported on first use: importing lightning takes seconds)."""
    for mod in ("lightning.pytorch.utilities", "pytorch_lightning.utilities"):
        try:
            module = __import__(mod, fromlist=["grad_norm"])
            return module.grad_norm, f"{mod}.grad_norm"
        except (ImportError, AttributeError):
            continue
    return grad_norm_reimplementation, "re-implementation (lightning is not installed)"


@functools.cache
def _compiled_stats() -> Callable[[Sequence[Tensor]], tuple[Tensor, Tensor, Tensor]]:
    return torch.compile(composite_stats, dynamic=False)


def reset_compiled() -> None:
    """Forget compiled graphs, so the next point compiles for its own shapes (and no recompile limit is hit)."""
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ facts for the checks
def _ref_facts(sample: Sample) -> Facts:
    sumsq, amax, counts = reference_multi_tensor_stats(sample.tensors)
    return {"sumsq": sumsq, "amax": amax, "counts": counts}


def _stats_facts(s: Sample, out: Any) -> Facts:
    sumsq, amax, counts = out
    return {"sumsq": sumsq, "amax": amax, "counts": counts}


def _norms_facts(norms: Sequence[Tensor]) -> Facts:
    return {"sumsq": torch.stack([n.double() for n in norms]).cpu() ** 2}


def _composite_facts(s: Sample, out: Any) -> Facts:
    norms, zeros, nans, infs = out
    counts = torch.stack([torch.stack([z, n, i]) for z, n, i in zip(zeros, nans, infs)])
    return {**_norms_facts(norms), "counts": counts}


def _compiled_facts(s: Sample, out: Any) -> Facts:
    norms, amax, counts = out
    return {"sumsq": norms.double() ** 2, "amax": amax, "counts": counts}


def _lightning_facts(s: Sample, out: Any) -> Facts:
    values = list(out.values())
    return {**_norms_facts(values[:-1]), "total_norm": float(values[-1])}


def _collector_facts(s: Sample, out: Any) -> Facts:
    total_sq, mn, mx, _, _, zeros, nans, infs = out
    return {"total_sumsq": total_sq, "min_norm": mn, "max_norm": mx, "total_counts": [zeros, nans, infs]}


def _sum_facts(s: Sample, out: Any) -> Facts:
    return {"flat_sum": (float(out), float(s.flat.double().sum()), float(s.flat.double().abs().sum()))}


def _copy(s: Sample) -> Tensor:
    assert s.dst is not None, "the copy ceiling needs a destination buffer (make_samples(copy_target=True))"
    return s.dst.copy_(s.flat)


def _copy_facts(s: Sample, out: Any) -> Facts:
    return {"copied": bool(torch.equal(out, s.flat))}


def _close(a: Any, b: Any, rtol: Any) -> bool:
    """Elementwise |a - b| <= rtol |b| (rtol a number or one per element); equal infinities and NaNs agree."""
    a = torch.as_tensor(a, dtype=torch.float64).cpu()
    b = torch.as_tensor(b, dtype=torch.float64).cpu()
    if a.shape != b.shape:
        return False
    agree = (a == b) | (a.isnan() & b.isnan()) | ((a - b).abs() <= torch.as_tensor(rtol, dtype=torch.float64) * b.abs())
    return bool(agree.all())


#: Relative tolerance of a statistic computed from a tensor of this dtype: 16-bit results may come back in 16 bits.
_RTOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}


def check_contender(contender: Contender, sample: Sample, output: Any) -> None:
    """Raise AssertionError unless ``output`` (what ``contender`` returned on ``sample``) agrees with the float64
    reference on everything the contender computes, within a tolerance set by each tensor's dtype."""
    facts = contender.facts(sample, output)
    ref = _ref_facts(sample)
    rtol = torch.tensor([_RTOL[t.dtype] for t in sample.tensors], dtype=torch.float64)
    norms = ref["sumsq"].sqrt()
    checks: dict[str, bool] = {}
    if "sumsq" in facts:
        checks["sumsq"] = _close(facts["sumsq"], ref["sumsq"], 2 * rtol)  # a square doubles a norm's error
    if "amax" in facts:
        checks["amax"] = _close(facts["amax"], ref["amax"], 0.0)
    if "counts" in facts:
        checks["counts"] = torch.equal(torch.as_tensor(facts["counts"]).cpu().long(), ref["counts"].cpu())
    if "total_norm" in facts:
        checks["total_norm"] = _close(facts["total_norm"], ref["sumsq"].sum().sqrt(), rtol.max())
    if "total_sumsq" in facts:
        checks["total_sumsq"] = _close(facts["total_sumsq"], ref["sumsq"].sum(), 1e-9)
        checks["min/max norm"] = _close([facts["min_norm"], facts["max_norm"]], [norms.min(), norms.max()], 1e-9)
        checks["total_counts"] = facts["total_counts"] == ref["counts"].sum(0).tolist()
    if "flat_sum" in facts:
        got, want, scale = facts["flat_sum"]
        checks["flat_sum"] = abs(got - want) <= 1e-5 * scale
    if "copied" in facts:
        checks["copied"] = facts["copied"]
    bad = [k for k, ok in checks.items() if not ok]
    assert checks and not bad, f"{contender.name}: disagrees with the float64 reference on {bad or 'nothing checked'}"


# ----------------------------------------------------------------------------------------------------- registry
def _total_norm_facts(s: Sample, out: Any) -> Facts:
    return {"total_norm": float(out)}


def _composite(s: Sample) -> object:
    # What users write today to get the same information: one norm launch plus three reductions per tensor.
    norms = torch._foreach_norm(s.tensors)
    zeros = [(g == 0).sum() for g in s.tensors]
    nans = [torch.isnan(g).sum() for g in s.tensors]
    infs = [torch.isinf(g).sum() for g in s.tensors]
    return norms, zeros, nans, infs


def _lightning(s: Sample) -> object:
    return lightning_grad_norm()[0](s.module, 2)


def _grad_stats(s: Sample) -> object:
    return grad_stats(s.params)


def _grad_stats_facts(s: Sample, out: Any) -> Facts:
    return {"sumsq": out.sumsq, "amax": out.amax, "counts": out.counts}


def _all_contenders() -> dict[str, Contender]:
    raw = torch.ops.torch_gradstats.multi_tensor_stats.default
    c = [
        Contender(FUSED, lambda s: multi_tensor_stats(s.tensors), _stats_facts),
        Contender(RAW_OP, lambda s: raw(s.tensors), _stats_facts),
        # grad_stats uploads each tensor's numel from host memory: not capturable in a CUDA graph.
        Contender(GRAD_STATS, _grad_stats, _grad_stats_facts, graph_safe=False),
        Contender(FALLBACK, lambda s: fallback_multi_tensor_stats(s.tensors), _stats_facts),
        Contender(FOREACH, lambda s: torch._foreach_norm(s.tensors), lambda s, o: _norms_facts(o)),
        Contender("composite", _composite, _composite_facts),
        Contender(COMPILED, lambda s: _compiled_stats()(s.tensors), _compiled_facts, compiled=True),
        Contender("lightning_grad_norm", _lightning, _lightning_facts, graph_safe=False),
    ]
    if hasattr(torch.nn.utils, "get_total_norm"):  # added in torch 2.6
        c.append(Contender("get_total_norm", lambda s: torch.nn.utils.get_total_norm(s.tensors), _total_norm_facts))
    c += [
        Contender("orig_collector", lambda s: original_collector(s.tensors), _collector_facts, graph_safe=False),
        Contender(SUM_CEILING, lambda s: torch.sum(s.flat), _sum_facts),
        Contender(COPY_CEILING, _copy, _copy_facts),
    ]
    return {x.name: x for x in c}


#: name -> Contender, in the table's order.
CONTENDERS: dict[str, Contender] = _all_contenders()
