"""PerExampleNorms against float64 torch.func references (vmap of grad, one example at a time), layer by layer, on
sequences, tied embeddings and micro-batches, with both loss reductions; against Opacus where it is installed."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from torch_gradstats.monitors.per_example import PerExampleNorms

RTOL = 1e-4
Loss = Callable[[Tensor, Tensor], Tensor]


def example_loss(out: Tensor, target: Tensor) -> Tensor:
    """One example's loss (the mean over its elements), nonlinear in the output."""
    return (out.tanh() - target).square().mean()


def batch_loss(out: Tensor, target: Tensor, reduction: str, bd: int = 0) -> Tensor:
    per = torch.stack([example_loss(o, t) for o, t in zip(out.unbind(bd), target.unbind(bd))])
    return per.mean() if reduction == "mean" else per.sum()


def reference(model: nn.Module, x: Tensor, target: Tensor, bd: int = 0, loss: Loss = example_loss) -> Tensor:
    """Each example's gradient norm in float64: vmap over the batch of grad of that example's own loss."""
    m64 = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in m64.named_parameters() if v.requires_grad}
    x = x.double() if x.is_floating_point() else x

    def one(p: dict[str, Tensor], xi: Tensor, ti: Tensor) -> Tensor:
        out = functional_call(m64, p, (xi.unsqueeze(bd),)).squeeze(bd)
        return loss(out, ti)

    grads = vmap(grad(one), in_dims=(None, bd, bd))(params, x, target.double())
    return torch.stack([g.reshape(g.shape[0], -1).square().sum(1) for g in grads.values()]).sum(0).sqrt()


def run(model: nn.Module, x: Tensor, target: Tensor, reduction: str = "mean", bd: int = 0,
        **kwargs: int) -> PerExampleNorms:
    with PerExampleNorms(model, loss_reduction=reduction, batch_dim=bd, **kwargs) as pe:
        batch_loss(model(x), target, reduction, bd).backward()
    return pe


def check(model: nn.Module, x: Tensor, reduction: str, bd: int = 0, **kwargs: int) -> PerExampleNorms:
    torch.manual_seed(1)
    with torch.no_grad():
        out = model(x)
    target = torch.randn_like(out) * 0.5
    pe = run(model, x, target, reduction, bd, **kwargs)
    ref = reference(model, x, target, bd)
    got = pe.norms()
    assert got.dtype == torch.float32 and got.shape == (x.shape[0 if bd == 0 else bd],)
    torch.testing.assert_close(got.double(), ref, rtol=RTOL, atol=0.0)
    return pe


class Scale(nn.Module):
    """A module with a parameter of its own and no closed form: torch.func computes its per-example gradients."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w + torch.sin(x * self.w.square())


class SelfAttention(nn.Module):
    """MultiheadAttention (its out_proj's parameters used without calling out_proj), with a per-example padding mask
    given as a keyword."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        last = x[:, -1:, 0] > 0  # some examples ignore their last position
        pad = torch.cat([torch.zeros(x.shape[0], x.shape[1] - 1, dtype=torch.bool), last], dim=1)
        return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def layer_cases() -> dict[str, tuple[Callable[[], nn.Module], Callable[[int], Tensor]]]:
    ints = lambda v, *s: (lambda n: torch.randint(0, v, (n, *s)))  # noqa: E731
    rand = lambda *s: (lambda n: torch.randn(n, *s))  # noqa: E731
    return {
        "linear": (lambda: nn.Linear(7, 5), rand(7)),
        "linear_sequence": (lambda: nn.Linear(6, 4), rand(9, 6)),
        "linear_4d": (lambda: nn.Linear(3, 4), rand(2, 5, 3)),
        "linear_gram_form": (lambda: nn.Linear(64, 48), rand(3, 64)),  # few positions: the Gram form
        "linear_materialized": (lambda: nn.Linear(3, 2), rand(40, 3)),  # many positions: made in full
        "linear_no_bias": (lambda: nn.Linear(6, 3, bias=False), rand(4, 6)),
        "embedding_padding_repeats": (lambda: nn.Embedding(10, 4, padding_idx=0), ints(10, 12)),
        "embedding_large_vocabulary": (lambda: nn.Embedding(1000, 8), ints(7, 6)),
        "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), rand(3, 11)),
        "conv1d_groups_circular": (
            lambda: nn.Conv1d(4, 6, 3, dilation=2, groups=2, padding=2, padding_mode="circular"), rand(4, 9)),
        "conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), rand(3, 6, 6)),
        "conv2d_same_groups": (lambda: nn.Conv2d(4, 6, (2, 3), padding="same", groups=2), rand(4, 5, 6)),
        "conv2d_reflect_stride": (lambda: nn.Conv2d(2, 3, 3, stride=(2, 1), padding=1, padding_mode="reflect"),
                                  rand(2, 7, 5)),
        "conv2d_large_kernel": (lambda: nn.Conv2d(8, 8, 5, bias=False), rand(8, 6, 6)),
        "layernorm_sequence": (lambda: nn.LayerNorm(6), rand(3, 6)),
        "layernorm_2d_shape": (lambda: nn.LayerNorm((4, 5)), rand(4, 5)),
        "layernorm_no_bias": (lambda: nn.LayerNorm(6, bias=False), rand(2, 6)),
        "groupnorm": (lambda: nn.GroupNorm(2, 4), rand(4, 5)),
        "groupnorm_2d": (lambda: nn.GroupNorm(3, 6), rand(6, 3, 3)),
        "rmsnorm": (lambda: nn.RMSNorm(6), rand(3, 6)),
        "rmsnorm_eps": (lambda: nn.RMSNorm((2, 3), eps=1e-3), rand(2, 3)),
        "own_parameter_torch_func": (lambda: Scale(5), rand(3, 5)),
        "multihead_attention": (lambda: SelfAttention(8), rand(4, 8)),
        "conv3d_torch_func": (lambda: nn.Conv3d(2, 3, 2), rand(2, 3, 3, 3)),
        "conv_transpose_torch_func": (lambda: nn.ConvTranspose2d(2, 3, 3, stride=2), rand(2, 4, 4)),
        "prelu_torch_func": (lambda: nn.PReLU(3), rand(3, 4)),
        "batchnorm_eval": (lambda: nn.BatchNorm1d(4).eval(), rand(4, 3)),
    }


CASES = layer_cases()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_float64_reference(case: str, reduction: str) -> None:
    torch.manual_seed(0)
    make, data = CASES[case]
    layer = make()
    model = nn.Sequential(layer, nn.Identity())  # the layer inside a model, named "0"
    if case == "batchnorm_eval":  # non-trivial running statistics
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    if isinstance(layer, nn.RMSNorm | nn.LayerNorm | nn.GroupNorm | nn.BatchNorm1d) and layer.weight is not None:
        with torch.no_grad():  # away from the initial ones and zeros
            for p in layer.parameters():
                p.normal_()
    pe = check(model, data(5), reduction)
    assert set(pe.per_parameter()) == {n for n, p in model.named_parameters()}


def test_reductions_give_the_same_norms() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, t = torch.randn(6, 4), torch.randn(6, 3)
    mean, total = run(model, x, t, "mean").norms(), run(model, x, t, "sum").norms()
    torch.testing.assert_close(mean, total, rtol=1e-5, atol=0.0)


class TinyLM(nn.Module):
    """Token and position embeddings, a pre-norm attention block with separate q/k/v projections, an MLP, and a
    head, optionally tied to the token embedding."""

    def __init__(self, vocab: int = 23, d: int = 16, tied: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=bias) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.shape
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device).expand(b, t))
        a = self.ln1(h)
        q, k, v = (f(a).reshape(b, t, 2, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        h = h + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.head(self.ln_f(h))


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def lm_reference(model: nn.Module, idx: Tensor, target: Tensor) -> Tensor:
    return reference(model, idx, target.double(), loss=lambda out, t: lm_loss(out, t.long()))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sequence_model(tied: bool, reduction: str) -> None:
    torch.manual_seed(0)
    model = TinyLM(d=48, tied=tied)  # wide enough for the Gram form, shared by the q, k and v projections
    idx, target = torch.randint(0, 23, (4, 12)), torch.randint(0, 23, (4, 12))
    with PerExampleNorms(model, loss_reduction=reduction) as pe:
        loss = lm_loss(model(idx), target)  # the mean over every token: the mean of the examples' own means
        (loss if reduction == "mean" else loss * idx.shape[0]).backward()
    torch.testing.assert_close(pe.norms().double(), lm_reference(model, idx, target), rtol=RTOL, atol=0.0)
    names = set(pe.per_parameter())
    assert names == {n for n, _ in model.named_parameters()}
    assert ("head.weight" in names) == (not tied)  # the tied weight is reported once, under its first name


@pytest.mark.parametrize("limit", [1, 300], ids=["one_example_per_slice", "slices"])
def test_small_max_materialize_stays_exact(limit: int) -> None:
    """Gram matrices are made a slice of the batch at a time; the result does not change."""
    torch.manual_seed(0)
    model = TinyLM()
    idx, target = torch.randint(0, 23, (5, 10)), torch.randint(0, 23, (5, 10))
    with PerExampleNorms(model, max_materialize=limit) as pe:
        lm_loss(model(idx), target).backward()
    torch.testing.assert_close(pe.norms().double(), lm_reference(model, idx, target), rtol=RTOL, atol=0.0)


def test_tied_weight_past_max_materialize_is_named() -> None:
    torch.manual_seed(0)
    model = TinyLM(tied=True)
    idx = torch.randint(0, 23, (4, 12))
    pe = PerExampleNorms(model, max_materialize=100)  # one example's Gram (12 x 12) and the gradients are larger
    with pytest.raises(RuntimeError, match=r"'tok\.weight'.*max_materialize"):
        lm_loss(model(idx), idx).backward()
    pe.remove()


def test_tied_embedding_used_as_linear_and_twice_as_embedding() -> None:
    """Three uses of one weight: two lookups and a head; every cross term counts."""
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(9, 6), nn.Linear(6, 9)
            self.head.weight = self.emb.weight

        def forward(self, idx: Tensor) -> Tensor:
            return self.head(torch.tanh(self.emb(idx) + self.emb(idx.flip(1))))

    model = Twice()
    idx, target = torch.randint(0, 9, (3, 7)), torch.randint(0, 9, (3, 7))
    with PerExampleNorms(model) as pe:
        lm_loss(model(idx), target).backward()
    torch.testing.assert_close(pe.norms().double(), lm_reference(model, idx, target), rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_cover_every_example_in_order(reduction: str) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    idx, target = torch.randint(0, 23, (7, 9)), torch.randint(0, 23, (7, 9))
    with PerExampleNorms(model, loss_reduction=reduction) as pe:
        for part in (slice(0, 3), slice(3, 4), slice(4, 7)):  # each backward's loss over its own examples
            loss = lm_loss(model(idx[part]), target[part])
            (loss if reduction == "mean" else loss * (part.stop - part.start)).backward()
    assert pe.num_examples == 7
    torch.testing.assert_close(pe.norms().double(), lm_reference(model, idx, target), rtol=RTOL, atol=0.0)
    assert all(v.shape == (7,) for v in pe.per_parameter().values())
    pe.reset()
    assert pe.norms().shape == (0,) and pe.num_examples == 0


def test_reset_starts_a_new_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x, t = torch.randn(6, 4), torch.randn(6, 3)
    pe = PerExampleNorms(model)
    batch_loss(model(x[:2]), t[:2], "mean").backward()
    pe.reset()
    batch_loss(model(x[2:]), t[2:], "mean").backward()
    torch.testing.assert_close(pe.norms().double(), reference(model, x[2:], t[2:]), rtol=RTOL, atol=0.0)
    pe.remove()
    batch_loss(model(x), t, "mean").backward()  # no hooks any more: nothing recorded
    assert pe.num_examples == 4


def test_sequence_first_batch_dim() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    idx = torch.randint(0, 11, (8, 4))  # [T, B]
    target = torch.randn(8, 4, 3)
    pe = run(model, idx, target, "mean", bd=1)
    torch.testing.assert_close(pe.norms().double(), reference(model, idx, target, bd=1), rtol=RTOL, atol=0.0)


def test_frozen_parameters_are_left_out() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].weight.requires_grad_(False)
    x, t = torch.randn(4, 4), torch.randn(4, 3)
    pe = run(model, x, t)
    assert list(pe.per_parameter()) == ["0.bias", "2.weight", "2.bias"]
    torch.testing.assert_close(pe.norms().double(), reference(model, x, t), rtol=RTOL, atol=0.0)


def test_corrupted_example_is_top_1() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    x, labels = torch.randn(16, 10), torch.randint(0, 4, (16,))
    target = F.one_hot(labels, 4).float()
    target[11] *= 1000.0  # one corrupted target
    with PerExampleNorms(model) as pe:
        F.mse_loss(model(x), target).backward()
    indices, norms = pe.top(3)
    assert indices[0].item() == 11
    assert norms[0] > 100 * norms[1]
    assert torch.equal(norms, pe.norms().sort(descending=True).values[:3])


def test_no_host_read() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = TinyLM(tied=True)
    idx = torch.randint(0, 23, (3, 6))
    pe = PerExampleNorms(model)
    with Reads():
        lm_loss(model(idx), idx).backward()
        pe.norms(), pe.per_parameter(), pe.top(2)
    assert Reads.count == 0


def test_refusals_name_the_module() -> None:
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\)"):
        PerExampleNorms(bn)
    no_stats = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False).eval())
    with pytest.raises(ValueError, match=r"'0' \(BatchNorm1d\)"):
        PerExampleNorms(no_stats)
    with pytest.raises(TypeError, match=r"'0' \(LSTM\).*torch.func"):
        PerExampleNorms(nn.Sequential(nn.LSTM(3, 4)))
    with pytest.raises(ValueError, match=r"'0' \(Embedding\).*scale_grad_by_freq"):
        PerExampleNorms(nn.Sequential(nn.Embedding(5, 2, scale_grad_by_freq=True)))
    for bad in ({"loss_reduction": "none"}, {"batch_dim": -1}, {"max_materialize": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PerExampleNorms(nn.Linear(2, 2), **bad)  # type: ignore[arg-type]


def test_batchnorm_put_in_training_mode_later_is_refused_at_the_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    pe = PerExampleNorms(model)
    model.train()
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\)"):
        model(torch.randn(5, 3))
    pe.remove()


def test_parameter_used_outside_its_module_is_named() -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x) @ self.b.weight.T  # b's weight without calling b

    model = Reuse()
    pe = PerExampleNorms(model)
    with pytest.raises(RuntimeError, match=r"'b\.weight' received a gradient outside"):
        model(torch.randn(4, 3)).square().sum().backward()
    pe.remove()


def test_top_checks_k() -> None:
    model = nn.Linear(3, 2)
    pe = run(model, torch.randn(4, 3), torch.randn(4, 2))
    assert pe.top(4)[0].shape == (4,)
    with pytest.raises(ValueError, match="k must be an int from 0 to the 4 examples"):
        pe.top(5)


@pytest.mark.skipif(importlib.util.find_spec("opacus") is None, reason="opacus is not installed")
def test_matches_opacus() -> None:
    from opacus.grad_sample import GradSampleModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    idx, target = torch.randint(0, 30, (6, 7)), torch.randint(0, 5, (6, 7))
    gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="mean")
    F.cross_entropy(gsm(idx).reshape(-1, 5), target.reshape(-1)).backward()
    samples = [p.grad_sample.reshape(6, -1) for p in gsm.parameters()]
    opacus = torch.cat(samples, 1).norm(dim=1)
    with PerExampleNorms(model) as pe:
        F.cross_entropy(model(idx).reshape(-1, 5), target.reshape(-1)).backward()
    torch.testing.assert_close(pe.norms(), opacus, rtol=RTOL, atol=0.0)


@pytest.mark.slow
def test_bench_script_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/bench_per_example.py end to end on a small transformer (the memory is measured in child processes at
    the full size)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_per_example.py"
    spec = importlib.util.spec_from_file_location("_bench_per_example", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, value in (("SEQ", 8), ("BATCH", 4), ("LAYERS", 1), ("D_MODEL", 32), ("HEADS", 2)):
        monkeypatch.setattr(bench, name, value)
    out = tmp_path / "result.md"
    assert bench.main(["--rounds", "1", "--steps", "1", "--only", "plain", "PerExampleNorms", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| plain |" in text and "| PerExampleNorms |" in text and "did not run" not in text


def test_an_evaluation_under_inference_mode_records_nothing_and_training_goes_on() -> None:
    """A real architecture (the model zoo's TransformerEncoder): a forward under ``inference_mode`` inside the
    object's life neither fails nor enters the next step's norms, which equal those of a run without it."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from model_zoo import CheckpointedEncoder

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 5, 8, generator=g), torch.randn(6, 5, 4, generator=g)

    def norms(evaluate_first: bool) -> Tensor:
        model = CheckpointedEncoder(use_reentrant=False, checkpointed=False)
        with PerExampleNorms(model) as pe:
            if evaluate_first:
                model.eval()
                with torch.inference_mode():
                    assert model(x).shape == (6, 5, 4)
                model.train()
            F.mse_loss(model(x), y).backward()
            return pe.norms()

    plain, after_eval = norms(False), norms(True)
    assert plain.shape == (6,) and bool(torch.isfinite(plain).all()) and bool((plain > 0).all())
    torch.testing.assert_close(after_eval, plain, rtol=1e-6, atol=0)


def test_a_compiled_model_is_read_as_the_module_it_wraps() -> None:
    """``PerExampleNorms(torch.compile(net))``: the parameters keep ``net``'s names (no ``_orig_mod.``, so they
    match ``grad_stats(net.named_parameters())``), the norms are exact, and ``copy.deepcopy(net)`` (an EMA copy)
    still works; before, the object held the compiled wrapper, whose copy is rebuilt from a half-made ``net``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    x, target = torch.randn(8, 6), torch.randn(8, 3)
    compiled = torch.compile(net, backend="eager")
    with PerExampleNorms(compiled) as pe:
        batch_loss(compiled(x), target, "mean").backward()
        ema = copy.deepcopy(net)
    assert list(pe.per_parameter()) == [n for n, _ in net.named_parameters()]
    torch.testing.assert_close(pe.norms().double(), reference(net, x, target), rtol=RTOL, atol=0.0)
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), net.parameters()))


def test_a_model_compiled_and_run_before_it_was_hooked_is_named_as_the_cause() -> None:
    """Dynamo does not guard on hooks added after it compiled: a graph compiled and run before ``PerExampleNorms``
    was made replays without the hooks, so no layer's call is seen. The error said a parameter was used outside its
    module; it now names the compiled graph and the remedy, which gives exact norms."""
    torch._dynamo.reset()  # this test's graph alone: none compiled by another test for the same code
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    compiled = torch.compile(net, backend="eager")
    x, target = torch.randn(8, 6), torch.randn(8, 3)
    batch_loss(compiled(x), target, "mean").backward()  # compiled and run, no hooks yet
    net.zero_grad()
    with PerExampleNorms(compiled) as pe:
        with pytest.raises(RuntimeError, match=r"no hooked module's forward ran .* torch\._dynamo\.reset\(\)"):
            batch_loss(compiled(x), target, "mean").backward()
        net.zero_grad()
        torch._dynamo.reset()
        batch_loss(compiled(x), target, "mean").backward()
    torch.testing.assert_close(pe.norms().double(), reference(net, x, target), rtol=RTOL, atol=0.0)
