"""Run by tests/test_integrations_lightning_optimizers_ddp.py: a 2-rank Lightning DDP fit on the CPU (gloo) of a tiny
GAN in manual optimization (generator and discriminator, each with its own optimizer and spike guard).

Each rank records, for every optimizer step, its own local gradients (tensor hooks, which run before DDP averages)
and float64 norms of the gradients the optimizer steps with, and each optimizer's weights before its step and at the
batch's end. Two incidents hit rank 1's generator only: at ``SPIKE_BATCH`` its generator loss jumps by a constant
(the gradients do not change, so only the loss averaged over the ranks can make rank 0 skip too), at ``NAN_BATCH``
one of its local generator gradients gets a NaN (DDP's average carries it to both ranks). The callback also watches
the activations, and a validation every 4 batches (and Lightning's sanity check before training) calls the
discriminator alone; each rank records the watch's step at every optimizer step. Each optimizer keeps per-example
norms and its own flight recorder, each rank dumping into ``<out>/flight<r>``. Lightning's DDP launcher starts rank 1
by running this script again; each rank writes ``<out>/rank<r>.json``, rank 0's CSV logger the figures.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from torch_gradstats import FlightRecorder, SpikeGuard
from torch_gradstats.integrations.lightning import GradStatsCallback

RANK1, SPIKE_BATCH, NAN_BATCH, BATCHES = 1, 7, 10, 12


class GAN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.batch = -1
        self.phase = ""
        self.local: dict[str, dict[str, list[float]]] = {}  # "<batch>/<optimizer>" -> name -> local gradient

    def on_fit_start(self) -> None:
        for name, p in self.named_parameters():
            p.register_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.global_rank == RANK1 and self.batch == NAN_BATCH and name == "generator.2.weight":
                grad = grad.clone()
                grad[1, 2] = float("nan")
            self.local.setdefault(f"{self.batch}/{self.phase}", {})[name] = grad.double().flatten().tolist()
            return grad

        return hook

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        self.batch = batch_idx
        g_opt, d_opt = self.optimizers()
        seed = 1000 * self.global_rank + batch_idx  # each rank its own noise, as its own data
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(seed))
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.phase = "generator"
        self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), ones)
        if self.global_rank == RANK1 and batch_idx == SPIKE_BATCH:
            g_loss = g_loss + 1e4  # the loss spikes on this rank, its gradient does not
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        self.phase = "discriminator"
        self.toggle_optimizer(d_opt)
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        self.discriminator(real)  # its score on held-out real data (not logged: the rows stay one per batch)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        # fused Adam: the guard skips on the device; SGD: from the host
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-2, fused=True),
                torch.optim.SGD(self.discriminator.parameters(), lr=5e-3)]


class Recorder(L.Callback):
    """Before our callback: float64 norms of the stepping optimizer's gradients (DDP's average) and its weights."""

    def __init__(self, watched: GradStatsCallback) -> None:
        self.watched = watched
        self.watch_steps: dict[str, int] = {}  # the activation watch's step at each optimizer step
        self.norms: dict[str, dict[str, float]] = {}
        self.before: dict[str, list[torch.Tensor]] = {}
        self.unchanged: list[str] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        which = "generator" if optimizer is trainer.optimizers[0] else "discriminator"
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        key = f"{pl_module.batch}/{which}"
        self.watch_steps[key] = self.watched.activation_watch.step
        self.norms[key] = {n: float(p.grad.double().norm()) for n, p in pl_module.named_parameters()
                           if id(p) in mine}
        self.before[key] = [p.detach().clone() for n, p in pl_module.named_parameters() if id(p) in mine]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for which, module in (("generator", pl_module.generator), ("discriminator", pl_module.discriminator)):
            key = f"{batch_idx}/{which}"
            if all(torch.equal(a, p) for a, p in zip(self.before[key], module.parameters())):
                self.unchanged.append(key)


class Pending(L.Callback):
    """After our callback, when training ends (the last step a logging step): whether each optimizer's incident rows
    were all read or let go, so that a rank that never reports does not keep one row per step for ever."""

    def __init__(self, watched: GradStatsCallback) -> None:
        self.watched = watched
        self.pending: dict[str, bool] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for taker in (self.watched._takers or {}).values():
            assert taker.incidents is not None
            self.pending[taker.name] = taker.incidents.pending() is not None


def _plain(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state.double().flatten().tolist()
    return state


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for the rank it starts
    cb = GradStatsCallback(every_n_steps=1, optimizer_names=("generator", "discriminator"), on_nonfinite="skip",
                           spike_guard=SpikeGuard(window=16, sigma=6.0, min_history=4), watch_activations=True,
                           per_example=True, flight_recorder=FlightRecorder(32, dump_dir=out / f"flight{rank}"))
    rec, pending = Recorder(cb), Pending(cb)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(2 * 8 * BATCHES, 6, generator=g) + 2.0)
    trainer = L.Trainer(
        # each optimizer's backward leaves the other's parameters unused: find_unused_parameters, as any GAN needs
        accelerator="cpu", devices=2, strategy=DDPStrategy(find_unused_parameters=True), max_epochs=1,
        val_check_interval=4, limit_val_batches=2, callbacks=[rec, cb, pending], logger=CSVLogger(out),
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
    )
    model = GAN()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = torch.utils.data.DataLoader(ds, batch_size=8)
        trainer.fit(model, loader, loader)
    assert rank == trainer.local_rank, (rank, trainer.local_rank)  # each rank dumped into its own folder
    result = {
        "rank": trainer.global_rank,
        "local": model.local,
        "norms": rec.norms,
        "watch_steps": rec.watch_steps,
        "unchanged": rec.unchanged,
        "skipped": cb.skipped_steps,
        "guards": {name: _plain(guard.state_dict()) for name, guard in cb.spike_guards.items()},
        "weights": [p.detach().double().flatten().tolist() for p in model.parameters()],
        "pending": pending.pending,
        "dumps": {path.name: [json.loads(line) for line in path.read_text().splitlines()]
                  for path in sorted((out / f"flight{rank}").glob("*.jsonl"))},
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    # Both files exist once both ranks pass this barrier; then leave without the interpreter's teardown, where
    # gloo's threads can abort the process after a clean run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
