"""The drop-in collector against a reimplementation of the original's semantics (the baseline below).

The baseline follows esper-lite's gradient_collector.py as last published in the indexed history (global L2 norm,
float64 norms via ``g.double()`` + ``torch._foreach_norm``, counts over ``torch.cat`` of all gradients, health
1 - 0.5*vanishing share - 0.8*exploding share). It is written here from that description, not copied. Where the
new collector deliberately differs (a non-finite norm counts as exploding and gives health 0.0) the tests say so.
"""

import math

import pytest
import torch
from torch import nn

import torch_gradstats.stats._params as params_mod
from torch_gradstats.compat import collector as C

try:
    from test_stats import count_host_reads
except ImportError:  # tests/ imported as a package
    from tests.test_stats import count_host_reads


# ------------------------------------------------------------------ baseline (original semantics)
def baseline(params, vt=1e-7, et=10.0):
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return {"gradient_norm": 0.0, "gradient_health": 1.0, "has_vanishing": False, "has_exploding": False,
                "min_layer_norm": 0.0, "max_layer_norm": 0.0, "norm_ratio": 1.0, "zero_grad_fraction": 0.0,
                "nan_count": 0, "inf_count": 0}
    norms = torch.stack(torch._foreach_norm([g.double() for g in grads], ord=2))
    flat = torch.cat([g.reshape(-1) for g in grads])
    n = len(grads)
    n_van = int((norms < vt).sum())
    n_exp = int((norms > et).sum())
    health = max(0.0, min(1.0, 1.0 - (n_van / n) * 0.5 - (n_exp / n) * 0.8))
    mn, mx = float(norms.min()), float(norms.max())
    return {
        "gradient_norm": float((norms**2).sum()) ** 0.5,
        "gradient_health": health,
        "has_vanishing": n_van > 0,
        "has_exploding": n_exp > 0,
        "min_layer_norm": mn,
        "max_layer_norm": mx,
        "norm_ratio": mx / max(mn, 1e-10),
        "zero_grad_fraction": int((flat == 0).sum()) / max(flat.numel(), 1),
        "nan_count": int(torch.isnan(flat).sum()),
        "inf_count": int(torch.isinf(flat).sum()),
    }


def baseline_squared_sum(params):
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0, 0
    norms = torch.stack(torch._foreach_norm([g.double() for g in grads], ord=2))
    return float(norms.pow(2).sum()), sum(g.numel() for g in grads)


BASIC = ("gradient_norm", "gradient_health", "has_vanishing", "has_exploding")


def same(a, b, rel=1e-6):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, float):
        return a == pytest.approx(b, rel=rel, abs=1e-300)
    return a == b


# ------------------------------------------------------------------ models
def linear():
    torch.manual_seed(1)
    m = nn.Linear(10, 5)
    m(torch.randn(4, 10)).sum().backward()
    return m


def mlp():
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    m(torch.randn(16, 8)).pow(2).mean().backward()
    return m


def small_cnn():
    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 3 * 3, 10))
    nn.functional.cross_entropy(m(torch.randn(6, 1, 12, 12)), torch.randint(0, 10, (6,))).backward()
    return m


def with_unused_param():
    m = mlp()
    m.extra = nn.Linear(3, 3)  # never used: its .grad stays None
    return m


def scaled(make, factor):
    def f():
        m = make()
        with torch.no_grad():
            for p in m.parameters():
                p.grad.mul_(factor)
        return m
    return f


def filled(make, value, dtype=torch.float32):
    def f():
        m = make().to(dtype)
        for p in m.parameters():
            p.grad = torch.full_like(p, value)
        return m
    return f


MODELS = {
    "linear": linear,
    "mlp": mlp,
    "cnn": small_cnn,
    "unused_param": with_unused_param,
    "exploding": scaled(mlp, 1e3),
    "vanishing": scaled(small_cnn, 1e-12),
    "fp32_1e20": filled(linear, 1e20),
    "fp16_5000": filled(mlp, 5000.0, torch.float16),
    "bf16": filled(small_cnn, 0.5, torch.bfloat16),
    "zeros": filled(linear, 0.0),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("thresholds", [(1e-7, 10.0), (1e-3, 0.5)])
def test_matches_original_semantics_on_finite_models(name, thresholds):
    m = MODELS[name]()
    vt, et = thresholds
    want = baseline(m.parameters(), vt, et)
    got = C.collect_seed_gradients(m.parameters(), vt, et, return_enhanced=True)
    assert isinstance(got, C.GradientHealthMetrics)
    for key, value in want.items():
        assert same(getattr(got, key), value), (key, getattr(got, key), value)
    assert got.to_dict().keys() == want.keys()
    assert got.is_healthy() == (
        want["nan_count"] == 0 and want["inf_count"] == 0 and want["norm_ratio"] < 1000
        and want["zero_grad_fraction"] < 0.5 and not want["has_exploding"]
    )
    basic = C.collect_seed_gradients(m.parameters(), vt, et)
    assert set(basic) == set(BASIC) and all(same(basic[k], want[k]) for k in BASIC)
    coll = C.SeedGradientCollector(vt, et)
    for result in (coll.collect(m.parameters()), C.materialize_grad_stats(coll.collect_async(m.parameters())),
                   C.materialize_grad_stats(C.collect_seed_gradients_async(m.parameters(), vt, et))):
        assert set(result) == set(BASIC)
        assert all(same(result[k], want[k]) for k in BASIC), (result, want)
        assert isinstance(result["gradient_norm"], float) and isinstance(result["has_exploding"], bool)


def test_extreme_values_stay_finite():
    for make in (MODELS["fp32_1e20"], MODELS["fp16_5000"]):
        m = make()
        r = C.SeedGradientCollector().collect(m.parameters())
        expected = math.sqrt(sum(p.numel() for p in m.parameters())) * float(next(m.parameters()).grad.flatten()[0])
        assert math.isfinite(r["gradient_norm"]) and r["gradient_norm"] == pytest.approx(expected, rel=1e-6)
        a = C.collect_host_gradients_async(m.parameters())
        assert torch.isfinite(a["_host_squared_sum"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("make", [linear, mlp, small_cnn])
def test_nonfinite_is_exploding_with_zero_health(bad, make):
    m = make()
    first = next(m.parameters())
    first.grad.view(-1)[0] = bad
    want = baseline(m.parameters())
    got = C.collect_seed_gradients(m.parameters(), return_enhanced=True)
    # same as the original: counts, fraction, non-finite norm
    assert (got.nan_count, got.inf_count) == (want["nan_count"], want["inf_count"])
    assert got.zero_grad_fraction == want["zero_grad_fraction"]
    assert not math.isfinite(got.gradient_norm) and same(got.gradient_norm, want["gradient_norm"])
    # the fix: a non-finite norm is exploding and health is 0 (the original left NaN unflagged)
    assert got.has_exploding is True and got.gradient_health == 0.0 and not got.is_healthy()
    for r in (C.SeedGradientCollector().collect(m.parameters()), C.collect_seed_gradients(m.parameters())):
        assert r["gradient_health"] == 0.0 and r["has_exploding"] is True
        assert not math.isfinite(r["gradient_norm"])
    if math.isnan(bad):
        assert want["has_exploding"] is False or want["gradient_health"] > 0.0  # what the original reported


@pytest.mark.parametrize(
    "params",
    [lambda: iter([]), list, lambda: nn.Linear(3, 3).parameters(), lambda: (p for p in [nn.Parameter(torch.ones(2))])],
)
def test_empty(params):
    empty = {"gradient_norm": 0.0, "gradient_health": 1.0, "has_vanishing": False, "has_exploding": False}
    assert C.SeedGradientCollector().collect(params()) == empty
    assert C.collect_seed_gradients(params()) == empty
    a = C.collect_seed_gradients_async(params())
    assert a["_empty"] is True and C.materialize_grad_stats(a) == empty
    e = C.collect_seed_gradients(params(), return_enhanced=True)
    assert e == C.GradientHealthMetrics(0.0, 1.0, False, False, 0.0, 0.0, 1.0, 0.0, 0, 0) and e.is_healthy()
    d = C.materialize_dual_grad_stats(C.collect_dual_gradients_async(params(), params()))
    assert d == C.DualGradientStats(0.0, 0, 0.0, 0) and d.normalized_ratio == 0.0


def test_generators_and_none_grads():
    m = with_unused_param()
    want = baseline(list(m.parameters()))
    got = C.collect_seed_gradients((p for p in m.parameters()), return_enhanced=True)
    assert same(got.gradient_norm, want["gradient_norm"]) and got.zero_grad_fraction == want["zero_grad_fraction"]
    a = C.SeedGradientCollector().collect_async(iter(list(m.parameters())))
    assert a["_n_grads"] == sum(p.grad is not None for p in m.parameters())


def test_async_dict_keys_and_types():
    a = C.SeedGradientCollector().collect_async(mlp().parameters())
    assert {"_empty", "_n_grads", "_total_squared_norm", "_all_norms", "_n_vanishing", "_n_exploding"} <= set(a)
    assert a["_empty"] is False and a["_n_grads"] == 6
    assert a["_all_norms"].shape == (6,) and a["_total_squared_norm"].dim() == 0
    norms = torch.stack(torch._foreach_norm([p.grad.double() for p in mlp().parameters()]))
    torch.testing.assert_close(a["_all_norms"], norms, rtol=1e-6, atol=0)


@pytest.mark.parametrize("host, seed", [(mlp, linear), (small_cnn, mlp), (filled(linear, 1e20), small_cnn)])
def test_dual_matches_original(host, seed):
    h, s = host(), seed()
    hs, hc = baseline_squared_sum(h.parameters())
    ss, sc = baseline_squared_sum(s.parameters())
    d = C.materialize_dual_grad_stats(C.collect_dual_gradients_async(h.parameters(), s.parameters()))
    assert (d.host_param_count, d.seed_param_count) == (hc, sc)
    assert d.host_grad_norm == pytest.approx(hs**0.5, rel=1e-6)
    assert d.seed_grad_norm == pytest.approx(ss**0.5, rel=1e-6)
    eps = 1e-8
    want = (ss**0.5 / sc**0.5) / (hs**0.5 / hc**0.5 + eps)
    assert d.normalized_ratio == pytest.approx(want, rel=1e-6)
    hd = C.collect_host_gradients_async(h.parameters())
    sd = C.collect_seed_gradients_only_async(s.parameters())
    assert set(hd) == {"_host_squared_sum", "_host_param_count"}
    assert set(sd) == {"_seed_squared_sum", "_seed_param_count"}
    assert C.materialize_dual_grad_stats({**hd, **sd}) == d


def test_dual_accepts_python_numbers():
    d = C.materialize_dual_grad_stats(
        {"_host_squared_sum": 16.0, "_host_param_count": 4, "_seed_squared_sum": torch.tensor(9.0),
         "_seed_param_count": 1}
    )
    assert (d.host_grad_norm, d.seed_grad_norm) == (4.0, 3.0)


def test_constants_and_names():
    assert C.DEFAULT_VANISHING_THRESHOLD == 1e-7 and C.DEFAULT_EXPLODING_THRESHOLD == 10.0
    for name in C.__all__:
        assert hasattr(C, name)
    c = C.SeedGradientCollector()
    assert (c.vanishing_threshold, c.exploding_threshold) == (1e-7, 10.0)


# ------------------------------------------------------------------ the cost claims
def test_one_fused_call_no_copies_one_transfer(monkeypatch):
    m = small_cnn()
    grads = {p.grad.data_ptr() for p in m.parameters()}
    op_calls, copies = [], []
    real_op = params_mod.multi_tensor_stats
    monkeypatch.setattr(params_mod, "multi_tensor_stats", lambda ts: op_calls.append(len(ts)) or real_op(ts))
    real_cat, real_clone, real_double = torch.cat, torch.Tensor.clone, torch.Tensor.double

    def cat(tensors, *a, **k):
        if any(t.data_ptr() in grads for t in tensors):
            copies.append("cat")
        return real_cat(tensors, *a, **k)

    def clone(self, *a, **k):
        if self.data_ptr() in grads:
            copies.append("clone")
        return real_clone(self, *a, **k)

    def double(self, *a, **k):
        if self.data_ptr() in grads:
            copies.append("double")
        return real_double(self, *a, **k)

    monkeypatch.setattr(torch, "cat", cat)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    monkeypatch.setattr(torch.Tensor, "double", double)

    with count_host_reads() as counts:
        a = C.SeedGradientCollector().collect_async(m.parameters())
    assert counts == {}  # collect_async never syncs
    with count_host_reads() as counts:
        C.materialize_grad_stats(a)
    assert counts.pop("cpu") == 1 and set(counts) <= {"numpy"}
    with count_host_reads() as counts:
        C.collect_seed_gradients(m.parameters(), return_enhanced=True)
    assert counts.pop("cpu") == 1 and set(counts) <= {"numpy"}
    with count_host_reads() as counts:
        d = C.collect_dual_gradients_async(m.parameters(), m.parameters())
    assert counts == {}
    n = len(list(m.parameters()))
    assert op_calls == [n, n, n, n] and copies == []
    assert d["_host_param_count"] == sum(p.numel() for p in m.parameters())
