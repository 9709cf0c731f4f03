"""Per-example norms and flight recorders of the training callbacks on real models, against references computed here:
each example's float64 gradient norm over the stepping optimizer's parameters (one backward per example, on a float64
copy of the networks at that step), and float64 norms of the gradients each optimizer step reads.

The GAN (manual optimization, two optimizers) is varied the ways people write one: with and without
``toggle_optimizer``, ``zero_grad(set_to_none=False)``, gradient accumulation, one Linear split between the two
optimizers, a module shared by both networks, weight tying, attention and checkpointed encoder layers in the
discriminator, two param groups, validation between steps, bf16-mixed, a second fit and a resume; BatchNorm (whose
examples have no gradient of their own), a reentrant checkpoint called twice and a gradient penalty must be refused by
name. Then the one-optimizer paths (the Lightning and Hugging Face callbacks, tg.Trainer) on the zoo's GPT-2 (loss
inside forward) and ResNet (BatchNorm: refused; flight recorder rows)."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from model_zoo import CheckpointedEncoder
from torch import nn

from torch_gradstats import PerExampleNorms

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from test_integrations_lightning_optimizers_incidents import _read, _rows  # noqa: E402

from torch_gradstats.integrations.lightning import GradStatsCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("generator", "discriminator")
B = 8
bce = nn.functional.binary_cross_entropy_with_logits


def example_norms(nets: nn.Module, names: list[str], loss_of: Any, n: int) -> list[float]:
    """Each example's own gradient norm over the parameters ``names`` of ``nets``: one float64 backward per example
    (``loss_of(copy, i)`` is example i's loss)."""
    ref = copy.deepcopy(nets).double()
    params = dict(ref.named_parameters())
    out = []
    for i in range(n):
        ref.zero_grad(set_to_none=True)
        loss_of(ref, i).backward()
        out.append(math.sqrt(sum(float(params[k].grad.pow(2).sum()) for k in names if params[k].grad is not None)))
    return out


class GAN(L.LightningModule):
    """A generator and a discriminator in manual optimization; ``variant`` changes how the networks and optimizers
    are put together. Before each backward it records, per optimizer, the reference per-example norms of the
    examples that backward adds to that optimizer's next step."""

    def __init__(self, variant: str = "plain", toggle: bool = False, set_to_none: bool = True,
                 accumulate: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.variant, self.toggle, self.set_to_none, self.accumulate = variant, toggle, set_to_none, accumulate
        n = nn.ModuleDict()
        n["g"] = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        n["d"] = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        if variant == "tied":  # the generator's two layers share one weight
            n["g"] = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 6))
            n["g"][2].weight = n["g"][0].weight
        if variant in ("split", "shared", "unheld"):  # in front of the discriminator (and after the generator)
            n["x"] = nn.Linear(6, 6)
        if variant == "attention":
            n["d"] = nn.ModuleDict({"a": nn.Linear(6, 8), "h": nn.Linear(8, 1),
                                    "enc": nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)})
        if variant in ("checkpointed", "reentrant"):
            n["d"] = nn.ModuleDict({"a": nn.Linear(6, 8), "h": nn.Linear(4, 1),
                                    "enc": CheckpointedEncoder(use_reentrant=variant == "reentrant")})
        if variant == "conv":  # the 6 features as a 2 x 3 image
            n["d"] = nn.Sequential(nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 4, 2), nn.GroupNorm(2, 4),
                                   nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8, 1))
        if variant == "batchnorm":
            n["d"] = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, affine=False), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        self.nets = n
        self.refs: dict[tuple[int, str], list[float]] = {}
        self.losses: dict[tuple[int, str], float] = {}  # the losses given to manual_backward for each step

    def G(self, n: nn.Module, z: torch.Tensor) -> torch.Tensor:
        out = n["g"](z.to(next(n.parameters()).dtype))
        if self.variant == "shared":
            out = n["x"](out)
        if self.variant in ("attention", "checkpointed", "reentrant"):  # a sequence of 3 positions
            out = out.unsqueeze(1) * torch.arange(1, 4, dtype=out.dtype).reshape(1, 3, 1)
        return out

    def D(self, n: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.to(next(n.parameters()).dtype)
        if self.variant in ("split", "shared", "unheld"):
            x = n["x"](x)
        if self.variant == "attention":
            return n["d"]["h"](n["d"]["enc"](n["d"]["a"](x)).mean(1))
        if self.variant in ("checkpointed", "reentrant"):
            return n["d"]["h"](n["d"]["enc"](n["d"]["a"](x)).mean(1))
        return n["d"](x)

    def held(self, opt: Any) -> list[str]:
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        return [k for k, p in self.nets.named_parameters() if id(p) in ids]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        if self.variant in ("attention", "checkpointed", "reentrant"):
            real = real.unsqueeze(1) + 0.1 * torch.arange(3.0).reshape(1, 3, 1)
        g_opt, d_opt = self.optimizers()
        gen = torch.Generator().manual_seed(batch_idx)
        zs = [torch.randn(B, 4, generator=gen) for _ in range(2 if self.accumulate else 1)]
        ones, zeros = torch.ones(B, 1), torch.zeros(B, 1)
        n = self.nets
        if self.toggle:
            self.toggle_optimizer(g_opt)
        g_opt.zero_grad(set_to_none=self.set_to_none)
        ref: list[float] = []
        self.losses[(batch_idx, "generator")] = 0.0
        for z in zs:  # accumulate: two backwards, one step
            ref += example_norms(n, self.held(g_opt), lambda m, i, z=z: bce(self.D(m, self.G(m, z[i:i + 1])),
                                                                            ones[:1].double()), B)
            fake = self.G(n, z)
            g_loss = bce(self.D(n, fake), ones)
            self.losses[(batch_idx, "generator")] += float(g_loss)
            self.manual_backward(g_loss)
        self.refs[(batch_idx, "generator")] = ref
        g_opt.step()
        if self.toggle:
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
        fake = fake.detach()
        d_opt.zero_grad(set_to_none=self.set_to_none)
        self.refs[(batch_idx, "discriminator")] = example_norms(
            n, self.held(d_opt), lambda m, i: (bce(self.D(m, real[i:i + 1]), ones[:1].double())
                                               + bce(self.D(m, fake[i:i + 1]), zeros[:1].double())) / 2, B)
        d_loss = (bce(self.D(n, real), ones) + bce(self.D(n, fake), zeros)) / 2
        self.losses[(batch_idx, "discriminator")] = float(d_loss)
        self.manual_backward(d_loss)
        d_opt.step()
        if self.toggle:
            self.untoggle_optimizer(d_opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        n = self.nets
        gp, dp = list(n["g"].parameters()), list(n["d"].parameters())
        if self.variant == "split":  # one Linear: its weight the generator's, its bias the discriminator's
            gp.append(n["x"].weight)
            dp.append(n["x"].bias)
        if self.variant == "shared":  # after the generator and in front of the discriminator, trained by G
            gp += list(n["x"].parameters())
        if self.variant == "unheld-bias":  # trained by no optimizer, its gradient still made
            dp = [p for p in dp if p is not n["d"][0].bias]
        if self.variant == "groups":
            return [torch.optim.SGD([{"params": gp[:2]}, {"params": gp[2:], "lr": 0.001}], lr=0.01),
                    torch.optim.SGD(dp, lr=0.005)]
        return [torch.optim.SGD(gp, lr=0.01), torch.optim.SGD(dp, lr=0.005)]


class StepNorms(L.Callback):
    """Before our callback: float64 norms of the stepping optimizer's gradients, by (batch, optimizer name)."""

    def __init__(self) -> None:
        self.norms: dict[tuple[int, str], float] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        which = NAMES[0] if optimizer is trainer.optimizers[0] else NAMES[1]
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
        grads = [p.grad.double() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.norms[(batch, which)] = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))


def _data(batches: int = 3) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(batches * B, 6, generator=g) + 2.0),
                                       batch_size=B)


def _fit(tmp_path: Path, module: Any, callbacks: list, **kw: Any) -> Any:
    kw.setdefault("max_epochs", 1)
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, logger=CSVLogger(str(tmp_path)),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data())
    return trainer


def _check_examples(trainer: Any, module: GAN, batches: int = 3) -> None:
    """Each batch's logged ``examples/<name>/max_norm`` and ``median_norm`` against the references (the median of an
    even count is the lower middle one, as torch's)."""
    rows = _rows(trainer)
    for batch in range(batches):
        for name in NAMES:
            ref = torch.tensor(module.refs[(batch, name)], dtype=torch.float64)
            got = rows[batch]
            assert got[f"examples/{name}/max_norm"] == pytest.approx(float(ref.max()), rel=1e-4), (batch, name)
            assert got[f"examples/{name}/median_norm"] == pytest.approx(float(ref.median()), rel=1e-4), (batch, name)


def _check_dumps(tmp_path: Path, cb: Any, norms: StepNorms, module: GAN, batches: int = 3) -> None:
    """Each optimizer's flight recorder, dumped now: one row per step of its own, at Lightning's global step, with
    the float64 norm of its own gradients and the sum of the losses given to manual_backward for it."""
    for index, name in enumerate(NAMES):
        rows = _read(cb.flight_recorders[name].dump(tmp_path / f"{name}.jsonl"))
        assert [r["step"] for r in rows] == [2 * b + index for b in range(batches)], name
        for batch, r in enumerate(rows):
            assert r["total_norm"] == pytest.approx(norms.norms[(batch, name)], rel=1e-5), (name, batch)
            assert r["loss"] == pytest.approx(module.losses[(batch, name)], rel=1e-5), (name, batch)


# Every variant's dumps had no loss (a flight recorder without a spike guard recorded none); these variants' per-example
# norms were wrong too:
NORMS_WRONG_BEFORE = [
    # a Linear whose weight the generator's optimizer holds and its bias the discriminator's: each optimizer's norms
    # counted the other's parameter too
    pytest.param({"variant": "split"}, id="split-linear"),
    # zero_grad(set_to_none=False) zeroes in place: the discriminator counted the generator's backward's examples too
    pytest.param({"set_to_none": False}, id="zero-grad-in-place"),
    # the discriminator's first bias in no optimizer: it was counted in the discriminator's norms
    pytest.param({"variant": "unheld-bias"}, id="bias-in-no-optimizer"),
]
NORMS_RIGHT_BEFORE = [
    pytest.param({}, id="plain"),
    pytest.param({"toggle": True}, id="toggle"),
    pytest.param({"set_to_none": False, "toggle": True}, id="zero-grad-in-place-toggle"),
    pytest.param({"accumulate": True}, id="two-backwards-one-step"),
    pytest.param({"variant": "split", "toggle": True}, id="split-linear-toggle"),
    pytest.param({"variant": "shared"}, id="shared-module"),
    pytest.param({"variant": "tied"}, id="tied-weights"),
    pytest.param({"variant": "conv"}, id="conv2d-groupnorm"),
    pytest.param({"variant": "attention"}, id="transformer-layer", marks=pytest.mark.slow),
    pytest.param({"variant": "checkpointed"}, id="checkpointed-encoder", marks=pytest.mark.slow),
    pytest.param({"variant": "groups"}, id="two-param-groups", marks=pytest.mark.slow),
    pytest.param({"variant": "unheld"}, id="parameter-in-no-optimizer", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kw", NORMS_WRONG_BEFORE + NORMS_RIGHT_BEFORE)
def test_gan_per_example_norms_and_dumps_match_float64_references(tmp_path: Path, kw: dict[str, Any]) -> None:
    module, norms = GAN(**kw), StepNorms()
    cb = GradStatsCallback(optimizer_names=NAMES, per_example=True, flight_recorder=8)
    trainer = _fit(tmp_path, module, [norms, cb])
    _check_examples(trainer, module)
    _check_dumps(tmp_path, cb, norms, module)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_layer_called_twice_in_one_backward(use_reentrant: bool) -> None:
    """Each layer of the encoder runs under a checkpoint twice in one loss (a discriminator given real and generated
    examples). Non-reentrant: exact. Reentrant: a layer's second use is counted only when its segment is recomputed,
    after the first's per-example gradient was reduced; its norms missed one use (15 % off here): refused by name."""
    model = CheckpointedEncoder(use_reentrant=use_reentrant)
    x, y = torch.randn(6, 3, 8), torch.randn(6, 3, 8)

    def loss(m: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (m(a).pow(2).mean((1, 2)) + m(b).pow(2).mean((1, 2))).mean()

    pe = PerExampleNorms(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if use_reentrant:
            with pytest.raises(RuntimeError, match=r"parameter 'encoder.layers.1.norm2.weight' of module "
                                                   r"'encoder.layers.1.norm2' \(LayerNorm\) is used again, in a "
                                                   r"reentrant checkpoint .* use_reentrant=False"):
                loss(model, x, y).backward()
            pe.remove()
            return
        loss(model, x, y).backward()
    pe.remove()
    names = [k for k, _ in model.named_parameters()]
    ref = example_norms(model, names, lambda m, i: loss(m, x[i:i + 1].double(), y[i:i + 1].double()), 6)
    torch.testing.assert_close(pe.norms().double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-4, atol=0)


def test_gan_reentrant_checkpoint_in_the_discriminator_is_refused_by_name(tmp_path: Path) -> None:
    """The discriminator's checkpointed encoder (use_reentrant=True) runs on real and generated examples in one
    loss: the discriminator's per-example norms were silently off by a few percent, now an error names the
    parameter (the generator's backward, one use per layer, is exact)."""
    cb = GradStatsCallback(optimizer_names=NAMES, per_example=True)
    with pytest.raises(RuntimeError, match=r"parameter 'nets.d.enc.encoder.layers.1.norm2.weight' .* is used "
                                           r"again, in a reentrant checkpoint"):
        _fit(tmp_path, GAN(variant="reentrant"), [cb])


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_is_refused_with_or_without_parameters_and_leaves_no_hook(affine: bool) -> None:
    """A BatchNorm in training mode after a layer mixes the examples' gradients whether or not it has parameters of
    its own: refused by name (with parameters when made, without at its first forward with a gradient), and the
    model is left as it was (no hook on the layers before it)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, affine=affine), nn.Tanh(), nn.Linear(6, 1))
    refused = pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\) normalises with the statistics of the whole")
    if affine:
        with refused:
            PerExampleNorms(model)
    else:
        with PerExampleNorms(model), refused:
            model(torch.randn(8, 4))
    model(torch.randn(8, 4)).pow(2).mean().backward()  # the model trains on without per-example norms
    # a BatchNorm without parameters on the raw inputs (a normalisation of the data) mixes no gradient: taken
    data_norm = nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.Linear(4, 1))
    with PerExampleNorms(data_norm) as pe:
        data_norm(torch.randn(8, 4)).pow(2).mean().backward()
    assert pe.num_examples == 8
    model.eval()  # running statistics: each example its own gradient
    pe = PerExampleNorms(model)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    assert pe.num_examples == 8
    model.train()  # put back in training mode: refused at its next forward
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\)"):
        model(torch.randn(8, 4))
    pe.remove()


def test_gan_batchnorm_in_the_discriminator_is_refused_for_both_optimizers(tmp_path: Path) -> None:
    """The generator's backward goes through the discriminator's BatchNorm too: refused when training starts, by
    name, even though it holds no parameter (affine=False)."""
    cb = GradStatsCallback(optimizer_names=NAMES, per_example=True)
    with pytest.raises(ValueError, match=r"module 'nets.d.1' \(BatchNorm1d\) normalises with the statistics"):
        _fit(tmp_path, GAN(variant="batchnorm"), [cb])


def test_a_gradient_penalty_double_backward_is_refused_by_name() -> None:
    """A WGAN-GP discriminator's loss holds the gradient of its output (autograd.grad with create_graph=True): that
    backward through the hooked modules counted a batch of examples of its own, and the norms missed the penalty."""
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    real, fake, eps = torch.randn(8, 6), torch.randn(8, 6), torch.rand(8, 1)
    pe = PerExampleNorms(d)
    inter = (eps * real + (1 - eps) * fake).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"create_graph=True .* went through module '2' \(Linear\)"):
        torch.autograd.grad(d(inter).sum(), inter, create_graph=True)
    pe.remove()


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_gan_validation_between_steps_and_precision(tmp_path: Path, precision: str) -> None:
    """Validation after every batch (forwards without grad, the modules put in eval mode and back) leaves each
    optimizer's figures and dumps exact; under bf16-mixed they are those of the bf16 forward (within its rounding)."""

    class Validated(GAN):
        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (real,) = batch
            return bce(self.D(self.nets, real), torch.ones(real.shape[0], 1))

    module, norms = Validated(), StepNorms()
    cb = GradStatsCallback(optimizer_names=NAMES, per_example=True, flight_recorder=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[norms, cb], logger=CSVLogger(str(tmp_path)),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1, max_epochs=1, val_check_interval=1, limit_val_batches=1,
                        precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), _data(1))
    rows = _rows(trainer)
    rel = 3e-2 if precision == "bf16-mixed" else 1e-4
    for batch in range(3):
        for name in NAMES:
            ref = torch.tensor(module.refs[(batch, name)], dtype=torch.float64)
            assert rows[batch][f"examples/{name}/max_norm"] == pytest.approx(float(ref.max()), rel=rel)
            assert rows[batch][f"examples/{name}/median_norm"] == pytest.approx(float(ref.median()), rel=rel)
    _check_dumps(tmp_path, cb, norms, module)


def test_gan_second_fit_and_resume_keep_figures_and_rows_right(tmp_path: Path) -> None:
    """The same callback fits twice (its recorders carried over by name: the second fit's rows follow the first's,
    the step counted from 0 again), then a new callback resumes from the first fit's checkpoint (steps go on)."""
    cb = GradStatsCallback(optimizer_names=NAMES, per_example=True, flight_recorder=16)
    first, second = (GAN(), StepNorms()), (GAN(variant="split"), StepNorms())
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[first[1], cb], logger=CSVLogger(str(tmp_path / "a")),
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(first[0], _data())
    _check_examples(trainer, first[0])
    _check_examples(_fit(tmp_path / "b", second[0], [second[1], cb]), second[0])
    for index, name in enumerate(NAMES):
        rows = _read(cb.flight_recorders[name].dump(tmp_path / f"{name}.jsonl"))
        assert [r["step"] for r in rows] == [2 * b + index for b in range(3)] * 2
        want = [n.norms[(b, name)] for n in (first[1], second[1]) for b in range(3)]
        assert [r["total_norm"] for r in rows] == pytest.approx(want, rel=1e-5)

    (ckpt,) = (tmp_path / "a").rglob("*.ckpt")
    resumed, norms = GAN(), StepNorms()
    cb2 = GradStatsCallback(optimizer_names=NAMES, per_example=True, flight_recorder=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[norms, cb2], logger=CSVLogger(str(tmp_path / "c")),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1, max_epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resumed, _data(), ckpt_path=str(ckpt))
    rows = _rows(trainer)
    for batch in range(3):  # the second epoch's batches, at logger steps 3, 4, 5
        for name in NAMES:
            ref = torch.tensor(resumed.refs[(batch, name)], dtype=torch.float64)
            assert rows[3 + batch][f"examples/{name}/max_norm"] == pytest.approx(float(ref.max()), rel=1e-4)
    for index, name in enumerate(NAMES):
        dumped = _read(cb2.flight_recorders[name].dump(tmp_path / f"resumed-{name}.jsonl"))
        assert [r["step"] for r in dumped] == [6 + 2 * b + index for b in range(3)]
        assert [r["total_norm"] for r in dumped] == pytest.approx([norms.norms[(b, name)] for b in range(3)], rel=1e-5)


# ------------------------------------------------------------------------------------------------- one optimizer
T, MICRO, ACCUMULATION, STEPS = 8, 4, 2, 3


def _gpt2_ids() -> torch.Tensor:
    return torch.randint(1, 64, (MICRO * ACCUMULATION * STEPS, T), generator=torch.Generator().manual_seed(0))


def _lm_loss(gpt: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """GPT-2's loss computed inside its forward, with position ids per example (docs/per_example.md)."""
    return gpt(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand(ids.shape[0], -1), labels=ids).loss


def _gpt2_no_dropout() -> nn.Module:
    from model_zoo import gpt2

    model = gpt2()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


class GPT2Module(L.LightningModule):
    """The zoo's GPT-2 in automatic optimization; before each optimizer step, the reference per-example norms of
    the step's examples and the float64 norm of its gradient."""

    def __init__(self, ids: torch.Tensor) -> None:
        super().__init__()
        self.gpt, self.ids = _gpt2_no_dropout(), ids
        self.refs: list[list[float]] = []
        self.norms: list[float] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = _lm_loss(self.gpt, ids)
        self.losses.append(float(loss))
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        window = self.ids[len(self.refs) * MICRO * ACCUMULATION:][:MICRO * ACCUMULATION]
        names = [k for k, _ in self.gpt.named_parameters()]
        self.refs.append(example_norms(self.gpt, names, lambda m, i: _lm_loss(m, window[i:i + 1]), len(window)))
        self.norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in self.parameters())))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("names", [None, ("net",)], ids=["unnamed", "optimizer_names"])
def test_one_optimizer_lightning_gpt2_figures_and_dump(tmp_path: Path, names: tuple[str, ...] | None) -> None:
    """One optimizer, gradient accumulation over two micro-batches, GPT-2's loss made inside its forward: the
    logged figures are the references' (optimizer_names of one optimizer: the same figures under its segment)."""
    ids = _gpt2_ids()
    module = GPT2Module(ids)
    cb = GradStatsCallback(per_example=True, flight_recorder=8, optimizer_names=names)
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[cb], logger=CSVLogger(str(tmp_path)),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1, max_epochs=1, accumulate_grad_batches=ACCUMULATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=MICRO))
    rows, key = _rows(trainer), "examples/" if names is None else "examples/net/"
    for step, ref in enumerate(module.refs):
        ref_t = torch.tensor(ref, dtype=torch.float64)
        assert rows[step][key + "max_norm"] == pytest.approx(float(ref_t.max()), rel=1e-4), step
        assert rows[step][key + "median_norm"] == pytest.approx(float(ref_t.median()), rel=1e-4), step
    recorder = cb.flight_recorder if names is None else cb.flight_recorders["net"]
    dumped = _read(recorder.dump(tmp_path / "gpt2.jsonl"))
    assert [r["step"] for r in dumped] == [0, 1, 2]
    assert [r["total_norm"] for r in dumped] == pytest.approx(module.norms, rel=1e-5)
    # each step's loss: the mean of its micro-batches' (a flight recorder without a spike guard records it too)
    pairs = zip(module.losses[::ACCUMULATION], module.losses[1::ACCUMULATION])
    assert [r["loss"] for r in dumped] == pytest.approx([(a + b) / 2 for a, b in pairs], rel=1e-5)


def test_one_optimizer_lightning_resnet_refused_by_name_and_its_flight_recorder_right(tmp_path: Path) -> None:
    """The zoo's ResNet (BatchNorm in training mode, in-place residual and ReLU): per_example is refused when the
    fit is set up, naming the BatchNorm, and leaves the model trainable; its flight recorder alone records every
    step's float64 gradient norm."""
    from model_zoo import ResNet

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = ResNet()
            self.norms: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in self.parameters())))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(12, 3, 8, 8, generator=g), torch.randint(0, 5, (12,), generator=g)), batch_size=4)
    kw: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
                          "enable_model_summary": False, "enable_checkpointing": False, "max_epochs": 1}
    module = Net()
    with pytest.raises(ValueError, match=r"module 'net.bn1' \(BatchNorm2d\) normalises with the statistics"):
        L.Trainer(callbacks=[GradStatsCallback(per_example=True)], **kw).fit(module, data)
    cb = GradStatsCallback(flight_recorder=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(callbacks=[cb], **kw).fit(module, data)  # the same module, no hook left by the refusal
    dumped = _read(cb.flight_recorder.dump(tmp_path / "resnet.jsonl"))
    assert [r["step"] for r in dumped] == [0, 1, 2]
    assert [r["total_norm"] for r in dumped] == pytest.approx(module.norms, rel=1e-5)


def _step_references(model: nn.Module, windows: list[torch.Tensor]) -> tuple[list[float], float]:
    """The per-example references of one step's examples (each its own ``_lm_loss``) and its gradient's norm."""
    examples = torch.cat(windows)
    names = [k for k, _ in model.named_parameters()]
    ref = example_norms(model, names, lambda m, i: _lm_loss(m, examples[i:i + 1]), len(examples))
    return ref, math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


def _check_steps(figures: list[tuple[float, float]], refs: list[list[float]], factor: float = 1.0) -> None:
    assert len(figures) == len(refs) == STEPS
    for step, ((top, median), ref) in enumerate(zip(figures, refs)):
        ref_t = torch.tensor(ref, dtype=torch.float64) * factor
        assert top == pytest.approx(float(ref_t.max()), rel=1e-4), step
        assert median == pytest.approx(float(ref_t.median()), rel=1e-4), step


@pytest.mark.parametrize("loss_type", ["ForCausalLM", None])
def test_one_optimizer_hugging_face_gpt2_figures_and_dump(tmp_path: Path, loss_type: str | None) -> None:
    """The Hugging Face callback, GPT-2's loss made inside its forward over the Trainer's num_items_in_batch, two
    micro-batches per step: the logged figures are the references', the dump's rows the float64 gradient norms. With
    its loss_type None (GPT2LMHeadModel's own) the Trainer counts every label, the first of each sequence too, which
    the shifted loss never reads: the figures are (T - 1) / T of the references, as docs/integrations.md says."""
    transformers = pytest.importorskip("transformers")
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = _gpt2_no_dropout()
    model.loss_type = loss_type
    ids = _gpt2_ids()
    batches: list[dict[str, torch.Tensor]] = []

    def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batches.append(transformers.default_data_collator(features))
        return batches[-1]

    refs: list[list[float]] = []
    norms: list[float] = []

    class References(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            window = [b["input_ids"] for b in batches[ACCUMULATION * len(refs):][:ACCUMULATION]]
            ref, norm = _step_references(model, window)
            refs.append(ref)
            norms.append(norm)

    cb = HFCallback(per_example=True, flight_recorder=8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        max_grad_norm=0.0)
    data = [{"input_ids": x, "position_ids": torch.arange(T), "labels": x} for x in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                   optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
                                   callbacks=[References()])
    add_to_trainer(trainer, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logged = [(h["examples/max_norm"], h["examples/median_norm"]) for h in trainer.state.log_history
              if "examples/max_norm" in h]
    _check_steps(logged, refs, 1.0 if loss_type else (T - 1) / T)
    dumped = _read(cb.flight_recorder.dump(tmp_path / "hf.jsonl"))
    assert [r["total_norm"] for r in dumped] == pytest.approx(norms, rel=1e-5)


def test_one_optimizer_trainer_gpt2_loss_inside_forward_figures_and_dump(tmp_path: Path) -> None:
    """tg.Trainer with a model whose forward returns GPT-2's own loss (the loss function passes it on)."""
    from torch_gradstats import Trainer

    gpt = _gpt2_no_dropout()

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return _lm_loss(self.gpt, ids)

    ids = _gpt2_ids()
    refs: list[list[float]] = []
    norms: list[float] = []

    def after_backward(trainer: Any) -> None:
        window = ids[len(refs) * MICRO * ACCUMULATION:][:MICRO * ACCUMULATION]
        ref, norm = _step_references(gpt, [window])
        refs.append(ref)
        norms.append(norm)

    class Sink:
        def __init__(self) -> None:
            self.figures: list[tuple[float, float]] = []

        def log(self, report: Any, step: int) -> None:
            self.figures.append((report.extra["examples/max_norm"], report.extra["examples/median_norm"]))

    sink = Sink()
    trainer = Trainer(LM(), torch.optim.SGD(gpt.parameters(), lr=0.01), lambda loss, _: loss, per_example=True,
                      flight_recorder=8, log_to=[sink], accumulation_steps=ACCUMULATION, after_backward=after_backward,
                      progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train_epoch(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=MICRO))
    _check_steps(sink.figures, refs)
    assert trainer.flight_recorder is not None
    dumped = _read(trainer.flight_recorder.dump(tmp_path / "trainer.jsonl"))
    assert [r["total_norm"] for r in dumped] == pytest.approx(norms, rel=1e-5)


def test_one_optimizer_hugging_face_resnet_refused_by_name_leaves_no_hook(tmp_path: Path) -> None:
    """The Hugging Face callback with per_example on the zoo's ResNet: refused when training begins, naming the
    BatchNorm, and neither its own hooks nor PerExampleNorms' are left on the model (they went on running at every
    backward of a later training without the callback)."""
    transformers = pytest.importorskip("transformers")
    from model_zoo import ResNet

    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = ResNet()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.cross_entropy(self.net(x), labels)}

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(3, 8, 8, generator=g), "labels": i % 5} for i in range(8)]
    model = Classifier()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    add_to_trainer(trainer, HFCallback(per_example=True))
    with pytest.raises(ValueError, match=r"module 'net.bn1' \(BatchNorm2d\) normalises"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not [n for n, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
