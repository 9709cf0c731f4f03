"""The logging-rank arguments of the sinks and callbacks, in one process (tests/test_distributed_pipeline.py runs
them on 2 and 4 gloo ranks): bad values are refused before any file is opened, and without torch.distributed
the one process writes."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import torch_gradstats as tg
from torch_gradstats.integrations import CSVSink, JSONLSink


def _report() -> tg.GradReport:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    return tg.grad_stats([("w", p)]).report()


@pytest.mark.parametrize("sink_cls", [CSVSink, JSONLSink])
def test_file_sinks_refuse_a_bad_log_rank_before_opening(tmp_path: Path, sink_cls: type) -> None:
    path = tmp_path / "out"
    with pytest.raises(TypeError, match=f"{sink_cls.__name__}: log_rank must be an int"):
        sink_cls(path, log_rank="0")
    with pytest.raises(TypeError, match="log_rank must be an int"):
        sink_cls(path, log_rank=True)
    with pytest.raises(ValueError, match=f"{sink_cls.__name__}: log_rank must be a global rank >= 0"):
        sink_cls(path, log_rank=-1)
    assert not path.exists()


def test_without_torch_distributed_the_process_writes(tmp_path: Path) -> None:
    with CSVSink(tmp_path / "a.csv", log_rank=0) as sink:
        assert sink.writes
        sink.log(_report(), 7)
    (row,) = list(csv.DictReader((tmp_path / "a.csv").open()))
    assert row["step"] == "7" and float(row["total_norm"]) == pytest.approx(5.0)


def test_tensorboard_and_wandb_sinks_take_the_same_arguments(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch_gradstats.integrations.tensorboard import TensorBoardSink
    from torch_gradstats.integrations.wandb import WandbSink

    with pytest.raises(TypeError, match="TensorBoardSink: log_rank must be an int"):
        TensorBoardSink(tmp_path / "tb", log_rank=1.0)
    assert not (tmp_path / "tb").exists()
    with pytest.raises(ValueError, match="WandbSink: log_rank must be a global rank"):
        WandbSink(log_rank=-2)


def test_mlflow_sink_takes_the_same_arguments() -> None:
    from torch_gradstats.integrations.mlflow import MLflowSink

    with pytest.raises(TypeError, match="MLflowSink: log_rank must be an int"):
        MLflowSink(log_rank="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MLflowSink: log_rank must be a global rank"):
        MLflowSink(log_rank=-1)
    assert MLflowSink(log_rank=0).writes  # one process: it writes


def test_lightning_callback_logging_rank_arguments() -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    from torch_gradstats.integrations.lightning import GradStatsCallback

    with pytest.raises(TypeError, match="GradStatsCallback: log_rank must be an int"):
        GradStatsCallback(log_rank="last")
    with pytest.raises(ValueError, match="stage_group"):
        GradStatsCallback(stage_group=object(), log_weight_norms=True)
    cb = GradStatsCallback(log_rank=0)
    trainer = lightning.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, accelerator="cpu", devices=1)
    assert cb._logs_here(trainer) and GradStatsCallback()._logs_here(trainer)


def test_transformers_callback_logging_rank_arguments() -> None:
    pytest.importorskip("transformers")
    from torch_gradstats.integrations.transformers import GradStatsCallback

    with pytest.raises(TypeError, match="GradStatsCallback: log_rank must be an int"):
        GradStatsCallback(log_rank=[0])
    with pytest.raises(ValueError, match="stage_group"):
        GradStatsCallback(stage_group=object(), log_update_ratio=True)
    assert GradStatsCallback(log_rank=0).log_rank == 0
