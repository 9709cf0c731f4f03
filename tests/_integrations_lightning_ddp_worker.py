"""Run by tests/test_integrations_lightning_ddp.py: a 2-rank Lightning DDP fit on the CPU (gloo) with the callback.

Lightning's DDP launcher starts rank 1 by running this script again. Each rank writes what it saw to
``<out>/rank<r>.json``; rank 0's CSV logger writes the logged figures.
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
from torch import nn

from torch_gradstats.integrations.lightning import GradStatsCallback

NAN_RANK, NAN_STEP = 1, 3


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_fit_start(self) -> None:
        # A NaN in one rank's local gradient only, made during the backward (a tensor hook runs before DDP's
        # reduction hook), so DDP's averaging carries it to every rank, as a real one would be.
        def poison(grad: torch.Tensor) -> torch.Tensor:
            if self.global_rank == NAN_RANK and self.trainer.global_step == NAN_STEP:
                grad = grad.clone()
                grad[0, 0] = float("nan")
            return grad

        self.net[2].weight.register_hook(poison)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.norms[trainer.global_step] = {n: float(p.grad.double().norm()) for n, p in pl_module.named_parameters()}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rec = Recorder()
    cb = GradStatsCallback(every_n_steps=2, on_nonfinite="skip")
    reports = []
    real_report = cb.taker.report

    def counting(stats: Any) -> Any:
        reports.append(1)
        return real_report(stats)

    cb.taker.report = counting  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, callbacks=[rec, cb], logger=CSVLogger(out),
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
    )
    model = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=8))
    result = {
        "rank": trainer.global_rank,
        "reports": len(reports),
        "skipped": cb.skipped_steps,
        "norms": {str(k): v for k, v in rec.norms.items()},
        "weights": [p.detach().double().flatten().tolist() for p in model.parameters()],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    # Both files exist once both ranks pass this barrier; then leave without the interpreter's teardown, where
    # gloo's threads can abort the process ("terminate called without an active exception") after a clean run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
