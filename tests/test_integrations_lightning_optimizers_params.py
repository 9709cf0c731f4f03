"""The Lightning callback with several optimizers whose parameters change during training: a param group added
mid-run, every parameter of one optimizer frozen, a parameter held by both optimizers, one optimizer stepping twice
in a batch. Trained for real on the CPU (manual optimization); every logged figure is compared with float64 figures
of that optimizer's own gradients and weights, taken around its own ``step()`` inside the training step."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers.logger import Logger

from torch_gradstats.integrations.lightning import GradStatsCallback

pytestmark = pytest.mark.usefixtures("one_thread")


class Rows(Logger):
    """Every ``log_metrics`` call's values, merged by logger step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    name, version = "rows", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(int(step or 0), {}).update(metrics)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def experiment(self) -> None:
        return None


class Net(L.LightningModule):
    """Two optimizers, ``one`` (``a``, and ``extra`` where added) and ``two`` (``b``), manual optimization; each
    step's float64 reference: ``||g||`` of every parameter the optimizer holds that requires grad, and the measured
    ``||w_after - w_before|| / ||w_after||`` of its own step."""

    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.case = case
        self.a, self.extra, self.b = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
        self.ref: dict[tuple[int, str], tuple[dict[str, float], dict[str, float]]] = {}

    def _step(self, opt: Any, which: str, batch_idx: int) -> None:
        held = {id(p) for group in opt.optimizer.param_groups for p in group["params"]}
        mine = [(n, p) for n, p in self.named_parameters() if id(p) in held and p.requires_grad]
        before = {n: p.detach().double().clone() for n, p in mine}
        norms = {n: float(p.grad.double().norm()) for n, p in mine}
        opt.step()
        ratios = {n: float((p.detach().double() - before[n]).norm() / p.detach().double().norm()) for n, p in mine}
        self.ref[(batch_idx, which)] = (norms, ratios)  # a second step of the batch replaces the first

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        one, two = self.optimizers()
        if self.case == "add_group" and batch_idx == 2:
            one.optimizer.add_param_group({"params": list(self.extra.parameters()), "lr": 0.05})
        if self.case == "freeze_one" and batch_idx == 2:
            self.a.requires_grad_(False)
        one.zero_grad()
        two.zero_grad()
        self.manual_backward(self.b(self.extra(self.a(x))).pow(2).mean())
        if self.case == "twice":
            self._step(one, "one", batch_idx)
            one.zero_grad()
            self.manual_backward(self.b(self.extra(self.a(x))).pow(2).mean() * 3)
        self._step(one, "one", batch_idx)
        self._step(two, "two", batch_idx)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        one = list(self.a.parameters()) + ([self.b.weight] if self.case == "shared" else [])
        return [torch.optim.SGD(one, lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]


def _fit(case: str) -> tuple[Net, dict[int, dict[str, float]]]:
    net, rows = Net(case), Rows()
    callback = GradStatsCallback(every_n_steps=1, optimizer_names=("one", "two"), log_update_ratio=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=rows, callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(32, 3, generator=torch.Generator().manual_seed(1))), batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(net, data)
    return net, rows.rows


def _logged(row: dict[str, float], which: str) -> tuple[dict[str, float], dict[str, float]]:
    norms = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith(f"grad_2.0_norm/{which}/")}
    ratios = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith(f"grad_stats/{which}/update_ratio/")}
    return norms, ratios


@pytest.mark.parametrize("case", ["add_group", "freeze_one", "shared", "twice"])
def test_each_optimizer_reads_and_measures_what_it_holds_at_its_step(case: str) -> None:
    net, rows = _fit(case)
    assert sorted(rows) == [0, 1, 2, 3]
    for (batch, which), (norms, ratios) in net.ref.items():
        logged_norms, logged_ratios = _logged(rows[batch], which)
        assert logged_norms.keys() == norms.keys(), (case, batch, which)
        assert logged_ratios.keys() == ratios.keys(), (case, batch, which)
        for name, norm in norms.items():
            assert logged_norms[name] == pytest.approx(norm, rel=1e-5), (case, batch, which, name)
            assert logged_ratios[name] == pytest.approx(ratios[name], rel=1e-4), (case, batch, which, name)
        if norms:
            total = math.sqrt(sum(v * v for v in norms.values()))
            assert rows[batch][f"grad_stats/{which}/total_norm"] == pytest.approx(total, rel=1e-5)
        else:  # every parameter of the optimizer frozen: nothing read, nothing measured (never the other's)
            assert rows[batch][f"grad_stats/{which}/num_tensors"] == 0, (case, batch, which)
    if case == "add_group":  # the group added at batch 2 is read and measured from that step on
        assert "extra.weight" in _logged(rows[2], "one")[0] and "extra.weight" not in _logged(rows[1], "one")[0]


def test_an_added_parameter_outside_the_module_is_named() -> None:
    class Outside(Net):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                self.optimizers()[1].optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2, 5))]})
            super().training_step(batch, batch_idx)

    net, callback = Outside("plain"), GradStatsCallback(every_n_steps=1, optimizer_names=("one", "two"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 3)), batch_size=8)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"optimizer 'two' \(SGD\).*shape \(2, 5\)"):
        warnings.simplefilter("ignore")
        trainer.fit(net, data)


class OneOptimizer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("saved_names,resumed_names", [(None, ("net",)), (("net",), None)])
def test_one_optimizer_resumes_its_statistics_with_or_without_a_name(tmp_path: Any, saved_names: Any,
                                                                    resumed_names: Any) -> None:
    """A one-optimizer run saved without optimizer_names and resumed with one name (or the reverse) keeps its guard's
    and clip's statistics: they are one optimizer's either way. (Before: a ValueError said the run had "1
    optimizers, each judged by its own", or that the checkpoint held several optimizers' statistics.)"""
    from torch_gradstats import AdaptiveClip, SpikeGuard

    def fit(names: Any, epochs: int, ckpt: str | None) -> tuple[Any, Any]:
        callback = GradStatsCallback(every_n_steps=1, optimizer_names=names, spike_guard=SpikeGuard(min_history=2),
                                     adaptive_clip=AdaptiveClip(warmup=2))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, callbacks=[callback],
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            torch.randn(32, 3, generator=torch.Generator().manual_seed(1))), batch_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(OneOptimizer(), data, ckpt_path=ckpt)
        return trainer, callback

    def policies(callback: Any) -> tuple[Any, Any]:
        if callback.spike_guards:
            return callback.spike_guards["net"], callback.adaptive_clips["net"]
        return callback.spike_guard, callback.adaptive_clip

    trainer, _ = fit(saved_names, 1, None)
    trainer.save_checkpoint(str(tmp_path / "one.ckpt"))
    _, resumed = fit(resumed_names, 2, str(tmp_path / "one.ckpt"))
    _, straight = fit(resumed_names, 2, None)  # the same two epochs without stopping
    assert resumed.policies_restored
    for got, want in zip(policies(resumed), policies(straight)):
        for key, value in want.state_dict().items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got.state_dict()[key], value, rtol=0, atol=0, equal_nan=True, msg=key)
