"""PerExampleNorms on a Hugging Face GPT-2 (loss inside ``forward``) beside an ActivationWatch, and under bfloat16
autocast: its torch.func replays (GPT-2's Conv1D, MultiheadAttention) run inside the backward, where the watch's
hooks must not read their storage-less tensors and where autocast is no longer active."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import pytest
import torch
from model_zoo import gpt2
from torch import Tensor, nn

from torch_gradstats.monitors.activations import ActivationWatch
from torch_gradstats.monitors.per_example import PerExampleNorms

pytestmark = pytest.mark.usefixtures("one_thread")

B, T = 3, 6


def _gpt2() -> nn.Module:
    """The zoo's GPT-2 in training mode without dropout: each example's gradient is then one function of its tokens,
    which the one-at-a-time reference recomputes."""
    model = gpt2()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _batch() -> dict[str, Tensor]:
    ids = torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(0))
    # position_ids per example: without them GPT-2 makes one [1, T] row shared by the batch (docs/per_example.md)
    return {"input_ids": ids, "position_ids": torch.arange(T).expand(B, T).contiguous(), "labels": ids}


def _example(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    return {k: v[i:i + 1] for k, v in batch.items()}


def _reference(model: nn.Module, batch: dict[str, Tensor], amp: bool = False) -> Tensor:
    """Each example's own loss gradient norm, one example at a time (float64 unless ``amp``)."""
    model = copy.deepcopy(model) if amp else copy.deepcopy(model).double()
    norms = []
    for i in range(B):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            loss = model(**_example(batch, i)).loss
        loss.backward()
        norms.append(torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]).norm())
    return torch.stack(norms)


def _step(model: nn.Module, batch: dict[str, Tensor], *monitors: Any) -> None:
    with contextlib.ExitStack() as stack:
        for m in monitors:
            stack.enter_context(m)
        model.zero_grad()
        model(**batch).loss.backward()  # the mean over B * T tokens: each example's mean, averaged


@pytest.mark.parametrize("watch_first", [True, False])
def test_gpt2_with_an_activation_watch_gives_the_same_figures_as_each_alone(watch_first: bool) -> None:
    model, batch = _gpt2(), _batch()
    alone_pe = PerExampleNorms(model, loss_reduction="mean")
    _step(model, batch, alone_pe)
    alone_watch = ActivationWatch(model)
    _step(model, batch, alone_watch)
    grads_alone = [p.grad.clone() for p in model.parameters()]

    pe, watch = PerExampleNorms(model, loss_reduction="mean"), ActivationWatch(model)
    _step(model, batch, *((watch, pe) if watch_first else (pe, watch)))

    torch.testing.assert_close(pe.norms().double(), _reference(model, batch), rtol=1e-4, atol=0.0)
    assert torch.equal(pe.norms(), alone_pe.norms())
    # the replays inside the backward added no call, forward or backward, to the watch's step
    assert watch.report().to_dict(per_module=True) == alone_watch.report().to_dict(per_module=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_alone))


def test_gpt2_with_an_activation_watch_names_a_nan_and_evaluates_under_inference_mode() -> None:
    model, batch = _gpt2(), _batch()
    pe, watch = PerExampleNorms(model, loss_reduction="mean"), ActivationWatch(model)
    with watch, pe:
        model.eval()
        with torch.inference_mode():
            model(**batch)
        model.train()
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
        model.zero_grad()
        model(**batch).loss.backward()
        assert watch.report().origin == "transformer.h.1.mlp.c_fc"
        assert pe.norms().isnan().all()  # every example's tokens pass the poisoned weight


def test_gpt2_under_bfloat16_autocast_matches_the_per_example_reference() -> None:
    model, batch = _gpt2(), _batch()
    with PerExampleNorms(model, loss_reduction="mean") as pe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
    # the replays compute in bfloat16 as the forward did; one example alone rounds a little differently
    torch.testing.assert_close(pe.norms().double(), _reference(model, batch, amp=True), rtol=2e-2, atol=0.0)


@pytest.mark.parametrize("when", ["before", "between"])  # before the training forward, or between it and its backward
def test_gpt2_evaluations_around_a_training_step_leave_its_norms_exact(when: str) -> None:
    """Evaluation forwards of held-out batches (5 examples, another batch size) under ``inference_mode``, under
    ``no_grad`` and under ``model.eval()`` alone (gradients enabled: hooked as a training forward would be, as a model
    trained in eval mode must be, though no backward ever reaches them): the training step's per-example norms equal
    the one-at-a-time reference."""
    model, batch = _gpt2(), _batch()
    held_out = {"input_ids": torch.randint(1, 64, (5, T), generator=torch.Generator().manual_seed(1)),
                "position_ids": torch.arange(T).expand(5, T).contiguous()}

    def evaluate() -> None:
        model.eval()
        with torch.inference_mode():
            model(**held_out)
        with torch.no_grad():
            model(**held_out)
        model(**held_out)  # gradients enabled, its output dropped
        model.train()

    with PerExampleNorms(model, loss_reduction="mean") as pe:
        if when == "before":
            evaluate()
        loss = model(**batch).loss
        if when == "between":
            evaluate()
        loss.backward()
    torch.testing.assert_close(pe.norms().double(), _reference(model, batch), rtol=1e-5, atol=0.0)


class _Attention(nn.Module):
    """Linear, then MultiheadAttention (a torch.func replay) fed the Linear's bfloat16 output under autocast."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0]).float().mean(dim=(1, 2))


def test_multihead_attention_replay_under_autocast_computes_in_the_forwards_dtype() -> None:
    model, x = _Attention(), torch.randn(B, 5, 8)

    def loss_of(xb: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(xb).sum()

    with PerExampleNorms(model, loss_reduction="sum") as pe:
        loss_of(x).backward()
    want = []
    for i in range(B):
        model.zero_grad()
        loss_of(x[i:i + 1]).backward()
        want.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm())
    torch.testing.assert_close(pe.norms().double(), torch.stack(want), rtol=2e-2, atol=0.0)


def test_trainer_with_autocast_per_example_norms_and_an_activation_watch() -> None:
    import torch_gradstats as tg

    model = _Attention()
    data = [(torch.randn(4, 5, 8), torch.randn(4)) for _ in range(3)]
    trainer = tg.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), amp_dtype=torch.bfloat16,
                         per_example=True, watch_activations=True, progress=False)
    summary = trainer.train_epoch(data)
    assert summary.steps == 3 and summary.nonfinite_steps == 0 and math.isfinite(summary.loss)
    report = trainer.last_activation_report
    assert report is not None and not report.nonfinite


def test_the_callers_own_torch_func_code_is_none_of_the_steps() -> None:
    """PyTorch's per-sample-gradient recipe (vmap of grad over functional_call) run on a watched model between
    forward and backward adds nothing to either monitor's step."""
    model, x = _Attention(), torch.randn(B, 5, 8)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        return torch.func.functional_call(model, p, (xi.unsqueeze(0),)).sum()

    def step(func: bool) -> tuple[Tensor, dict]:
        pe, watch = PerExampleNorms(model, loss_reduction="sum"), ActivationWatch(model)
        with pe, watch:
            model.zero_grad()
            out = model(x).sum()
            if func:
                torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
            out.backward()
            return pe.norms(), watch.report().to_dict(per_module=True)

    (plain, plain_watch), (mixed, mixed_watch) = step(False), step(True)
    assert plain.shape == (B,) and torch.equal(mixed, plain)
    assert mixed_watch == plain_watch


class _CheckpointsInside(nn.Module):
    """A module with parameters of its own (replayed by torch.func) that checkpoints inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(lambda h: torch.tanh(h @ self.w), x, use_reentrant=False)


def test_a_module_checkpointing_inside_its_forward_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 6), _CheckpointsInside())
    with PerExampleNorms(model, loss_reduction="sum"):
        out = model(torch.randn(3, 4)).sum()
        with pytest.raises(RuntimeError, match=r"cannot replay the forward of module '1' \(_CheckpointsInside\)"):
            out.backward()


def test_gpt2_without_position_ids_names_the_shared_position_embedding_and_the_fix() -> None:
    """Without position_ids, GPT-2's positions are one [1, T] row broadcast over the batch: the position embedding's
    gradient is summed over the examples before any hook sees it. The error names the module and says what to pass;
    the gradients are left as the backward made them."""
    model, batch = _gpt2(), _batch()
    del batch["position_ids"]
    reference = copy.deepcopy(model)
    reference(**batch).loss.backward()
    with pytest.raises(RuntimeError, match=r"'transformer\.wpe' \(Embedding\) got an input of shape \(1, 6\).*"
                                           r"shared by the batch.*position_ids of shape \[B, T\]"):
        _step(model, batch, PerExampleNorms(model))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
