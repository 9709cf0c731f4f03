"""multi_tensor_stats inside torch.cond and torch.while_loop bodies, eager and under torch.compile (CPU).

The op's result drives the control flow (a branch taken on a NaN count, a loop that accumulates sumsq), and the
bodies call it on tensors they made themselves, so tracing the higher-order ops has to go through the op's fake
kernel and the compiled graphs through its real one. The CUDA versions, and torch.cond captured into a CUDA graph's
conditional nodes, are in tests/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

import torch_gradstats
from torch_gradstats.ops.op import reference_multi_tensor_stats

OP = torch.ops.torch_gradstats.multi_tensor_stats.default


def stats_tuple(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = torch_gradstats.multi_tensor_stats(tensors)
    return got.sumsq, got.amax, got.counts


def assert_stats(got, tensors: list[torch.Tensor]) -> None:
    ref = reference_multi_tensor_stats(tensors)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[2], ref[2]), (got[2], ref[2])


def skip_on_nan(grad: torch.Tensor, bias: torch.Tensor):
    """The statistics of the step that is taken: the gradients as they are, or zeros when they hold a NaN."""
    nan = OP([grad, bias])[2][:, 1].sum() > 0

    def take(g: torch.Tensor, b: torch.Tensor):
        return stats_tuple([g, b])

    def skip(g: torch.Tensor, b: torch.Tensor):
        return stats_tuple([torch.zeros_like(g), b * 0])

    return torch.cond(nan, skip, take, (grad, bias))


def doubling_sums(x: torch.Tensor, steps: int):
    """sumsq of x, 2x, 4x, ... (`steps` of them) accumulated in a while_loop, with the last counts."""

    def cond_fn(i, x, total, counts):
        return i < steps

    def body_fn(i, x, total, counts):
        sumsq, _, c = OP([x, x[: x.numel() // 2]])
        return i + 1, x * 2, total + sumsq, c

    init = (torch.tensor(0), x, torch.zeros(2, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.int64))
    return torch.while_loop(cond_fn, body_fn, init)


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(3000, generator=gen).to(torch.bfloat16)
    grad[17] = 0.0
    bias = torch.randn(33, generator=gen, dtype=torch.float64)
    return grad, bias


def check_skip_on_nan(fn) -> None:
    grad, bias = inputs()
    assert_stats(fn(grad, bias), [grad, bias])  # no NaN: the gradients' own statistics
    grad[5] = float("nan")
    assert_stats(fn(grad, bias), [torch.zeros_like(grad), bias * 0])  # a NaN: the skipped step's


def check_doubling_sums(fn) -> None:
    x = inputs(1)[0].float()
    x[9] = float("inf")
    i, last, total, counts = fn(x, 3)
    assert int(i) == 3 and torch.equal(last, x * 8)
    expected = sum(reference_multi_tensor_stats([x * k, (x * k)[:1500]])[0] for k in (1, 2, 4))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0, equal_nan=True)
    assert torch.equal(counts, reference_multi_tensor_stats([x * 4, (x * 4)[:1500]])[2])


def test_cond_eager():
    check_skip_on_nan(skip_on_nan)


def test_while_loop_eager():
    check_doubling_sums(doubling_sums)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cond_compiled(backend):
    torch._dynamo.reset()
    check_skip_on_nan(torch.compile(skip_on_nan, fullgraph=True, backend=backend))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_while_loop_compiled(backend):
    torch._dynamo.reset()
    check_doubling_sums(torch.compile(doubling_sums, fullgraph=True, backend=backend, dynamic=False))


def test_cond_nested_in_a_while_loop_body_compiled():
    # Each round takes the NaN branch or not by the op's own count, on a tensor the loop changes.
    def fn(x: torch.Tensor):
        def cond_fn(i, x, nan_rounds):
            return i < 4

        def body_fn(i, x, nan_rounds):
            has_nan = OP([x])[2][0, 1] > 0
            counted = torch.cond(has_nan, lambda n: n + 1, lambda n: n.clone(), (nan_rounds,))
            poisoned = torch.where(i == 1, torch.full_like(x, float("nan")), x)  # NaN from round 2 on
            return i + 1, poisoned, counted

        return torch.while_loop(cond_fn, body_fn, (torch.tensor(0), x, torch.tensor(0)))

    torch._dynamo.reset()
    x = inputs(2)[0].float()
    eager = fn(x)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert int(eager[2]) == 2 and int(compiled[2]) == 2  # rounds 3 and 4 saw the NaN
