"""A catalogue of hostile inputs, through every entry point: the op wrapper ``multi_tensor_stats``, ``grad_stats``,
the collector and ``clip_grad_norm_``.

Bad *inputs* must raise the exact error type with the tensor's index (op) or the parameter's name (the others) in
the message, and leave every gradient bitwise unchanged. Bad *values* (NaN, inf, huge, subnormal, -0.0) are not
errors: they must give the right answer. The suite runs once with the compiled kernel and once under
TORCH_GRADSTATS_FORCE_FALLBACK=1; inputs that used to crash the process run in a child process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import torch_gradstats as tg
from torch_gradstats.compat import collector
from torch_gradstats.ops.op import reference_multi_tensor_stats

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a dense tensor, so NaN == NaN and -0.0 != 0.0 in comparisons (any dtype)."""
    if t.is_quantized:
        return t.int_repr().clone()
    t = t.resolve_neg()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.contiguous().view(torch.uint8).clone()


def snapshot(tensors: list[Any]) -> list[Any]:
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested and t.device.type != "meta":
            out.append(bits(t))
        elif isinstance(t, torch.Tensor) and t.layout in (torch.sparse_coo,):
            out.append(t.coalesce().values().clone())
        else:
            out.append(None)
    return out


def assert_unchanged(tensors: list[Any], before: list[Any]) -> None:
    for t, b in zip(tensors, before):
        if b is None:
            continue
        now = t.coalesce().values() if t.layout == torch.sparse_coo else bits(t)
        assert torch.equal(now, b), "a hostile input was modified"


# ---------------------------------------------------------------------------------------------- bad containers
@dataclass
class BadContainer:
    """A bad argument as a whole (not one bad tensor): what each entry point must answer."""

    make: Callable[[], Any]
    op: tuple[type, str]  # (error type, message regex) for multi_tensor_stats
    params: tuple[type, str] | None  # for grad_stats / collector / clip_grad_norm_; None: a valid, empty input


def _gen_of_non_tensors():
    return (x for x in [torch.ones(2), 3.0])


CONTAINERS = {
    "empty list": BadContainer(list, (ValueError, "at least one tensor"), None),
    "empty generator": BadContainer(lambda: iter(()), (ValueError, "at least one tensor"), None),
    "None": BadContainer(lambda: None, (TypeError, "tensors, got None"), (TypeError, "got a NoneType")),
    "int": BadContainer(lambda: 3, (TypeError, "int"), (TypeError, "got a int")),
    "string": BadContainer(lambda: "weights", (TypeError, "tensors, got a str"), (TypeError, "got a str")),
    "bytes": BadContainer(lambda: b"w", (TypeError, "tensors, got a bytes"), (TypeError, "got a bytes")),
    "None in list": BadContainer(lambda: [torch.ones(2), None], (TypeError, r"tensors\[1\] is a NoneType"),
                                 (TypeError, r"item 1 is a NoneType")),
    "float in list": BadContainer(lambda: [torch.ones(2), 2.5], (TypeError, r"tensors\[1\] is a float"),
                                  (TypeError, r"item 1 is a float")),
    "numpy array in list": BadContainer(lambda: [np.ones(3, dtype=np.float32)],
                                        (TypeError, r"tensors\[0\] is a ndarray"), (TypeError, r"item 0 is a ndarray")),
    "nested python list": BadContainer(lambda: [[1.0, 2.0]], (TypeError, r"tensors\[0\] is a list"),
                                       (TypeError, r"item 0 is a list")),
    "generator of non-tensors": BadContainer(_gen_of_non_tensors, (TypeError, r"tensors\[1\] is a float"),
                                             (TypeError, r"item 1 is a float")),
    "dict (a state_dict)": BadContainer(lambda: {"w": torch.ones(2)}, (TypeError, r"got a dict; pass list\(d.values"),
                                        (TypeError, r"item 0 is a str")),
    "(name, tensor) pair to the op": BadContainer(lambda: [("w", torch.ones(2))],
                                                  (TypeError, r"tensors\[0\] is a tuple"), None),
    "pair with a non-str name": BadContainer(lambda: [(3, nn.Parameter(torch.ones(2)))],
                                             (TypeError, r"tensors\[0\] is a tuple"),
                                             (TypeError, r"item 0 is a tuple")),
    "triple instead of a pair": BadContainer(lambda: [("w", torch.ones(2), 1)], (TypeError, r"tensors\[0\] is a tuple"),
                                             (TypeError, r"item 0 is a tuple")),
}


@pytest.mark.parametrize("case", list(CONTAINERS), ids=list(CONTAINERS))
def test_bad_container_through_the_op(case):
    c = CONTAINERS[case]
    err, msg = c.op
    with pytest.raises(err, match=msg):
        tg.multi_tensor_stats(c.make())


@pytest.mark.parametrize("case", list(CONTAINERS), ids=list(CONTAINERS))
@pytest.mark.parametrize("entry", ["grad_stats", "collector", "collect_seed_gradients", "clip_grad_norm_"])
def test_bad_container_through_the_parameter_entry_points(case, entry):
    c = CONTAINERS[case]
    call = {
        "grad_stats": lambda x: tg.grad_stats(x),
        "collector": lambda x: collector.SeedGradientCollector().collect(x),
        "collect_seed_gradients": lambda x: collector.collect_seed_gradients(x),
        "clip_grad_norm_": lambda x: tg.clip_grad_norm_(x, max_norm=1.0),
    }[entry]
    x = c.make()
    if c.params is None:
        if case == "(name, tensor) pair to the op":  # valid for the parameter entry points: a tensor without grad
            x = [("w", torch.ones(2))]
        result = call(x)  # valid: nothing has a gradient
        if entry == "grad_stats":
            assert len(result) == 0 and result.report().health == 1.0
        elif entry in ("collector", "collect_seed_gradients"):
            assert result["gradient_norm"] == 0.0 and result["gradient_health"] == 1.0
        else:
            assert result.clip_norm.item() == 0.0
        return
    err, msg = c.params
    with pytest.raises(err, match=msg):
        call(x)


# ---------------------------------------------------------------------------------------------- bad tensors
@dataclass
class BadTensor:
    """One bad tensor, placed at index 1 of a list after a good one (and as the gradient of parameter
    ``enc.layers.1.weight`` for the parameter entry points)."""

    make: Callable[[], torch.Tensor]
    error: type
    op_msg: str  # regex, without the "tensors[1] " prefix the op adds
    as_grad: bool = True  # can torch assign it as a .grad?
    grad_msg: str | None = None  # regex for the parameter entry points, default: op_msg


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


def _nested(layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


BAD_TENSORS = {
    "int64": BadTensor(lambda: torch.arange(3), TypeError, "has dtype torch.int64",
                       grad_msg="has a torch.int64 gradient"),
    "int8": BadTensor(lambda: torch.ones(3, dtype=torch.int8), TypeError, "has dtype torch.int8",
                      grad_msg="has a torch.int8 gradient"),
    "uint8": BadTensor(lambda: torch.ones(3, dtype=torch.uint8), TypeError, "has dtype torch.uint8",
                       grad_msg="has a torch.uint8 gradient"),
    "bool": BadTensor(lambda: torch.ones(3, dtype=torch.bool), TypeError, "has dtype torch.bool",
                      grad_msg="has a torch.bool gradient"),
    "complex64": BadTensor(lambda: torch.ones(3, dtype=torch.complex64), TypeError, "has dtype torch.complex64",
                           grad_msg="has a torch.complex64 gradient"),
    "complex128": BadTensor(lambda: torch.ones(3, dtype=torch.complex128), TypeError, "has dtype torch.complex128",
                            grad_msg="has a torch.complex128 gradient"),
    "float8_e4m3fn": BadTensor(lambda: torch.zeros(3, dtype=torch.float8_e4m3fn), TypeError,
                               "has dtype torch.float8_e4m3fn", grad_msg="has a torch.float8_e4m3fn gradient"),
    "float8_e5m2": BadTensor(lambda: torch.zeros(3, dtype=torch.float8_e5m2), TypeError,
                             "has dtype torch.float8_e5m2", grad_msg="has a torch.float8_e5m2 gradient"),
    "quantized qint8": BadTensor(_quantized, TypeError, "has dtype torch.qint8", as_grad=False),
    "sparse COO": BadTensor(lambda: torch.eye(3)[0].to_sparse(), ValueError, "has layout torch.sparse_coo",
                            grad_msg="has a torch.sparse_coo gradient"),
    "sparse CSR": BadTensor(lambda: torch.eye(3).to_sparse_csr(), ValueError, "has layout torch.sparse_csr",
                            as_grad=False),
    "sparse CSC": BadTensor(lambda: torch.eye(3).to_sparse_csc(), ValueError, "has layout torch.sparse_csc",
                            as_grad=False),
    "nested (strided)": BadTensor(lambda: _nested(torch.strided), ValueError, "is a nested tensor", as_grad=False),
    "nested (jagged)": BadTensor(lambda: _nested(torch.jagged), ValueError, "is a nested tensor", as_grad=False),
    "on another device (meta)": BadTensor(lambda: torch.ones(3, device="meta"), ValueError,
                                          "is on meta but tensors\\[0\\] is on cpu", as_grad=False),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS), ids=list(BAD_TENSORS))
def test_bad_tensor_through_the_op(case):
    c = BAD_TENSORS[case]
    tensors = [torch.randn(4), c.make()]
    before = snapshot(tensors)
    with pytest.raises(c.error, match=r"multi_tensor_stats: tensors\[1\] " + c.op_msg):
        tg.multi_tensor_stats(tensors)
    assert_unchanged(tensors, before)


def _params_with_bad_grad(bad: torch.Tensor) -> list[tuple[str, nn.Parameter]]:
    good = nn.Parameter(torch.zeros(4))
    good.grad = torch.randn(4)
    p = nn.Parameter(torch.zeros(bad.shape, dtype=torch.float32))
    p.grad_dtype = None  # let torch accept a gradient of another dtype, as autograd hooks can produce
    p.grad = bad
    return [("enc.layers.0.bias", good), ("enc.layers.1.weight", p)]


ENTRY_POINTS: dict[str, Callable[[Any], Any]] = {
    "grad_stats": lambda x: tg.grad_stats(x),
    "collector.collect": lambda x: collector.SeedGradientCollector().collect(x),
    "collector.collect_async": lambda x: collector.SeedGradientCollector().collect_async(x),
    "collect_seed_gradients": lambda x: collector.collect_seed_gradients(x, return_enhanced=True),
    "collect_dual_gradients_async": lambda x: collector.collect_dual_gradients_async(x, x),
    "clip_grad_norm_": lambda x: tg.clip_grad_norm_(x, max_norm=1.0),
    "clip_grad_norm_ (inf)": lambda x: tg.clip_grad_norm_(x, max_norm=1.0, norm_type=math.inf),
}


@pytest.mark.parametrize("case", [k for k, c in BAD_TENSORS.items() if c.as_grad])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_bad_gradient_names_the_parameter_and_mutates_nothing(case, entry):
    c = BAD_TENSORS[case]
    named = _params_with_bad_grad(c.make())
    grads = [p.grad for _, p in named]
    before = snapshot(grads)
    with pytest.raises(c.error, match=r"parameter 'enc.layers.1.weight' " + (c.grad_msg or c.op_msg)):
        ENTRY_POINTS[entry](named)
    assert_unchanged(grads, before)  # clip_grad_norm_ included: it failed before touching any gradient


def test_a_non_tensor_grad_is_named():
    class WeirdParam(torch.Tensor):
        @property
        def grad(self):  # what a broken wrapper class could hand us
            return [1.0, 2.0]

    w = torch.zeros(3).as_subclass(WeirdParam)
    for entry in ENTRY_POINTS.values():
        with pytest.raises(TypeError, match=r"parameter 'w' has a .grad of type list, not a tensor"):
            entry([("w", w)])


# ---------------------------------------------------------------------------------------------- crashes, in a child
_FREED_CHILD = """
import math, torch, torch_gradstats as tg
from torch_gradstats.compat import collector
def bad_param(kept):
    p = torch.nn.Parameter(torch.zeros(1000))
    g = torch.ones(1000)
    g.untyped_storage().resize_(kept)
    p.grad = g
    return p
for kept in (0, 16):
    x = torch.ones(1000)
    x.untyped_storage().resize_(kept)
    good = torch.nn.Parameter(torch.zeros(3)); good.grad = torch.full((3,), 2.0)
    calls = {
        "op": (lambda: tg.multi_tensor_stats([torch.ones(2), x]), "tensors[1] needs 4000 bytes"),
        "raw": (lambda: torch.ops.torch_gradstats.multi_tensor_stats.default([x]), "tensors[0] needs 4000 bytes"),
        "grad_stats": (lambda: tg.grad_stats([("a", good), ("fsdp.w", bad_param(kept))]), "'fsdp.w'"),
        "collector": (lambda: collector.collect_seed_gradients([("a", good), ("fsdp.w", bad_param(kept))]),
                      "'fsdp.w'"),
        "clip": (lambda: tg.clip_grad_norm_([("a", good), ("fsdp.w", bad_param(kept))], 1.0), "'fsdp.w'"),
    }
    for name, (call, needle) in calls.items():
        try:
            call()
            print(name, kept, "NO-ERROR")
        except ValueError as e:
            print(name, kept, "ok" if needle in str(e) and f"storage holds {kept}" in str(e) else "BAD:" + str(e))
    assert torch.equal(good.grad, torch.full((3,), 2.0)), "clip mutated a gradient before failing"
print("alive")
"""


@pytest.mark.parametrize("fallback", [False, True], ids=["as-configured", "forced-fallback"])
def test_freed_and_shrunk_storage_in_a_child_process(fallback):
    env = dict(os.environ)
    env.pop("TORCH_GRADSTATS_FORCE_FALLBACK", None)
    if fallback:
        env["TORCH_GRADSTATS_FORCE_FALLBACK"] = "1"
    child = subprocess.run([sys.executable, "-c", _FREED_CHILD], env=env, capture_output=True, text=True,
                           timeout=180, check=False)  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-3000:]}"
    lines = child.stdout.strip().splitlines()
    assert lines[-1] == "alive"
    assert [line.split()[-1] for line in lines[:-1]] == ["ok"] * 10, child.stdout


# ---------------------------------------------------------------------------------------------- odd but valid
def _subclass():
    class Marked(torch.Tensor):
        pass

    return torch.tensor([3.0, -4.0]).as_subclass(Marked)


ODD_VALID = {
    "bare tensor (one tensor, not its rows)": lambda: torch.ones(2, 3),
    "zero-size": lambda: [torch.empty(0), torch.empty(3, 0, 2, dtype=torch.float16)],
    "0-d": lambda: [torch.tensor(-2.5), torch.tensor(0.0, dtype=torch.bfloat16)],
    "odd shapes": lambda: [torch.randn(1, 1, 1, 100_003), torch.randn(3, 1, 7, 1, 5, dtype=torch.float64)],
    "expanded (overlapping) view": lambda: [torch.randn(5, 1).expand(5, 40_000)],
    "transposed and sliced": lambda: [torch.randn(64, 33).t(), torch.randn(64, 33)[::3, 1::2]],
    "channels_last": lambda: [torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)],
    "negative view bit": lambda: [torch._neg_view(torch.tensor([1.0, -2.0, 0.0]))],
    "requires-grad leaf": lambda: [torch.randn(5, requires_grad=True)],
    "tensor subclass": lambda: [_subclass()],
    "inference-mode tensor": lambda: [_inference_tensor()],
    "many tiny tensors": lambda: [torch.full((1 + i % 3,), float(i % 5)) for i in range(3000)],
    "meta tensors only": lambda: [torch.empty(3, 4, device="meta")],
}


def _inference_tensor():
    with torch.inference_mode():
        return torch.tensor([1.0, 2.0])


@pytest.mark.parametrize("case", list(ODD_VALID), ids=list(ODD_VALID))
def test_odd_but_valid_inputs_give_the_reference_answer(case):
    x = ODD_VALID[case]()
    tensors = [x] if isinstance(x, torch.Tensor) else x
    before = snapshot(tensors)
    s = tg.multi_tensor_stats(x)
    assert_unchanged(tensors, before)
    assert not s.sumsq.requires_grad
    if case == "meta tensors only":
        assert s.sumsq.device.type == "meta" and s.counts.shape == (1, 3)
        return
    ref = reference_multi_tensor_stats([t.detach() for t in tensors])
    torch.testing.assert_close(s.sumsq.as_subclass(torch.Tensor), ref[0], rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(s.amax.as_subclass(torch.Tensor), ref[1], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(s.counts.as_subclass(torch.Tensor), ref[2])


def test_meta_gradients_report_a_clear_error():
    p = nn.Parameter(torch.empty(3, device="meta"))
    p.grad = torch.empty(3, device="meta")
    cpu = nn.Parameter(torch.zeros(2))
    cpu.grad = torch.ones(2)
    stats = tg.grad_stats([("cpu.w", cpu), ("meta.w", p)])  # grouped by device: fine until values are asked for
    with pytest.raises(ValueError, match="meta tensors, which have shapes but no values"):
        stats.report()


def test_meta_model_grad_and_weight_report_a_clear_error():
    # GradWeightStats.report failed with torch's "Cannot copy out of meta tensor; no data!".
    from torch_gradstats.updates import grad_and_weight_stats

    with torch.device("meta"):
        model = nn.Linear(3, 2)
    model(torch.ones(4, 3, device="meta")).sum().backward()
    with pytest.raises(ValueError, match="GradWeightStats.report: these statistics are of meta tensors"):
        grad_and_weight_stats(model.named_parameters()).report()
    real = nn.Linear(3, 2)
    real(torch.ones(4, 3)).sum().backward()
    report = grad_and_weight_stats(real.named_parameters()).report()
    assert report.weight_norms["bias"] == pytest.approx(float(real.bias.detach().double().norm()), rel=1e-6)


@pytest.mark.parametrize("k,error", [(2.5, TypeError), ("3", TypeError), (True, TypeError), (None, TypeError),
                                     (-1, ValueError)])
def test_report_k_is_validated(k, error):
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(error, match="GradStats.report: k must be a non-negative int"):
        tg.grad_stats([p]).report(k=k)
    assert tg.grad_stats([p]).report(k=np.int64(1)).top_norms == [("0", math.sqrt(2))]


@pytest.mark.parametrize("field,value,error", [("vanishing_threshold", -1.0, ValueError),
                                               ("exploding_threshold", "10", TypeError),
                                               ("exploding_threshold", float("nan"), ValueError)])
def test_collector_thresholds_are_validated_at_construction(field, value, error):
    with pytest.raises(error, match=f"HealthPolicy.{field} must be"):
        collector.SeedGradientCollector(**{field: value})
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(error, match=f"HealthPolicy.{field} must be"):
        collector.collect_seed_gradients([p], **{field: value})


# ---------------------------------------------------------------------------------------------- bad values
def _values(dtype):
    finfo = torch.finfo(dtype)
    return {
        "NaN": torch.tensor([1.0, float("nan"), 2.0], dtype=dtype),
        "+inf": torch.tensor([1.0, float("inf")], dtype=dtype),
        "-inf and NaN": torch.tensor([float("-inf"), float("nan"), -0.0], dtype=dtype),
        "dtype max": torch.full((1000,), finfo.max, dtype=dtype),
        "huge": torch.full((64,), 1e20 if dtype != torch.float16 else 6e4, dtype=dtype),
        "subnormal": torch.full((100,), finfo.tiny / 4, dtype=dtype),
        "smallest subnormal": torch.full((7,), finfo.tiny * finfo.eps, dtype=dtype),
        "signed zeros": torch.tensor([0.0, -0.0, -0.0], dtype=dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_bad_values_give_right_answers_everywhere(dtype):
    values = _values(dtype)
    tensors = list(values.values())
    before = snapshot(tensors)
    s = tg.multi_tensor_stats(tensors)
    ref = reference_multi_tensor_stats(tensors)
    assert_unchanged(tensors, before)
    assert torch.equal(s.counts, ref[2])
    torch.testing.assert_close(s.amax, ref[1], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(s.sumsq, ref[0], rtol=1e-5, atol=0, equal_nan=True)
    if dtype != torch.float64:  # finite 16/32-bit values never overflow the float64 sums
        assert torch.isfinite(s.sumsq[3:]).all()
    # the same numbers through the parameter entry points
    named = []
    for name, v in values.items():
        p = nn.Parameter(torch.zeros_like(v))
        p.grad = v.clone()
        named.append((name, p))
    report = tg.grad_stats(named).report(k=len(named))
    for i, name in enumerate(values):
        want = math.sqrt(ref[0][i].item()) if not math.isnan(ref[0][i].item()) else math.nan
        got = report.norms[name]
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-5), name
    assert report.first_nonfinite == "NaN"
    assert report.nan_count == 2 and report.inf_count == 2
    c = collector.collect_seed_gradients(named, return_enhanced=True)
    assert math.isnan(c.gradient_norm) and c.gradient_health == 0.0 and c.nan_count == 2 and c.inf_count == 2
    finite = [(n, p) for n, p in named if n not in ("NaN", "+inf", "-inf and NaN")]
    grads_before = snapshot([p.grad for _, p in finite])
    stats = tg.clip_grad_norm_(finite, max_norm=1.0)
    assert math.isfinite(stats.clip_norm.item()) or dtype == torch.float64  # float64 max squared is inf
    if dtype != torch.float64:
        assert all(torch.isfinite(p.grad).all() for _, p in finite)
        assert not all(torch.equal(bits(p.grad), b) for (_, p), b in zip(finite, grads_before))  # it did clip


def test_freed_storage_of_a_tensor_subclass_is_named_too():
    """Subclasses sharing a real storage get the same storage check as plain tensors (in a child: the old code
    read the freed memory)."""
    code = (
        "import torch, torch_gradstats as tg\n"
        "class Marked(torch.Tensor): pass\n"
        "x = torch.ones(1000).as_subclass(Marked)\n"
        "x.untyped_storage().resize_(0)\n"
        "try:\n"
        "    tg.multi_tensor_stats([x])\n"
        "except ValueError as e:\n"
        "    print('ok' if 'tensors[0] needs 4000 bytes' in str(e) else e)\n"
    )
    for fallback in (False, True):
        env = dict(os.environ)
        env.pop("TORCH_GRADSTATS_FORCE_FALLBACK", None)
        if fallback:
            env["TORCH_GRADSTATS_FORCE_FALLBACK"] = "1"
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                               check=False)  # fmt: skip
        assert child.returncode == 0 and child.stdout.strip() == "ok", (fallback, child.stdout, child.stderr[-2000:])
