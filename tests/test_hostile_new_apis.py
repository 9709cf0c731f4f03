"""Hostile inputs to the newer public APIs: each must raise a named TypeError/ValueError, never give a silently wrong
result or leave an object in a broken state."""

from __future__ import annotations

import math

import pytest
import torch

from torch_gradstats import AdaptiveClip, NoiseScale, SpikeGuard


# ------------------------------------------------------------------------------------------- SpikeGuard
def _guard_state(**changes: torch.Tensor) -> dict:
    g = SpikeGuard(window=4, min_history=2)
    for v in (1.0, 1.1, 0.9):
        g.observe(v)
    state = g.state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("count", torch.tensor([100, 0]), "'count' must be in"),
        ("count", torch.tensor([-1, 0]), "'count' must be in"),
        ("position", torch.tensor([-7, 0]), "'position' must be in"),
        ("position", torch.tensor([1, 0]), "'position' must be in"),  # 3 values recorded: the next slot is 3
        ("counters", torch.tensor([3, -1, 0, 0, 0]), "'counters' must be >= 0"),
        ("history", torch.tensor([[1.0, math.nan, 0.9, 0.0], [0.0] * 4], dtype=torch.float64), "non-finite"),
    ],
)
def test_guard_load_rejects_impossible_state(key: str, value: torch.Tensor, match: str) -> None:
    # A count above the window used to load and then skip every later step.
    g = SpikeGuard(window=4)
    before = g.state_dict()
    with pytest.raises(ValueError, match=match):
        g.load_state_dict(_guard_state(**{key: value}))
    assert torch.equal(g.state_dict()["count"], before["count"])  # left as it was
    assert g.observe(1.0).item() == 1.0


def test_guard_load_accepts_its_own_state_and_decides_alike() -> None:
    state = _guard_state()
    a, b = SpikeGuard(window=4), SpikeGuard(window=4)
    a.load_state_dict(state)
    b.load_state_dict(state)
    assert [a.observe(v).item() for v in (1.0, 50.0)] == [1.0, 0.0]
    assert [b.observe(v).item() for v in (1.0, 50.0)] == [1.0, 0.0]


@pytest.mark.parametrize("make", [lambda: SpikeGuard(window=4), lambda: AdaptiveClip(warmup=2)])
def test_meta_figure_is_rejected_and_state_kept(make) -> None:
    # A meta norm used to move the whole state to the meta device: every recorded value was lost.
    policy = make()
    step = policy.observe if isinstance(policy, SpikeGuard) else policy.threshold
    step(1.0)
    with pytest.raises(ValueError, match="meta tensor"):
        step(torch.tensor(1.0, device="meta"))
    assert policy.device.type == "cpu"
    step(1.0)  # still usable on the CPU


# ------------------------------------------------------------------------------------------- AdaptiveClip
@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("count", torch.tensor([-5]), r"'count' \(the warm-up norms collected\) must be in"),
        ("count", torch.tensor([9]), r"'count' \(the warm-up norms collected\) must be in"),
        ("ema", torch.tensor([1.0, -1.0], dtype=torch.float64), r"EMA variance .* must be finite and >= 0"),
        ("ema", torch.tensor([math.nan, 1.0], dtype=torch.float64), "must be finite"),
    ],
)
def test_adaptive_clip_load_rejects_impossible_state(key: str, value: torch.Tensor, match: str) -> None:
    # A negative count used to load and then never end the warm-up: no step was ever clipped.
    saved = AdaptiveClip(warmup=2)
    saved.threshold(1.0)
    state = saved.state_dict()
    state[key] = value
    clip = AdaptiveClip(warmup=2)
    with pytest.raises(ValueError, match=match):
        clip.load_state_dict(state)
    assert int(clip.state_dict()["count"][0]) == 0


# ------------------------------------------------------------------------------------------- NoiseScale
def test_noise_scale_update_does_not_chain_autograd_graphs() -> None:
    # Norms that require grad used to make the EMAs part of every step's graph (growing without bound).
    ns = NoiseScale(2)
    x = torch.tensor(4.0, requires_grad=True)
    for _ in range(3):
        ns.update(x * 1.0, x * 0.75, big_batch_size=4)
    assert not ns.grad_sq.requires_grad and ns.grad_sq.grad_fn is None
    assert not ns.trace_sigma.requires_grad
    assert math.isfinite(ns.to_dict()["noise/b_simple"])


# ------------------------------------------------------------------------------------------- file sinks
def _report():
    from torch_gradstats import grad_stats

    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    return grad_stats([("w", w)]).report()


@pytest.mark.parametrize("sink_name", ["CSVSink", "JSONLSink"])
@pytest.mark.parametrize(
    ("step", "error"), [(1.7, TypeError), ("5", TypeError), (None, TypeError), (math.nan, TypeError), (True, TypeError)]
)
def test_sink_step_must_be_an_int(tmp_path, sink_name: str, step: object, error: type) -> None:
    # A float step used to be written truncated (1.7 as 1), a str as given; None/NaN failed inside int().
    from torch_gradstats.integrations import files

    sink = getattr(files, sink_name)(tmp_path / "f")
    with pytest.raises(error, match=r"\.log: step must be an int"):
        sink.log(_report(), step)
    sink.log(_report(), 3)
    sink.close()
    assert "3" in (tmp_path / "f").read_text()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"style": "nope"}, ValueError, "style must be one of"),
        ({"style": None}, TypeError, "style must be a str"),
        ({"prefix": None}, TypeError, "prefix must be a str"),
        ({"per_param": "no"}, TypeError, "per_param must be a bool"),
    ],
)
def test_sink_settings_checked_before_the_file_is_truncated(tmp_path, kwargs: dict, error: type, match: str) -> None:
    from torch_gradstats.integrations.files import CSVSink

    path = tmp_path / "keep.csv"
    path.write_text("earlier run\n")
    with pytest.raises(error, match=match):
        CSVSink(path, **kwargs)
    assert path.read_text() == "earlier run\n"


def test_sink_log_rejects_a_non_report(tmp_path) -> None:
    from torch_gradstats.integrations.files import JSONLSink

    with JSONLSink(tmp_path / "f.jsonl") as sink, pytest.raises(TypeError, match="report must be a GradReport"):
        sink.log(None, 1)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- grad_stats options
def _named() -> list:
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    return [("w", w)]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tied": "w"}, TypeError, "tied must be a collection"),  # a str is a collection of characters
        ({"tied": ["w"]}, ValueError, "pass stage_group too"),
        ({"is_expert": lambda n: True}, ValueError, "expert_group and is_expert go together"),
        ({"is_expert": 5}, TypeError, "is_expert must be a callable"),
    ],
)
def test_grad_stats_group_options_without_their_group_are_refused(kwargs: dict, error: type, match: str) -> None:
    # Without a process group these options used to be ignored silently.
    from torch_gradstats import grad_stats

    with pytest.raises(error, match=match):
        grad_stats(_named(), **kwargs)


def test_grad_stats_empty_tied_list_is_fine() -> None:
    from torch_gradstats import grad_stats

    assert grad_stats(_named(), tied=[]).report().total_norm == pytest.approx(math.sqrt(2))


def test_report_groups_must_be_group_stats() -> None:
    from torch_gradstats import grad_stats

    with pytest.raises(TypeError, match="groups must be a GroupStats"):
        grad_stats(_named()).report(groups="layer")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- compat.torchtitan
@pytest.mark.parametrize(
    ("max_norm", "norm_type", "error", "match"),
    [
        (math.nan, 2.0, ValueError, "max_norm must be >= 0"),  # used to make every gradient NaN
        (-1.0, 2.0, ValueError, "max_norm must be >= 0"),  # used to flip every gradient's sign
        ("1", 2.0, TypeError, "max_norm must be a real number"),
        (None, 2.0, TypeError, "max_norm must be a real number"),
        (1.0, "2", TypeError, "norm_type must be a real number"),  # used to be parsed as a number
        (1.0, True, TypeError, "norm_type must be a real number"),
    ],
)
def test_torchtitan_clip_rejects_bad_settings_and_leaves_gradients(
    max_norm: object, norm_type: object, error: type, match: str
) -> None:
    from torch_gradstats.compat import torchtitan

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, -4.0])
    with pytest.raises(error, match=match):
        torchtitan.clip_grad_norm_([p], max_norm, norm_type)  # type: ignore[arg-type]
    assert torch.equal(p.grad, torch.tensor([3.0, -4.0]))


def test_torchtitan_clip_still_takes_a_tensor_max_norm_and_inf() -> None:
    from torch_gradstats.compat import torchtitan

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, -4.0])
    assert torchtitan.clip_grad_norm_([p], math.inf).item() == pytest.approx(5.0)
    assert torch.equal(p.grad, torch.tensor([3.0, -4.0]))
    torchtitan.clip_grad_norm_([p], torch.tensor(1.0))
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


# ------------------------------------------------------------------------------------------- meta tensors
def test_activation_watch_report_of_a_meta_model_is_a_value_error() -> None:
    # It used to fail inside the host transfer with NotImplementedError("Cannot copy out of meta tensor").
    from torch_gradstats.monitors.activations import ActivationWatch

    model = torch.nn.Linear(2, 2, device="meta")
    with ActivationWatch(model) as watch:
        model(torch.ones(1, 2, device="meta"))
        with pytest.raises(ValueError, match="meta tensors"):
            watch.report()


def test_step_or_skip_meta_factor_is_a_value_error() -> None:
    from torch_gradstats import step_or_skip

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=1.0)
    with pytest.raises(ValueError, match="factor is a meta tensor"):
        step_or_skip(opt, torch.tensor(1.0, device="meta"))
    assert torch.equal(p.detach(), torch.ones(2))


@pytest.mark.parametrize("cls", [SpikeGuard, AdaptiveClip])
@pytest.mark.parametrize(("device", "error"), [(5, TypeError), (None, TypeError), ("gpu", ValueError)])
def test_policy_device_is_checked(cls: type, device: object, error: type) -> None:
    # An int used to reach torch.device and fail with "Cannot access accelerator device" (a RuntimeError).
    if device is not None:
        with pytest.raises(error, match=f"{cls.__name__}: device"):
            cls(device=device)
    with pytest.raises(error, match=rf"{cls.__name__}\.to: device"):
        cls().to(device)
    assert cls(device="cpu").to(torch.device("cpu")).device.type == "cpu"


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"ema": None}, TypeError, "ema must be a float"),  # used to fail inside float()
        ({"ema": "0.9"}, TypeError, "ema must be a float"),  # used to be parsed
        ({"grad_sq_ema": torch.tensor(1.0, device="meta")}, ValueError, "with a value"),  # failed at the next step
        ({"grad_sq_ema": torch.tensor(1)}, ValueError, "floating-point"),
    ],
)
def test_noise_scale_load_rejects_bad_state(change: dict, error: type, match: str) -> None:
    saved = NoiseScale(2, ema=0.9)
    saved.update(4.0, 3.0, big_batch_size=4)
    state = {**saved.state_dict(), **change}
    ns = NoiseScale(2, ema=0.9)
    with pytest.raises(error, match=match):
        ns.load_state_dict(state)
    assert ns.steps == 0
    ns.load_state_dict(saved.state_dict())
    ns.update(4.0, 3.0, big_batch_size=4)
    assert ns.steps == 2


@pytest.mark.parametrize("style", ["default", "hf"])
def test_to_dict_prefix_must_be_a_str(style: str) -> None:
    # GroupReport.to_dict(None) used to write "Nonegroup/..." keys; GradReport.to_dict failed inside "+".
    from torch_gradstats import grad_stats

    stats = grad_stats(_named())
    report = stats.report(groups=stats.grouped(lambda n: "all"))
    with pytest.raises(TypeError, match="prefix must be a str"):
        report.to_dict(prefix=None, style=style)  # type: ignore[arg-type]
    assert report.groups is not None
    with pytest.raises(TypeError, match="GroupReport.to_dict: prefix must be a str"):
        report.groups.to_dict(None)  # type: ignore[arg-type]
    assert report.groups.to_dict("g/")["g/group/all/norm"] == pytest.approx(math.sqrt(2))


def test_adaptive_clip_clips_a_tied_parameter_once() -> None:
    # named_parameters(remove_duplicate=False) lists a tied weight twice: it used to be counted twice in the norm
    # and scaled twice (a norm of 1/12 instead of the cap of 1).
    a = torch.nn.Linear(2, 2, bias=False)
    b = torch.nn.Linear(2, 2, bias=False)
    b.weight = a.weight
    model = torch.nn.Sequential(a, b)
    a.weight.grad = torch.full((2, 2), 3.0)
    stats = AdaptiveClip(warmup=1, max_norm=1.0).clip_(model.named_parameters(remove_duplicate=False))
    assert stats.total_norm.item() == pytest.approx(6.0)
    assert a.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_is_logging_rank_rank_argument() -> None:
    # A negative rank used to answer True (torch.distributed not initialized); a numpy int was a TypeError.
    import numpy as np

    from torch_gradstats.distributed.reduce import is_logging_rank

    with pytest.raises(ValueError, match="rank must be a global rank >= 0"):
        is_logging_rank(rank=-1)
    with pytest.raises(TypeError, match="rank must be an int"):
        is_logging_rank(rank="0")  # type: ignore[arg-type]
    assert is_logging_rank(rank=np.int64(0)) is True


def _meta_named() -> list:
    w = torch.nn.Parameter(torch.ones(2, device="meta"))
    w.grad = torch.ones(2, device="meta")
    return [("w", w)]


def test_group_stats_report_of_meta_gradients_is_a_value_error() -> None:
    from torch_gradstats import grad_stats

    with pytest.raises(ValueError, match="GroupStats.report: these figures are of meta tensors"):
        grad_stats(_meta_named()).grouped().report()


def test_megatron_compat_hostile_inputs() -> None:
    from torch_gradstats.compat import megatron

    with pytest.raises(ValueError, match="meta tensors"):
        megatron.get_grad_norm_fp32([torch.ones(2, device="meta")])
    # A str used to count 0 zeros (its characters were skipped as parameters without a gradient).
    with pytest.raises(TypeError, match="parameters must be a tensor or a list"):
        megatron.count_zeros_fp32("weight", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parameters\[1\] must be a torch.Tensor"):
        megatron.count_zeros_fp32([torch.nn.Parameter(torch.ones(1)), "bias"], None)  # type: ignore[list-item]
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([0.0, 1.0, 0.0])
    assert megatron.count_zeros_fp32([p], None) == 2.0


# ------------------------------------------------------------------------------------------- copies mid-run
def test_noise_scale_deepcopies_and_pickles_mid_window() -> None:
    # Its lock made copy.deepcopy and pickle fail ("cannot pickle '_thread.lock' object").
    import copy
    import pickle

    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    ns = NoiseScale(2, ema=0.5)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, generator=gen, dtype=torch.float64) for _ in range(4)]

    def micro(n: NoiseScale, x: torch.Tensor) -> None:
        with n.micro_batch([w]):
            ((x * w).sum(1).mean() / 2).backward()

    micro(ns, xs[0]), micro(ns, xs[1])
    ns.step([w])
    w.grad = None
    micro(ns, xs[2])  # a window in progress
    grad = w.grad.clone()
    copies = [copy.deepcopy(ns), pickle.loads(pickle.dumps(ns))]
    for n in (ns, *copies):
        w.grad = grad.clone()
        micro(n, xs[3])
        n.step([w])
    want = ns.to_dict()
    assert ns.steps == 2 and math.isfinite(want["noise/b_simple"])
    for c in copies:
        assert c.steps == 2 and c.to_dict() == want
        assert c._state is not ns._state  # independent: a step of one leaves the other as it was


# ------------------------------------------------------------------------------------------- inference tensors
def _model_with_inference_grads(index: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model(torch.randn(16, 4)).pow(2).mean().backward()
    p = list(model.parameters())[index]
    with torch.inference_mode():
        p.grad = p.grad.clone()
    return model, [q.grad.clone() for q in model.parameters()]


@pytest.mark.parametrize("index", [0, 2])
def test_clipping_an_inference_gradient_names_it_and_scales_nothing(index: int) -> None:
    # Scaling failed part-way (the gradients before it in the list already scaled) with torch's message, no name.
    from torch_gradstats import clip_grad_norm_

    model, before = _model_with_inference_grads(index)
    name = ["0.weight", "0.bias", "2.weight", "2.bias"][index]
    clip = AdaptiveClip(warmup=1, max_norm=1e-3)
    state = clip.state_dict()
    for call in (lambda: clip_grad_norm_(model.named_parameters(), 1e-3), lambda: clip.clip_(model.named_parameters())):
        with pytest.raises(ValueError, match=f"'{name}' is an inference tensor"):
            call()
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    for a, b in zip(clip.state_dict().values(), state.values()):  # the threshold's step was not taken
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    with torch.inference_mode():  # inside the mode it is scaled as any other
        stats = clip_grad_norm_(model.named_parameters(), 1e-3)
    want = 1e-3 / (float(stats.total_norm) + 1e-6)
    assert all(torch.allclose(p.grad, b * want) for p, b in zip(model.parameters(), before))


def test_compiled_clipping_of_an_inference_gradient_fails_loudly() -> None:
    # Inside torch.compile the check is skipped (Dynamo cannot trace is_inference, and the clip stays one graph): the
    # documented outcome is PyTorch's own error, never a clip that returns as if the gradient had been scaled.
    from torch_gradstats import clip_grad_norm_

    model, _ = _model_with_inference_grads(2)
    compiled = torch.compile(lambda: clip_grad_norm_(model.named_parameters(), 1e-3), backend="eager")
    try:
        with pytest.raises(RuntimeError, match="[Ii]nference"):
            compiled()
    finally:  # a compiled torch.no_grad() block that raises leaves grad mode off (PyTorch's, any such block)
        torch.set_grad_enabled(True)
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------------- the meta device
def test_noise_scale_refuses_meta_figures_and_stays_usable() -> None:
    # A window on a meta model (a dry run before to_empty) made the state on the meta device: every later step and
    # read then failed with "Cannot copy out of meta tensor".
    with torch.device("meta"):
        model = torch.nn.Linear(4, 1)
    ns = NoiseScale(2, ema=0.5)
    for _ in range(2):
        with ns.micro_batch(model):
            model(torch.randn(2, 4, device="meta")).sum().backward()
    with pytest.raises(ValueError, match="small_sq is a meta tensor"):
        ns.step(model)
    with pytest.raises(ValueError, match="big_sq is a meta tensor"):
        ns.update(1.0, torch.ones((), device="meta"), big_batch_size=4)
    assert ns._state is None and ns.steps == 0
    ns.update(1.0, 0.5, big_batch_size=4)  # |G|^2 = (4 * 0.5 - 2 * 1) / 2 = 0, tr = 0.5 / (1/2 - 1/4) = 2
    assert ns.to_dict() == {"noise/b_simple": math.inf, "noise/grad_sq": 0.0, "noise/trace_sigma": 2.0}


# ------------------------------------------------------------------------------------------- UpdateRatio
def test_update_ratio_names_a_parameter_that_the_subtraction_refuses() -> None:
    # A float8 weight, or one whose .data was replaced by another shape after snapshot(), failed measure() with
    # torch's "add_stub not implemented for 'Float8_e4m3fn'" or a size mismatch, naming nothing.
    from torch_gradstats.updates import UpdateRatio

    w = torch.nn.Parameter(torch.ones(4))
    f8 = torch.nn.Parameter(torch.ones(4).to(torch.float8_e4m3fn), requires_grad=False)
    ratio = UpdateRatio([("w", w), ("scale8", f8)])
    ratio.snapshot()
    with pytest.raises(TypeError, match="parameter 'scale8' has a torch.float8_e4m3fn tensor"):
        ratio.measure()
    with pytest.raises(RuntimeError, match="without a snapshot"):  # not measured again from half-subtracted buffers
        ratio.measure()

    resized = torch.nn.Parameter(torch.ones(4))
    ratio = UpdateRatio([("w", w), ("resized", resized)])
    ratio.snapshot()
    resized.data = torch.ones(5)
    with pytest.raises(ValueError, match=r"'resized' changed between snapshot\(\) and measure\(\), from \(4,\)"):
        ratio.measure()
    ratio.snapshot()  # a new snapshot measures again
    with torch.no_grad():
        resized.mul_(3.0)
    stats = ratio.measure()
    assert stats.delta_sumsq.tolist() == [0.0, 20.0] and stats.weight_sumsq.tolist() == [4.0, 45.0]


def test_noise_scale_step_leaves_out_a_frozen_parameters_stale_gradient() -> None:
    # micro_batch reads the parameters that require grad, step read every .grad: a layer frozen mid-run kept its
    # last gradient, which step counted in the big batch alone (here b_simple -3.98 instead of 3.74).
    def run(stale: bool) -> dict[str, float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
        x = torch.randn(4, 8, 4, dtype=torch.float64)
        model(x[0]).sum().backward()  # an earlier step: every parameter has a gradient
        model[0].requires_grad_(False)  # the first layer frozen from here on
        for p in model.parameters():
            if p.requires_grad or not stale:
                p.grad = None
        ns = NoiseScale(4, ema=0.5)
        for s in range(1, 4):
            for i in range(2):
                with ns.micro_batch(model):
                    (model(x[s, i * 4:(i + 1) * 4]).pow(2).mean() / 2).backward()
            ns.step(model)
            model[2].zero_grad(set_to_none=True)
        return ns.to_dict()

    fresh, stale = run(False), run(True)
    assert stale == fresh and fresh["noise/b_simple"] == pytest.approx(3.7445, abs=1e-4)


@pytest.mark.parametrize("cls", [SpikeGuard, AdaptiveClip])
def test_policies_refuse_the_meta_device_for_their_state(cls: type) -> None:
    # A policy built with device=<a meta model's device> (deferred init) or moved there held no values: its
    # decisions were meta tensors, and the first real step failed with "Cannot copy out of meta tensor".
    name = cls.__name__
    with pytest.raises(ValueError, match=f"{name}: device is the meta device"):
        cls(device=torch.device("meta"))
    policy = cls()
    first = policy.observe(1.0) if cls is SpikeGuard else policy.threshold(1.0)
    with pytest.raises(ValueError, match=rf"{name}.to: device is the meta device"):
        policy.to("meta")
    assert policy.device == torch.device("cpu")
    assert float(first) == (1.0 if cls is SpikeGuard else math.inf)
    if cls is SpikeGuard:  # still readable: the step taken before is there
        assert policy.check()["guard/skipped"] == 0.0 and int(policy.steps) == 1
    else:
        assert policy.figures() == {"clip/threshold": math.inf, "clip/coef": 1.0}


def test_numpy_integers_where_ints_are_taken() -> None:
    # Trainer(flight_recorder=np.int64(8)) and a NoiseScale state whose step count went through numpy were refused
    # ("must be an int").
    np = pytest.importorskip("numpy")
    from torch_gradstats import Trainer

    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(),
                      flight_recorder=np.int64(8), progress=False)
    assert trainer.flight_recorder is not None and trainer.flight_recorder.capacity == 8
    ns = NoiseScale(2, ema=0.5)
    ns.update(1.0, 0.5, big_batch_size=4)
    state = ns.state_dict()
    state["steps"] = np.int64(state["steps"])
    other = NoiseScale(2, ema=0.5)
    other.load_state_dict(state)
    assert other.steps == 1 and type(other.steps) is int and other.to_dict() == ns.to_dict()


def test_noise_scale_deep_copy_reads_through_the_same_grad_scaler() -> None:
    # The copy got a copy of the GradScaler, which starts with no scale: its readings of scaled gradients were no
    # longer unscaled (the window's sum 833947 instead of 0.983), and a copy made after unscale_ failed on the
    # scaler's "may only be pickled at the beginning of an iteration".
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ns = NoiseScale(2, ema=0.5, scaler=scaler)
    x = torch.randn(4, 4, dtype=torch.float64)

    def micro(n: NoiseScale, xb: torch.Tensor) -> None:
        with n.micro_batch(model):
            scaler.scale(model(xb).pow(2).mean() / 2).backward()

    micro(ns, x[:2])
    grads = [p.grad.clone() for p in model.parameters()]
    copies = []
    for n in (ns, copy.deepcopy(ns)):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        micro(n, x[2:])
        scaler.unscale_(opt)
        n.step(model)
        copies.append(copy.deepcopy(n))  # mid-iteration: after unscale_, before update
        scaler._per_optimizer_states.clear()  # the same iteration again for the copy
    ns, twin = copies
    assert twin.scaler is scaler and ns.scaler is scaler
    reference = NoiseScale(2, ema=0.5)  # the same window without a loss scale
    for p in model.parameters():
        p.grad = None
    for xb in (x[:2], x[2:]):
        with reference.micro_batch(model):
            (model(xb).pow(2).mean() / 2).backward()
    reference.step(model)
    want = reference.to_dict()  # the scale is a power of two: the unscaled readings are exact
    assert twin.to_dict() == ns.to_dict() == want and twin.steps == ns.steps == 1


@pytest.mark.parametrize("cls", [SpikeGuard, AdaptiveClip])
def test_policy_state_loaded_on_the_meta_device_is_named(cls: type) -> None:
    # torch.load(map_location="meta") gives shapes without values: the load failed with torch's "Cannot copy out of
    # meta tensor; no data!".
    import io

    policy = cls()
    first = policy.observe(2.0) if cls is SpikeGuard else policy.threshold(2.0)
    buf = io.BytesIO()
    torch.save(policy.state_dict(), buf)
    buf.seek(0)
    meta = torch.load(buf, map_location="meta", weights_only=True)
    other = cls()
    with pytest.raises(ValueError, match=f"{cls.__name__}.load_state_dict: '[a-z_]+' is a meta tensor"):
        other.load_state_dict(meta)
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert float(first) == (1.0 if cls is SpikeGuard else math.inf)
    if cls is SpikeGuard:
        assert int(other.steps) == 1
    else:
        assert int(other.state_dict()["count"][0]) == 1


def test_numpy_integers_in_the_monitors_and_grouping() -> None:
    # Each was refused with "must be an int ..., got np.int64(...)".
    np = pytest.importorskip("numpy")
    from torch_gradstats import ActivationWatch, PerExampleNorms, grad_stats

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    per_example = PerExampleNorms(model, batch_dim=np.int64(0), max_materialize=np.int64(4))
    watch = ActivationWatch(model, every_n_steps=np.int64(2))
    x = torch.randn(4, 3)
    model(x).sum().backward()
    indices, norms = per_example.top(np.int64(2))
    assert indices.tolist() == per_example.norms().argsort(descending=True)[:2].tolist() and len(norms) == 2
    assert watch.every_n_steps == 2 and type(watch.every_n_steps) is int
    assert grad_stats(model.named_parameters()).grouped(np.int64(1)).names == ["0", "1"]
    watch.remove()
    per_example.remove()
