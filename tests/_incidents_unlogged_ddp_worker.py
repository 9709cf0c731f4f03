"""Run by tests/test_incidents_unlogged.py: a 2-rank Lightning DDP fit on the CPU (gloo) that logs no step
(``log_every_n_steps=0``), with per-example norms, ``on_nonfinite="skip"`` and a flight recorder dumping into
``<out>/flight<r>``; a NaN put into one step's averaged gradient on both ranks. Each rank writes ``<out>/rank<r>.json``:
the most incident rows left unread after a batch, and the dumps it wrote. Lightning's DDP launcher starts rank 1 by
running this script again."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from torch_gradstats import FlightRecorder
from torch_gradstats.integrations.lightning import GradStatsCallback
from torch_gradstats.training._incidents import UNREAD_MAX

NAN = 5  # the step whose gradient gets a NaN
STEPS = UNREAD_MAX + 10


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self) -> None:  # after DDP's average: both ranks alike
        if self.global_step == NAN:
            self.net[2].weight.grad[0, 1] = float("nan")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Pending(L.Callback):
    """The callback's unread incident rows after each batch (placed after it)."""

    def __init__(self, watched: GradStatsCallback) -> None:
        self.watched, self.most = watched, 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        incidents = self.watched.taker.incidents
        assert incidents is not None
        pending = incidents.pending()
        self.most = max(self.most, 0 if pending is None else int(pending.floats[0].shape[0]))


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    cb = GradStatsCallback(per_example=True, on_nonfinite="skip",
                           flight_recorder=FlightRecorder(STEPS + 1, dump_dir=out / f"flight{rank}"))
    pending = Pending(cb)
    x = torch.randn(2 * 2 * STEPS, 3, generator=torch.Generator().manual_seed(1))
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_epochs=1, callbacks=[cb, pending],
                        logger=False, log_every_n_steps=0, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=2))
    result = {"steps": trainer.global_step, "most": pending.most,
              "dumps": sorted(p.name for p in (out / f"flight{rank}").glob("*.jsonl"))}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
