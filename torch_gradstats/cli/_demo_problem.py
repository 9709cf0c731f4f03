"""The demo's problem and its run's pieces (:mod:`torch_gradstats.cli.demo` runs them): the synthetic data, the
model, the policies' settings, the flags checked into a :class:`Plan`, and the Trainer's ``after_backward`` that injects
the asked-for NaN or spike and records each step's figures. Their own module: what is trained and injected is a job
apart from running the command and reporting what it found."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from torch_gradstats.monitors.activations import ActivationReport
from torch_gradstats.policies.adaptive_clip import AdaptiveClip
from torch_gradstats.policies.guard import SpikeGuard
from torch_gradstats.stats.gradients import grad_stats
from torch_gradstats.training import Trainer

FEATURES, CLASSES, BATCH, STEPS_PER_EPOCH = 16, 3, 64, 25
#: ``--inject-spike`` multiplies every gradient of its step by this.
SPIKE_FACTOR = 1000.0
#: ``--inject-bad-example``: the batch position whose target is corrupted, and the factor its one-hot target gets.
BAD_POSITION, BAD_TARGET = 7, 1000.0


def make_guard() -> SpikeGuard:
    """The demo's SpikeGuard: a one-epoch window, so it judges steps from step ``min_history`` (11) on, and 12 sigma:
    early in training this small model's norm climbs by up to 10 sigma of the steps before."""
    return SpikeGuard(window=STEPS_PER_EPOCH, sigma=12.0)


def make_clip() -> AdaptiveClip:
    """The demo's AdaptiveClip: ZClip's defaults with a 10-step warm-up, so short runs see it clip."""
    return AdaptiveClip(warmup=10)


def make_data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """Noisy concentric rings (one per class) in 2-d, mixed into ``FEATURES`` dims by a fixed random matrix."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    radius = 1.0 + y.float() + 0.25 * torch.randn(n, generator=g)
    angle = 2 * math.pi * torch.rand(n, generator=g)
    xy = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    mix = torch.randn(2, FEATURES, generator=torch.Generator().manual_seed(1234)) / math.sqrt(2)
    x = xy @ mix + 0.05 * torch.randn(n, FEATURES, generator=g)
    return x, y


def make_model(seed: int) -> nn.Module:
    """A small MLP with readable parameter names (``embed.weight``, ``hidden.weight``, ``head.bias``, ...)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(FEATURES, 64),
            act1=nn.GELU(),
            hidden=nn.Linear(64, 64),
            act2=nn.GELU(),
            head=nn.Linear(64, CLASSES),
        )
    )


def epoch_batches(x: Tensor, y: Tensor, n_batches: int, g: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    order = torch.randperm(x.shape[0], generator=g)
    return [(x[idx], y[idx]) for idx in order[: n_batches * BATCH].split(BATCH)]


def corrupt_target(y: Tensor) -> Tensor:
    """``y`` (class indices) as one-hot class probabilities, the row of :data:`BAD_POSITION` scaled by
    :data:`BAD_TARGET`: CrossEntropyLoss gives every other example the same loss, and that one BAD_TARGET times its
    loss and gradient."""
    target = nn.functional.one_hot(y, CLASSES).to(torch.float32)
    target[BAD_POSITION] *= BAD_TARGET
    return target


def check_step(flag: str, step: int | None, steps: int) -> None:
    if step is not None and not 0 <= step < steps:
        raise ValueError(f"{flag} {step} is outside the run's optimizer steps 0..{steps - 1}")


@dataclass
class Plan:
    """What the flags ask for, checked against the model and the run's length."""

    inject_param: str
    guard: SpikeGuard | None
    clip: AdaptiveClip | None
    watch_activations: bool
    per_example: bool
    injected: list[str]  #: what is injected, in words (the banner and the layer figure's title)


def plan_run(
    model: nn.Module,
    steps: int,
    inject_nan: int | None,
    inject_param: str | None,
    nan_module: str | None,
    inject_spike: int | None,
    spike_guard: bool,
    adaptive_clip: bool,
    watch_activations: bool,
    inject_bad_example: int | None,
) -> Plan:
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules() if n]
    if nan_module is not None and inject_param is not None:
        raise ValueError("give --inject-param (a gradient) or --nan-module (a forward output) to poison, not both")
    if inject_param is None:
        inject_param = "hidden.weight"
    if inject_param not in names:
        raise ValueError(f"--inject-param {inject_param!r} is not a parameter of the demo model; one of {names}")
    if nan_module is not None and nan_module not in modules:
        raise ValueError(f"--nan-module {nan_module!r} is not a module of the demo model; one of {modules}")
    if nan_module is not None and inject_nan is None:
        raise ValueError(f"--nan-module {nan_module} needs --inject-nan STEP: the step whose forward it poisons")
    check_step("--inject-nan", inject_nan, steps)
    check_step("--inject-spike", inject_spike, steps)
    check_step("--inject-bad-example", inject_bad_example, steps)
    per_example = inject_bad_example is not None
    guard = make_guard() if spike_guard or inject_spike is not None or per_example else None
    for flag, step in (("--inject-spike", inject_spike), ("--inject-bad-example", inject_bad_example)):
        if guard is not None and step is not None and step < guard.min_history:
            judged = (f"it judges steps {guard.min_history}..{steps - 1}" if steps > guard.min_history
                      else f"with --steps {steps} it judges none: give --steps above {guard.min_history}")
            raise ValueError(
                f"{flag} {step} falls in the spike guard's warm-up: {judged} (it takes every step until its history "
                f"holds {guard.min_history} norms)"
            )
    injected = []
    if inject_nan is not None:
        where = f"{nan_module}'s forward output" if nan_module is not None else f"{inject_param}'s gradient"
        injected.append(f"NaN injected into {where} at step {inject_nan}")
    if inject_spike is not None:
        injected.append(f"gradients multiplied by {SPIKE_FACTOR:g} at step {inject_spike}")
    if inject_bad_example is not None:
        injected.append(f"target of batch position {BAD_POSITION} multiplied by {BAD_TARGET:g} at step "
                        f"{inject_bad_example}")
    return Plan(inject_param, guard, make_clip() if adaptive_clip else None,
                 watch_activations or nan_module is not None, per_example, injected)


class StepRecorder:
    """The Trainer's ``after_backward``: injects the asked-for NaN or spike into the gradients, then keeps each
    step's per-layer norms, exponent histogram and AdaptiveClip threshold on the device (read once, at the end)."""

    def __init__(self, plan: Plan, inject_nan: int | None, gradient_nan: bool, inject_spike: int | None) -> None:
        self.plan = plan
        self.nan_step = inject_nan if gradient_nan else None
        self.spike_step = inject_spike
        self.bar: Any = None  # the progress bar, advanced once per step
        self.thresholds: list[Tensor] = []  # AdaptiveClip's threshold of each step
        self.layers: list[str] = []
        self.layer_norms: list[Tensor] = []  # each layer's gradient norm at each step
        self.exponents: list[Tensor] = []  # each step's exponent histogram
        self.first_report: ActivationReport | None = None  # the first non-finite one the Trainer kept

    def __call__(self, trainer: Trainer) -> None:
        step = trainer.global_step
        if step == self.nan_step:
            grad = dict(trainer.model.named_parameters())[self.plan.inject_param].grad
            if grad is not None:
                grad.fill_(float("nan"))
        if step == self.spike_step:
            for p in trainer.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(SPIKE_FACTOR)
        if self.plan.clip is not None and step > 0:
            self.thresholds.append(self.plan.clip.last_threshold)  # the previous step's
        stats = grad_stats(trainer.model.named_parameters(), histogram=True)  # one more op call, no host sync
        groups = stats.grouped("layer")
        self.layers[:] = groups.names
        self.layer_norms.append(groups.norms)
        self.exponents.append(cast(Tensor, stats.exponent_histogram))
        self.keep_report(trainer.last_activation_report)  # from the previous step's sync
        if self.bar is not None:
            self.bar.update(1)

    def keep_report(self, report: ActivationReport | None) -> None:
        if self.first_report is None and report is not None and report.nonfinite:
            self.first_report = report

    def finish(self, trainer: Trainer) -> tuple[list[float], dict[str, list[float]], list[list[int]]]:
        """The last step's figures, then everything read to the host: the thresholds, each layer's norms by step,
        the exponent histograms (one transfer each)."""
        self.keep_report(trainer.last_activation_report)
        if self.plan.clip is not None:
            self.thresholds.append(self.plan.clip.last_threshold)
        thresholds = [float(v) for v in torch.stack(self.thresholds).tolist()] if self.thresholds else []
        by_step = torch.stack(self.layer_norms).tolist() if self.layer_norms else []
        per_layer = {name: [float(row[i]) for row in by_step] for i, name in enumerate(self.layers)}
        exponent_rows: list[list[int]] = torch.stack(self.exponents).tolist() if self.exponents else []
        return thresholds, per_layer, exponent_rows
