"""Worker side of tests/test_compat_deepspeed.py: each of 2 gloo ranks trains a tiny model with a real DeepSpeed
ZeRO 1/2 engine on the CPU and checks engine_grad_stats against a single-process float64 reference: the same
weights, backward on the whole global batch (every rank makes every rank's batch from one seed)."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn

MICRO = 4  # samples per rank and micro-batch


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    with torch.no_grad():
        model[0].bias[0] = -100.0  # a dead unit: its gradient rows are exact zeros
    return model


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 7, generator=gen), torch.randn(MICRO, 3, generator=gen)


def _engine(stage: int, gas: int, world: int, precision: dict | None = None, **zero: object) -> object:
    import deepspeed

    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.1)  # 2 groups
    config = {
        "train_batch_size": MICRO * gas * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **(precision or {}),
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _reference(engine: object, step: int, gas: int, world: int) -> tuple[list[str], torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    ref = _model().double()
    with torch.no_grad():
        for q, p in zip(ref.parameters(), engine.module.parameters()):  # type: ignore[attr-defined]
            q.copy_(p)
    xs, ys = zip(*(_batch(step, m, r) for m in range(gas) for r in range(world)))
    loss = nn.functional.mse_loss(ref(torch.cat(xs).double()), torch.cat(ys).double())
    loss.backward()
    names = [n for n, _ in ref.named_parameters()]
    grads = [q.grad for q in ref.parameters()]
    sumsq = torch.stack([g.pow(2).sum() for g in grads])
    amax = torch.stack([g.abs().max() for g in grads])
    zeros = torch.tensor([int((g == 0).sum()) for g in grads])
    return names, sumsq, amax, zeros


def _train_and_check(stage: int, gas: int, rank: int, world: int, precision: dict | None = None,
                     rtol: float = 2e-5) -> None:
    from torch_gradstats.compat.deepspeed import engine_grad_stats

    engine = _engine(stage, gas, world, precision)
    dtype = next(engine.module.parameters()).dtype  # type: ignore[attr-defined]
    assert engine.optimizer.cpu_offload == ("offload_optimizer" in str(precision))  # type: ignore[attr-defined]
    for step in range(3):
        names, sumsq, amax, zeros = _reference(engine, step, gas, world)
        for micro in range(gas):
            x, y = _batch(step, micro, rank)
            out = engine(x.to(dtype)).float()  # type: ignore[operator]
            engine.backward(nn.functional.mse_loss(out, y))  # type: ignore[attr-defined]
            if micro == gas - 1:
                got = engine_grad_stats(engine)
                assert got.names == names, got.names
                torch.testing.assert_close(got.sumsq, sumsq, rtol=rtol, atol=0)
                torch.testing.assert_close(got.amax, amax, rtol=rtol, atol=0)
                assert torch.equal(got.counts[:, 0], zeros), (got.counts, zeros)
                assert int(got.counts[:, 1:].sum()) == 0
                assert got.numel.tolist() == [35, 5, 15, 3]
                report = got.report()
                assert abs(report.total_norm - float(sumsq.sum().sqrt())) < rtol * report.total_norm
            engine.step()  # type: ignore[attr-defined]
    assert zeros.tolist() == [7, 1, 3, 0]  # the dead unit's row, bias entry and column


def zero1(rank: int, world: int) -> None:
    _train_and_check(1, 1, rank, world)


def zero2_accumulated(rank: int, world: int) -> None:
    _train_and_check(2, 2, rank, world)


def zero2_fp16(rank: int, world: int) -> None:
    # the partitions hold loss-scaled gradients (scale 2**8 here) until step(): the figures are unscaled ones
    _train_and_check(2, 1, rank, world, {"fp16": {"enabled": True, "initial_scale_power": 8}}, rtol=5e-3)


def zero1_bf16(rank: int, world: int) -> None:
    _train_and_check(1, 1, rank, world, {"bf16": {"enabled": True}}, rtol=3e-2)


def zero2_offload(rank: int, world: int) -> None:
    # the averaged partitions then live in the offloaded optimizer's gradient dictionary
    _train_and_check(2, 1, rank, world, {"zero_force_ds_cpu_optimizer": False,
                                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def after_step_raises(rank: int, world: int) -> None:
    from torch_gradstats.compat.deepspeed import engine_grad_stats

    engine = _engine(2, 1, world)
    x, y = _batch(0, 0, rank)
    engine.backward(nn.functional.mse_loss(engine(x), y))  # type: ignore[attr-defined, operator]
    engine.step()  # type: ignore[attr-defined]
    try:
        engine_grad_stats(engine)
    except ValueError as e:
        assert "only available immediately after backward" in str(e), e
    else:
        raise AssertionError("no ValueError after engine.step()")


def unlinked_parameter_rejected(rank: int, world: int) -> None:
    from torch_gradstats.compat.deepspeed import engine_grad_stats

    engine = _engine(1, 1, world)
    del engine.module[2].bias._hp_mapping  # type: ignore[attr-defined, index]
    try:
        engine_grad_stats(engine)
    except ValueError as e:
        assert "2.bias" in str(e), e
    else:
        raise AssertionError("no ValueError for a parameter without its partition link")


def round_robin_rejected(rank: int, world: int) -> None:
    from torch_gradstats.compat.deepspeed import engine_grad_stats

    engine = _engine(2, 1, world, round_robin_gradients=True)
    try:
        engine_grad_stats(engine)
    except ValueError as e:
        assert "round_robin_gradients" in str(e), e
    else:
        raise AssertionError("no ValueError with round_robin_gradients=True")


SCENARIOS = {
    f.__name__: f
    for f in (zero1, zero2_accumulated, zero2_fp16, zero1_bf16, zero2_offload, after_step_raises,
              unlinked_parameter_rejected, round_robin_rejected)
}


def run_worker(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    results: dict[str, str] = {}
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        for name, fn in SCENARIOS.items():
            try:
                fn(rank, world)
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported by the test of this scenario
                results[name] = traceback.format_exc()
    except Exception:  # noqa: BLE001 - DeepSpeed failed to start: every scenario reports it
        results = dict.fromkeys(SCENARIOS, traceback.format_exc())
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown, where gloo threads can abort a finished process
