"""Run by tests/test_integrations_policies.py: a 2-rank Lightning DDP fit on the CPU (gloo) with a spike guard.

At one step rank 1's loss alone jumps by a constant (its gradient, and so DDP's averaged gradient, is unchanged):
a guard judging each rank's own loss would skip on rank 1 only and the ranks' weights would part. Each rank writes
its weights and the steps it saw skipped to ``<out>/rank<r>.json``.
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
from torch import nn

from torch_gradstats import SpikeGuard
from torch_gradstats.integrations.lightning import GradStatsCallback

SPIKE_RANK, SPIKE_STEP = 1, 6


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.global_rank == SPIKE_RANK and self.trainer.global_step == SPIKE_STEP:
            loss = loss + 1e4  # the loss spikes, the gradient does not
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)


class Weights(L.Callback):
    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.unchanged: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step - 1
        if all(torch.equal(a, p) for a, p in zip(self.before[step], pl_module.parameters())):
            self.unchanged.append(step)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    weights = Weights()
    cb = GradStatsCallback(every_n_steps=5, spike_guard=SpikeGuard(window=16, sigma=4.0, min_history=3))
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(160, 6, generator=g), torch.randint(0, 3, (160,), generator=g))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=10, callbacks=[weights, cb], logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    model = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=8))
    result = {
        "unchanged": weights.unchanged,
        "weights": [p.detach().double().flatten().tolist() for p in model.parameters()],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    # Leave without the interpreter's teardown, where gloo's threads can abort the process after a clean run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
