"""SpikeGuard, AdaptiveClip and ActivationWatch through the Lightning and Hugging Face callbacks, with real Lightning
and real ``transformers.Trainer`` runs on the CPU (no mocks): a spike injected at a known step leaves the
parameters unchanged on that step, and the policies' figures are logged."""

from __future__ import annotations

import csv
import logging
import math
import os
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _host_reads import HostReads, instrument
from torch import nn

from torch_gradstats import ActivationWatch, AdaptiveClip, SpikeGuard, SpikeStreakError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger

from torch_gradstats.integrations.lightning import GradStatsCallback

pytestmark = pytest.mark.usefixtures("one_thread")

SPIKE = 6  # the optimizer step whose loss (and so gradient) is multiplied by 1e4
POLICY_KEYS = {"guard/skipped", "guard/consecutive", "guard/grad_norm_z", "guard/loss_z"}
CLIP_KEYS = {"clip/threshold", "clip/coef"}


# ------------------------------------------------------------------------------------------------- Lightning
class Tiny(L.LightningModule):
    def __init__(self, fused: bool = True, spike_at: int | None = SPIKE) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.fused = fused
        self.spike_at = spike_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        return loss * 1e4 if self.trainer.global_step == self.spike_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=self.fused)


class Weights(L.Callback):
    """The weights before and after every optimizer step."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]

    def changed(self, step: int) -> bool:
        return any(not torch.equal(a, b) for a, b in zip(self.before[step], self.after[step]))


def _data(n: int = 96) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(module: Any, callbacks: list, tmp_path: Path, max_steps: int = 10, **kw: Any) -> CSVLogger:
    logger = CSVLogger(str(tmp_path))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=logger,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        log_every_n_steps=kw.pop("log_every_n_steps", 1), **kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data())
    return logger


def _rows(logger: CSVLogger) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update(
                {k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return rows


def _guard(**kw: Any) -> SpikeGuard:
    return SpikeGuard(window=16, sigma=4.0, min_history=3, **kw)


@pytest.mark.parametrize("fused", [True, False])
def test_lightning_guard_skips_the_spike_step_and_logs_its_figures(tmp_path: Path, fused: bool,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    weights = Weights()
    cb = GradStatsCallback(spike_guard=_guard())
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        rows = _rows(_fit(Tiny(fused=fused), [weights, cb], tmp_path))
    assert not weights.changed(SPIKE)  # the spike's step left every parameter as it was
    assert all(weights.changed(s) for s in range(10) if s != SPIKE)
    assert POLICY_KEYS <= set(rows[SPIKE])
    assert rows[SPIKE - 1]["guard/skipped"] == 0 and rows[SPIKE]["guard/skipped"] == 1
    assert rows[SPIKE]["guard/consecutive"] == 1 and rows[SPIKE + 1]["guard/consecutive"] == 0
    assert rows[SPIKE]["guard/grad_norm_z"] > 4 and rows[SPIKE]["guard/loss_z"] > 4
    # the non-fused optimizer is skipped from the host, and says so once
    host = [r for r in caplog.records if "decides each step on the host" in r.getMessage()]
    assert len(host) == (0 if fused else 1)


def test_lightning_guard_on_a_fused_optimizer_reads_nothing_on_steps_that_do_not_log(tmp_path: Path) -> None:
    cb = GradStatsCallback(every_n_steps=5, spike_guard=_guard(), adaptive_clip=AdaptiveClip(warmup=3))
    counts = instrument(cb, ("on_before_optimizer_step",))
    weights = Weights()
    rows = _rows(_fit(Tiny(fused=True), [weights, cb], tmp_path))
    assert not weights.changed(SPIKE)
    assert counts["reads"] == 0  # the skip is decided on the device
    assert counts["report"] == 2  # steps 4 and 9: one transfer each, the policies' figures in it
    assert POLICY_KEYS | CLIP_KEYS <= set(rows[9])
    assert rows[9]["guard/skipped"] == 1


def test_lightning_adaptive_clip_clips_to_its_threshold(tmp_path: Path) -> None:
    seen: dict[int, float] = {}

    class After(L.Callback):  # after ours: the gradients the optimizer receives
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen[trainer.global_step] = float(torch.stack([p.grad.norm() for p in pl_module.parameters()]).norm())

    clip = AdaptiveClip(warmup=3, z_thresh=2.0)
    rows = _rows(_fit(Tiny(), [GradStatsCallback(adaptive_clip=clip), After()], tmp_path))
    spike = rows[SPIKE]
    assert CLIP_KEYS <= set(spike)
    assert spike["clip/coef"] < 1e-2  # the spike was clipped hard
    assert seen[SPIKE] == pytest.approx(spike["clip/threshold"], rel=1e-4)
    assert spike["grad_stats/total_norm"] > 100 * spike["clip/threshold"]  # logged: the norm before clipping
    assert rows[1]["clip/coef"] == 1.0 and math.isinf(rows[1]["clip/threshold"])  # warm-up: no clip


def test_lightning_adaptive_clip_and_gradient_clip_val_are_refused_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gradient_clip_val or adaptive_clip"):
        _fit(Tiny(), [GradStatsCallback(adaptive_clip=AdaptiveClip())], tmp_path, gradient_clip_val=1.0)


def test_lightning_spike_streak_raises_at_the_log_step(tmp_path: Path) -> None:
    class Spiky(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * 1e4 if self.trainer.global_step >= SPIKE else loss

    weights = Weights()
    cb = GradStatsCallback(every_n_steps=5, spike_guard=_guard(max_consecutive=2))
    with pytest.raises(SpikeStreakError) as err:
        _fit(Spiky(), [weights, cb], tmp_path, max_steps=20)
    # the streak reached 2 at step 7; the next log step, 9, raises (a lag of up to every_n_steps - 1 steps), before
    # its optimizer step, naming the streak's latest step (the guard counts from one: optimizer step 9)
    assert err.value.step == 10 and err.value.consecutive == 4
    assert max(weights.after) == 8 and not any(weights.changed(s) for s in range(SPIKE, 9))


def test_lightning_policy_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="spike_guard must be a SpikeGuard"):
        GradStatsCallback(spike_guard=3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="adaptive_clip must be an AdaptiveClip"):
        GradStatsCallback(adaptive_clip=SpikeGuard())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="watch_activations must be an ActivationWatch"):
        GradStatsCallback(watch_activations="yes")  # type: ignore[arg-type]


def test_both_callbacks_give_back_their_policies_and_their_state_under_the_same_names(
        caplog: pytest.LogCaptureFixture) -> None:
    """``spike_guard``, ``adaptive_clip`` (None where not given), ``state_dict()`` and ``load_state_dict()``, the same
    on the Lightning and the Hugging Face callback: a state saved by one restores into the other's fresh policies,
    and a saved policy the callback lacks is named in a warning."""
    pytest.importorskip("transformers")
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback

    for cls in (GradStatsCallback, HFCallback):
        guard, clip = SpikeGuard(min_history=2), AdaptiveClip(warmup=2)
        cb = cls(spike_guard=guard, adaptive_clip=clip)
        assert cb.spike_guard is guard and cb.adaptive_clip is clip, cls
        bare = cls()
        assert bare.spike_guard is None and bare.adaptive_clip is None and bare.state_dict() == {}, cls
        for norm, loss in ((1.0, 2.0), (1.1, 2.1), (0.9, 1.9)):
            guard.observe(torch.tensor(norm, dtype=torch.float64), torch.tensor(loss))
            clip.threshold(torch.tensor(norm, dtype=torch.float64))
        state = cb.state_dict()
        assert set(state) == {"spike_guard", "adaptive_clip"}, cls
        other = (HFCallback if cls is GradStatsCallback else GradStatsCallback)(
            spike_guard=SpikeGuard(), adaptive_clip=AdaptiveClip())
        assert not other.policies_restored
        other.load_state_dict(state)
        assert other.policies_restored and other.spike_guard is not None and other.adaptive_clip is not None
        assert int(other.spike_guard.steps) == 3, cls
        for name, value in clip.state_dict().items():
            got = other.adaptive_clip.state_dict()[name]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (cls, name)
        with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
            caplog.clear()
            bare.load_state_dict(state)
        assert [r.getMessage() for r in caplog.records].count(
            "torch_gradstats: the checkpoint holds GradStatsCallback's spike_guard statistics, but this callback has "
            "no spike_guard: they are not restored") == 1, cls


def test_lightning_watch_names_the_origin_and_the_parameter(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    module = Tiny(spike_at=None)

    class Break(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 3:  # an Inf weight: net.2 is the forward origin of the non-finite values
                with torch.no_grad():
                    pl_module.net[2].weight[0, 0] = float("inf")

    cb = GradStatsCallback(on_nonfinite="stop", watch_activations=True)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        rows = _rows(_fit(module, [Break(), cb], tmp_path))
    warning = [r.getMessage() for r in caplog.records if "non-finite gradient at optimizer step 3" in r.getMessage()]
    assert len(warning) == 1
    # the first non-finite gradient in model order is net.0's (the NaN flowed back); the watch names the producer
    assert "'net.0.weight'" in warning[0] and "forward origin net.2" in warning[0]
    assert rows[3]["act/nonfinite"] == 1.0
    assert rows[3]["act/origin_index"] >= 0
    assert cb.last_activation_report is not None and cb.last_activation_report.origin == "net.2"
    assert rows[2]["act/nonfinite"] == 0.0 and rows[2]["act/origin_index"] == -1
    assert cb.activation_watch is None  # the watch made for True is removed at teardown


# ------------------------------------------------------------------------------------------------- transformers
def _hf() -> Any:
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")


def _gpt2() -> Any:
    transformers = _hf()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _tokens(n: int = 48) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def _hf_args(tmp_path: Path, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "max_steps": 10, "logging_steps": 1,
        "max_grad_norm": 0.0, "report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True,
        "seed": 0,
    }
    base.update(kw)
    return _hf().TrainingArguments(**base)


def _spiker(model: Any, at: int) -> Any:
    """A callback that multiplies the model's loss by 1e4 during optimizer step ``at`` (a forward hook registered
    before the guard's, so the guard sees the spiked loss), and keeps the weights around each step."""
    transformers = _hf()

    class Spiker(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.active = False
            self.before: dict[int, list[torch.Tensor]] = {}
            self.after: dict[int, list[torch.Tensor]] = {}

            def hook(module: Any, args: Any, output: Any) -> Any:
                if self.active and module.training:
                    output.loss = output.loss * 1e4
                return output

            model.register_forward_hook(hook)

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.active = state.global_step == at
            self.before[state.global_step] = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.after[state.global_step - 1] = [p.detach().clone() for p in model.parameters()]

        def changed(self, step: int) -> bool:
            return any(not torch.equal(a, b) for a, b in zip(self.before[step], self.after[step]))

    return Spiker()


def _hf_train(trainer: Any) -> dict[int, dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return {e["step"]: e for e in trainer.state.log_history if "loss" in e}


@pytest.mark.parametrize("fused", [True, False])
def test_hf_wrapped_optimizer_skips_the_spike_step(tmp_path: Path, fused: bool) -> None:
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    transformers = _hf()
    model = _gpt2()
    spiker = _spiker(model, SPIKE)
    cb = HFCallback(spike_guard=_guard(), adaptive_clip=AdaptiveClip(warmup=3, max_norm=1e6))
    opt = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused))
    wrapped, step_reads, depth = opt.step, [], []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:  # host reads made by each step (step_or_skip re-enters)
        if depth:
            return wrapped(*args, **kwargs)
        depth.append(1)
        try:
            with HostReads() as mode:
                out = wrapped(*args, **kwargs)
        finally:
            depth.clear()
        step_reads.append(mode.count)
        return out

    opt.step = types.MethodType(counted, opt)  # type: ignore[method-assign]
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path), train_dataset=_tokens(),
                                   callbacks=[spiker], optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    counts = instrument(cb, ("_after_backward",))
    logs = _hf_train(trainer)
    assert counts["reads"] == 0  # the guard and the clip decide on the device
    assert len(step_reads) == 10
    if fused:  # skipped on the device (a non-fused AdamW reads its own step counts, besides the skip's one read)
        assert step_reads == [0] * 10
    assert not spiker.changed(SPIKE)  # parameters unchanged on the spike's step
    assert all(spiker.changed(s) for s in range(10) if s != SPIKE)
    step = logs[SPIKE + 1]  # the Trainer logs optimizer step s at global step s + 1
    assert POLICY_KEYS | CLIP_KEYS <= set(step)
    assert step["guard/skipped"] == 1 and step["guard/consecutive"] == 1
    assert step["guard/grad_norm_z"] > 4 and step["guard/loss_z"] > 4
    assert logs[SPIKE]["guard/skipped"] == 0 and logs[SPIKE + 2]["guard/consecutive"] == 0
    assert step["clip/coef"] < 1e-2


def test_hf_spike_guard_needs_the_wrapped_optimizer(tmp_path: Path) -> None:
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    transformers = _hf()
    model = _gpt2()
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path, max_steps=1), train_dataset=_tokens())
    add_to_trainer(trainer, HFCallback(spike_guard=_guard()))
    with pytest.raises(ValueError, match="wrap_optimizer"):
        _hf_train(trainer)
    with pytest.raises(ValueError, match="no spike_guard"):
        HFCallback().wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        HFCallback(spike_guard=_guard()).wrap_optimizer(model)  # type: ignore[arg-type]


def test_hf_spike_streak_raises_at_the_log_step(tmp_path: Path) -> None:
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    transformers = _hf()
    model = _gpt2()
    spiker = _spiker(model, SPIKE)
    cb = HFCallback(spike_guard=_guard(max_consecutive=1))
    opt = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path, logging_steps=4), train_dataset=_tokens(),
                                   callbacks=[spiker], optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    with pytest.raises(SpikeStreakError) as err:
        _hf_train(trainer)
    assert err.value.step == SPIKE + 1  # tripped at optimizer step 6, raised when global step 8 was logged
    assert trainer.state.global_step == 8


def test_hf_watch_logs_the_origin(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    transformers = _hf()
    model = _gpt2()
    bad = "transformer.h.1.mlp.c_fc"

    class Break(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == 2:
                with torch.no_grad():
                    model.get_submodule(bad).weight[0, 0] = float("inf")

    watch = ActivationWatch(model)
    real_report, reports = watch._report_of, []

    def counted(held: Any) -> Any:  # every report is made here, report() and the callback's of a held step alike
        reports.append(watch.step)
        return real_report(held)

    watch._report_of = counted  # type: ignore[method-assign]
    cb = HFCallback(on_nonfinite="stop", watch_activations=watch)
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path), train_dataset=_tokens(),
                                   callbacks=[Break()])
    add_to_trainer(trainer, cb)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        logs = _hf_train(trainer)
    warning = [r.getMessage() for r in caplog.records if "optimizer step 2" in r.getMessage()]
    assert len(warning) == 1 and f"forward origin {bad}" in warning[0] and "'transformer." in warning[0]
    assert logs[1]["act/nonfinite"] == 0.0 and logs[1]["act/origin_index"] == -1 and "act/origin" not in logs[1]
    assert logs[3]["act/nonfinite"] == 1.0 and logs[3]["act/origin"] == bad
    assert logs[3]["act/origin_index"] == watch.module_names.index(bad)
    # one report per logged step: the non-finite step's warning and its log share one
    assert len(reports) == len(set(reports)) == 3
    assert cb.activation_watch is watch  # a watch given to the callback stays in place
    watch.remove()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_lightning_ddp_ranks_judge_the_same_loss_and_skip_together(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    worker = Path(__file__).with_name("_integrations_policies_ddp_worker.py")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], check=False, env=env, capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    # rank 1's loss alone spiked at step 6; the loss is averaged over the ranks, so both skipped it
    assert r0["unchanged"] == r1["unchanged"] == [6]
    assert r0["weights"] == r1["weights"]


@pytest.mark.parametrize("fused", [True, False])
def test_hf_wrapped_optimizer_under_a_grad_scaler(fused: bool) -> None:
    # What accelerate does under fp16: scaler.step(optimizer). The guard's skip joins the scaler's decision.
    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback

    _hf()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cb = HFCallback(spike_guard=_guard())
    opt = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for take in (1.0, 0.0, 1.0):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).square().mean()).backward()
        cb._factor = torch.tensor(take)  # the guard's decision, as the callback leaves it after the backward
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert changed == (take == 1.0)
        assert not hasattr(opt, "found_inf")
    assert scaler.get_scale() == 4.0  # the guard's skip never shrinks the scale
