"""The policies, the Trainer, the groups and the compat collector on the model zoo (tests/model_zoo.py): a ResNet with
in-place residual adds and ReLUs, a Hugging Face GPT-2 computing its loss inside forward, a TransformerEncoder with
checkpointed layers. Each in training, with evaluation under ``torch.inference_mode()`` and ``torch.no_grad()``
between steps, with bfloat16 autocast and a GradScaler, with parameters frozen mid-run and with checkpoints, against
float64 references computed here (torch's own ``clip_grad_norm_`` on float64 copies, the rules written out in
Python floats), never against the library itself."""

from __future__ import annotations

import copy
import io
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_gradstats as tg
from torch_gradstats.collector import (
    SeedGradientCollector,
    collect_dual_gradients_async,
    collect_seed_gradients,
    materialize_dual_grad_stats,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_zoo import GPT2LM, CheckpointedEncoder, resnet

pytestmark = pytest.mark.usefixtures("one_thread")

ZOO = ["resnet", "gpt2", "encoder"]


# ---------------------------------------------------------------------------------------------- the zoo's tasks
@dataclass
class Task:
    """A zoo model with its data: ``batch(step)`` is a fixed batch of 8 ``(inputs, targets)``, ``loss_fn(outputs,
    targets)`` the mean loss; ``block`` a module to freeze mid-run, ``head`` the parameters the collector's dual
    statistics call the seed."""

    kind: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[Any, Any], torch.Tensor]
    block: str
    head: str
    order: list[torch.Tensor]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.order[step % len(self.order)]
        return self.inputs[i], self.targets[i]

    def loss(self, step: int) -> torch.Tensor:
        x, y = self.batch(step)
        return self.loss_fn(self.model(x), y)

    def loader(self, steps: int) -> DataLoader:
        xs, ys = zip(*(self.batch(s) for s in range(steps)))
        return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)


def _model_loss(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return out  # GPT-2 computed its loss inside forward


def task(kind: str, seed: int = 0, examples: int = 64) -> Task:
    gen = torch.Generator().manual_seed(seed + 100)
    if kind == "resnet":
        model: nn.Module = resnet(seed)
        x, y = torch.randn(examples, 3, 6, 6, generator=gen), torch.randint(0, 5, (examples,), generator=gen)
        loss_fn: Callable[[Any, Any], torch.Tensor] = nn.functional.cross_entropy
        block, head = "layer1", "fc"
    elif kind == "gpt2":
        model = GPT2LM(seed)
        x = torch.randint(0, 64, (examples, 12), generator=gen)
        y, loss_fn = x, _model_loss
        block, head = "gpt.transformer.h.0", "gpt.transformer.ln_f"
    else:
        model = CheckpointedEncoder(use_reentrant=False, seed=seed)
        x, y = torch.randn(examples, 5, 8, generator=gen), torch.randn(examples, 5, 4, generator=gen)
        loss_fn, block, head = nn.functional.mse_loss, "encoder.layers.0", "head"
    order = [torch.randint(0, examples, (8,), generator=gen) for _ in range(512)]
    return Task(kind, model, x, y, loss_fn, block, head, order)


def freeze(model: nn.Module, prefix: str, frozen: bool = True) -> None:
    """Freeze (or unfreeze) every parameter under ``prefix``; a frozen one's gradient becomes None."""
    for name, p in model.named_parameters():
        if name.startswith(prefix + "."):
            p.requires_grad_(not frozen)
            if frozen:
                p.grad = None


def evaluate(t: Task) -> torch.Tensor:
    """Evaluation between training steps, under inference_mode and no_grad: both must agree, and the model is back
    in training mode after."""
    t.model.eval()
    x, y = t.batch(0)
    with torch.inference_mode():
        a = t.loss_fn(t.model(x), y)
    with torch.no_grad():
        b = t.loss_fn(t.model(x), y)
    t.model.train()
    assert torch.equal(a, b)
    return b


# ---------------------------------------------------------------------------------------------- float64 references
def grads64(model: nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Every present gradient as a float64 copy, divided by a loss scale."""
    return {n: p.grad.detach().to(torch.float64) / scale for n, p in model.named_parameters() if p.grad is not None}


def norm64(grads: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.square().sum()) for g in grads.values()))


def torch_clip64(grads: dict[str, torch.Tensor], max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """torch.nn.utils.clip_grad_norm_ on float64 copies: (its total norm, the clipped gradients)."""
    leaves = {}
    for n, g in grads.items():
        leaves[n] = torch.zeros_like(g, requires_grad=True)
        leaves[n].grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(list(leaves.values()), max_norm)
    return float(total), {n: p.grad for n, p in leaves.items()}


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return a == b or math.isclose(a, b, rel_tol=rel)


class GuardRule:
    """SpikeGuard's rule (docs/guard.md) on Python floats: windowed mean and Bessel std of the finite values taken,
    ``adopt_after`` skipped all-finite steps in a row starting the adoption of a new level."""

    def __init__(self, window: int, sigma: float, min_history: int | None = None, adopt_after: int = 4) -> None:
        self.window, self.sigma, self.adopt_after = window, sigma, adopt_after
        self.min_history = max(2, window // 2) - 1 if min_history is None else min_history
        self.hist: dict[str, list[float]] = {"g": [], "l": []}
        self.streak = self.skipped = 0

    def _spike(self, h: list[float], v: float) -> bool:
        if len(h) < self.min_history:
            return False
        if not math.isfinite(v):
            return True
        return len(h) >= 2 and v - statistics.fmean(h) > self.sigma * statistics.stdev(h)

    def step(self, norm: float, loss: float) -> bool:
        values = {"g": norm, "l": loss}
        take = not any(self._spike(self.hist[s], v) for s, v in values.items())
        finite = all(math.isfinite(v) for v in values.values())
        self.streak = 0 if take else self.streak + finite
        adopt = not take and finite and self.streak >= self.adopt_after
        for s, v in values.items():
            if math.isfinite(v) and (take or adopt):
                self.hist[s] = (self.hist[s] + [v])[-self.window :]
        self.skipped += not take
        return take


class ClipRule:
    """AdaptiveClip's default rule (ZClip's z-score mode, adaptive_scaling, with the adoption after ``adopt_after``
    clipped steps in a row) on Python floats; non-finite norms stay out of the statistics."""

    def __init__(self, warmup: int, alpha: float = 0.97, z_thresh: float = 2.5, adopt_after: int = 16) -> None:
        self.warmup, self.alpha, self.z, self.adopt_after = warmup, alpha, z_thresh, adopt_after
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0
        self.streak = 0

    def step(self, norm: float) -> float:
        if self.mean is None:
            if math.isfinite(norm):
                self.buffer.append(norm)
            if len(self.buffer) >= self.warmup:
                self.mean = statistics.fmean(self.buffer)
                self.var = statistics.fmean([(x - self.mean) ** 2 for x in self.buffer])
            return math.inf
        std = math.sqrt(self.var)
        z = (norm - self.mean) / (std + 1e-6)
        clip = (self.mean + self.z * std / (z / self.z)) if z > self.z else None
        if not math.isfinite(norm):
            return math.inf if clip is None else clip
        self.streak = 0 if clip is None else self.streak + 1
        v = norm if clip is None or self.streak >= self.adopt_after else clip
        self.mean = self.alpha * self.mean + (1 - self.alpha) * v
        self.var = self.alpha * self.var + (1 - self.alpha) * (v - self.mean) ** 2
        return math.inf if clip is None else clip


# ---------------------------------------------------------------------------------------------- clip_grad_norm_
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-scaler"])
@pytest.mark.parametrize("kind", ZOO)
def test_clip_grad_norm_equals_torch_in_float64_through_training(kind, amp):
    """Every step of a short run: tg.clip_grad_norm_ (after GradScaler.unscale_ under AMP) against torch's
    clip_grad_norm_ on float64 copies of the unscaled gradients: the same total norm and the same clipped gradients,
    with evaluation between steps, a block frozen from step 3 (its gradients None) and unfrozen at step 5, and the
    clip itself called under inference_mode on odd steps. A twin run without the evaluations ends bitwise equal."""
    finals = []
    for with_eval in (True, False):
        t = task(kind)
        opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
        for step in range(7):
            if step == 3:
                freeze(t.model, t.block)
            if step == 5:
                freeze(t.model, t.block, frozen=False)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = t.loss(step)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            ref = grads64(t.model)
            assert any(n.startswith(t.block + ".") for n in ref) == (step not in (3, 4))
            max_norm = 0.5 * norm64(ref)  # clips every step
            want_total, want = torch_clip64(ref, max_norm)
            mode = torch.inference_mode() if step % 2 else torch.enable_grad()
            with mode:
                stats = tg.clip_grad_norm_(t.model.named_parameters(), max_norm)
            assert stats.names == list(ref)
            assert close(float(stats.clip_norm), want_total), (step, float(stats.clip_norm), want_total)
            for n, p in t.model.named_parameters():
                if n in want:
                    torch.testing.assert_close(p.grad.to(torch.float64), want[n], rtol=1e-6, atol=1e-9 * max_norm)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if with_eval:
                evaluate(t)
        finals.append([p.detach().clone() for p in t.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.parametrize("kind", ZOO)
def test_clip_grad_norm_other_norm_types_and_a_nonfinite_gradient_named(kind):
    """norm_type inf and 3 against torch in float64; error_if_nonfinite names the first non-finite parameter in model
    order and leaves the gradients untouched."""
    t = task(kind)
    t.loss(0).backward()
    for norm_type in (math.inf, 3.0):
        ref = grads64(t.model)
        leaves = []
        for g in ref.values():
            leaf = torch.zeros_like(g, requires_grad=True)
            leaf.grad = g.clone()
            leaves.append(leaf)
        want = float(torch.nn.utils.clip_grad_norm_(leaves, 0.01, norm_type=norm_type))
        stats = tg.clip_grad_norm_(t.model.parameters(), 0.01, norm_type=norm_type)
        assert close(float(stats.clip_norm), want, rel=1e-5), norm_type
        for p, leaf in zip((p for p in t.model.parameters() if p.grad is not None), leaves):
            torch.testing.assert_close(p.grad.to(torch.float64), leaf.grad, rtol=1e-5, atol=1e-12)
    names = [n for n, _ in t.model.named_parameters()]
    bad = dict(t.model.named_parameters())[names[3]]
    bad.grad.view(-1)[-1] = math.inf
    dict(t.model.named_parameters())[names[5]].grad.view(-1)[0] = math.nan
    before = grads64(t.model)
    with pytest.raises(RuntimeError, match=f"first non-finite gradient: '{names[3]}' \\(2 in all\\)"):
        tg.clip_grad_norm_(t.model.named_parameters(), 1.0, error_if_nonfinite=True)
    after = grads64(t.model)
    assert all(torch.equal(before[n].nan_to_num(), after[n].nan_to_num()) for n in before)


# ---------------------------------------------------------------------------------------------- the two policies
SPIKE, OVERFLOW = 14, 19  # the steps of a x1000 gradient spike and of an inf gradient


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-scaler"])
@pytest.mark.parametrize("kind", ZOO)
def test_guard_and_adaptive_clip_on_a_training_run_equal_their_rules(kind, amp):
    """A run of 24 steps with a x1000 gradient at step 14 and an inf one at step 19 (the scaler's overflow under
    AMP), evaluated between steps. Each step's norm is the float64 norm of the unscaled gradients; the guard's
    decisions and the clip's thresholds equal their rules fed those norms; a skipped step leaves the parameters and
    AdamW's state untouched; the loss scale halves at the overflow only (the spike the guard skipped is not the
    scaler's); the overflow enters neither policy's statistics."""
    t = task(kind)
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
    guard, clip = tg.SpikeGuard(window=8, sigma=6.0), tg.AdaptiveClip(warmup=5)
    guard_rule, clip_rule = GuardRule(8, 6.0), ClipRule(5)
    scales = []
    for step in range(24):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = t.loss(step)
        scale = scaler.get_scale() if scaler is not None else 1.0
        scales.append(scale)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        first = next(p for p in t.model.parameters())
        if step == SPIKE:
            for p in t.model.parameters():
                p.grad.mul_(1000)
        if step == OVERFLOW:
            first.grad.view(-1)[0] = math.inf
        ref = norm64(grads64(t.model, scale))
        if step == OVERFLOW:
            guard_state, clip_state = guard.state_dict(), clip.state_dict()
        params = [p.detach().clone() for p in t.model.parameters()]
        adam_steps = [float(s["step"]) for s in opt.state.values()]
        if scaler is not None:
            scaler.unscale_(opt)
        stats = clip.clip_(t.model.named_parameters())
        factor = guard.observe(stats.total_norm, loss.detach())
        tg.step_or_skip(opt, factor, scaler)

        assert close(float(stats.total_norm), ref) or (step == OVERFLOW and ref == math.inf), (step, ref)
        take = guard_rule.step(ref, float(loss.detach()))
        assert float(factor) == float(take), step
        assert take == (step not in (SPIKE, OVERFLOW)), step
        want = clip_rule.step(ref)
        if step != OVERFLOW:  # the overflow's gradients are not clipped: the scaler skips the step
            assert close(float(stats.clipped_norm), ref * min(1.0, want / (ref + 1e-6))), step
        unchanged = all(torch.equal(a, p) for a, p in zip(params, t.model.parameters()))
        assert unchanged == (not take), step
        assert [float(s["step"]) for s in opt.state.values()] == [s + take for s in adam_steps] or step == 0
        if step == OVERFLOW:  # the inf norm entered no history: only the guard's counters moved
            after_g, after_c = guard.state_dict(), clip.state_dict()
            for key in ("history", "count", "position"):
                assert torch.equal(after_g[key], guard_state[key]), key
            assert after_g["counters"][1] == guard_state["counters"][1] + 1  # counted as skipped
            assert torch.equal(after_c["ema"], clip_state["ema"])
            assert torch.equal(after_c["streak"], clip_state["streak"])
        if step % 3 == 0:
            evaluate(t)
    if amp:
        assert scales[OVERFLOW + 1] == scales[OVERFLOW] / 2 and len(set(scales[: OVERFLOW + 1])) == 1
    figures = guard.check()
    assert figures["guard/skipped"] == guard_rule.skipped == 2 and figures["guard/consecutive"] == 0


RISE = 90  # the step from which the loss, and so the gradient norm, is x10 for good


@pytest.mark.slow
@pytest.mark.parametrize("kind", ZOO)
def test_default_policies_adopt_a_lasting_x10_rise(kind):
    """160 steps of Adam, the loss x10 from step 90 on (the gradient norm's level rises x10 and stays; Adam's steps
    do not change): the default SpikeGuard skips the first steps of the new level, then adopts it and takes every
    later step, and the default AdaptiveClip stops clipping a few dozen steps after the rise (docs/guard.md); both
    equal their rules fed the float64 norms."""
    t = task(kind)
    opt = torch.optim.Adam(t.model.parameters(), lr=1e-4)
    guard, clip = tg.SpikeGuard(), tg.AdaptiveClip()
    guard_rule, clip_rule = GuardRule(128, 6.0), ClipRule(25)
    skipped, clipped = [], []
    for step in range(160):
        opt.zero_grad()
        loss = t.loss(step) * (10.0 if step >= RISE else 1.0)
        loss.backward()
        ref = norm64(grads64(t.model))
        stats = clip.clip_(t.model.named_parameters())
        factor = guard.observe(stats.total_norm, loss.detach())
        tg.step_or_skip(opt, factor)
        assert float(factor) == guard_rule.step(ref, float(loss.detach())), step
        want = clip_rule.step(ref)
        assert close(float(stats.clipped_norm), ref * min(1.0, want / (ref + 1e-6))), step
        if float(factor) == 0:
            skipped.append(step)
        if float(stats.clip_coef) < 1:
            clipped.append(step)
    # The rise is skipped adopt_after (4) times, then its values widen the band within a few more steps.
    assert skipped[:4] == list(range(RISE, RISE + 4)) and skipped[-1] < RISE + 12, skipped
    after = [s for s in clipped if s >= RISE]  # before it: ZClip's occasional clip of noise (z > 2.5)
    assert after[:16] == list(range(RISE, RISE + 16)) and after[-1] < RISE + 40, clipped
    assert guard.check()["guard/consecutive"] == 0 and clip.figures()["clip/coef"] == 1.0


# ---------------------------------------------------------------------------------------------- the Trainer
def _trainer(t: Task, refs: list[float], losses: list[float]) -> tg.Trainer:
    """A Trainer with bfloat16 autocast, a GradScaler, a SpikeGuard and an AdaptiveClip; its after_backward records
    the float64 norm of the unscaled gradients and makes step 8's gradients x1000 and step 10's inf."""
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def after_backward(trainer: tg.Trainer) -> None:
        if trainer.global_step == 8:
            for p in t.model.parameters():
                p.grad.mul_(1000)
        if trainer.global_step == 10:
            next(t.model.parameters()).grad.view(-1)[1] = math.inf
        refs.append(norm64(grads64(t.model, scaler.get_scale())))

    guard = tg.SpikeGuard(window=8, sigma=6.0, min_history=5)
    return tg.Trainer(
        t.model,
        opt,
        t.loss_fn,
        scaler=scaler,
        amp_dtype=torch.bfloat16,
        progress=False,
        spike_guard=guard,
        adaptive_clip=tg.AdaptiveClip(warmup=4),
        after_backward=after_backward,
    )


def _checkpoint(tr: tg.Trainer) -> dict[str, Any]:
    assert tr.scaler is not None and tr.spike_guard is not None and tr.adaptive_clip is not None
    buf = io.BytesIO()
    torch.save({"model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict(),
                "scaler": tr.scaler.state_dict(), "guard": tr.spike_guard.state_dict(),
                "clip": tr.adaptive_clip.state_dict(), "step": tr.global_step, "epoch": tr.epoch}, buf)  # fmt: skip
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kind", ZOO)
def test_trainer_with_amp_guard_clip_evaluation_and_resume(kind):
    """Three epochs of 6 steps with autocast, a GradScaler, a SpikeGuard and an AdaptiveClip, evaluated between
    epochs, a block frozen for the last one: each step's norm equals the float64 norm of the unscaled gradients, the
    x1000 step (8) and the inf one (10) are the two skipped, the frozen weights stay as they were, the guard's and
    the clip's figures equal their rules, and a run resumed after epoch 1 from a torch.save'd checkpoint ends bitwise
    equal to the uninterrupted one."""
    t, refs, losses = task(kind), [], []
    loader = t.loader(6)
    tr = _trainer(t, refs, losses)
    summaries, saved = [], None
    for epoch in range(3):
        torch.manual_seed(epoch)  # GPT-2's dropout: the same draws in the resumed run
        if epoch == 2:  # a block frozen for the last epoch: its gradients None, its weights left as they are
            freeze(t.model, t.block)
            frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
        summaries.append(tr.train_epoch(loader))
        evaluate(t)
        if epoch == 0:
            saved = _checkpoint(tr)
    assert frozen and all(torch.equal(p, dict(t.model.named_parameters())[n]) for n, p in frozen.items())
    history = [r for s in summaries for r in s.history]
    assert [r.step for r in history] == list(range(18))
    for r, ref in zip(history, refs):
        assert close(r.total_norm, ref) or r.total_norm == ref == math.inf, (r.step, r.total_norm, ref)
    assert [r.step for r in history if r.skipped] == [8, 10]
    assert [s.skipped_steps for s in summaries] == [0, 2, 0] and summaries[1].first_nonfinite_step == 10
    assert summaries[1].first_nonfinite_param == next(n for n, _ in t.model.named_parameters())
    assert tr.scaler is not None and tr.scaler.get_scale() == 2.0**7  # halved at the overflow only
    guard_rule, clip_rule = GuardRule(8, 6.0, min_history=5), ClipRule(4)
    decisions = [guard_rule.step(ref, r.loss) for ref, r in zip(refs, history)]
    assert decisions == [not r.skipped for r in history]
    thresholds = [clip_rule.step(ref) for ref in refs]
    figures = tr.policy_figures
    assert figures["guard/skipped"] == 2 and close(figures["clip/threshold"], thresholds[-1])

    resumed_t = task(kind)
    resumed = _trainer(resumed_t, [], [])
    assert saved is not None and resumed.scaler is not None
    assert resumed.spike_guard is not None and resumed.adaptive_clip is not None
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.scaler.load_state_dict(saved["scaler"])
    resumed.spike_guard.load_state_dict(saved["guard"])
    resumed.adaptive_clip.load_state_dict(saved["clip"])
    resumed.global_step, resumed.epoch = saved["step"], saved["epoch"]
    for epoch in (1, 2):
        torch.manual_seed(epoch)
        if epoch == 2:
            freeze(resumed_t.model, resumed_t.block)
        again = resumed.train_epoch(loader)
        evaluate(resumed_t)
    assert again.to_dict() == summaries[-1].to_dict()
    assert resumed.policy_figures == figures
    assert all(torch.equal(a, b) for a, b in zip(t.model.state_dict().values(), resumed_t.model.state_dict().values()))


# ---------------------------------------------------------------------------------------------- groups
def layer_of(name: str) -> str:
    """docs/groups.md's "layer": up to the outermost numbered part, else the owning module (else the name)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def reference_groups(grads: dict[str, torch.Tensor], key: Callable[[str], str | None]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for n, g in grads.items():
        k = key(n)
        if k is None:
            continue
        row = out.setdefault(k, {"sumsq": 0.0, "max_abs": 0.0, "zeros": 0, "nan": 0, "inf": 0, "numel": 0})
        finite = g[g.isfinite()]
        row["sumsq"] += float(g.square().sum())
        row["max_abs"] = max(row["max_abs"], float(finite.abs().max()) if finite.numel() else 0.0)
        row["zeros"] += int((g == 0).sum())
        row["nan"] += int(g.isnan().sum())
        row["inf"] += int(g.isinf().sum())
        row["numel"] += g.numel()
    return out


@pytest.mark.parametrize("kind", ZOO)
def test_groups_equal_float64_sums_through_amp_frozen_blocks_and_a_nan(kind):
    """grouped("layer"), grouped(1), a regex and a callable on the zoo models after GradScaler.unscale_, against
    float64 sums of the unscaled gradients per group written out here: before and after a block is frozen (its
    groups vanish), with a NaN in one gradient (its group alone says so), and made under inference_mode."""
    t = task(kind)
    opt = torch.optim.SGD(t.model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    keys: dict[str, Callable[[str], str | None]] = {
        "layer": layer_of,
        "1": lambda n: n.split(".")[0] if "." in n else n,
        r"(weight|bias)$": lambda n: next((s for s in ("weight", "bias") if n.endswith(s)), None),  # in_proj_bias
    }
    for step in range(3):
        if step == 1:
            freeze(t.model, t.block)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = t.loss(step)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if step == 2:
            bad = [n for n, p in t.model.named_parameters() if p.grad is not None][-2]
            dict(t.model.named_parameters())[bad].grad.view(-1)[0] = math.nan
        grads = grads64(t.model)
        with torch.inference_mode() if step == 1 else torch.enable_grad():
            stats = tg.grad_stats(t.model.named_parameters())
        for by, key in keys.items():
            want = reference_groups(grads, key)
            groups = stats.grouped(int(by) if by.isdigit() else by)
            rep = groups.report()
            assert list(rep.norms) == list(want), by
            assert (step >= 1) != any(g.startswith(t.block) for g in rep.norms) or by != "layer"
            for g, row in want.items():
                if row["nan"]:
                    assert math.isnan(rep.norms[g]) and math.isnan(rep.max_abs[g]), (by, g)
                else:
                    assert close(rep.norms[g], math.sqrt(row["sumsq"])), (by, g)
                    assert rep.max_abs[g] == row["max_abs"], (by, g)
                assert (rep.zero_counts[g], rep.nan_counts[g], rep.inf_counts[g], rep.numel[g]) == (
                    row["zeros"], row["nan"], row["inf"], row["numel"]), (by, g)  # fmt: skip
            assert rep.nonfinite == ([key(bad)] if step == 2 and key(bad) is not None else [])
        report = stats.report(groups=stats.grouped("layer"))
        assert report.groups is not None and list(report.groups.norms) == list(reference_groups(grads, layer_of))
        if step < 2:  # the NaN came after unscale_'s check: the scaler would step with it
            scaler.step(opt)
            scaler.update()
            evaluate(t)


# ---------------------------------------------------------------------------------------------- the collector
@pytest.mark.parametrize("kind", ZOO)
def test_collector_equals_float64_references_through_amp_evaluation_and_a_nan(kind):
    """esper-lite's collector API on the zoo models, after GradScaler.unscale_ and evaluation: the global norm, the
    vanishing/exploding flags and the health score from per-tensor float64 norms, the enhanced metrics, the dual
    host/seed figures; a NaN makes the health 0.0 and the tensor exploding."""
    t = task(kind)
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = t.loss(step)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        evaluate(t)
        if step == 2:
            next(t.model.parameters()).grad.view(-1)[0] = math.nan
        grads = grads64(t.model)
        norms = [float(g.norm()) for g in grads.values()]
        finite = [x for x in norms if math.isfinite(x)]
        vanishing, exploding = statistics.median(finite), 0.9 * max(finite)  # some tensors of each
        n_van = sum(x < vanishing for x in norms)
        n_exp = sum(x > exploding or not math.isfinite(x) for x in norms)
        health = max(0.0, min(1.0, 1 - 0.5 * n_van / len(norms) - 0.8 * n_exp / len(norms)))
        if step == 2:
            health = 0.0
        total = norm64(grads)
        collector = SeedGradientCollector(vanishing_threshold=vanishing, exploding_threshold=exploding)
        with torch.inference_mode():
            got = collector.collect(t.model.parameters())
        assert close(got["gradient_norm"], total) or (step == 2 and math.isnan(got["gradient_norm"]))
        assert got["has_vanishing"] and got["has_exploding"]
        assert close(got["gradient_health"], health, rel=1e-12), (got, health)
        enhanced = collect_seed_gradients(t.model.parameters(), vanishing, exploding, return_enhanced=True)
        assert isinstance(enhanced, tg.collector.GradientHealthMetrics)
        zeros = sum(int((g == 0).sum()) for g in grads.values()) / sum(g.numel() for g in grads.values())
        assert enhanced.zero_grad_fraction == zeros and enhanced.nan_count == (step == 2)
        assert enhanced.is_healthy() == (step != 2 and not enhanced.has_exploding)
        if step < 2:
            assert close(enhanced.min_layer_norm, min(norms)) and close(enhanced.max_layer_norm, max(norms))
        host = [p for n, p in t.model.named_parameters() if not n.startswith(t.head + ".")]
        seed = [p for n, p in t.model.named_parameters() if n.startswith(t.head + ".")]
        dual = materialize_dual_grad_stats(collect_dual_gradients_async(host, seed))
        seed_grads = {n: g for n, g in grads.items() if n.startswith(t.head + ".")}
        host_grads = {n: g for n, g in grads.items() if n not in seed_grads}
        assert dual.seed_param_count == sum(g.numel() for g in seed_grads.values())
        assert dual.host_param_count == sum(g.numel() for g in host_grads.values())
        assert close(dual.seed_grad_norm, norm64(seed_grads))
        if step < 2:
            assert close(dual.host_grad_norm, norm64(host_grads))
            want_ratio = (norm64(seed_grads) / dual.seed_param_count**0.5) / (
                norm64(host_grads) / dual.host_param_count**0.5 + 1e-8
            )
            assert close(dual.normalized_ratio, want_ratio)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("where", ["built", "loaded", "moved"])
def test_policies_made_under_inference_mode_train_on_outside_it(where):
    """A guard and a clip built, resumed from a checkpoint (with other settings, so their state is made anew) or
    moved inside ``torch.inference_mode()`` (an evaluation loop, a checkpoint loaded by evaluation code) keep normal
    state tensors: training goes on outside it, the guard raises its SpikeStreakError at check() (it clears a flag
    in its state in place), and both decide as policies that never saw inference mode."""
    t = task("resnet")
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)

    def make() -> tuple[tg.SpikeGuard, tg.AdaptiveClip]:
        return tg.SpikeGuard(window=8, min_history=4, max_consecutive=2), tg.AdaptiveClip(warmup=4)

    guard, clip = make()
    plain_guard, plain_clip = make()
    if where == "built":
        with torch.inference_mode():
            guard, clip = make()
    elif where == "loaded":
        with torch.inference_mode():
            guard, clip = tg.SpikeGuard(window=3), tg.AdaptiveClip(warmup=9)
            guard.load_state_dict(plain_guard.state_dict())
            clip.load_state_dict(plain_clip.state_dict())
    else:
        with torch.inference_mode():
            guard.to("cpu"), clip.to("cpu")
    for step in range(10):
        opt.zero_grad()
        t.loss(step).backward()
        if step >= 8:
            for p in t.model.parameters():
                p.grad.mul_(1000)
        stats = tg.grad_stats(t.model.named_parameters())
        factor = guard.observe(stats.total_norm)
        threshold = clip.threshold(stats.total_norm)
        assert float(factor) == float(plain_guard.observe(stats.total_norm)), step
        assert float(threshold) == float(plain_clip.threshold(stats.total_norm)), step
        tg.step_or_skip(opt, factor)
        evaluate(t)
    assert not any(s.is_inference() for s in (guard.state_dict()["history"], clip.state_dict()["ema"]))
    with pytest.raises(tg.SpikeStreakError, match="2 steps in a row were skipped"):
        guard.check()
    assert guard.check()["guard/skipped"] == 2  # raised once, then read again


@pytest.mark.parametrize("kind", ZOO)
def test_trainer_clipping_and_accumulating_under_a_scaler_equals_a_plain_torch_loop(kind):
    """Trainer(max_grad_norm, accumulation_steps=2, scaler) against the loop people write with torch alone
    (scale(loss / 2).backward() twice, unscale_, torch.nn.utils.clip_grad_norm_, scaler.step, update): the same
    pre-clip norms and, after 4 steps of SGD with momentum, the same parameters."""
    results = []
    for use_trainer in (True, False):
        t = task(kind)
        loader = t.loader(8)
        opt = torch.optim.SGD(t.model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        torch.manual_seed(3)  # GPT-2's dropout; iterating the loader draws from the generator in both runs
        if use_trainer:
            tr = tg.Trainer(t.model, opt, t.loss_fn, scaler=scaler, max_grad_norm=0.5, accumulation_steps=2,
                            progress=False)  # fmt: skip
            norms = [r.total_norm for r in tr.train_epoch(loader).history]
        else:
            norms, batches = [], iter(loader)
            for _ in range(4):
                opt.zero_grad()
                for x, y in (next(batches), next(batches)):
                    scaler.scale(t.loss_fn(t.model(x), y) / 2).backward()
                scaler.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(t.model.parameters(), 0.5)))
                scaler.step(opt)
                scaler.update()
        results.append((norms, [p.detach().clone() for p in t.model.parameters()]))
    (got, params), (want, torch_params) = results
    assert len(got) == 4 and all(close(a, b, rel=1e-5) for a, b in zip(got, want)), (got, want)
    for a, b in zip(params, torch_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trainer_per_example_norms_under_a_scaler_whose_scale_changes():
    """Trainer(per_example=True) with a GradScaler that doubles its scale after every step (growth_interval=1) and
    halves it at an overflow (step 2): each logging step's largest and median per-example gradient norms equal each
    example's own float64 gradient norm, computed here on a copy of the model one example at a time, whatever the
    scale did at that step (the ResNet's BatchNorm mixes the examples and GPT-2's position embedding sees one row
    for all of them: PerExampleNorms refuses both)."""
    t = task("encoder")
    opt = torch.optim.SGD(t.model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    want: list[list[float]] = []

    def after_backward(trainer: tg.Trainer) -> None:
        copy_ = copy.deepcopy(t.model)
        x, y = t.batch(trainer.global_step)
        norms = []
        for i in range(len(x)):
            copy_.zero_grad()
            t.loss_fn(copy_(x[i : i + 1]), y[i : i + 1]).backward()
            norms.append(norm64(grads64(copy_)))
        want.append(sorted(norms))
        if trainer.global_step == 2:
            next(t.model.parameters()).grad.view(-1)[0] = math.inf

    class Sink:
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def log(self, report: Any, step: int) -> None:
            self.rows.append(dict(report.extra))

    sink = Sink()
    tr = tg.Trainer(t.model, opt, t.loss_fn, scaler=scaler, per_example=True, log_to=[sink], progress=False,
                    after_backward=after_backward)  # fmt: skip
    torch.manual_seed(0)
    summary = tr.train_epoch(t.loader(4))
    assert [r.skipped for r in summary.history] == [False, False, True, False]
    assert scaler.get_scale() == 2.0**8 * 2 * 2 / 2 * 2
    for step, (row, norms) in enumerate(zip(sink.rows, want)):
        assert close(row["examples/max_norm"], norms[-1], rel=1e-5), (step, row, norms)
        assert close(row["examples/median_norm"], norms[(len(norms) - 1) // 2], rel=1e-5), (step, row, norms)


@pytest.mark.parametrize("kind", ZOO)
def test_scaler_overflows_in_a_row_trip_the_guard_and_leave_its_level(kind):
    """Two overflows in a row under a GradScaler (inf gradients at steps 5 and 6) with max_consecutive=2: both skipped
    (parameters untouched, the scale halved twice), the streak raised at check() with the inf norm named, and the
    next finite step judged against the history of the steps before the overflows (taken, as its rule says)."""
    t = task(kind)
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard, rule = tg.SpikeGuard(window=8, min_history=3, max_consecutive=2), GuardRule(8, 6.0, min_history=3)
    for step in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = t.loss(step)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        if step in (5, 6):
            next(t.model.parameters()).grad.view(-1)[-1] = math.inf
        ref = norm64(grads64(t.model, scale))
        params = [p.detach().clone() for p in t.model.parameters()]
        scaler.unscale_(opt)
        factor = guard.observe(tg.grad_stats(t.model.named_parameters()).total_norm, loss.detach())
        tg.step_or_skip(opt, factor, scaler)
        assert float(factor) == rule.step(ref, float(loss.detach())) == (step not in (5, 6)), step
        assert all(torch.equal(a, p) for a, p in zip(params, t.model.parameters())) == (step in (5, 6))
        if step == 6:
            assert scaler.get_scale() == 2.0**6
            with pytest.raises(tg.SpikeStreakError) as info:
                guard.check()
            assert info.value.consecutive == 2 and info.value.step == 7 and info.value.values["grad_norm"] == math.inf
            kept = guard.state_dict()["history"][0, :5].tolist()  # the five steps before
            assert all(close(a, b) for a, b in zip(kept, rule.hist["g"], strict=True)), (kept, rule.hist["g"])
    assert guard.check()["guard/skipped"] == 2


def test_trainer_activation_warning_names_the_optimizer_step_of_the_watched_forward(caplog):
    """Trainer(watch_activations=...) on the ResNet with 2 micro-batches per optimizer step and an evaluation forward
    before training: the watch counts forward calls (step 6 is the second micro-batch of optimizer step 2), so the
    warning says which optimizer step its step belonged to, or that it was no training step."""
    t = task("resnet")
    poisoned = t.model.layer1[0].conv2

    def poison(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * math.nan if module.training and tr.global_step == 2 else None

    poisoned.register_forward_hook(poison)
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)
    tr = tg.Trainer(t.model, opt, t.loss_fn, watch_activations=True, skip_nonfinite=True, accumulation_steps=2,
                    sync_every=1, progress=False)  # fmt: skip
    evaluate(t)  # two forwards: the watch's steps 0 and 1
    with caplog.at_level("WARNING", logger="torch_gradstats"):
        tr.train_epoch(t.loader(8))
    said = [r.getMessage() for r in caplog.records if "non-finite activations" in r.getMessage()]
    assert len(said) == 1 and "non-finite activations at step 7: forward origin layer1.0.conv2 (" in said[0], said
    assert "(the watch's step 7, a forward call of optimizer step 2); first non-finite parameter" in said[0]

    caplog.clear()  # a watch recording every other forward: its latest recorded step is the evaluation's
    t = task("resnet")
    watch = tg.ActivationWatch(t.model, every_n_steps=2)
    tr = tg.Trainer(t.model, torch.optim.SGD(t.model.parameters(), lr=0.1), t.loss_fn, watch_activations=watch,
                    sync_every=1, progress=False)  # fmt: skip
    t.model(t.batch(0)[0])  # the watch's step 0, its first training forward, recorded
    t.model.eval()
    with torch.inference_mode():
        t.model(torch.full_like(t.batch(0)[0], math.nan))  # the watch's step 1, its first evaluation, recorded
    t.model.train()
    with caplog.at_level("WARNING", logger="torch_gradstats"):
        tr.train_epoch(t.loader(1))  # the watch's step 2, its second training forward, not recorded
    said = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]  # at the step's sync, the epoch's
    assert said and all("at step 1: the model's inputs were non-finite (the watch's step 1 was no training step: a "
                        "forward between optimizer steps)" in m for m in said), said


@pytest.mark.parametrize("fused", [False, True])
def test_trainer_warns_once_that_a_guard_with_a_non_fused_optimizer_reads_the_host_every_step(fused, caplog):
    """docs/training.md: a SpikeGuard's skip costs one host sync per step unless the optimizer is fused, as
    skip_nonfinite's does; the Trainer says so, once, for either (GPT-2, AdamW)."""
    t = task("gpt2")
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=fused)
    with caplog.at_level("WARNING", logger="torch_gradstats"):
        tr = tg.Trainer(t.model, opt, t.loss_fn, spike_guard=tg.SpikeGuard(window=4), progress=False)
        tr.train_epoch(t.loader(2))
    said = [r.getMessage() for r in caplog.records if "host sync per optimizer step" in r.getMessage()]
    want = (
        "torch_gradstats: spike_guard with AdamW (not fused) costs one host sync per optimizer step; create the "
        "optimizer with fused=True for a device-side skip"
    )
    assert said == ([] if fused else [want])


@pytest.mark.parametrize("path", ["trainer", "step_or_skip"])
@pytest.mark.parametrize("kind", ZOO)
def test_a_scaler_overflow_on_the_first_step_of_a_fused_sgd_with_momentum(kind, path):
    """A GradScaler whose first step overflows, with fused SGD and momentum: torch's fused kernel creates the
    momentum buffers uninitialised and skips the step, so a plain scaler.step would train on garbage from then on.
    Through the Trainer and step_or_skip the weights and momentum buffers equal those of the same loop with the
    (unfused) foreach SGD, which never creates a buffer on a skipped step."""
    finals = []
    for fused in (True, False):
        t = task(kind)
        opt = torch.optim.SGD(t.model.parameters(), lr=0.05, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        torch.manual_seed(0)
        if path == "trainer":

            def after_backward(trainer: tg.Trainer) -> None:
                if trainer.global_step == 0:
                    next(trainer.model.parameters()).grad.view(-1)[0] = math.inf

            tr = tg.Trainer(t.model, opt, t.loss_fn, scaler=scaler, after_backward=after_backward, progress=False)
            assert [r.skipped for r in tr.train_epoch(t.loader(3)).history] == [True, False, False]
        else:
            guard = tg.SpikeGuard(window=4)
            for step in range(3):
                opt.zero_grad()
                scaler.scale(t.loss(step)).backward()
                if step == 0:
                    next(t.model.parameters()).grad.view(-1)[0] = math.inf
                scaler.unscale_(opt)
                tg.step_or_skip(opt, guard.observe(tg.grad_stats(t.model.parameters()).total_norm), scaler)
        assert scaler.get_scale() == 2.0**7
        finals.append([p.detach().clone() for p in t.model.parameters()])
        finals.append([opt.state[p]["momentum_buffer"].clone() for p in t.model.parameters()])
    fused_params, fused_buffers, params, buffers = finals
    for a, b in zip(fused_params + fused_buffers, params + buffers):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ZOO)
def test_policies_resumed_in_the_middle_of_adopting_a_new_level_decide_as_uninterrupted(kind):
    """A loss x10 from step 12 of 20 with SpikeGuard(window=10) and AdaptiveClip(warmup=5, adopt_after=3): both are
    mid-streak at step 14. Their states saved there (torch.save, weights_only load) into fresh policies with other
    settings, loaded under no_grad, make the rest of the run decide and clip exactly as the uninterrupted one."""

    def run(cut: int | None) -> list[tuple[float, float]]:
        t = task(kind)
        opt = torch.optim.Adam(t.model.parameters(), lr=1e-4)
        guard, clip = tg.SpikeGuard(window=10), tg.AdaptiveClip(warmup=5, adopt_after=3)
        out = []
        for step in range(20):
            if step == cut:
                buf = io.BytesIO()
                torch.save({"guard": guard.state_dict(), "clip": clip.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
                assert int(saved["guard"]["counters"][5]) > 0 and int(saved["clip"]["streak"][0]) > 0  # mid-streak
                guard, clip = tg.SpikeGuard(window=3, sigma=1.0), tg.AdaptiveClip()
                with torch.no_grad():
                    guard.load_state_dict(saved["guard"])
                    clip.load_state_dict(saved["clip"])
            opt.zero_grad()
            loss = t.loss(step) * (10.0 if step >= 12 else 1.0)
            loss.backward()
            stats = clip.clip_(t.model.named_parameters())
            factor = guard.observe(stats.total_norm, loss.detach())
            tg.step_or_skip(opt, factor)
            out.append((float(factor), float(stats.clip_coef)))
        return out

    whole = run(None)
    assert [i for i, (f, _) in enumerate(whole) if f == 0][:4] == [12, 13, 14, 15]
    assert run(14) == whole
