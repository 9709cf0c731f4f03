"""clip_grad_norm_: same clipped gradients as torch.nn.utils.clip_grad_norm_, no host sync, telemetry returned."""

import copy
import math

import pytest
import torch
from torch import nn

from torch_gradstats.policies.clip import clip_grad_norm_
from torch_gradstats.stats.gradients import GradStats, grad_stats

try:
    from test_stats import count_host_reads
except ImportError:  # tests/ imported as a package
    from tests.test_stats import count_host_reads


def model(kind, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    if kind == "linear":
        m = nn.Linear(10, 5)
        x = torch.randn(4, 10)
    elif kind == "mlp":
        m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        x = torch.randn(16, 8)
    else:
        m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
        x = torch.randn(3, 2, 6, 6)
    m = m.to(dtype)
    (m(x.to(dtype)).float() * 10).square().sum().backward()
    return m


def twin(m):
    """A copy of m whose gradients are copies of m's (deepcopy does not copy .grad)."""
    m2 = copy.deepcopy(m)
    for a, b in zip(m.parameters(), m2.parameters()):
        if a.grad is not None and a.grad.dtype != b.dtype:
            b.grad_dtype = None
        b.grad = None if a.grad is None else a.grad.detach().clone()
    return m2


def grads(m):
    return [p.grad for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["linear", "mlp", "cnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e6])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
def test_parity_with_torch(kind, dtype, max_norm, norm_type):
    ours, ref = model(kind, dtype), None
    ref = twin(ours)
    before = grad_stats(ours.named_parameters())
    stats = clip_grad_norm_(ours.named_parameters(), max_norm, norm_type)
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    assert isinstance(stats, GradStats) and stats.names == before.names
    assert torch.equal(stats.sumsq, before.sumsq)  # the stats describe the gradients before clipping
    assert float(stats.clip_norm) == pytest.approx(float(total), rel=1e-6)
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    for a, b in zip(grads(ours), grads(ref)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=0)
    if max_norm >= 1e6:
        assert float(stats.clip_coef) == 1.0


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_modes_and_plain_parameters(foreach):
    ours = model("mlp")
    ref = twin(ours)
    clip_grad_norm_(ours.parameters(), 0.5, foreach=foreach)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, foreach=foreach)
    for a, b in zip(grads(ours), grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_against_float64_reference_and_torch(dtype):
    ours = model("mlp", dtype)
    ref = twin(ours)
    g64 = [g.double() for g in grads(ours)]
    true_norm = math.sqrt(sum(float(g.square().sum()) for g in g64))
    coef = min(1.0, 0.5 / (true_norm + 1e-6))
    stats = clip_grad_norm_(ours.parameters(), 0.5)
    assert float(stats.clip_norm) == pytest.approx(true_norm, rel=1e-5)  # the op's accuracy contract
    for a, g in zip(grads(ours), g64):  # within rounding of the scaled value to the 16-bit dtype
        torch.testing.assert_close(a.double(), g * coef, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10,
                                   atol=0)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    for a, b in zip(grads(ours), grads(ref)):  # torch's norm is itself rounded to 16 bits
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=0)


def test_mixed_dtypes():
    ours = model("mlp")
    ours[0].weight.grad_dtype = None  # allow a gradient dtype other than the parameter's
    ours[0].weight.grad = ours[0].weight.grad.half()
    ours[2].bias.grad_dtype = None
    ours[2].bias.grad = ours[2].bias.grad.double()
    ref = twin(ours)
    stats = clip_grad_norm_(ours.parameters(), 1.0)
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    assert float(stats.clip_norm) == pytest.approx(float(total), rel=1e-3)
    for a, b in zip(grads(ours), grads(ref)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=0)


def test_fp16_large_values_do_not_overflow_unlike_torch():
    ours = model("mlp", torch.float16)
    for p in ours.parameters():
        p.grad = torch.full_like(p, 5000.0)  # 420 elements: the norm, 1.02e5, is above float16's 65504
    ref = twin(ours)
    stats = clip_grad_norm_(ours.parameters(), 1.0)
    n = sum(p.numel() for p in ours.parameters())
    assert float(stats.clip_norm) == pytest.approx(5000.0 * math.sqrt(n), rel=1e-6)
    for g in grads(ours):
        torch.testing.assert_close(g.float(), torch.full_like(g.float(), 1 / math.sqrt(n)), rtol=1e-3, atol=0)
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    assert math.isinf(float(total))  # torch's float16 norm overflows (65504) and zeroes the gradients
    assert all(float(g.float().abs().max()) == 0.0 for g in grads(ref))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_nonfinite_like_torch(bad, norm_type):
    ours = model("mlp")
    ours[2].weight.grad[0, 1] = bad
    ref = twin(ours)
    stats = clip_grad_norm_(ours.parameters(), 1.0, norm_type)
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type)
    assert not math.isfinite(float(stats.clip_norm)) and not math.isfinite(float(total))
    for a, b in zip(grads(ours), grads(ref)):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    assert stats.report().first_nonfinite == "2"


def test_error_if_nonfinite_names_parameter_and_leaves_grads():
    ours = model("mlp")
    ours[2].bias.grad[0] = float("nan")
    saved = [g.clone() for g in grads(ours)]
    with count_host_reads() as counts, pytest.raises(
        RuntimeError, match=r"non-finite.*first non-finite gradient: '2\.bias'"
    ):
        clip_grad_norm_(ours.named_parameters(), 1.0, error_if_nonfinite=True)
    assert counts.pop("cpu") == 1 and set(counts) <= {"tolist", "numpy"}
    for a, b in zip(grads(ours), saved):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    ref = twin(model("mlp"))
    # finite gradients: no error, same result as torch's error_if_nonfinite=True
    fine = model("mlp")
    clip_grad_norm_(fine.parameters(), 1.0, error_if_nonfinite=True)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, error_if_nonfinite=True)
    for a, b in zip(grads(fine), grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_no_host_read_without_error_check():
    ours = model("cnn")
    with count_host_reads() as counts:
        clip_grad_norm_(ours.parameters(), 0.1)
        clip_grad_norm_(ours.parameters(), 0.1, math.inf)
    assert counts == {}


def test_zero_and_missing_grads():
    ours = model("mlp")
    for p in ours.parameters():
        p.grad.zero_()
    ours[0].bias.grad = None
    stats = clip_grad_norm_(ours.parameters(), 1.0)
    assert float(stats.clip_norm) == 0.0 and float(stats.clip_coef) == 1.0 and len(stats) == 3
    assert all(float(g.abs().max()) == 0.0 for g in grads(ours))
    empty = clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0)
    assert len(empty) == 0 and float(empty.clip_norm) == 0.0 and float(empty.total_norm) == 0.0
    assert float(torch.nn.utils.clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0)) == 0.0


def test_single_tensor_and_generator():
    ours = model("linear")
    ref = twin(ours)
    clip_grad_norm_(ours.weight, 0.2)
    clip_grad_norm_((p for p in [ours.bias]), 1.0)
    torch.nn.utils.clip_grad_norm_(ref.weight, 0.2)
    torch.nn.utils.clip_grad_norm_([ref.bias], 1.0)
    for a, b in zip(grads(ours), grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_group_allows_only_norm_2_or_inf():
    m = torch.nn.Linear(3, 2)
    m(torch.randn(4, 3)).sum().backward()
    before = m.weight.grad.clone()
    with pytest.raises(ValueError, match="norm_type must be 2 or inf"):
        clip_grad_norm_(m.parameters(), 1.0, norm_type=1.0, group=object())
    assert torch.equal(m.weight.grad, before)


# ---------------------------------------------------------------------------------------------- where it differs
def _param_with_grad(grad):
    p = nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


def test_float32_squares_that_overflow_the_documented_difference():
    """torch squares float32 gradients in float32: 1e20**2 overflows, its norm is inf and it zeroes the gradients
    (or raises). Ours is the true norm, and the gradients are scaled to max_norm. Pinned on both sides, so a change
    in either shows up here."""
    grad = torch.full((4,), 1e20)
    ours, theirs = _param_with_grad(grad), _param_with_grad(grad)
    stats = clip_grad_norm_([ours], max_norm=1.0)
    torch_norm = torch.nn.utils.clip_grad_norm_([theirs], max_norm=1.0)
    assert torch_norm.item() == math.inf and torch.equal(theirs.grad, torch.zeros(4))
    assert stats.clip_norm.item() == pytest.approx(2 * grad[0].item(), rel=1e-12)  # float32's 1e20, doubled
    torch.testing.assert_close(ours.grad, torch.full((4,), 0.5))
    # error_if_nonfinite: torch raises on its overflowed norm; ours is finite, so it clips without raising
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_([_param_with_grad(grad)], max_norm=1.0, error_if_nonfinite=True)
    p = _param_with_grad(grad)
    clip_grad_norm_([p], max_norm=1.0, error_if_nonfinite=True)
    torch.testing.assert_close(p.grad, torch.full((4,), 0.5))


def test_float16_norm_above_65504_the_documented_difference():
    grad = torch.full((4,), 60000.0, dtype=torch.float16)  # norm 120000 > float16 max
    ours, theirs = _param_with_grad(grad), _param_with_grad(grad)
    stats = clip_grad_norm_([ours], max_norm=1.0)
    torch_norm = torch.nn.utils.clip_grad_norm_([theirs], max_norm=1.0)
    assert torch_norm.item() == math.inf and torch.equal(theirs.grad, torch.zeros(4, dtype=torch.float16))
    assert stats.clip_norm.item() == pytest.approx(120000.0, rel=1e-12)
    torch.testing.assert_close(ours.grad.float(), torch.full((4,), 0.5), rtol=1e-3, atol=0)


def test_bfloat16_norm_differs_by_at_most_bfloat16_rounding():
    grad = (torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    exact = grad.double().square().sum().sqrt().item()
    stats = clip_grad_norm_([_param_with_grad(grad)], max_norm=1.0)
    torch_norm = torch.nn.utils.clip_grad_norm_([_param_with_grad(grad)], max_norm=1.0).item()
    assert stats.clip_norm.item() == pytest.approx(exact, rel=1e-5)  # the op's contract for 16/32-bit inputs
    assert abs(torch_norm - exact) <= 2**-8 * exact  # bfloat16 keeps 8 significant bits


def test_inf_norm_and_representable_float32_norms_agree_with_torch():
    grad = torch.full((4,), 1e20)
    s = clip_grad_norm_([_param_with_grad(grad)], max_norm=1.0, norm_type=math.inf)
    t = torch.nn.utils.clip_grad_norm_([_param_with_grad(grad)], max_norm=1.0, norm_type=math.inf)
    assert s.clip_norm.item() == t.item() == grad[0].item()
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    ours, theirs = _param_with_grad(grad), _param_with_grad(grad)
    s = clip_grad_norm_([ours], max_norm=1.0)
    t = torch.nn.utils.clip_grad_norm_([theirs], max_norm=1.0)
    assert s.clip_norm.item() == pytest.approx(t.item(), rel=1e-6)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=0)


def test_nan_gradient_behaves_like_torch():
    grad = torch.tensor([1.0, float("nan"), 2.0])
    ours, theirs = _param_with_grad(grad), _param_with_grad(grad)
    s = clip_grad_norm_([ours], max_norm=1.0)
    t = torch.nn.utils.clip_grad_norm_([theirs], max_norm=1.0)
    assert math.isnan(s.clip_norm.item()) and math.isnan(t.item())
    assert torch.isnan(ours.grad).all() and torch.isnan(theirs.grad).all()
