"""ActivationWatch: the module where a NaN/Inf starts, named from device-side figures, on real small models."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from _host_reads import fallback_kernel_files
from torch import nn

from torch_gradstats.monitors.activations import ActivationReport, ActivationWatch


# ------------------------------------------------------------------------------------------------- models
class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Normalize(nn.Module):
    """x / |x|: finite forward at a zero row (eps), but sqrt's derivative at 0 is inf, so the backward makes NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)


class MLP(nn.Module):
    def __init__(self, middle: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.act = nn.Linear(8, 16), nn.ReLU()
        self.mid = middle if middle is not None else nn.Identity()
        self.fc2, self.fc3 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc2(self.mid(self.act(self.fc1(x)))))


class Scores(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1) * self.scale


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.scores = Scores((d // heads) ** -0.5)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        attn = self.softmax(self.scores(split(self.q(x)), split(self.k(x))))
        return self.out((attn @ split(self.v(x))).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(idx)))


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.float().sum().backward()
    return out


# ------------------------------------------------------------------------------------------------- forward origin
def test_log_of_zero_is_the_forward_origin_and_the_layers_after_it_only_propagate():
    torch.manual_seed(0)
    model = MLP(Log())
    with torch.no_grad():  # one unit of fc1 is always 0 after the ReLU: log(0) = -inf there
        model.fc1.weight[3].zero_()
        model.fc1.bias[3] = 0.0
    with ActivationWatch(model) as watch:
        _step(model, torch.randn(4, 8))
        report = watch.report()
    assert isinstance(report, ActivationReport)
    assert report.step == 0
    assert report.forward_origin == "mid"
    assert report.forward_propagators == ["fc2", "fc3", "<root>"]  # the root is read too, and finishes last
    assert "mid" not in report.forward_propagators
    assert not report.inputs_nonfinite
    assert report.modules["mid"].inf_count >= 4  # at least one -inf per row
    assert report.modules["fc1"].nan_count == report.modules["fc1"].inf_count == 0
    assert report.weight_max_abs is None  # Log owns no parameters
    assert report.input_max_abs == pytest.approx(report.modules["act"].max_abs)
    assert report.forward_order == ["fc1", "act", "mid", "fc2", "fc3", "<root>"]
    assert report.backward_order == ["fc3", "fc2", "mid", "act", "fc1"]
    assert report.origin == "mid" and report.to_dict() == {"act/origin": "mid"}
    assert "forward origin mid" in report.summary()


def test_a_huge_weight_is_the_origin_with_its_weight_max_abs():
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc2.weight.fill_(3e38)  # finite in float32, but the products overflow
    watch = ActivationWatch(model)
    _step(model, torch.rand(4, 8) + 1.0)
    report = watch.report()
    watch.remove()
    assert report.forward_origin == "fc2"
    assert report.forward_propagators == ["fc3", "<root>"]
    assert report.weight_max_abs == pytest.approx(3e38, rel=1e-6)
    assert math.isfinite(report.input_max_abs) and report.input_max_abs > 0
    assert report.modules["fc2"].weight_max_abs == pytest.approx(3e38, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_attention_logit_that_overflows_is_the_forward_origin(dtype):
    torch.manual_seed(0)
    model = TinyTransformer()
    big = 3e2 if dtype == torch.float16 else 1e20  # q and k stay finite; q @ k^T overflows the dtype
    with torch.no_grad():
        model.block.attn.q.weight.mul_(big)
        model.block.attn.k.weight.mul_(big)
    model = model.to(dtype)
    with ActivationWatch(model) as watch:
        _step(model, torch.randint(0, 32, (2, 8)))
        report = watch.report()
    assert report.forward_origin == "block.attn.scores", report.summary()
    assert report.forward_first_nonfinite == "block.attn.scores"
    props = report.forward_propagators
    assert "block.attn.scores" not in props
    assert props[:2] == ["block.attn.softmax", "block.attn.v"] or props[0] == "block.attn.softmax"
    assert "block.attn.q" not in props and "block.attn.k" not in props  # their outputs were finite
    assert props[-2:] == ["head", "<root>"]
    # "logits reached inf while the inputs were this large"
    assert math.isfinite(report.input_max_abs) and report.input_max_abs > 100
    assert report.modules["block.attn.scores"].inf_count > 0
    assert report.weight_max_abs is None


def test_nn_multihead_attention_is_the_origin_when_its_logits_overflow():
    torch.manual_seed(0)

    class MHABlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return self.head(self.attn(h, h, h, need_weights=False)[0])

    model = MHABlock()
    with torch.no_grad():
        model.attn.in_proj_weight[:32].mul_(1e5)  # q and k overflow inside the module
    model = model.half()
    with ActivationWatch(model) as watch:
        _step(model, torch.randn(2, 8, 16).half())
        report = watch.report()
    assert report.forward_origin == "attn"
    assert report.forward_propagators == ["head", "<root>"]
    assert report.weight_max_abs is not None and report.weight_max_abs > 100


def test_non_finite_model_inputs_name_no_module():
    model = MLP()
    x = torch.randn(4, 8)
    x[1, 2] = math.nan
    with ActivationWatch(model) as watch:
        _step(model, x)
        report = watch.report()
    assert report.inputs_nonfinite
    assert report.forward_origin is None
    assert report.forward_propagators == ["fc1", "act", "mid", "fc2", "fc3", "<root>"]
    assert report.origin == "<inputs>" and report.to_dict()["act/origin"] == "<inputs>"
    assert "inputs were non-finite" in report.summary()
    assert report.input_max_abs is None and report.weight_max_abs is None


def test_a_value_made_outside_the_watched_modules_is_blamed_on_the_root_not_on_the_next_one():
    class Inject(nn.Module):  # a container: not selected by default
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * math.inf  # made in the container's own forward

    model = nn.Sequential(Inject(), nn.Linear(8, 4))
    with ActivationWatch(model) as watch:
        _step(model, torch.randn(2, 8))
        report = watch.report()
    assert report.forward_origin == "<root>"  # the nearest watched module around the code that made it
    assert report.forward_first_nonfinite == "1"
    assert "outside the watched modules" in report.summary() and "first seen by 1" in report.summary()
    # watching the containers too finds it
    with ActivationWatch(model, modules=lambda path, m: path != "") as watch:
        _step(model, torch.randn(2, 8))
        assert watch.report().forward_origin == "0"


# ------------------------------------------------------------------------------------------------- backward origin
def test_a_division_by_a_zero_norm_in_the_backward_only_is_the_backward_origin():
    torch.manual_seed(0)
    model = MLP(Normalize())
    with torch.no_grad():
        model.fc1.bias.zero_()
    x = torch.randn(4, 8)
    x[2] = 0.0  # row 2 reaches Normalize as zeros: forward 0 / eps, backward inf * 0
    with ActivationWatch(model) as watch:
        _step(model, x)
        report = watch.report()
    assert not report.inputs_nonfinite and report.forward_first_nonfinite is None and report.forward_origin is None
    assert report.backward_recorded
    assert report.backward_origin == "mid"
    assert report.backward_propagators == ["act"]  # the ReLU's zero there masks the NaN: fc1 is clean
    assert "mid" not in report.backward_propagators
    assert report.modules["fc2"].grad_nonfinite == 0
    assert report.modules["mid"].grad_input_nonfinite == 16
    assert report.modules["act"].grad_nonfinite == 16
    assert report.modules["fc1"].grad_nonfinite == 0
    assert report.origin == "mid"
    assert "backward origin mid" in report.summary()


def test_a_custom_autograd_function_that_divides_by_zero_in_its_backward():
    class ZeroGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            (x,) = ctx.saved_tensors
            return g / (x - x)  # 0 / 0 where g is 0, inf elsewhere

    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ZeroGrad.apply(x)

    model = nn.Sequential(nn.Linear(8, 8), Bad(), nn.Linear(8, 4))
    x = torch.randn(3, 8, requires_grad=True)
    with ActivationWatch(model) as watch:
        _step(model, x)
        report = watch.report()
    assert report.forward_origin is None
    assert report.backward_origin == "1"
    assert report.backward_propagators == ["0"]
    assert report.modules["0"].grad_input_nonfinite == x.numel()  # x requires grad: grad_input is watched


def test_a_finite_step_reports_no_origin_and_sensible_figures():
    torch.manual_seed(0)
    model = TinyTransformer()
    with ActivationWatch(model) as watch:
        out = _step(model, torch.randint(0, 32, (2, 8)))
        report = watch.report()
    assert not report.nonfinite and report.origin is None
    assert report.forward_origin is None and report.backward_origin is None
    assert report.forward_propagators == [] and report.backward_propagators == []
    head = report.modules["head"]
    assert head.max_abs == pytest.approx(out.detach().abs().max().item())
    assert head.norm == pytest.approx(out.detach().norm().item(), rel=1e-5)
    assert head.grad_max_abs == pytest.approx(1.0)  # d(sum)/d(out)
    assert head.weight_max_abs == pytest.approx(model.head.weight.detach().abs().max().item())
    # default selection: leaves and direct parameter owners; no containers
    assert "block" not in report.modules and "block.attn" not in report.modules
    assert report.forward_order[0] == "emb" and report.forward_order[-2:] == ["head", "<root>"]
    assert report.backward_order[0] == "head"
    assert report.to_dict(per_module=True)["act/head/max_abs"] == head.max_abs
    assert report.to_dict() == {"act/origin": None}


# ------------------------------------------------------------------------------------------------- steps, handle
def test_every_n_steps_records_only_those_steps_and_hooks_are_off_between():
    torch.manual_seed(0)
    model = MLP(Log())
    watch = ActivationWatch(model, every_n_steps=3)
    good, bad = torch.rand(2, 8) + 1.0, torch.rand(2, 8) + 1.0
    with torch.no_grad():
        model.fc1.bias.fill_(10.0)  # every unit positive: log is finite
    bad[0, 0] = math.nan
    seen = []
    for step in range(7):
        _step(model, bad if step in (1, 2, 6) else good)
        seen.append((watch.step, watch.report().step, bool(model.fc1._forward_hooks)))
        if step in (1, 2):  # not recorded: the NaN of these steps is not seen
            assert not watch.report().nonfinite
    assert seen == [(0, 0, True), (1, 0, False), (2, 0, False), (3, 3, True), (4, 3, False), (5, 3, False),
                    (6, 6, True)]  # fmt: skip
    assert watch.report().inputs_nonfinite
    watch.remove()


def test_remove_and_with_take_every_hook_away():
    model = TinyTransformer()

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())

    with ActivationWatch(model) as watch:
        _step(model, torch.randint(0, 32, (2, 8)))
        assert hooks() > 0
    assert hooks() == 0
    _step(model, torch.randint(0, 32, (2, 8)))
    assert watch.step == 0  # no longer counting
    assert watch.report().step == 0  # the last figures stay readable
    watch.remove()  # idempotent
    watch = ActivationWatch(model, every_n_steps=2)
    _step(model, torch.randint(0, 32, (2, 8)))
    _step(model, torch.randint(0, 32, (2, 8)))  # off step: one pre-hook per module (the step count) and the root's
    assert hooks() == len(watch.module_names) + 1
    assert not any(m._forward_hooks for m in model.modules() if m is not model)
    watch.remove()
    assert hooks() == 0


def test_report_before_any_step():
    report = ActivationWatch(MLP()).report()
    assert report.step is None and not report.nonfinite and report.modules == {}
    assert report.summary() == "no forward recorded yet"


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    aux: dict[str, object]


def test_nested_outputs_tuples_dicts_dataclasses():
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))  # owns a parameter: watched by default

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Output]:
            h = x * self.scale
            bad = h * torch.tensor([1.0, 1.0, 1.0, math.inf])
            return h, Output(hidden=h * 2, aux={"ids": torch.arange(3), "deep": [bad, (h, None)]})

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nested = Nested()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, out = self.nested(x)
            return h.sum() + out.hidden.sum()

    model = Top()
    with ActivationWatch(model, backward=False) as watch:
        model(torch.rand(3, 4) + 1.0)
        report = watch.report()
    assert report.forward_origin == "nested"
    fig = report.modules["nested"]
    assert fig.inf_count + fig.nan_count == 3  # one bad column x 3 rows, found three levels deep
    assert not report.backward_recorded and fig.grad_max_abs is None


def test_a_module_called_twice_in_a_step_is_merged():
    lin = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.relu(self.lin(x)))

    model = Twice()
    with ActivationWatch(model) as watch:
        for _ in range(2):
            _step(model, torch.randn(2, 4))
        report = watch.report()
    assert report.step == 1
    assert report.modules["lin"].calls == 2
    assert report.forward_order == ["lin", "<root>"]


def test_bad_arguments():
    model = MLP()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ActivationWatch("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every_n_steps must be an int"):
        ActivationWatch(model, every_n_steps=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every_n_steps must be an int"):
        ActivationWatch(model, every_n_steps=True)
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        ActivationWatch(model, every_n_steps=0)
    with pytest.raises(TypeError, match="backward must be a bool"):
        ActivationWatch(model, backward=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="modules must be None"):
        ActivationWatch(model, modules=["fc1"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="modules must be None"):
        ActivationWatch(model, modules=(nn.Linear, "fc1"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="selected no module"):
        ActivationWatch(model, modules=nn.Conv2d)
    assert ActivationWatch(model, modules=nn.Linear).module_names == ["<root>", "fc1", "fc2", "fc3"]
    assert ActivationWatch(model, modules=(nn.ReLU,)).module_names == ["<root>", "act"]
    by_path = ActivationWatch(model, modules=lambda path, m: path.startswith("fc"))
    assert by_path.module_names == ["<root>", "fc1", "fc2", "fc3"]


def test_in_place_modules_work_with_backward_and_leave_the_gradients_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2), nn.Dropout(0.0, inplace=True))
    x = torch.randn(3, 4)
    _step(model, x)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ActivationWatch(model) as watch:
        _step(model, x)
        report = watch.report()
    assert not report.nonfinite and report.backward_order == ["3", "2", "1", "0"]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
    # the ReLU's grad_output is the gradient of its result; its grad_input masks the negative pre-activations
    relu = report.modules["1"]
    assert relu.grad_max_abs is not None and relu.grad_max_abs > 0 and relu.grad_input_nonfinite == 0


def test_a_module_that_changes_its_input_in_place_and_returns_another_tensor_is_refused():
    class Clobber(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2.0)
            return x + 1.0  # the caller's x changed, but under an autograd history the watch cannot give it

    model = nn.Sequential(nn.Linear(4, 4), Clobber())
    with ActivationWatch(model) as watch, pytest.raises(RuntimeError, match=r"module 1 \(Clobber\).*backward=False"):
        _step(model, torch.randn(2, 4))
    with ActivationWatch(model, backward=False) as watch:
        _step(model, torch.randn(2, 4))
        assert not watch.report().nonfinite


# ------------------------------------------------------------------------------------------------- no host sync
def test_no_host_sync_in_any_hook(monkeypatch):
    torch.manual_seed(0)
    model = TinyTransformer()
    watch = ActivationWatch(model, modules=lambda path, m: path != "")
    x = torch.randint(0, 32, (2, 8))
    _step(model, x)  # warm: buffers exist

    names = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        # The pure-PyTorch fallback (TORCH_GRADSTATS_FORCE_FALLBACK=1) reads a CPU batch's range with tolist(): a
        # read of host memory, no device sync (docs/design.md). Anything else is a host read inside a hook.
        if t.device.type == "cpu" and os.path.abspath(sys._getframe(1).f_code.co_filename) in fallback_kernel_files():
            return saved["tolist"](t)
        raise AssertionError("host read inside a hook")

    for name in names:
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for _ in range(2):
        out = model(x)
        out.sum().backward()
    for name, fn in saved.items():
        monkeypatch.setattr(torch.Tensor, name, fn)
    report = watch.report()
    assert report.step == 2 and not report.nonfinite and report.backward_recorded
    assert len(report.modules) == len(watch.module_names)
    with pytest.raises(AssertionError, match="host read"):  # the patch did bite
        monkeypatch.setattr(torch.Tensor, "tolist", refuse)
        torch.ones(1).tolist()
    watch.remove()


def test_hooks_launch_no_copy_of_the_figures():
    """Each hook call is one op call: its outputs are kept as they are, no copy into other buffers."""
    from torch.profiler import ProfilerActivity, profile

    model = TinyTransformer()
    x = torch.randint(0, 32, (2, 8))

    def copies() -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, x)
        # (the pure-PyTorch fallback kernel copies inside the op itself: only copies of its results are counted)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::_foreach_copy_")

    plain = copies()
    with ActivationWatch(model, modules=lambda path, m: True) as watch:
        _step(model, x)
        watched = copies()
        assert len(watch._fwd) == len(watch.module_names)
    assert watched == plain == 0


# ------------------------------------------------------------------------------------------------- compile, wrappers
def test_torch_compile_around_the_watched_model_is_a_clear_error():
    model = MLP()
    watch = ActivationWatch(model)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(RuntimeError, match="cannot run inside a torch.compile'd region"):
        compiled(torch.randn(2, 8))
    watch.remove()
    with pytest.raises(ValueError, match="model is compiled"):
        ActivationWatch(compiled)


def test_a_compiled_submodule_is_watched_as_a_whole_from_outside():
    torch._dynamo.reset()
    model = MLP(Log())
    model.mid = torch.compile(model.mid, backend="eager")  # type: ignore[assignment]
    with torch.no_grad():
        model.fc1.weight[3].zero_()
        model.fc1.bias[3] = 0.0
    with ActivationWatch(model) as watch:
        assert watch.module_names == ["<root>", "fc1", "act", "mid", "fc2", "fc3"]  # no "_orig_mod"
        _step(model, torch.randn(4, 8))
        report = watch.report()
    assert report.forward_origin == "mid"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_wrapped_model_has_no_wrapper_prefix(gloo_group):
    torch.manual_seed(0)
    inner = MLP(Log())
    with torch.no_grad():
        inner.fc1.weight[3].zero_()
        inner.fc1.bias[3] = 0.0
    model = nn.parallel.DistributedDataParallel(inner)
    with ActivationWatch(model) as watch:
        assert watch.module_names == ["<root>", "fc1", "act", "mid", "fc2", "fc3"]
        _step(model, torch.randn(4, 8))
        report = watch.report()
    assert report.forward_origin == "mid" and report.step == 0
    assert report.backward_order == ["fc3", "fc2", "mid", "act", "fc1"]


def test_fsdp2_sharded_model_has_no_wrapper_prefix(gloo_group):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = MLP(Log())
    with torch.no_grad():
        model.fc1.weight[3].zero_()
        model.fc1.bias[3] = 0.0
    mesh = init_device_mesh("cpu", (1,))
    fsdp.fully_shard(model.fc2, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    with ActivationWatch(model) as watch:
        assert watch.module_names == ["<root>", "fc1", "act", "mid", "fc2", "fc3"]
        _step(model, torch.randn(4, 8))
        report = watch.report()
    assert report.forward_origin == "mid"
    assert report.forward_propagators == ["fc2", "fc3", "<root>"]


# ------------------------------------------------------------------------------------------------- the Trainer
def _trainer_data(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def test_trainer_warns_with_the_origin_at_the_epoch_end_sync(caplog):
    from torch_gradstats import Trainer

    torch.manual_seed(0)
    model = MLP(Log())
    with torch.no_grad():
        model.fc1.weight[3].zero_()
        model.fc1.bias[3] = 0.0
    # skip_nonfinite keeps the weights finite, so the last step still shows the producer, not a poisoned layer
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(model, opt, nn.MSELoss(), watch_activations=True, skip_nonfinite=True)
    assert isinstance(trainer.activation_watch, ActivationWatch)
    with caplog.at_level("WARNING", logger="torch_gradstats"):
        summary = trainer.train_epoch(_trainer_data())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "activations" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, at the epoch-end sync
    assert "forward origin mid" in warnings[0]
    assert f"first non-finite parameter gradient: {summary.first_nonfinite_param} at step 0" in warnings[0]
    assert summary.first_nonfinite_param is not None
    report = trainer.last_activation_report
    assert report is not None and report.step == 2 and report.forward_origin == "mid"
    trainer.activation_watch.remove()


def test_trainer_with_a_finite_model_keeps_the_report_and_does_not_warn(caplog):
    from torch_gradstats import Trainer

    model = MLP()
    watch = ActivationWatch(model, every_n_steps=2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), watch_activations=watch)
    assert trainer.activation_watch is watch
    with caplog.at_level("WARNING", logger="torch_gradstats"):
        trainer.train_epoch(_trainer_data())
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert trainer.last_activation_report is not None and trainer.last_activation_report.step == 2
    assert not trainer.last_activation_report.nonfinite
    watch.remove()


def test_trainer_watch_activations_arguments():
    from torch_gradstats import Trainer

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert Trainer(model, opt, nn.MSELoss(), watch_activations=False).activation_watch is None
    assert Trainer(model, opt, nn.MSELoss()).activation_watch is None
    with pytest.raises(TypeError, match="watch_activations must be an ActivationWatch, True, False or None, got str"):
        Trainer(model, opt, nn.MSELoss(), watch_activations="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="watch_activations needs compile=False"):
        Trainer(model, opt, nn.MSELoss(), watch_activations=True, compile=True)


def test_a_tensor_is_read_once_per_step_unless_changed_in_place():
    class Chain(nn.Module):
        def __init__(self, poke: bool) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.poke = poke

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if self.poke:
                h.mul_(math.inf)  # same memory, new values: b must read its input again
            return self.b(h)

    model = Chain(poke=False)
    with ActivationWatch(model, backward=False) as watch:
        model(torch.randn(2, 4))
        calls = {watch._names[c.index]: c for c in watch._fwd}
        assert calls["b"].refs[0] == calls["a"].refs[1]  # b's input is a's output, which a read first
        assert calls["a"].refs[0] == calls["<root>"].refs[0]  # a's input is the model's input
        assert calls["b"].refs[1][0].sumsq.numel() == 3  # b read its output, weight and bias only
        report = watch.report()
    assert report.modules["b"].input_max_abs == report.modules["a"].max_abs
    model.poke = True
    with ActivationWatch(model, backward=False) as watch:
        model(torch.randn(2, 4))
        report = watch.report()
    assert report.forward_origin == "<root>"  # the NaN was made between the modules, in the root's own code
    assert report.forward_first_nonfinite == "b" and report.modules["b"].input_nonfinite > 0


def test_a_contiguous_reshape_of_a_tensor_already_read_is_not_read_again():
    class Flatten(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h.view(-1, 4))  # same elements, another shape: the same figures

    model = Flatten()
    with ActivationWatch(model) as watch:
        _step(model, torch.randn(2, 3, 4))
        calls = {watch._names[c.index]: c for c in watch._fwd}
        assert calls["b"].refs[0] == calls["a"].refs[1]
        report = watch.report()
    assert report.modules["b"].input_max_abs == report.modules["a"].max_abs
    assert not report.nonfinite and report.modules["a"].grad_max_abs is not None


def test_module_outputs_are_handed_on_as_they_are_with_backward():
    class Keep(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.made = x * 2
            return self.made

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.keep = nn.Linear(4, 4), Keep()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.keep(self.fc(x))

    torch.manual_seed(0)
    model, x = Outer(), torch.randn(2, 4)
    plain = torch.autograd.grad(model(x).square().sum(), model.fc.weight)[0]
    with ActivationWatch(model) as watch:
        out = model(x)
        assert out is model.keep.made  # no alias in between: what the module made is what its caller gets
        (grad,) = torch.autograd.grad(out.square().sum(), model.fc.weight)
        report = watch.report()
    torch.testing.assert_close(grad, plain)
    assert report.modules["keep"].grad_max_abs == pytest.approx(2 * report.modules["keep"].max_abs)
    assert report.modules["keep"].grad_input_max_abs == pytest.approx(4 * report.modules["keep"].max_abs)


def _ours_or_a_tensor(obj: object) -> bool:
    """Whether a collected object is a real tensor or belongs to this library (its functions, their instances).
    Other garbage is not the step's: Dynamo's caches of earlier tests in the process can drop cyclic objects at
    any time (fake tensors, frame summaries)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(obj, torch.Tensor):
        return not isinstance(obj, FakeTensor)
    module = getattr(obj, "__module__", None) if callable(obj) else type(obj).__module__
    return isinstance(module, str) and module.startswith("torch_gradstats")


def test_a_watched_step_leaves_no_reference_cycle():
    """Activations are freed when the step lets go of them, not when Python's garbage collector runs."""
    import gc

    model, x = TinyTransformer(), torch.randint(0, 32, (2, 8))
    with ActivationWatch(model):
        _step(model, x)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            out = model(x)  # a forward whose graph is dropped without a backward
            del out
            _step(model, x)
            gc.collect()
            found = [type(o).__name__ for o in gc.garbage if _ours_or_a_tensor(o)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert found == []


def test_report_is_one_transfer(monkeypatch):
    from torch_gradstats.ops import _transfer

    calls = []
    real = _transfer.fetch

    def counting(buf: torch.Tensor, staging: object = None) -> torch.Tensor:
        calls.append(buf.numel())
        return real(buf, staging)  # type: ignore[arg-type]

    monkeypatch.setattr(_transfer, "fetch", counting)
    model = TinyTransformer()
    with ActivationWatch(model) as watch:
        _step(model, torch.randint(0, 32, (2, 8)))
        assert calls == []  # the step itself moved nothing
        report = watch.report()
    assert len(calls) == 1 and len(report.modules) == len(watch.module_names)


def test_the_root_itself_can_be_watched_with_every_n_steps():
    model = MLP(Log())
    with torch.no_grad():
        model.fc1.weight[3].zero_()
        model.fc1.bias[3] = 0.0
    with ActivationWatch(model, modules=lambda path, m: True, every_n_steps=2) as watch:
        for _ in range(3):
            _step(model, torch.randn(4, 8))
        report = watch.report()
    assert report.step == 2
    assert report.forward_origin == "mid"
    assert report.forward_propagators == ["fc2", "fc3", "<root>"]  # the root finishes last
    assert report.modules["<root>"].calls == 1 and report.backward_order[0] == "<root>"
    assert "act/<root>/max_abs" in report.to_dict(per_module=True)
    assert watch.module_names[0] == "<root>" and "" not in watch.module_names


# ------------------------------------------------------------------------------------------------- evaluation, steps
def _log_of_zero_model() -> MLP:
    torch.manual_seed(0)
    model = MLP(Log())
    with torch.no_grad():  # one unit of fc1 is always 0 after the ReLU: log(0) = -inf there
        model.fc1.weight[3].zero_()
        model.fc1.bias[3] = 0.0
    return model


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
def test_an_evaluation_forward_is_a_step_of_its_own_and_training_after_it_works(context):
    model = _log_of_zero_model()
    with ActivationWatch(model) as watch:
        with context():
            model(torch.randn(4, 8))
        evaluation = watch.report()
        _step(model, torch.randn(4, 8))
        training = watch.report()
    assert evaluation.step == 0 and evaluation.forward_origin == "mid" and not evaluation.backward_recorded
    assert evaluation.modules["fc3"].grad_max_abs is None
    assert training.step == 1 and training.forward_origin == "mid" and training.backward_recorded
    assert training.modules["fc3"].grad_max_abs == pytest.approx(1.0)


def test_the_backward_of_a_step_after_another_forward_is_dropped_with_a_warning(caplog):
    model = MLP()
    with ActivationWatch(model) as watch:
        out = model(torch.randn(2, 8))
        with torch.no_grad():
            model(torch.randn(2, 8))  # a step of its own
        with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
            out.sum().backward()
        report = watch.report()
    assert report.step == 1 and not report.backward_recorded
    said = [r for r in caplog.records if r.name.startswith("torch_gradstats")]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "backward of step 0" in said[0].getMessage()


def test_the_watch_raises_no_python_warning():
    """The first layer's inputs need no gradient: PyTorch's full backward hooks warned there, the watch does not."""
    model = MLP()
    with ActivationWatch(model) as watch, warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, torch.randn(2, 8))
        assert watch.report().modules["fc1"].grad_max_abs is not None


def test_a_removed_watch_entered_again_puts_its_hooks_back_and_counts_on():
    model = _log_of_zero_model()
    watch = ActivationWatch(model)
    with watch:
        _step(model, torch.randn(4, 8))
    _step(model, torch.randn(4, 8))  # removed: not counted
    with watch:
        assert model.fc1._forward_pre_hooks
        _step(model, torch.randn(4, 8))
        report = watch.report()
    assert watch.step == 1 and report.step == 1 and report.forward_origin == "mid" and report.backward_recorded


def test_a_step_is_counted_when_the_roots_forward_is_not_called():
    class Holder(nn.Module):  # like a LightningModule whose training_step calls self.net(x)
        def __init__(self) -> None:
            super().__init__()
            self.net = _log_of_zero_model()

    holder = Holder()
    with ActivationWatch(holder) as watch:
        assert watch.report().summary() == "no forward recorded yet"
        for _ in range(3):
            _step(holder.net, torch.randn(4, 8))
        report = watch.report()
    assert watch.step == 2 and report.step == 2
    assert report.forward_origin == "net.mid" and report.modules["net.fc1"].calls == 1


# ---------------------------------------------------------------------------------------------- in place, complex, root
def test_an_input_changed_in_place_is_read_before_the_module_runs():
    class Blowup(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(1e38)  # finite in, inf out, in the input's own memory

    for backward in (False, True):
        model = nn.Sequential(nn.Linear(4, 4), Blowup(), nn.Linear(4, 2))
        with ActivationWatch(model, backward=backward) as watch:
            out = model(torch.randn(3, 4) * 10)
            if backward:
                out.sum().backward()
            report = watch.report()
        assert report.forward_origin == "1", (backward, report.summary())
        assert math.isfinite(report.input_max_abs) and report.modules["1"].input_nonfinite == 0


def test_complex_activations_are_read():
    class ToComplex(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.complex(x, 2 * x)

    class Bad(nn.Module):
        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return z * torch.complex(torch.ones(()), torch.full((), math.inf))  # inf in the imaginary parts

    class Abs(nn.Module):
        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return z.abs()

    model = nn.Sequential(nn.Linear(4, 4), ToComplex(), Bad(), Abs(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with ActivationWatch(model, backward=False) as watch:
        model(x)
        report = watch.report()
    assert report.forward_origin == "2", report.summary()  # not the consumer Abs
    assert report.forward_propagators[:2] == ["3", "4"]
    z = torch.complex(model[0](x), 2 * model[0](x)).detach()
    assert report.modules["1"].max_abs == pytest.approx(z.abs().max().item(), rel=1e-6)
    assert report.modules["1"].norm == pytest.approx(z.abs().square().sum().sqrt().item(), rel=1e-5)
    assert report.modules["2"].nan_count + report.modules["2"].inf_count > 0


def test_a_nan_made_in_the_roots_own_forward_names_the_root():
    class WithLoss(nn.Module):  # computes its loss inside forward, as Hugging Face models do
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.fc(x) - 100.0).mean()  # log of a negative number: NaN

    model = WithLoss()
    with ActivationWatch(model) as watch:
        model(torch.randn(2, 4)).backward()
        report = watch.report()
    assert report.forward_origin == "<root>" and report.origin == "<root>"
    assert report.modules["<root>"].nan_count == 1 and report.modules["fc"].nan_count == 0
    assert "forward origin <root>" in report.summary()
    assert report.to_dict(per_module=True)["act/<root>/max_abs"] != report.to_dict(per_module=True)["act/fc/max_abs"]


def test_a_backward_nan_from_outside_the_watched_modules_names_no_consumer():
    class Normalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            h = h / (h.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)  # the root's own code: sqrt'(0) = inf
            return self.fc2(h)

    model = Normalized()
    with torch.no_grad():
        model.fc1.weight.zero_()
        model.fc1.bias.zero_()  # fc1 outputs zeros: the division's backward is 0 * inf
    with ActivationWatch(model) as watch:
        model(torch.randn(2, 4)).sum().backward()
        report = watch.report()
    assert report.nonfinite and report.forward_first_nonfinite is None
    assert report.backward_origin is None and report.origin is None  # fc1 only received it
    assert report.backward_first_nonfinite == "fc1"
    summary = report.summary()
    assert "first non-finite gradient in the backward of fc1, which received it" in summary
    assert "outside the watched modules" in summary


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_device_outputs_are_read_after_their_copy_lands():
    class ToHost(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:1, :1].cpu() * 0.0 + 1.0  # a small CPU output of a large CUDA input

    class Big(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = torch.full_like(x, 1.0 / x.shape[0])
            for _ in range(30):  # keep the stream busy so that the result lands late; every value stays 1
                x = x @ w
            return x

    model = nn.Sequential(Big(), ToHost())
    x = torch.ones(4096, 4096, device="cuda")
    with ActivationWatch(model, backward=False) as watch:
        for _ in range(3):
            model(x)
            report = watch.report()
            assert report.modules["1"].input_max_abs == pytest.approx(1.0, rel=1e-4)
            assert report.modules["1"].max_abs == 1.0


def test_a_deep_copy_of_the_model_is_not_watched_but_a_replica_is():
    """copy.deepcopy of a watched model (an EMA or teacher copy) carries the hooks: its forwards were counted as the
    watched model's steps, so a NaN in the copy's evaluation was reported as the model's incident (and the model's
    backward warned as late). DataParallel's replicas stay the model's own."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    watch = ActivationWatch(model)
    ema = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the backward of step 0 ran after step 1 began"
        out = model(torch.randn(6, 4))
        with torch.no_grad():
            ema(torch.full((3, 4), math.nan))
        out.pow(2).mean().backward()
    report = watch.report()
    assert report.step == 0 and not report.nonfinite and not report.inputs_nonfinite
    replica = model._replicate_for_data_parallel()  # what nn.DataParallel runs on each device, hooks shared
    replica(torch.full((3, 4), math.nan))
    report = watch.report()
    assert report.step == 1 and report.inputs_nonfinite
    watch.remove()
