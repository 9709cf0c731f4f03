"""grad_stats / GradStats / GradReport: inputs, values against the float64 reference and torch, one transfer."""

import contextlib
import math
import sys
import types

import pytest
import torch
from torch import nn

import torch_gradstats.ops.fallback
import torch_gradstats.stats._params as params_mod
import torch_gradstats.stats.gradients as stats_mod
from torch_gradstats.ops.op import reference_multi_tensor_stats
from torch_gradstats.stats.gradients import GradReport, GradStats, grad_stats
from torch_gradstats.stats.health import HealthPolicy

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    m(torch.randn(5, 6, dtype=dtype)).square().sum().backward()
    return m


def cnn(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    m(torch.randn(2, 3, 8, 8)).sum().backward()
    return m


def params_with(grads):
    """Parameters whose .grad are the given tensors (None allowed)."""
    out = []
    for g in grads:
        p = nn.Parameter(torch.zeros(1 if g is None else g.shape, dtype=torch.float32 if g is None else g.dtype))
        p.grad = g
        out.append(p)
    return out


# ------------------------------------------------------------------ inputs
def test_accepts_every_input_form_and_names():
    m = mlp()
    expected = [n for n, _ in m.named_parameters()]
    assert grad_stats(m.named_parameters()).names == expected
    assert grad_stats(list(m.named_parameters())).names == expected
    assert grad_stats(m.parameters()).names == [str(i) for i in range(len(expected))]
    assert grad_stats(p for p in m.parameters()).names == [str(i) for i in range(len(expected))]
    assert grad_stats([("a", m[0].weight), ["b", m[0].bias]]).names == ["a", "b"]
    assert grad_stats(m[0].weight).names == ["0"]
    ref = grad_stats(m.named_parameters())
    for form in (m.parameters(), list(m.parameters()), (p for p in m.parameters())):
        assert torch.equal(grad_stats(form).sumsq, ref.sumsq)


def test_none_grads_skipped_and_unnamed_named_by_input_position():
    ps = params_with([torch.ones(3), None, torch.full((2,), 2.0), None])
    s = grad_stats(ps)
    assert s.names == ["0", "2"]
    assert s.sumsq.tolist() == [3.0, 8.0]
    assert s.numel.tolist() == [3, 2]


@pytest.mark.parametrize(
    "bad, match",
    [
        ([torch.zeros(2, requires_grad=True), 3], "item 1 is a int"),
        ([("w", torch.zeros(1)), ("b",)], "item 1 is a tuple"),
        (["weight"], "item 0 is a str"),
        (5, "got a int"),
        ("weight", "got a str"),
    ],
)
def test_wrong_input_names_the_item(bad, match):
    with pytest.raises(TypeError, match=match):
        grad_stats(bad)


def test_bad_gradient_names_the_parameter():
    p = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    p.grad = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"'enc\.w' has a torch\.complex64 gradient"):
        grad_stats([("enc.w", p)])
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"'weight' has a torch\.sparse_coo gradient"):
        grad_stats(emb.named_parameters())


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference_on_mixed_dtypes(seed):
    g = torch.Generator().manual_seed(seed)
    grads = []
    for i, dt in enumerate(DTYPES * 2):
        t = (torch.randn(7 + 13 * i, generator=g) * 10 ** (i % 4 - 2)).to(dt)
        t[:: 3 + i] = 0
        grads.append(t if i % 3 else t.reshape(-1, 1).expand(-1, 2).t())  # non-contiguous views too
    s = grad_stats(params_with(grads))
    r_sumsq, r_amax, r_counts = reference_multi_tensor_stats(grads)
    torch.testing.assert_close(s.sumsq, r_sumsq, rtol=1e-5, atol=0)
    torch.testing.assert_close(s.amax, r_amax, rtol=1e-5, atol=0)
    assert torch.equal(s.counts, r_counts)
    assert s.numel.tolist() == [t.numel() for t in grads]
    assert s.sumsq.dtype == s.amax.dtype == torch.float64 and s.counts.dtype == torch.int64


@pytest.mark.parametrize("make", [mlp, cnn, lambda: mlp(dtype=torch.float64)])
def test_total_norm_equals_torch(make):
    m = make()
    s = grad_stats(m.named_parameters())
    clip = torch.nn.utils.clip_grad_norm_(m.parameters(), math.inf)  # inf max_norm: nothing is clipped
    total = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    assert float(s.total_norm) == pytest.approx(float(clip), rel=1e-6)
    assert float(s.total_norm) == pytest.approx(float(total), rel=1e-6)
    inf = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], math.inf)
    assert float(s.inf_norm) == pytest.approx(float(inf), rel=1e-6)
    r = s.report()
    assert r.total_norm == float(s.total_norm)
    assert r.total_norm == pytest.approx(float(clip), rel=1e-6)


def test_extreme_values_do_not_overflow():
    s = grad_stats(params_with([torch.full((50,), 1e20), torch.full((1000,), 5000.0, dtype=torch.float16)]))
    r = s.report()
    assert r.total_norm == pytest.approx(math.sqrt(50 * 1e40 + 1000 * 25e6), rel=1e-6)
    assert r.norms["1"] == pytest.approx(5000.0 * math.sqrt(1000), rel=1e-6)
    assert r.inf_count == 0 and r.nonfinite == []


def test_nonfinite_named_in_model_order():
    m = mlp()
    m[2].bias.grad[3] = float("nan")
    m[4].weight.grad[0, 0] = float("inf")
    m[4].weight.grad[1, 1] = float("-inf")
    s = grad_stats(m.named_parameters())
    assert s.nonfinite_mask.tolist() == [False, False, False, True, True, False]
    assert int(s.nan_count) == 1 and int(s.inf_count) == 2 and int(s.nonfinite_count) == 3
    assert math.isnan(float(s.total_norm))
    r = s.report()
    assert r.nonfinite == ["2.bias", "4.weight"]
    assert r.first_nonfinite == "2.bias"
    assert r.nan_counts["2.bias"] == 1 and r.inf_counts["4.weight"] == 2
    assert math.isnan(r.total_norm) and math.isnan(r.inf_norm) and math.isnan(r.max_norm)
    assert r.health == 0.0 and float(s.health()) == 0.0
    assert r.top_norms[0][0] == "2.bias"  # NaN sorts first
    assert "first non-finite: 2.bias" in str(r)


def test_only_inf_gives_inf_total():
    s = grad_stats(params_with([torch.tensor([1.0, float("inf")]), torch.ones(2)]))
    r = s.report()
    assert r.total_norm == math.inf and r.inf_norm == math.inf and r.first_nonfinite == "0"


def test_zero_counts_fraction_min_max_top():
    grads = [torch.tensor([0.0, -0.0, 3.0, 4.0]), torch.zeros(4), torch.tensor([12.0])]
    r = grad_stats(params_with(grads)).report(k=2)
    assert r.numel == 9 and r.zero_count == 6 and r.zero_fraction == pytest.approx(6 / 9)
    assert r.zero_counts == {"0": 2, "1": 4, "2": 0}
    assert r.norms == {"0": 5.0, "1": 0.0, "2": 12.0}
    assert (r.min_norm, r.max_norm) == (0.0, 12.0)
    assert r.top_norms == [("2", 12.0), ("0", 5.0)]
    assert r.total_norm == 13.0 and r.inf_norm == 12.0
    assert r.vanishing == ["1"] and r.exploding == ["2"]
    assert r.health == pytest.approx(1 - 0.5 / 3 - 0.8 / 3)


def test_health_device_equals_report():
    for seed in range(5):
        m = mlp(seed)
        with torch.no_grad():
            m[0].weight.grad.mul_(100)  # one exploding tensor
            m[2].bias.grad.zero_()  # one vanishing tensor
        s = grad_stats(m.named_parameters())
        for policy in (None, HealthPolicy(exploding_threshold=0.5)):
            assert float(s.health(policy)) == s.report(policy=policy).health


def test_empty():
    for empty in ([], iter([]), params_with([None, None]), nn.Linear(2, 2).parameters()):
        s = grad_stats(empty)
        assert len(s) == 0 and s.names == []
        assert float(s.total_norm) == 0.0 and float(s.inf_norm) == 0.0 and float(s.health()) == 1.0
        r = s.report()
        assert (r.total_norm, r.inf_norm, r.numel, r.health, r.first_nonfinite) == (0.0, 0.0, 0, 1.0, None)
        assert r.norms == {} and r.top_norms == [] and r.zero_fraction == 0.0
        assert str(r)


def test_to_dict_is_flat_and_str_has_table():
    m = mlp()
    r = grad_stats(m.named_parameters()).report(k=3)
    d = r.to_dict(prefix="grad/")
    assert d["grad/total_norm"] == r.total_norm and d["grad/health"] == r.health
    assert d["grad/norm/0.weight"] == r.norms["0.weight"]
    assert all(isinstance(v, (int, float, str, type(None))) for v in d.values())
    assert "norm/0.weight" not in r.to_dict(per_param=False)
    text = str(r)
    assert "total norm" in text and r.top_norms[0][0] in text and len(text.splitlines()) <= 10


# ------------------------------------------------------------------ no sync, one transfer, one op call
@contextlib.contextmanager
def count_host_reads():
    """Count every Tensor method that moves data to the host (or reads a value on it).

    The pure-PyTorch kernel reads a batch's min/max |x| when the batch is on the CPU, where that is no sync; while
    counting, it is told it is on another device, so it runs the sync-free ops it runs there and only the layers
    above it are counted."""
    counts = {}
    fallback_branches = torch_gradstats.ops.fallback._branches_on_host
    names = ["cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"]
    originals = {n: getattr(torch.Tensor, n) for n in names}
    orig_to = torch.Tensor.to

    def wrap(n):
        def f(self, *a, **k):
            counts[n] = counts.get(n, 0) + 1
            return originals[n](self, *a, **k)

        return f

    def to(self, *a, **k):
        target = a[0] if a else k.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            counts["to_cpu"] = counts.get("to_cpu", 0) + 1
        return orig_to(self, *a, **k)

    try:
        for n in names:
            setattr(torch.Tensor, n, wrap(n))
        torch.Tensor.to = to
        torch_gradstats.ops.fallback._branches_on_host = lambda device: False
        yield counts
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)
        torch.Tensor.to = orig_to
        torch_gradstats.ops.fallback._branches_on_host = fallback_branches


def test_grad_stats_properties_and_health_never_read_on_host():
    m = mlp()
    m[0].bias.grad[0] = float("nan")
    with count_host_reads() as counts:
        s = grad_stats(m.named_parameters())
        for prop in (
            "norms",
            "total_sumsq",
            "total_norm",
            "inf_norm",
            "zero_count",
            "nan_count",
            "inf_count",
            "nonfinite_count",
            "nonfinite_mask",
        ):
            getattr(s, prop)
        s.health()
        s.health(HealthPolicy(exploding_threshold=1.0))
    assert counts == {}


@pytest.mark.parametrize("nan", [False, True])
def test_report_makes_exactly_one_transfer(nan):
    m = cnn()
    if nan:
        m[0].weight.grad[0, 0, 0, 0] = float("nan")
    s = grad_stats(m.named_parameters())
    with count_host_reads() as counts:
        r = s.report()
    # exactly one .cpu(); numpy() only reads the host copy it returned (zero-copy), nothing else touches the device
    assert counts.pop("cpu") == 1
    assert set(counts) <= {"numpy"}
    assert isinstance(r, GradReport) and r.numel == sum(p.numel() for p in m.parameters())


def test_one_op_call_per_device(monkeypatch):
    calls = []
    real = params_mod.multi_tensor_stats

    def spy(tensors):
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(params_mod, "multi_tensor_stats", spy)
    m = cnn()
    grad_stats(m.named_parameters())
    assert calls == [len(list(m.parameters()))]


# ------------------------------------------------------------------ distributed hook wiring (no real communication)
def test_no_group_no_dtensor_no_distributed_import(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_gradstats.distributed.reduce", raising=False)
    grad_stats(mlp().named_parameters()).report()
    assert "torch_gradstats.distributed.reduce" not in sys.modules


def test_group_calls_reduce_across_ranks(monkeypatch):
    seen = {}
    fake = types.ModuleType("torch_gradstats.distributed.reduce")

    from torch_gradstats.distributed.reduce import ReducedStats

    def reduce_across_ranks(grads, sumsq, amax, counts, group, **options):
        seen.update(grads=grads, group=group, names=options.get("names"))
        world = 2
        rank_nf = torch.where(counts[:, 1] + counts[:, 2] > 0, 0, -1)  # the lowest rank with a NaN/Inf: 0
        numel = torch.tensor([g.numel() for g in grads], device=sumsq.device) * world
        return ReducedStats(sumsq * world, amax, counts * world, rank_nf, numel)

    fake.reduce_across_ranks = reduce_across_ranks
    monkeypatch.setitem(sys.modules, "torch_gradstats.distributed.reduce", fake)
    m = mlp()
    m[2].weight.grad[0, 0] = float("inf")
    local = grad_stats(m.named_parameters())
    s = grad_stats(m.named_parameters(), group="g")
    assert seen["group"] == "g" and len(seen["grads"]) == len(local) and seen["names"] == local.names
    assert seen["grads"][0] is m[0].weight.grad
    assert torch.equal(s.numel, local.numel * 2)
    assert torch.equal(s.sumsq, local.sumsq * 2) and s.rank_nonfinite.shape == (len(local),)
    r = s.report()
    assert r.nonfinite_ranks == {"2.weight": [0]}
    assert r.inf_count == 2


# ------------------------------------------------------------------ GPU (skipped without one)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_no_sync_until_report_and_mixed_devices():
    m = mlp().cuda()
    m(torch.randn(3, 6, device="cuda")).sum().backward()
    cpu_p = nn.Parameter(torch.ones(4))
    cpu_p.grad = torch.full((4,), 2.0)
    named = [("cpu.first", cpu_p)] + list(m.named_parameters())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = grad_stats(named)
        s.health()
        assert s.total_norm.device.type == "cuda"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert s.device.type == "cuda" and s.names[0] == "cpu.first"
    r = s.report()
    assert r.norms["cpu.first"] == 4.0
    ref = math.sqrt(16.0 + sum(float(p.grad.double().square().sum()) for p in m.parameters()))
    assert r.total_norm == pytest.approx(ref, rel=1e-6)


def test_gradstats_is_plain_dataclass():
    s = grad_stats(mlp().named_parameters())
    assert isinstance(s, GradStats) and s.rank_nonfinite is None and s.device == torch.device("cpu")


def test_repeated_names_stay_separate_parameters():
    """chain(enc.named_parameters(), dec.named_parameters()) yields "weight" twice: the report must not merge them."""
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([1.0, 2.0, 2.0])
    b.grad = torch.tensor([float("nan"), 0.0, 0.0])
    r = grad_stats([("w", a), ("w", b)]).report()
    assert r.norms["w"] == 3.0 and math.isnan(r.norms["w#1"])
    assert r.nonfinite == ["w#1"] and r.first_nonfinite == "w#1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiles_in_one_graph_and_matches_eager(dtype):
    """grad_stats under torch.compile(fullgraph=True): no graph break anywhere in the Python layer (an array, a
    pinned copy or a host read would break it), and the same figures as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(dtype)
    model(torch.randn(5, 4, dtype=dtype)).sum().backward()
    model[0].bias.grad = None  # a parameter without a gradient is skipped the same way in both

    @torch.compile(fullgraph=True, backend="aot_eager")
    def compiled(m):
        s = grad_stats(m.named_parameters())
        return s.sumsq, s.amax, s.counts, s.total_norm

    eager = grad_stats(model.named_parameters())
    got = compiled(model)
    for name, a, b in zip(
        ("sumsq", "amax", "counts", "total_norm"), got, (eager.sumsq, eager.amax, eager.counts, eager.total_norm)
    ):
        assert torch.equal(a, b), f"{name}: {a} != {b}"
    torch._dynamo.reset()


@pytest.mark.skipif(stats_mod._collect_grads is None, reason="needs the compiled library")
def test_native_walk_matches_the_python_walk(monkeypatch):
    """The C++ walk over (name, parameter) pairs gives what the Python walk gives: names (repeats made unique),
    None gradients skipped, sizes; and it declines whatever the Python walk must handle."""
    from torch.overrides import TorchFunctionMode

    collect = stats_mod._collect_grads
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    model[2].bias.grad = None
    pairs = list(model.named_parameters()) + [("0.weight", model[0].weight)]  # a repeated name
    names, grads, numels = collect(pairs)
    assert names == ["0.weight", "0.bias", "2.weight", "0.weight"] and numels == (12, 3, 6, 12)
    assert all(g is p.grad for g, (_, p) in zip(grads, [pairs[0], pairs[1], pairs[2], pairs[4]]))
    # Parameters alone, and mixed with pairs, are named by their position as the Python walk names them.
    mixed = [model[0].weight, ("b", model[0].bias), model[2].bias, model[2].weight]
    assert collect(mixed) == (["0", "b", "3"], [model[0].weight.grad, model[0].bias.grad, model[2].weight.grad],
                              (12, 3, 6))  # fmt: skip
    native = grad_stats(pairs)
    native_mixed = grad_stats(mixed)
    monkeypatch.setattr(stats_mod, "_collect_grads", None)
    python = grad_stats(iter(pairs))
    python_mixed = grad_stats(mixed)
    assert native.names == python.names == ["0.weight", "0.bias", "2.weight", "0.weight#1"]
    assert native_mixed.names == python_mixed.names == ["0", "b", "3"]
    for field in ("sumsq", "amax", "counts", "numel"):
        assert torch.equal(getattr(native, field), getattr(python, field)), field
        assert torch.equal(getattr(native_mixed, field), getattr(python_mixed, field)), field

    class MyParam(nn.Parameter):
        pass

    class MyTensor(torch.Tensor):
        pass

    w = model[0].weight
    odd_param = MyParam(torch.ones(2))
    odd_param.grad = torch.ones(2)
    odd_grad = nn.Parameter(torch.ones(2))
    odd_grad.grad = torch.ones(2).as_subclass(MyTensor)
    for items in ([("a", odd_param)], [("a", odd_grad)], [["a", w]], [("a", w, 1)], [(1, w)], [("a", 3)], [3],
                  [odd_param], ["a"]):  # fmt: skip
        assert collect(items) is None, items
    with TorchFunctionMode():
        assert collect([("a", w)]) is None
    assert collect([]) == ([], [], ())
    with pytest.raises(TypeError):
        collect((("a", w),))  # a list only


@pytest.mark.skipif(stats_mod._collect_grads is None, reason="needs the compiled library")
def test_native_walk_survives_a_finalizer_emptying_the_list_during_the_walk():
    """The walk allocates (gradients made by backward get their Python object only when first read), so the
    collector may run a __del__ that empties the list being walked: the walk must go on over the items it was given.
    In a subprocess: reading the emptied list crashed."""
    import subprocess

    code = (
        "import gc, torch\n"
        "from torch_gradstats import _C\n"
        "armed, box = [False], {}\n"
        "class Cyc:\n"
        "    def __init__(self):\n"
        "        self.me = self\n"
        "    def __del__(self):\n"
        "        if armed[0]:\n"
        "            armed[0] = False\n"
        "            box['items'].clear()\n"
        "fired = 0\n"
        "for attempt in range(30):\n"
        "    lin = torch.nn.Linear(8, 8)\n"
        "    lin(torch.randn(2, 8)).sum().backward()  # gradients without a Python object yet\n"
        "    items = box['items'] = [('p%d' % k, p) for k in range(20) for p in lin.parameters()]\n"
        "    gc.collect(); gc.set_threshold(1, 1, 1)\n"
        "    Cyc(); armed[0] = True\n"
        "    got = _C.collect_grads(items)\n"
        "    fired += not armed[0]\n"
        "    armed[0] = False; gc.set_threshold(700, 10, 10)\n"
        "    names, grads, numels = got\n"
        "    assert names == ['p%d' % k for k in range(20) for _ in range(2)], names\n"
        "    assert numels == (64, 8) * 20 and grads[0] is lin.weight.grad, numels\n"
        "assert fired > 0, 'the finalizer never ran during a walk: the test checked nothing'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout[-2000:] + res.stderr[-2000:]
