"""The gradient noise scale (torch_gradstats.monitors.noise_scale): the formulas against a float64 reimplementation, the
accumulation path in one process, and DDP's communication hook on 2 and 4 gloo ranks (tests/_noise_scale_worker.py).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import sys
import time

import pytest
import torch

import torch_gradstats
from torch_gradstats.monitors import noise_scale
from torch_gradstats.monitors.noise_scale import NoiseScale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _noise_scale_worker as worker


# ------------------------------------------------------------------------------------------------- the formulas
def _reference(pairs: list[tuple[float, float, int]], b_small: int, ema: float) -> tuple[float, float, float]:
    """(grad_sq, trace_sigma, b_simple) in float64 from (|G_small|^2, |G_big|^2, B_big) per step."""
    eg = et = 0.0
    for s, b, b_big in pairs:
        g2 = (b_big * b - b_small * s) / (b_big - b_small)
        tr = (s - b) / (1 / b_small - 1 / b_big)
        eg, et = ema * eg + (1 - ema) * g2, ema * et + (1 - ema) * tr
    corr = 1 - ema ** len(pairs)
    return eg / corr, et / corr, et / eg


def test_update_matches_the_float64_formulas() -> None:
    pairs = [(3.25, 1.5, 16), (2.75, 1.125, 16), (4.5, 0.875, 32), (3.0, 1.25, 8), (2.5, 1.0, 16)]
    for ema in (0.0, 0.5, 0.99):
        ns = NoiseScale(4, ema=ema)
        for i, (s, b, b_big) in enumerate(pairs):
            # tensors of other dtypes and shapes of one element, and plain floats, all count the same
            small = torch.tensor([s], dtype=torch.float32) if i % 2 else s
            ns.update(small, torch.tensor(b, dtype=torch.float64), big_batch_size=b_big)
            want = _reference(pairs[: i + 1], 4, ema)
            got = (ns.grad_sq, ns.trace_sigma, ns.b_simple)
            for t, w in zip(got, want, strict=True):
                assert t.dtype == torch.float64 and t.dim() == 0
                assert float(t) == pytest.approx(w, rel=1e-12)
        assert ns.steps == len(pairs)
        assert ns.to_dict() == pytest.approx(
            dict(zip(("noise/b_simple", "noise/grad_sq", "noise/trace_sigma"), (want[2], want[0], want[1])))
        )


def test_one_step_gives_the_unbiased_estimates_exactly() -> None:
    # |G_small|^2 = |G|^2 + tr/B_small and |G_big|^2 = |G|^2 + tr/B_big: the estimates invert them exactly
    ns = NoiseScale(8)
    g2, tr = 2.0, 96.0
    ns.update(g2 + tr / 8, g2 + tr / 32, big_batch_size=32)
    assert float(ns.grad_sq) == pytest.approx(g2, rel=1e-14)
    assert float(ns.trace_sigma) == pytest.approx(tr, rel=1e-14)
    assert float(ns.b_simple) == pytest.approx(48.0, rel=1e-14)


def test_before_any_step_everything_is_nan() -> None:
    ns = NoiseScale(4)
    assert all(math.isnan(float(t)) for t in (ns.b_simple, ns.grad_sq, ns.trace_sigma))
    assert ns.to_dict().keys() == {"noise/b_simple", "noise/grad_sq", "noise/trace_sigma"}
    assert all(math.isnan(v) for v in ns.to_dict().values())


def test_bad_arguments_name_them() -> None:
    with pytest.raises(TypeError, match="local_batch_size must be an int"):
        NoiseScale(4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_batch_size must be >= 1"):
        NoiseScale(0)
    with pytest.raises(TypeError, match="ema must be a float"):
        NoiseScale(4, ema="0.9")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ema must be in \[0, 1\)"):
        NoiseScale(4, ema=1.0)
    np = pytest.importorskip("numpy")
    assert NoiseScale(np.int64(4), ema=np.float32(0.5)).local_batch_size == 4  # numpy scalars count as numbers
    ns = NoiseScale(4)
    with pytest.raises(ValueError, match="big_batch_size must exceed local_batch_size"):
        ns.update(1.0, 0.5, big_batch_size=4)
    with pytest.raises(TypeError, match="big_batch_size must be an int"):
        ns.update(1.0, 0.5, big_batch_size=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="small_sq must be a floating-point tensor of one element"):
        ns.update(torch.ones(2), 0.5, big_batch_size=8)
    with pytest.raises(TypeError, match="big_sq must be a tensor or a float"):
        ns.update(1.0, "0.5", big_batch_size=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state must be a NoiseScale"):
        noise_scale.noise_scale_hook(object(), None)  # type: ignore[arg-type]
    assert ns.steps == 0


def test_state_dict_round_trip_continues_the_same_estimates() -> None:
    pairs = [(3.25 + i / 7, 1.5 - i / 50, 16) for i in range(6)]
    whole, first = NoiseScale(4, ema=0.9), NoiseScale(4, ema=0.9)
    for s, b, bb in pairs:
        whole.update(s, b, big_batch_size=bb)
    for s, b, bb in pairs[:3]:
        first.update(s, b, big_batch_size=bb)
    resumed = NoiseScale(4, ema=0.9)
    resumed.load_state_dict(first.state_dict())
    for s, b, bb in pairs[3:]:
        resumed.update(s, b, big_batch_size=bb)
    assert resumed.steps == 6
    assert resumed.to_dict() == whole.to_dict()
    with pytest.raises(ValueError, match="saved with ema=0.9"):
        NoiseScale(4).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="lacks"):
        NoiseScale(4, ema=0.9).load_state_dict({"ema": 0.9})
    with pytest.raises(TypeError, match="state must be a dict"):
        NoiseScale(4).load_state_dict([])  # type: ignore[arg-type]
    empty = NoiseScale(4)
    empty.load_state_dict(NoiseScale(4).state_dict())
    assert empty.steps == 0 and math.isnan(empty.to_dict()["noise/b_simple"])


def test_a_non_finite_step_is_left_out() -> None:
    """A NaN or Inf gradient on one step leaves the estimates as they were (it made them NaN for good before);
    the steps around it give what they give without it, and a checkpoint keeps that."""
    pairs = [(3.25 + i / 7, 1.5 - i / 50) for i in range(6)]
    bad = [(float("nan"), 1.0), (2.0, float("inf")), (float("inf"), float("inf"))]
    with_bad, without = NoiseScale(4, ema=0.9), NoiseScale(4, ema=0.9)
    for i, (s, b) in enumerate(pairs):
        if i == 3:
            for bs, bb in bad:
                with_bad.update(bs, bb, big_batch_size=16)
        with_bad.update(s, b, big_batch_size=16)
        without.update(s, b, big_batch_size=16)
    assert with_bad.steps == len(pairs) + len(bad)
    got, want = with_bad.to_dict(), without.to_dict()
    assert all(math.isfinite(v) for v in got.values())
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-14), key
    resumed = NoiseScale(4, ema=0.9)
    resumed.load_state_dict(with_bad.state_dict())
    assert resumed.to_dict() == got
    only_bad = NoiseScale(4)
    only_bad.update(float("nan"), 1.0, big_batch_size=16)
    assert all(math.isnan(v) for v in only_bad.to_dict().values())
    # a state saved without "weight" (every step counted) still loads
    old = with_bad.state_dict()
    legacy = NoiseScale(4, ema=0.9)
    legacy.load_state_dict({k: v for k, v in without.state_dict().items() if k != "weight"})
    assert legacy.to_dict()["noise/grad_sq"] == pytest.approx(want["noise/grad_sq"], rel=1e-14)
    with pytest.raises(ValueError, match="weight must be"):
        NoiseScale(4, ema=0.9).load_state_dict({**old, "weight": "x"})


def test_a_step_is_folded_when_its_last_all_reduce_completes_in_any_order() -> None:
    """The bookkeeping behind noise_scale_hook: buckets' all-reduces may complete out of order (a process group can
    run several at once); the step is folded once, after the last launched bucket AND every reduction are in."""
    ns = NoiseScale(4)
    t = torch.tensor
    # bucket 0 is launched and completes before the last bucket is even launched
    ns._bucket_launched(t(2.0, dtype=torch.float64), False)
    ns._bucket_reduced(t(0.5, dtype=torch.float64), 2)
    assert ns.steps == 0
    ns._bucket_launched(t(1.0, dtype=torch.float64), False)
    ns._bucket_launched(t(0.25, dtype=torch.float64), True)  # the last bucket
    ns._bucket_reduced(t(0.125, dtype=torch.float64), 2)  # ...completes before bucket 1
    assert ns.steps == 0
    ns._bucket_reduced(t(0.375, dtype=torch.float64), 2)
    assert ns.steps == 1
    want = NoiseScale(4)
    want.update(3.25, 1.0, big_batch_size=8)
    assert ns.to_dict() == want.to_dict()
    # the next step starts from nothing
    ns._bucket_launched(t(3.25, dtype=torch.float64), True)
    ns._bucket_reduced(t(1.0, dtype=torch.float64), 2)
    want.update(3.25, 1.0, big_batch_size=8)
    assert ns.steps == 2 and ns.to_dict() == want.to_dict()


# ------------------------------------------------------------------------------------------------- accumulation
def _window(step: int, k: int, m: int, d: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [worker.G_VALUE + worker.SIGMA * torch.randn(m, d, generator=gen, dtype=torch.float64) for _ in range(k)]


def _accumulate(ns: NoiseScale, w: torch.nn.Parameter, xs: list[torch.Tensor]) -> None:
    for x in xs:
        with ns.micro_batch([w]):
            ((x * w).sum(1).mean() / len(xs)).backward()  # per-sample gradient x_i, micro-batch mean, / k


@pytest.mark.parametrize("flush_bytes", [noise_scale._MICRO_FLUSH_BYTES, 1])
def test_accumulation_matches_the_formulas(monkeypatch: pytest.MonkeyPatch, flush_bytes: int) -> None:
    monkeypatch.setattr(noise_scale, "_MICRO_FLUSH_BYTES", flush_bytes)  # 1: an op call per gradient
    k, m, d = 3, 4, 10
    w = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))  # a second tensor: the sum over parameters
    ns = NoiseScale(m, ema=0.5)
    pairs = []
    for step in range(3):
        xs = _window(step, k, m, 2 * d)
        for x in xs:
            with ns.micro_batch([w, w2, w]):  # a repeated tensor counts once
                ((x * torch.cat([w, w2])).sum(1).mean() / k).backward()
        ns.step(torch.nn.ParameterList([w, w2]))  # a module is accepted
        small = sum(float(x.mean(0).pow(2).sum()) for x in xs) / k
        big = float(torch.cat(xs).mean(0).pow(2).sum())
        pairs.append((small, big, k * m))
        w.grad = w2.grad = None
        got = (ns.grad_sq, ns.trace_sigma, ns.b_simple)
        for t, want in zip(got, _reference(pairs, m, 0.5), strict=True):
            assert float(t) == pytest.approx(want, rel=1e-10)


def test_accumulation_converges_with_the_default_ema() -> None:
    k, m, d = 4, worker.LOCAL_BATCH, worker.D
    w = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))
    ns = NoiseScale(m)
    for step in range(500):
        _accumulate(ns, w, _window(step, k, m, d))
        ns.step([w])
        w.grad = None
    out = ns.to_dict()
    assert out["noise/b_simple"] == pytest.approx(worker.B_SIMPLE, rel=0.1)
    assert out["noise/grad_sq"] == pytest.approx(worker.G_VALUE**2 * d, rel=0.1)
    assert out["noise/trace_sigma"] == pytest.approx(worker.SIGMA**2 * d, rel=0.1)


def test_accumulation_reads_no_value_on_the_host() -> None:
    w = torch.nn.Parameter(torch.zeros(8))
    ns = NoiseScale(2)
    xs = [torch.randn(2, 8) for _ in range(3)]
    losses = [(x * w).sum(1).mean() / 3 for x in xs]
    calls: list[str] = []
    with worker.refusing_host_reads(calls):
        for loss in losses:
            with ns.micro_batch([w]):
                loss.backward()
        ns.step([w])
    assert calls == []
    assert ns.steps == 1 and math.isfinite(float(ns.b_simple))


def test_refusing_host_reads_sees_a_read() -> None:
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="host read"), worker.refusing_host_reads(calls):
        torch.ones(2).sum().item()
    assert calls == [f"Tensor.item() from {__name__}"]
    assert torch.ones(1).item() == 1.0  # restored


def test_accumulation_misuse_is_a_clear_error() -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    ns = NoiseScale(2)
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        ns.step([w])
    with ns.micro_batch([w]):
        (w * torch.ones(4)).sum().backward()
    with pytest.raises(RuntimeError, match="boom"), ns.micro_batch([w]):
        (w * torch.ones(4)).sum().backward()
        raise RuntimeError("boom")  # a failed micro-batch is not counted
    with pytest.raises(ValueError, match="got 1"):
        ns.step([w])
    with pytest.raises(ValueError, match="no tensor that requires grad"), ns.micro_batch([torch.zeros(2)]):
        pass
    with pytest.raises(TypeError, match="NoiseScale.micro_batch: expected parameters"), ns.micro_batch(3):
        pass
    assert ns.steps == 0


def test_public_names() -> None:
    assert torch_gradstats.NoiseScale is NoiseScale
    assert torch_gradstats.noise_scale_hook is noise_scale.noise_scale_hook


# ------------------------------------------------------------------------------------------------- DDP on gloo
SPAWN_TIMEOUT_S = 240.0
COLLECTIVE_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ddp_results(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, str]]]]:
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    import torch.multiprocessing as mp

    world = request.param
    outdir = str(tmp_path_factory.mktemp(f"noise{world}"))
    multiprocessing.set_forkserver_preload(["torch", "torch.nn.parallel", "_noise_scale_worker"])
    ctx = mp.start_processes(
        worker.run_worker,
        args=(world, _free_port(), outdir, COLLECTIVE_TIMEOUT_S),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world}-rank run did not finish in {SPAWN_TIMEOUT_S:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    results = []
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return world, results


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(worker.SCENARIOS))
def test_ddp(ddp_results, scenario: str) -> None:
    world, results = ddp_results
    outcomes = [r.get(scenario, {"status": "fail", "detail": "not reached"}) for r in results]
    failed = [(rank, o["detail"]) for rank, o in enumerate(outcomes) if o["status"] == "fail"]
    if failed:
        pytest.fail("\n".join(f"--- rank {rank} of {world}:\n{detail}" for rank, detail in failed))
    assert all(o["status"] == "ok" for o in outcomes), outcomes
    for rank, o in enumerate(outcomes):
        if o["detail"]:
            print(f"rank {rank}: {o['detail']} ({o['seconds']} s)")


def test_discard_window_drops_the_window_under_the_lock() -> None:
    """discard_window() empties the window (the next step needs its own micro-batches) and returns how many it
    dropped; it takes the lock the micro-batches' exits and step() take, so it waits for one in progress."""
    import threading

    w = torch.nn.Parameter(torch.ones(4))
    ns = NoiseScale(2)
    for _ in range(3):
        with ns.micro_batch([w]):
            (w * 2).sum().backward()
    ns._lock.acquire()  # a micro-batch's exit (or a step) holding the lock
    dropped: list[int] = []
    t = threading.Thread(target=lambda: dropped.append(ns.discard_window()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not dropped  # waiting for the lock
    ns._lock.release()
    t.join(10)
    assert dropped == [3]
    assert ns.discard_window() == 0
    with pytest.raises(ValueError, match="got 0"):
        ns.step([w])
    assert ns.steps == 0


def test_bench_noise_scale_ema_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/noise_scale_ema.py (the table of docs/noise_scale.md) folds its steps as NoiseScale.update does."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "noise_scale_ema.py"
    spec = importlib.util.spec_from_file_location("_bench_noise_scale_ema", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--steps", "40", "--seeds", "8"]) == 0  # checks itself against NoiseScale on each setup
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["2", "2", "2", "2", "4", "4"]
