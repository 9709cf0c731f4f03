"""PerExampleNorms over a graph backpropagated twice (``retain_graph=True``, then a second loss of the same forward):
the second backward's norms are each example's own, also for a layer called twice in the forward, whose uses were
counted for the first backward only. Checked against per-example gradients in float64."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from torch_gradstats.monitors.per_example import PerExampleNorms


class Twice(nn.Module):
    """One Linear called twice (an unrolled step), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.step(torch.tanh(self.step(x)))))


def _reference(model: nn.Module, x: torch.Tensor, weight: float) -> torch.Tensor:
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return weight * functional_call(model, p, (xi[None],)).pow(2).sum()

    grads = vmap(grad(loss), in_dims=(None, 0))(params, x)
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def test_second_backward_of_a_retained_graph_through_a_layer_called_twice() -> None:
    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    pe = PerExampleNorms(model, loss_reduction="sum")
    out = model(x)
    out.pow(2).sum().backward(retain_graph=True)
    (3.0 * out.pow(2).sum()).backward()
    norms = pe.norms()
    assert norms.shape == (12,)
    torch.testing.assert_close(norms[:6].double(), _reference(model, x, 1.0).float().double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(norms[6:].double(), _reference(model, x, 3.0).float().double(), rtol=1e-5, atol=0)
