"""Checkpoint and resume: a run stopped at step k, every state the library offers saved (``torch.save``, loaded with
``weights_only=True``) and restored into fresh objects, makes the same decisions and logs the same figures as the run
that never stopped.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_gradstats as tg
from torch_gradstats import FlightRecorder

REPO = Path(__file__).resolve().parents[1]


def saved(state: Any) -> Any:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------------------- the flight recorder
def _tiny_trainer(dump_dir: Path, spike_at: int) -> tg.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def after_backward(tr: tg.Trainer) -> None:
        if tr.global_step == spike_at:
            for p in tr.model.parameters():
                assert p.grad is not None
                p.grad.mul_(1e3)

    return tg.Trainer(model, opt, nn.functional.mse_loss, progress=False, after_backward=after_backward,
                      spike_guard=tg.SpikeGuard(window=8, min_history=3),
                      flight_recorder=FlightRecorder(4, dump_dir=dump_dir))


def _epoch_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)  # 6 steps an epoch


def test_trainer_flight_recorder_dump_after_a_resume_is_the_uninterrupted_runs(tmp_path: Path,
                                                                                caplog: pytest.LogCaptureFixture):
    """A Trainer with a SpikeGuard and a FlightRecorder of 4 steps, a spike at optimizer step 9 of 12, found at the
    epoch's end. Resumed after the first epoch (step 6) into fresh objects, it dumps the spike to the same
    ``flight-9.jsonl`` with the same rows, steps 8 to 11 (the recorder counted its own records: 2 to 5)."""
    full = _tiny_trainer(tmp_path / "full", spike_at=9)
    loader = _epoch_data()
    full.train_epoch(loader)
    state = saved({"model": full.model.state_dict(), "optimizer": full.optimizer.state_dict(),
                   "guard": full.spike_guard.state_dict() if full.spike_guard else None, "step": full.global_step,
                   "epoch": full.epoch})
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        full.train_epoch(loader)
    resumed = _tiny_trainer(tmp_path / "resumed", spike_at=9)
    resumed.model.load_state_dict(state["model"])
    resumed.optimizer.load_state_dict(state["optimizer"])
    assert resumed.spike_guard is not None
    resumed.spike_guard.load_state_dict(state["guard"])
    resumed.global_step, resumed.epoch = state["step"], state["epoch"]
    resumed.train_epoch(loader)
    assert sorted(os.listdir(tmp_path / "full")) == sorted(os.listdir(tmp_path / "resumed"))
    want = (tmp_path / "full" / "flight-9.jsonl").read_text().splitlines()
    got = (tmp_path / "resumed" / "flight-9.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in got] == [8, 9, 10, 11]
    assert got == want


def test_flight_recorder_step_labels_its_rows_and_names_the_dump(tmp_path: Path):
    """``record(step=)`` labels the row (a resumed run's optimizer steps), in the dump's name and in messages;
    without it rows count the records."""
    rec = FlightRecorder(3, dump_dir=tmp_path)
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for step in (40, 41, 42, 43):
        rec.record(tg.grad_stats([("p", p)]), step=step)
    assert [r["step"] for r in rec.to_dicts()] == [41, 42, 43] and rec.steps == 4
    assert rec.dump().name == "flight-43.jsonl"
    plain = FlightRecorder(3)
    for _ in range(4):
        plain.record(tg.grad_stats([("p", p)]))
    assert [r["step"] for r in plain.to_dicts()] == [1, 2, 3]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            plain.record(tg.grad_stats([("p", p)]), step=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="guard changed at step 44"):  # messages name the row's step too
        rec.record(tg.grad_stats([("p", p)]), guard=tg.SpikeGuard(), step=44)


# ---------------------------------------------------------------------------------------------- weights_only
def test_states_of_policies_built_with_numpy_settings_load_with_weights_only():
    """Settings given as numpy scalars (read from a config array, say) are saved as Python numbers: a numpy scalar in a
    state_dict would make ``torch.load(weights_only=True)``, torch's default, refuse the whole checkpoint. The state
    loaded into new objects built with the defaults continues with the same figures."""
    np = pytest.importorskip("numpy")
    guard = tg.SpikeGuard(window=np.int64(16), sigma=np.float64(3.0), min_history=np.int32(3),
                          adopt_after=np.int64(2), max_consecutive=np.int64(5))
    clip = tg.AdaptiveClip(alpha=np.float64(0.9), z_thresh=np.float32(2.0), warmup=np.int64(5),
                           max_norm=np.float32(2.0), adopt_after=np.int64(3))
    ns = tg.NoiseScale(np.int64(8), ema=np.float32(0.9))
    norms = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 30.0, 1.02]
    copies: tuple[tg.SpikeGuard, tg.AdaptiveClip, tg.NoiseScale] | None = None
    for i, n in enumerate(norms):
        if i == 4:
            copies = (tg.SpikeGuard(), tg.AdaptiveClip(), tg.NoiseScale(8, ema=float(np.float32(0.9))))
            for copy, original in zip(copies, (guard, clip, ns)):
                state = saved(original.state_dict())
                assert all(type(v) in (bool, int, float, str, type(None), torch.Tensor) for v in state.values())
                copy.load_state_dict(state)  # type: ignore[attr-defined]
        for g, c, s in [(guard, clip, ns)] + ([copies] if copies else []):
            t = torch.tensor(n, dtype=torch.float64)
            g.observe(t, t)
            c.threshold(t)
            s.update(t * 2, t, big_batch_size=16)
    assert copies is not None
    assert copies[0].check() == guard.check() and copies[1].figures() == clip.figures()
    assert copies[2].to_dict() == ns.to_dict() and copies[0].window == 16 and copies[1].warmup == 5


# ---------------------------------------------------------------------------------------------- NoiseScale
def _noise_scale_run(steps: int) -> tg.NoiseScale:
    ns = tg.NoiseScale(4)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        big = torch.rand((), generator=g, dtype=torch.float64) + 1.0
        ns.update(big * 1.5, big, big_batch_size=16)
    return ns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_noise_scale_state_cast_to_a_lower_precision_loads(dtype: torch.dtype):
    """A state whose tensors were cast to float32, bfloat16 or float16 (a checkpoint written by code that casts
    every floating tensor) loads, and continues from the rounded values: its bias correction rounded up past
    ``1 - ema**steps`` by less than the dtype's precision was refused as out of range."""
    ns = _noise_scale_run(10)
    state = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in saved(ns.state_dict()).items()}
    resumed = tg.NoiseScale(4)
    resumed.load_state_dict(state)
    assert resumed.steps == 10
    rel = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert resumed.to_dict()["noise/b_simple"] == pytest.approx(ns.to_dict()["noise/b_simple"], rel=rel)


def test_noise_scale_state_with_a_bias_correction_past_its_bound_is_refused():
    state = saved(_noise_scale_run(10).state_dict())
    state["weight"] = state["weight"] * 1.01
    with pytest.raises(ValueError, match="weight"):
        tg.NoiseScale(4).load_state_dict(state)


# ---------------------------------------------------------------------------------------------- Lightning
def _spiking_module(spike_at: int) -> Any:
    L = pytest.importorskip("lightning.pytorch")

    class Spiking(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            return loss * 1e4 if self.trainer.global_step == spike_at else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Spiking()


def _lightning_fit(root: Path, max_steps: int, ckpt_path: str | None = None, checkpoint: bool = False) -> Any:
    L = pytest.importorskip("lightning.pytorch")
    from torch_gradstats.integrations.lightning import GradStatsCallback

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    data = DataLoader(TensorDataset(x.repeat(8, 1), y.repeat(8)), batch_size=4)  # equal batches: any restart point
    cb = GradStatsCallback(every_n_steps=1, spike_guard=tg.SpikeGuard(window=8, min_history=2, max_consecutive=1),
                           flight_recorder=FlightRecorder(8, dump_dir=root / "flight"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpoint,
                        default_root_dir=str(root), num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_spiking_module(spike_at=5), data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_lightning_streak_dump_after_a_resume_names_the_optimizer_step(tmp_path: Path):
    """The Lightning callback with a guard (``max_consecutive=1``) and a flight recorder, a spike at optimizer step
    5: the SpikeStreakError's dump is ``flight-5.jsonl``, its last row step 5, in the uninterrupted fit and in one
    resumed from a checkpoint at step 3 (which named it after the recorder's own count, ``flight-1.jsonl``, and
    could overwrite an earlier dump of that name)."""
    with pytest.raises(tg.SpikeStreakError):
        _lightning_fit(tmp_path / "full", max_steps=8)
    _lightning_fit(tmp_path / "first", max_steps=3, checkpoint=True)
    (ckpt,) = glob.glob(str(tmp_path / "first" / "**" / "*.ckpt"), recursive=True)
    with pytest.raises(tg.SpikeStreakError):
        _lightning_fit(tmp_path / "resumed", max_steps=8, ckpt_path=ckpt)
    for run, first in (("full", 0), ("resumed", 3)):
        assert sorted(os.listdir(tmp_path / run / "flight")) == ["flight-5.jsonl", "flight-5.png"], run
        rows = [json.loads(line) for line in (tmp_path / run / "flight" / "flight-5.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(first, 6)), run
        assert rows[-1]["guard/skipped"] == 1 and rows[-2]["guard/skipped"] == 0


# ---------------------------------------------------------------------------------------------- callbacks' states
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_callback_load_state_dict_refuses_a_state_that_is_not_a_callbacks():
    """A policy's own state_dict, or a misspelt key, given to a callback's load_state_dict restored nothing, silently
    (the Hugging Face callback then warned that the policies "start afresh unless you restored them with
    load_state_dict"): it is refused, naming the keys. A callback's own state, an empty one included, loads."""
    from torch_gradstats.integrations.lightning import GradStatsCallback as PLCallback
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback

    guard = tg.SpikeGuard(min_history=2)
    for norm in (1.0, 1.1, 0.9):
        guard.observe(torch.tensor(norm))
    for cls in (PLCallback, HFCallback):
        cb = cls(spike_guard=tg.SpikeGuard(), adaptive_clip=tg.AdaptiveClip())
        with pytest.raises(ValueError, match=r"key\(s\) \['window', 'sigma'"):
            cb.load_state_dict(saved(guard.state_dict()))
        with pytest.raises(ValueError, match=r"\['spike_gaurd'\]"):
            cb.load_state_dict({"spike_gaurd": saved(guard.state_dict())})
        with pytest.raises(TypeError, match="expected the dict"):
            cb.load_state_dict([guard.state_dict()])  # type: ignore[arg-type]
        assert not cb.policies_restored
        cb.load_state_dict({})
        cb.load_state_dict(saved({"spike_guard": guard.state_dict()}))
        assert cb.policies_restored and cb.spike_guard is not None and int(cb.spike_guard.steps) == 3


# ---------------------------------------------------------------------------------------------- the zoo, new processes
def _worker(*args: Any) -> None:
    """tests/_resume_worker.py in a new Python process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "_resume_worker.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "kind"), [("trainer", "resnet"), ("trainer", "gpt2"), ("loop", "resnet")])
def test_a_run_resumed_in_a_new_process_decides_and_logs_as_the_uninterrupted_run(tmp_path: Path, mode: str,
                                                                                   kind: str):
    """tests/_resume_worker.py: the zoo's ResNet or GPT-2 (its loss computed inside its forward) for 25 steps of 2
    micro-batches under CPU bf16 autocast and a GradScaler whose scale doubles every 3 steps, with a SpikeGuard and an
    AdaptiveClip, the loss x10 for good from step 12 and one x1000 spike at step 21: the library's Trainer (a
    FlightRecorder, a JSONL sink logging every step) or a plain loop on ResNet (a NoiseScale reading every
    micro-batch, ``step_or_skip`` with the scaler). Each checkpoint, saved after step 5 (both policies in their
    warm-up) and after step 15 (past it, the new level being adopted), is loaded with weights_only=True into new
    objects in another process than the one that saved it, whose run logs exactly the lines the uninterrupted run
    logged from there: every skip, clip coefficient, threshold, z-score, noise scale, summary and flight recorder
    dump."""
    if kind == "gpt2":
        pytest.importorskip("transformers")
    from _resume_worker import CHANGE, PER_EPOCH, SAVE_AT, SPIKE

    _worker(mode, kind, tmp_path)
    _worker(mode, kind, tmp_path, *SAVE_AT)  # one new process, new objects for each resumed run
    if mode == "loop":
        full = json.loads((tmp_path / "loop-0.json").read_text())
        for start in SAVE_AT:
            assert json.loads((tmp_path / f"loop-{start}.json").read_text()) == full[start:], start
        assert all(math.isfinite(r["noise/b_simple"]) for r in full)
        rows = full
    else:
        lines = (tmp_path / "trainer-0.jsonl").read_text().splitlines()
        epochs = json.loads((tmp_path / "trainer-0.json").read_text())
        for start in SAVE_AT:
            assert (tmp_path / f"trainer-{start}.jsonl").read_text().splitlines() == lines[start:], start
            assert json.loads((tmp_path / f"trainer-{start}.json").read_text()) == epochs[start // PER_EPOCH:], start
            dumps = sorted(p.name for p in (tmp_path / f"flight-{start}").glob("*.jsonl"))
            assert dumps and set(dumps) <= {p.name for p in (tmp_path / "flight-0").glob("*.jsonl")}, start
            for name in dumps:
                assert (tmp_path / f"flight-{start}" / name).read_text() == (tmp_path / "flight-0" / name).read_text()
        rows = [json.loads(line) for line in lines]
    # What the runs went through: the policies in their warm-up at the first checkpoint (no clip threshold yet),
    # the change of level skipped then adopted (clipped, then clipped less) around the second, the spike skipped.
    assert rows[SAVE_AT[0] - 1]["clip/threshold"] in (None, math.inf) and rows[SAVE_AT[0] - 1]["guard/skipped"] == 0
    assert rows[CHANGE]["clip/coef"] < 0.5 and rows[CHANGE]["guard/skipped"] >= 1
    assert rows[SAVE_AT[0] - 1]["clip/coef"] == 1 and 0 < rows[SAVE_AT[1]]["clip/coef"] < 1
    assert rows[SPIKE]["guard/skipped"] > rows[SPIKE - 1]["guard/skipped"] and rows[SPIKE]["clip/coef"] < 0.01


def _resnet_module(change_at: int) -> Any:
    L = pytest.importorskip("lightning.pytorch")
    from model_zoo import resnet

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = resnet(0)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            return loss * 10 if self.trainer.global_step >= change_at else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    return Net()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_lightning_fit_resumed_in_and_after_the_warm_up_logs_the_uninterrupted_fits_figures(tmp_path: Path):
    """The zoo's ResNet under Lightning, ``precision="bf16-mixed"``, ``accumulate_grad_batches=2`` (4 steps an
    epoch), the callback's SpikeGuard and AdaptiveClip logging every step, the loss x10 for good from step 10.
    Resumed with ``ckpt_path`` from the checkpoints of epochs 0 (step 4, both policies in their warm-up) and 2 (step
    12, the new level being adopted): every logged guard and clip figure and gradient norm equals the uninterrupted
    fit's, to the last digit."""
    import csv

    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from torch_gradstats.integrations.lightning import GradStatsCallback

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 6, 6, generator=g), torch.randint(0, 5, (32,), generator=g)

    def fit(root: Path, ckpt: str | None = None) -> dict[int, dict[str, str]]:
        cb = GradStatsCallback(every_n_steps=1, per_param=False,
                               spike_guard=tg.SpikeGuard(window=8, sigma=3.0, min_history=6, adopt_after=3),
                               adaptive_clip=tg.AdaptiveClip(warmup=6, adopt_after=4))
        saver = ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=5, callbacks=[cb, saver],
                            logger=CSVLogger(str(root), name="csv"), enable_progress_bar=False,
                            enable_model_summary=False, log_every_n_steps=1, precision="bf16-mixed",
                            accumulate_grad_batches=2, num_sanity_val_steps=0, default_root_dir=str(root))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_resnet_module(change_at=10), DataLoader(TensorDataset(x, y), batch_size=4), ckpt_path=ckpt)
        rows: dict[int, dict[str, str]] = {}
        assert trainer.logger is not None and trainer.logger.log_dir is not None
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            for row in csv.DictReader(f):
                rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v and k != "step"})
        return rows

    full = fit(tmp_path / "full")
    keys = ["grad_2.0_norm_total", "guard/skipped", "guard/consecutive", "guard/grad_norm_z", "guard/loss_z",
            "clip/threshold", "clip/coef"]
    assert sorted(full) == list(range(20)) and all(k in full[19] for k in keys)
    assert full[3]["clip/threshold"] == "inf" and float(full[10]["clip/coef"]) < 0.5
    assert float(full[12]["clip/coef"]) < 1 and float(full[19]["guard/skipped"]) >= 1
    for epoch, first in ((0, 4), (2, 12)):
        resumed = fit(tmp_path / f"resumed-{epoch}", str(tmp_path / "full" / "ckpt" / f"epoch={epoch}.ckpt"))
        assert sorted(resumed) == list(range(first, 20)), epoch
        for step in resumed:
            assert {k: resumed[step][k] for k in keys} == {k: full[step][k] for k in keys}, (epoch, step)


# ---------------------------------------------------------------------------------------------- Hugging Face
@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
                    reason="needs transformers and accelerate")
def test_hf_run_resumed_from_its_checkpoints_in_and_after_the_warm_up_logs_the_uninterrupted_runs_figures(
        tmp_path: Path):
    """The callback's statistics saved into each of the Trainer's checkpoint folders (gradstats.pt) and read back by
    ``train(resume_from_checkpoint=True)`` (docs/integrations.md), on the zoo's GPT-2, bf16 on the CPU, 2
    micro-batches a step, a fused AdamW wrapped by the callback, the loss x10 for good from step 8. Resumed from
    checkpoint-4 (both policies in their warm-up) and checkpoint-12 (the new level being adopted, mid epoch), each
    copied alone into a new output_dir: every logged loss, gradient norm, guard and clip figure equals the
    uninterrupted run's."""
    import transformers
    from model_zoo import gpt2

    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    class Level(transformers.TrainerCallback):
        factor = 1.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.factor = 10.0 if state.global_step >= 8 else 1.0

    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]  # 8 steps an epoch

    def run(out: str, checkpoint: str | None = None) -> dict[int, dict[str, Any]]:
        if checkpoint is not None:  # the only checkpoint of the new output_dir: resume_from_checkpoint=True finds it
            shutil.copytree(tmp_path / "full" / checkpoint, tmp_path / out / checkpoint)
        cb = GradStatsCallback(spike_guard=tg.SpikeGuard(window=8, sigma=3.0, min_history=6, adopt_after=3),
                               adaptive_clip=tg.AdaptiveClip(warmup=6, adopt_after=4), per_param=False)
        model, level = gpt2(), Level()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0

        def scaled(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            output["loss"] = output["loss"] * level.factor  # the output's key and attribute alike
            return output

        model.register_forward_hook(scaled, with_kwargs=True)
        opt = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=True,
            use_cpu=True, max_grad_norm=0.0, max_steps=16, logging_steps=1, save_strategy="steps", save_steps=4,
            learning_rate=1e-3, report_to=[], disable_tqdm=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                                       callbacks=[level])
        add_to_trainer(trainer, cb)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=checkpoint is not None)
        assert cb.policies_restored == (checkpoint is not None)
        return {e["step"]: e for e in trainer.state.log_history if "loss" in e}

    keys = ["loss", "grad/total_norm", "guard/skipped", "guard/consecutive", "guard/grad_norm_z", "guard/loss_z",
            "clip/threshold", "clip/coef"]
    full = run("full")
    assert sorted(p.parent.name for p in (tmp_path / "full").glob("checkpoint-*/gradstats.pt")) == [
        "checkpoint-12", "checkpoint-16", "checkpoint-4", "checkpoint-8"]
    assert sorted(full) == list(range(1, 17))
    assert full[4]["clip/threshold"] == math.inf and full[9]["clip/coef"] < 0.5 and full[9]["guard/skipped"] == 1
    assert full[13]["clip/coef"] < 1
    for checkpoint, first in (("checkpoint-4", 5), ("checkpoint-12", 13)):
        resumed = run(f"resumed-{first}", checkpoint)
        assert sorted(s for s in resumed if s >= first) == list(range(first, 17)), checkpoint
        for step in range(first, 17):
            assert {k: resumed[step][k] for k in keys} == {k: full[step][k] for k in keys}, (checkpoint, step)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_lightning_fit_resumed_from_a_checkpoint_without_the_policies_statistics_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A fit resumed with ``ckpt_path`` from a checkpoint saved before the callback had its SpikeGuard: the guard
    starts afresh (a new warm-up), which the Hugging Face callback says in a warning and the Lightning one did not;
    resumed from a checkpoint that holds the guard's statistics, nothing is said."""
    L = pytest.importorskip("lightning.pytorch")
    from torch_gradstats.integrations.lightning import GradStatsCallback

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    data = DataLoader(TensorDataset(x.repeat(4, 1), y.repeat(4)), batch_size=4)

    def fit(root: Path, guard: bool, max_steps: int, ckpt: str | None = None) -> None:
        cb = GradStatsCallback(spike_guard=tg.SpikeGuard(min_history=2) if guard else None)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[cb], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_spiking_module(spike_at=-1), data, ckpt_path=ckpt)

    for guard in (False, True):
        fit(tmp_path / f"first-{guard}", guard, max_steps=2)
    said = []
    for guard in (False, True):
        (ckpt,) = glob.glob(str(tmp_path / f"first-{guard}" / "**" / "*.ckpt"), recursive=True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
            fit(tmp_path / f"resumed-{guard}", True, max_steps=4, ckpt=ckpt)
        said.append([r.getMessage() for r in caplog.records if "not restored" in r.getMessage()])
    warning = ("torch_gradstats: GradStatsCallback resumed at step 2 from a checkpoint that holds no statistics of its "
               "spike_guard: they are not restored (new ones start afresh, warm-up included)")
    assert said == [[warning], []]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_callback_state_with_a_corrupt_policy_state_loads_neither_policy():
    """A callback state whose clip state is corrupt (its EMA NaN): the ValueError names the key, and the guard, whose
    state came first and was sound, is left as it was (it was replaced, so the callback was half restored)."""
    from torch_gradstats.integrations.lightning import GradStatsCallback as PLCallback
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback

    source = HFCallback(spike_guard=tg.SpikeGuard(min_history=2), adaptive_clip=tg.AdaptiveClip(warmup=2))
    assert source.spike_guard is not None and source.adaptive_clip is not None
    for n in (1.0, 1.1, 0.9, 1.2):
        source.spike_guard.observe(torch.tensor(n))
        source.adaptive_clip.threshold(torch.tensor(n))
    state = saved(source.state_dict())
    state["adaptive_clip"]["ema"][0] = math.nan
    for cls in (PLCallback, HFCallback):
        cb = cls(spike_guard=tg.SpikeGuard(window=8), adaptive_clip=tg.AdaptiveClip())
        with pytest.raises(ValueError, match=r"'ema'\[0\]"):
            cb.load_state_dict(state)
        assert cb.spike_guard is not None and cb.spike_guard.window == 8 and int(cb.spike_guard.steps) == 0, cls
        assert not cb.policies_restored


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_lightning_state_of_several_optimizers_with_one_corrupt_loads_none(tmp_path: Path):
    """Several optimizers, each judged by its own guard: a checkpoint state whose discriminator guard is corrupt (a
    count past its window) is refused naming the key, and the generator's guard, whose state came first and was
    sound, is left as it was (it was loaded: the callback was half restored)."""
    from test_integrations_lightning_optimizers import GAN, _fit, _trainer

    from torch_gradstats.integrations.lightning import GradStatsCallback

    names = ("generator", "discriminator")
    cb = GradStatsCallback(optimizer_names=names, spike_guard=tg.SpikeGuard(window=16, min_history=2))
    _fit(_trainer(tmp_path, [cb], max_steps=2), GAN())
    before = {n: saved(g.state_dict()) for n, g in cb.spike_guards.items()}
    source = tg.SpikeGuard(window=16, min_history=2)
    for n in (1.0, 1.1, 0.9):
        source.observe(torch.tensor(n))
    bad = saved(source.state_dict())
    bad["count"][0] = 17
    with pytest.raises(ValueError, match="'count' must be in"):
        cb.load_state_dict({"optimizers": {"generator": {"spike_guard": saved(source.state_dict())},
                                           "discriminator": {"spike_guard": bad}}})
    for name, state in before.items():
        now = cb.spike_guards[name].state_dict()
        assert all(torch.equal(now[k].nan_to_num(-1), v.nan_to_num(-1)) if isinstance(v, torch.Tensor) else now[k] == v
                   for k, v in state.items()), name
