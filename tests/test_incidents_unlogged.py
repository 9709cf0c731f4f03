"""Incident rows where no step is ever logged (Lightning's ``log_every_n_steps=0``): the rows each step writes on the
device are read once enough of them wait, so they neither pile up for the whole run nor go untold; under DDP only by
the logging rank. A small model trained for real in Lightning on the CPU (one process, then two gloo ranks); a NaN
put into one step's gradient."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_gradstats import FlightRecorder
from torch_gradstats.training._incidents import UNREAD_MAX

L = pytest.importorskip("lightning.pytorch")

from _incidents_unlogged_ddp_worker import NAN, STEPS, Pending, Tiny  # noqa: E402  (the two-rank run's own)

from torch_gradstats.integrations.lightning import GradStatsCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORKER = Path(__file__).with_name("_incidents_unlogged_ddp_worker.py")
REPO = Path(__file__).resolve().parents[1]


def test_rows_read_where_no_step_logs(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(STEPS * 2, 3, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    callback = GradStatsCallback(per_example=True, on_nonfinite="skip",
                                 flight_recorder=FlightRecorder(STEPS + 1, dump_dir=tmp_path))
    pending = Pending(callback)
    trainer = L.Trainer(max_epochs=1, log_every_n_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, pending],
                        default_root_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        trainer.fit(Tiny(), loader)
    assert trainer.global_step == STEPS
    assert 0 < pending.most <= UNREAD_MAX  # bounded, not one row per step of the run
    dump = tmp_path / f"flight-{NAN}.jsonl"
    assert dump.is_file()  # the skipped step was told, with its dump
    told = [r.getMessage() for r in caplog.records if "flight recorder dumped" in r.getMessage()]
    assert len(told) == 1 and f"optimizer step {NAN} skipped (non-finite gradient)" in told[0]
    assert str(dump) in told[0]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_under_ddp_only_the_logging_rank_reads_and_dumps(tmp_path: Path) -> None:
    """Two CPU ranks (tests/_incidents_unlogged_ddp_worker.py, launched by Lightning itself): the logging rank reads
    its rows once they wait and dumps the skipped step; rank 1, which tells nothing, lets its rows go at every step,
    so it neither keeps them nor writes a second dump of the same step (into the same dump_dir, in a real run)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], check=False, env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["steps"] == r1["steps"] == STEPS
    assert 0 < r0["most"] <= UNREAD_MAX
    assert r0["dumps"] == [f"flight-{NAN}.jsonl"]
    assert r1["most"] == 0 and r1["dumps"] == []
