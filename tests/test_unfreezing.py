"""Gradual unfreezing: parameters whose trainability changes during training.

Real runs where layers are unfrozen at a step k (``requires_grad_(True)`` and ``optimizer.add_param_group`` with a
fresh learning rate, as in ULMFiT or layer-wise unfreezing of a pretrained GPT-2) and frozen again later: GPT-2
fine-tuned by the Hugging Face ``transformers.Trainer`` with the callback, a LightningModule fitted by Lightning with
the callback, and ``torch_gradstats.Trainer`` unfreezing between epochs. Every logged figure must cover exactly the
parameters trained at that step, and the measured update ratios ``||w_before - w_after|| / ||w_after||`` must equal
float64 ones from weight copies taken around each optimizer step, a parameter first trained at step k measured
against its weights just before step k.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import math
import os
import warnings
from pathlib import Path
from typing import Any

import model_zoo
import pytest
import torch
from _host_reads import HostReads
from torch import nn

import torch_gradstats as tg

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.usefixtures("one_thread")

REL = 1e-5  # float32 weights and their float32 differences against float64 references


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_hf = pytest.mark.skipif(not _installed("transformers", "accelerate"), reason="needs transformers and accelerate")
needs_lightning = pytest.mark.skipif(not _installed("lightning"), reason="needs lightning")


def _ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """The library's definition, in float64: ||w_before - w_after|| / ||w_after|| (0 where both are 0)."""
    d, w = float((before - after).norm()), float(after.norm())
    return 0.0 if d == 0 and w == 0 else d / w


class WeightWatch:
    """Float64 copies of every parameter around each optimizer step: the expected update ratios of the parameters
    that step trained (those that require grad, have a gradient and are held by the optimizer), keyed by ``key``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ratios: dict[int, dict[str, float]] = {}
        self.unchanged: dict[int, set[str]] = {}  # parameters the step did not touch
        self._before: dict[str, torch.Tensor] = {}
        self._trained: set[str] = set()

    def before(self, optimizer: Any) -> dict[str, torch.Tensor]:
        """Copy the weights before the step; returns the copies."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._trained = {n for n, p in self.model.named_parameters()
                         if p.requires_grad and p.grad is not None and id(p) in held}
        self._before = {n: p.detach().double().clone() for n, p in self.model.named_parameters()}
        return self._before

    def after(self, key: int) -> None:
        now = {n: p.detach().double() for n, p in self.model.named_parameters()}
        self.ratios[key] = {n: _ratio(self._before[n], now[n]) for n in self._trained}
        self.unchanged[key] = {n for n in now if torch.equal(now[n], self._before[n])}


def _assert_ratios(logged: dict[str, float], want: dict[str, float], step: int) -> None:
    assert set(logged) == set(want), (step, sorted(set(logged) ^ set(want)))
    for name, value in want.items():
        assert value > 0, (step, name)  # every trained parameter moved
        assert logged[name] == pytest.approx(value, rel=REL), (step, name)


# ============================================================================================ what both callbacks share
def _group_ratios(watch_before: dict[str, torch.Tensor], model: nn.Module, trained: set[str]) -> dict[str, float]:
    """Per module (``group_by=1``): sqrt(sum ||Δw||²) / sqrt(sum ||w_after||²) over the group's trained parameters."""
    d: dict[str, float] = {}
    w: dict[str, float] = {}
    for n, p in model.named_parameters():
        if n in trained:
            g = n.split(".")[0]
            after = p.detach().double()
            d[g] = d.get(g, 0.0) + float((watch_before[n] - after).square().sum())
            w[g] = w.get(g, 0.0) + float(after.square().sum())
    return {g: math.sqrt(d[g]) / math.sqrt(w[g]) for g in d}


def test_callbacks_measurement_follows_unfreezing_on_a_checkpointed_encoder() -> None:
    """What both callbacks run at a logging step (the statistics, the weights' copy before the optimizer step, the
    measurement after it, one report), on the checkpointed TransformerEncoder trained with Adam: its head first,
    encoder layer 1 unfrozen at step 2 and added as a param group with its own learning rate, the head frozen again
    at step 4. Per parameter and per module group, the measured update ratios are those of the parameters trained
    at that step (those that require grad and are held by the optimizer: at step 1 layer 1 has gradients the
    optimizer does not step with) and equal float64 ratios from weight copies; a parameter first trained at step 2
    is measured against its weights just before step 2; finding the change costs no host read, and the copy is made
    again only where the set changed. (Before: the copy was made once, of the parameters trainable at the first
    logging step: layer 1 had no update ratio, the head kept one, 0, once frozen, and the groups followed.)"""
    from torch_gradstats.integrations._common import StatsTaker

    model = model_zoo.CheckpointedEncoder(use_reentrant=False)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.head.parameters():
        p.requires_grad_(True)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    taker = StatsTaker(log_weight_norms=False, log_update_ratio=True, group=None, policy=None, k=5, group_by=1)
    watch = WeightWatch(model)
    g = torch.Generator().manual_seed(0)
    layer1 = {n for n, _ in model.named_parameters() if n.startswith("encoder.layers.1.")}
    made: list[Any] = []  # the UpdateRatio of each step
    for step in range(6):
        if step == 1:  # gradients for layer 1 from now on, but the optimizer holds it from step 2 only
            model.encoder.layers[1].requires_grad_(True)
        if step == 2:
            opt.add_param_group({"params": list(model.encoder.layers[1].parameters()), "lr": 3e-3})
        if step == 4:
            for p in model.head.parameters():
                p.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        x, y = torch.randn(4, 5, 8, generator=g), torch.randint(0, 4, (4, 5), generator=g)
        nn.functional.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1)).backward()
        stats = taker.take(model, opt)
        before = watch.before(opt)
        with HostReads() as reads:
            taker.snapshot(model)
        opt.step()  # (torch's Adam reads its step count on the CPU)
        with HostReads() as measure_reads:
            taker.measure(stats)
        assert reads.count == measure_reads.count == 0  # finding the change, and the measurement: no host read
        made.append(taker.ratio)
        watch.after(step)
        report = taker.report(stats)
        want = watch.ratios[step]
        assert (layer1 <= set(want)) == (step >= 2) and ("head.weight" in want) == (step < 4), step
        assert (layer1 <= set(report.grads.norms)) == (step >= 1)  # the gradient figures: every gradient
        _assert_ratios(report.update_ratios, want, step)
        groups = report.grads.groups
        assert groups is not None
        want_groups = _group_ratios(before, model, set(want))
        assert {k: v for k, v in groups.update_ratios.items() if k in want_groups} == pytest.approx(want_groups,
                                                                                                     rel=REL)
        assert set(groups.update_ratios) == set(want_groups), step
    # Made again only where the trained set changed (steps 2 and 4): unchanged, no copy is reallocated.
    assert [i for i in range(1, 6) if made[i] is not made[i - 1]] == [2, 4]



def test_a_frozen_layers_gradient_counts_only_where_the_optimizer_applies_it() -> None:
    """A layer frozen with a gradient still on it: the callbacks read it while the optimizer applies that gradient
    (frozen between the micro-batches of a step, held by the optimizer), and never where the optimizer does not hold
    it: a layer trained a while outside the optimizer keeps its last gradient after it is frozen (the optimizer's
    ``zero_grad`` clears only what it holds), and reading it would put that stale gradient into every later step's
    figures. The checkpointed TransformerEncoder, the head trained by SGD; its figures against float64 norms."""
    from torch_gradstats.integrations._common import StatsTaker

    model = model_zoo.CheckpointedEncoder(use_reentrant=False)
    for p in model.parameters():
        p.requires_grad_(False)
    model.head.requires_grad_(True)
    model.encoder.layers[1].requires_grad_(True)  # trained outside the optimizer for two steps
    opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
    taker = StatsTaker(log_weight_norms=False, log_update_ratio=False, group=None, policy=None, k=5, group_by=None)
    g = torch.Generator().manual_seed(0)
    layer1 = {n for n, _ in model.named_parameters() if n.startswith("encoder.layers.1.")}
    for step in range(4):
        if step == 2:
            model.encoder.layers[1].requires_grad_(False)  # its last gradient stays: opt.zero_grad never clears it
        opt.zero_grad(set_to_none=True)
        for micro in range(2):
            if step == 3 and micro == 1:
                model.head.bias.requires_grad_(False)  # frozen after its first micro-batch: SGD still applies it
            x, y = torch.randn(4, 5, 8, generator=g), torch.randint(0, 4, (4, 5), generator=g)
            nn.functional.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1)).backward()
        report = taker.take(model, opt).report()
        applied = {n: p.grad for n, p in model.named_parameters()
                   if p.grad is not None and (p.requires_grad or any(p is q for q in model.head.parameters()))}
        assert set(report.norms) == set(applied), step
        assert (layer1 <= set(report.norms)) == (step < 2), step
        assert "head.bias" in report.norms, step  # frozen at step 3 with a gradient SGD applies
        assert model.encoder.layers[1].linear1.weight.grad is not None  # the stale gradient is still there
        want = math.sqrt(sum(float(t.double().pow(2).sum()) for t in applied.values()))
        assert report.total_norm == pytest.approx(want, rel=REL), step
        opt.step()


# ================================================================================================ Hugging Face Trainer
def _freeze(model: nn.Module, prefix: str, frozen: bool) -> list[nn.Parameter]:
    params = [p for n, p in model.named_parameters() if n.startswith(prefix)]
    for p in params:
        p.requires_grad_(not frozen)
    return params


def _add_group(optimizer: Any, scheduler: Any, params: list[nn.Parameter], lr: float) -> None:
    """``optimizer.add_param_group`` with a learning rate of its own, and the Trainer's LR scheduler told of the
    group (a LambdaLR refuses param groups it has no schedule for)."""
    optimizer.add_param_group({"params": params, "lr": lr, "initial_lr": lr, "weight_decay": 0.0})
    scheduler.base_lrs.append(lr)
    scheduler.lr_lambdas.append(scheduler.lr_lambdas[0])


@pytest.mark.slow
@needs_hf
def test_hf_gpt2_gradual_unfreezing_update_ratios_follow_the_trained_parameters(tmp_path: Path) -> None:
    """GPT-2 with its embeddings and first block frozen; at global step 2 a TrainerCallback unfreezes block 0 and
    adds it to the optimizer as a param group of its own learning rate; at step 4 block 1 is frozen again. The
    logged ``grad/update_ratio/...`` of each step are exactly those of the parameters trained then, equal to float64
    ratios from weight copies. (Before: the callback built its measurement once, from the parameters trainable when
    it first logged, so block 0 had no update ratio at all after being unfrozen, and block 1 went on being logged,
    at 0, after being frozen.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = model_zoo.gpt2()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for p in model.parameters():
        p.requires_grad_(False)
    _freeze(model, "transformer.h.1.", False)
    _freeze(model, "transformer.ln_f.", False)
    watch = WeightWatch(model)

    class Unfreeze(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None,
                          **kw: Any) -> None:
            if state.global_step == 2:
                _add_group(optimizer, lr_scheduler, _freeze(model, "transformer.h.0.", False), 3e-3)
            if state.global_step == 4:
                _freeze(model, "transformer.h.1.", True)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                                  **kw: Any) -> None:
            watch.before(optimizer)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            watch.after(state.global_step + 1)

    ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(0))
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", learning_rate=1e-2, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                   callbacks=[Unfreeze()])
    callback = add_to_trainer(trainer, log_update_ratio=True, log_weight_norms=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(logs) == list(range(1, 7)) == sorted(watch.ratios)
    block0 = {n for n, _ in model.named_parameters() if n.startswith("transformer.h.0.")}
    block1 = {n for n, _ in model.named_parameters() if n.startswith("transformer.h.1.")}
    for step, entry in logs.items():
        want = watch.ratios[step]
        assert (block0 <= set(want)) == (step >= 3) and (block1 <= set(want)) == (step <= 4), step
        assert not set(want) & watch.unchanged[step], step
        logged = {k[len("grad/update_ratio/"):]: v for k, v in entry.items() if k.startswith("grad/update_ratio/")}
        _assert_ratios(logged, want, step)
        assert entry["grad/update_ratio_max"] == pytest.approx(max(want.values()), rel=REL)
        norms = {k[len("grad/norm/"):] for k in entry if k.startswith("grad/norm/")}
        assert norms == set(want), step  # the gradient figures too: the parameters with a gradient at that step
    assert callback.last_report is not None


@needs_hf
def test_hf_steps_are_read_after_every_first_trainable_parameter_is_frozen(tmp_path: Path) -> None:
    """The callback finds the end of a backward from gradient hooks on the trainable parameters: when every
    parameter trainable at the start (the head) is frozen and block 0 trained instead, the steps after are still
    read and logged. (Before: the hooks were put on the parameters trainable when training began, so from then on
    no hook fired and nothing more was logged.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = model_zoo.gpt2()
    for p in model.parameters():
        p.requires_grad_(False)
    _freeze(model, "transformer.ln_f.", False)

    class Swap(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None,
                          **kw: Any) -> None:
            if state.global_step == 2:
                _freeze(model, "transformer.ln_f.", True)
                _add_group(optimizer, lr_scheduler, _freeze(model, "transformer.h.0.", False), 1e-3)

    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", learning_rate=1e-3, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                   callbacks=[Swap()])
    add_to_trainer(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for step in range(1, 5):
        names = {k[len("grad/norm/"):] for k in logs[step] if k.startswith("grad/norm/")}
        prefix = "transformer.ln_f." if step <= 2 else "transformer.h.0."
        assert names and all(n.startswith(prefix) for n in names), (step, sorted(names))


# ================================================================================================ Lightning
@pytest.mark.slow
@needs_lightning
def test_lightning_gradual_unfreezing_update_ratios_follow_the_trained_parameters(tmp_path: Path) -> None:
    """A LightningModule training its head with Adam; at global step 2 a callback unfreezes the first layer and adds
    it to the optimizer with its own learning rate; at step 4 the head is frozen again. The measured update ratios
    Lightning's CSV logger wrote for each step cover exactly the parameters trained then and equal float64 ratios
    from weight copies. (Before: the first layer never had an update ratio, and the head was logged at 0 after
    being frozen.)"""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from torch_gradstats.integrations.lightning import GradStatsCallback

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    for p in net[:3].parameters():
        p.requires_grad_(False)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    module = Module()
    watch = WeightWatch(module)

    class Unfreeze(L.Callback):
        hooked = False

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 2:
                layer = list(net[0].parameters())
                for p in layer:
                    p.requires_grad_(True)
                trainer.optimizers[0].add_param_group({"params": layer, "lr": 3e-3})
            if trainer.global_step == 4:
                for p in net[4].parameters():
                    p.requires_grad_(False)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            watch.before(optimizer)
            if not self.hooked:
                self.hooked = True
                optimizer.register_step_post_hook(lambda *a: watch.after(trainer.global_step))

    cb = GradStatsCallback(every_n_steps=1, log_update_ratio=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[Unfreeze(), cb],
                        logger=CSVLogger(str(tmp_path), name="csv"), enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
                        default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, model_zoo.classification_data(8))
    rows: dict[int, dict[str, float]] = {}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update(
                {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    assert sorted(watch.ratios) == list(range(6))
    for step, want in watch.ratios.items():
        assert ("net.0.weight" in want) == (step >= 2) and ("net.4.weight" in want) == (step < 4), step
        assert "net.2.weight" not in want
        logged = {k[len("grad_stats/update_ratio/"):]: v for k, v in rows[step].items()
                  if k.startswith("grad_stats/update_ratio/")}
        _assert_ratios(logged, want, step)


# ============================================================================================== torch_gradstats.Trainer
class _Recorder:
    """A ``log_to`` sink keeping each logged report."""

    def __init__(self) -> None:
        self.reports: dict[int, Any] = {}

    def log(self, report: Any, step: int) -> None:
        self.reports[step] = report


def test_trainer_layer_wise_unfreezing_of_a_resnet_between_epochs() -> None:
    """ULMFiT's schedule on the ResNet of BasicBlocks: the head trained first, then one more block unfrozen (and
    added to the optimizer with its own learning rate) at each epoch, the head frozen again in the last. The
    gradient figures of every logged step cover exactly the parameters trained then, against float64 norms of the
    gradients the optimizer stepped with."""
    model = model_zoo.resnet()
    for p in model.parameters():
        p.requires_grad_(False)
    head = list(model.fc.parameters())
    for p in head:
        p.requires_grad_(True)
    opt = torch.optim.SGD(head, lr=0.05, momentum=0.9)
    seen: dict[int, dict[str, float]] = {}
    names = {id(p): n for n, p in model.named_parameters()}

    def keep(trainer: tg.Trainer) -> None:
        seen[trainer.global_step] = {names[id(p)]: float(p.grad.double().norm()) for p in model.parameters()
                                     if p.grad is not None}

    sink = _Recorder()
    trainer = tg.Trainer(model, opt, nn.CrossEntropyLoss(), log_to=[sink], progress=False, after_backward=keep)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    for block in (None, model.layer2, model.layer1):
        if block is not None:
            params = list(block.parameters())
            for p in params:
                p.requires_grad_(True)
            opt.add_param_group({"params": params, "lr": 0.01})
        if block is model.layer1:
            for p in head:
                p.requires_grad_(False)
        trainer.train_epoch(loader)
    assert sorted(sink.reports) == sorted(seen) == list(range(6))
    for step, report in sink.reports.items():
        want = seen[step]
        trained = {n for n, p in model.named_parameters() if p.requires_grad} if step >= 4 else None
        assert set(report.norms) == set(want), step
        if trained is not None:
            assert set(want) == trained
        for name, norm in want.items():
            assert report.norms[name] == pytest.approx(norm, rel=REL), (step, name)
        assert report.total_norm == pytest.approx(math.sqrt(sum(v * v for v in want.values())), rel=REL)
    assert any(n.startswith("layer1.") for n in seen[5]) and not any(n.startswith("fc.") for n in seen[5])


# ================================================================================================ per-example norms
def _per_example_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's own gradient norm over the parameters that require grad, in float64, one example at a time."""
    m64 = copy.deepcopy(model).double()
    out = []
    for i in range(x.shape[0]):
        m64.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m64(x[i:i + 1].double()), y[i:i + 1]).backward()
        out.append(math.sqrt(sum(float(p.grad.square().sum()) for p in m64.parameters() if p.grad is not None)))
    return torch.tensor(out, dtype=torch.float64)


def test_per_example_norms_follow_a_layer_unfrozen_after_they_were_set_up() -> None:
    """PerExampleNorms set up while the first layer is frozen: once it is unfrozen, each example's norm includes
    it, equal to float64 per-example gradients; frozen again, it is left out again."""
    from torch_gradstats.monitors.per_example import PerExampleNorms

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    model[0].requires_grad_(False)
    with PerExampleNorms(model) as pe:
        for frozen in (True, False, True):
            model[0].requires_grad_(not frozen)
            pe.reset()
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            assert pe.norms().double() == pytest.approx(_per_example_reference(model, x, y), rel=1e-4)
            assert ("0.weight" in pe.per_parameter()) == (not frozen)


def test_per_example_parameter_unfrozen_later_and_used_outside_its_module_is_named() -> None:
    """A parameter frozen when PerExampleNorms was set up, unfrozen later and used outside its own module's call
    (whose per-example gradients are unknown) is refused by name, as one trainable from the start is. (Before: the
    check's hooks were put on the parameters trainable at set-up only, so its gradient was silently left out of
    every example's norm.)"""
    from torch_gradstats.monitors.per_example import PerExampleNorms

    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) @ self.b.weight.T  # b's weight without calling b

    model = Reuse()
    model.b.requires_grad_(False)
    x = torch.randn(4, 3)
    with PerExampleNorms(model) as pe:
        model(x).square().sum().backward()  # b frozen: a's gradients only
        assert set(pe.per_parameter()) == {"a.weight", "a.bias"}
        model.b.weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"'b\.weight' received a gradient outside"):
            model(x).square().sum().backward()


# ================================================================================ frozen between micro-batches
class _Regressor(nn.Module):
    """A tiny model the Hugging Face Trainer can train (a dict with the loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.head(torch.tanh(self.body(x))).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def _with_grad(model: nn.Module) -> dict[str, float]:
    return {n: float(p.grad.double().norm()) for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@needs_hf
def test_hf_layer_frozen_between_micro_batches_is_read_with_the_gradient_the_optimizer_applies(tmp_path: Path) -> None:
    """Under gradient accumulation a layer frozen after the first micro-batch of a step keeps that micro-batch's
    gradient, which the optimizer applies: the step's figures and update ratios include it (the docs' rule, "the
    parameters with a gradient at that step"), equal to float64 figures and to the Trainer's own ``grad_norm``.
    (Before: it was left out, the total norm that of the head alone.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch_gradstats.integrations.transformers import add_to_trainer

    model, want = _Regressor(), {}
    watch = WeightWatch(model)

    class FreezeMidStep(transformers.TrainerCallback):
        def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:
                model.body.requires_grad_(False)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                                  **kw: Any) -> None:
            want[state.global_step + 1] = _with_grad(model)
            watch.before(optimizer)
            watch._trained = set(want[state.global_step + 1])  # every parameter with a gradient is stepped

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            watch.after(state.global_step + 1)

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(24)]
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2, disable_tqdm=True,
        seed=0, max_grad_norm=0.0, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[FreezeMidStep()])
    add_to_trainer(trainer, log_update_ratio=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(logs) == [1, 2, 3]
    assert {n for n in want[2] if n.startswith("body.")} == {"body.weight", "body.bias"}  # frozen, still stepped
    assert not any(n.startswith("body.") for n in want[3])
    for step, norms in want.items():
        logged = {k[len("grad/norm/"):]: v for k, v in logs[step].items() if k.startswith("grad/norm/")}
        assert logged.keys() == norms.keys(), step
        for name, norm in norms.items():
            assert logged[name] == pytest.approx(norm, rel=REL), (step, name)
        total = math.sqrt(sum(v * v for v in norms.values()))
        assert logs[step]["grad/total_norm"] == pytest.approx(total, rel=REL), step
        assert logs[step]["grad_norm"] == pytest.approx(total, rel=1e-4), step  # the Trainer's own figure
        ratios = {k[len("grad/update_ratio/"):]: v for k, v in logs[step].items() if k.startswith("grad/update_ratio/")}
        _assert_ratios(ratios, watch.ratios[step], step)
