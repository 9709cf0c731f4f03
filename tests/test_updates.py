"""grad_and_weight_stats, UpdateRatio and their one-transfer report, against plain float64 PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from _host_reads import HostReads
from torch import nn

import torch_gradstats as tg
import torch_gradstats.ops.op as ops_mod
import torch_gradstats.stats._params as params_mod
from torch_gradstats.monitors import updates
from torch_gradstats.monitors.updates import UpdateRatio, grad_and_weight_stats


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _backward(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(7, 6, generator=g)).pow(2).sum().backward()


def _norm64(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


class _OpCalls:
    """Counts calls of the fused op (whichever kernel runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = ops_mod.multi_tensor_stats

        def counting(tensors):  # type: ignore[no-untyped-def]
            self.calls += 1
            return real(tensors)

        monkeypatch.setattr(params_mod, "multi_tensor_stats", counting)  # updates reads through the per-device call


def test_grad_and_weight_stats_matches_grad_stats_and_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    _backward(model)
    calls = _OpCalls(monkeypatch)
    s = grad_and_weight_stats(model.named_parameters())
    assert calls.calls == 1  # grads and weights in one op call
    ref = tg.grad_stats(model.named_parameters())
    assert s.grads.names == ref.names
    torch.testing.assert_close(s.grads.sumsq, ref.sumsq, rtol=0, atol=0)
    torch.testing.assert_close(s.grads.counts, ref.counts, rtol=0, atol=0)
    torch.testing.assert_close(s.grads.numel, ref.numel, rtol=0, atol=0)
    for (name, p), wn in zip(model.named_parameters(), s.weight_norms.tolist()):
        assert wn == pytest.approx(_norm64(p), rel=1e-6), name


def test_lr_update_ratio_and_true_ratio_for_plain_sgd() -> None:
    model = _model()
    lrs = {"0.weight": 0.5, "0.bias": 0.5, "2.weight": 0.05, "2.bias": 0.05}
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([
        {"params": [params["0.weight"], params["0.bias"]], "lr": 0.5},
        {"params": [params["2.weight"], params["2.bias"]], "lr": 0.05},
    ])
    _backward(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = grad_and_weight_stats(model.named_parameters(), optimizer=opt)
    ratio = UpdateRatio(model.named_parameters())
    assert ratio.nbytes == sum(p.numel() * 4 for p in model.parameters())
    with ratio:
        opt.step()
    s.update = ratio.stats
    report = s.report()
    for name, p in model.named_parameters():
        g, w0 = p.grad.double(), before[name].double()
        est = lrs[name] * float(g.norm()) / float(w0.norm())
        assert report.lrs[name] == lrs[name]
        assert report.lr_update_ratios[name] == pytest.approx(est, rel=1e-6)
        true = float((p.detach().double() - w0).norm()) / float(p.detach().double().norm())
        assert report.update_ratios[name] == pytest.approx(true, rel=1e-5)
        assert report.delta_norms[name] == pytest.approx(float((p.detach().double() - w0).norm()), rel=1e-5)
        # plain SGD: the update is exactly lr * g
        assert report.delta_norms[name] == pytest.approx(lrs[name] * float(g.norm()), rel=1e-5)
    device_est = s.lr_update_ratios()
    assert device_est is not None
    assert device_est.tolist() == pytest.approx([report.lr_update_ratios[n] for n in s.names], rel=1e-12)
    d = report.to_dict(prefix="g/")
    assert d["g/weight_norm/2.bias"] == pytest.approx(_norm64(before["2.bias"]), rel=1e-6)
    assert d["g/update_ratio_max"] == max(report.update_ratios.values())
    assert d["g/total_norm"] == report.grads.total_norm


def test_update_ratio_measures_adam_not_the_sgd_estimate() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _backward(model)
    ratio = UpdateRatio(model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    ratio.snapshot()
    opt.step()
    stats = ratio.measure()
    for (name, p), w0, r in zip(model.named_parameters(), before, stats.ratios.tolist()):
        true = float((p.detach().double() - w0.double()).norm() / p.detach().double().norm())
        assert r == pytest.approx(true, rel=1e-5), name
    # the buffers are kept and reused between steps
    buffers = ratio._buffers
    _backward(model, seed=2)
    with ratio:
        opt.step()
    assert ratio._buffers is buffers
    ratio.release()
    assert ratio._buffers is None
    with pytest.raises(RuntimeError, match="snapshot"):
        ratio.measure()


def test_report_is_one_transfer_and_names_nonfinite(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    _backward(model)
    p = dict(model.named_parameters())
    p["2.weight"].grad[0, 1] = float("nan")
    p["0.bias"].grad[2] = float("inf")
    with torch.no_grad():
        p["2.bias"][0] = float("inf")  # a non-finite weight
    s = grad_and_weight_stats(model.named_parameters(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    fetches = []
    real = updates.to_host

    def counting(floats, ints):  # type: ignore[no-untyped-def]
        fetches.append(1)
        return real(floats, ints)

    monkeypatch.setattr(updates, "to_host", counting)
    with HostReads() as reads:
        report = s.report()
    assert len(fetches) == 1 and reads.count == 0
    ref = tg.grad_stats(model.named_parameters()).report()
    assert report.grads.first_nonfinite == ref.first_nonfinite == "0.bias"
    assert report.grads.nonfinite == ["0.bias", "2.weight"]
    assert report.grads.nan_count == 1 and report.grads.inf_count == 1
    assert report.weight_nonfinite == ["2.bias"]
    assert math.isinf(report.weight_norms["2.bias"])
    assert math.isnan(report.lr_update_ratios["2.weight"])


def test_no_grads_and_bad_input() -> None:
    model = _model()
    s = grad_and_weight_stats(model.named_parameters())
    r = s.report()
    assert r.grads.total_norm == 0.0 and r.weight_norms == {}
    with pytest.raises(TypeError, match="item 0"):
        grad_and_weight_stats([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no parameters"):
        UpdateRatio([])
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="'weight'.*sparse=False"):
        grad_and_weight_stats(emb.named_parameters())


def _fsdp2_worker(rank: int, world: int, port: int, out: str) -> None:
    import json
    import os
    import sys

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        sharded, full = _model(), _model()
        fully_shard(sharded)
        results = []
        for m in (sharded, full):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(torch.randn(7, 6, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
            s = grad_and_weight_stats(m.named_parameters(), optimizer=opt)
            ratio = UpdateRatio(m.named_parameters())
            planned = ratio.nbytes  # before the first snapshot: what it will allocate
            with ratio:
                opt.step()
            s.update = ratio.stats
            r = s.report()
            results.append({"grads": r.grads.norms, "numel": r.grads.numel, "weights": r.weight_norms,
                            "lr_ratios": r.lr_update_ratios, "ratios": r.update_ratios,
                            "nbytes": [planned, ratio.nbytes]})
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads can abort a finished process ("terminate called
    # without an active exception"); an exception above still fails the rank the usual way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_weights_and_updates_are_global(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under FSDP2 (DTensor shards on 2 CPU ranks) the weight norms and update ratios are those of the whole
    parameters: equal to an unsharded copy's, on every rank."""
    import json
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp2_worker, args=(2, port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        sharded, full = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sharded["numel"] == full["numel"]
        # the snapshot holds this rank's shards only, and nbytes says so before it exists too
        assert sharded["nbytes"][0] == sharded["nbytes"][1] < full["nbytes"][0] == full["nbytes"][1]
        for key in ("grads", "weights", "lr_ratios", "ratios"):
            assert sharded[key].keys() == full[key].keys()
            for name, v in full[key].items():
                assert sharded[key][name] == pytest.approx(v, rel=1e-4), (rank, key, name)


def test_device_ratios_agree_with_the_report_for_an_all_zero_parameter() -> None:
    """A zero weight that stays zero (a frozen zero-initialised bias, a zero gradient) has ratio 0 on the device as
    in the report, not 0/0 = NaN, so ``ratios.max()`` stays meaningful."""
    model = _model()
    bias = model[2].bias
    with torch.no_grad():
        bias.zero_()
    bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _backward(model)
    bias.grad = torch.zeros_like(bias)  # a zero gradient of a zero weight: lr * 0 / 0
    ratio = UpdateRatio(model.named_parameters())
    s = grad_and_weight_stats(model.named_parameters(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with ratio:
        opt.step()
    s.update = ratio.stats
    report = s.report()
    assert report.update_ratios["2.bias"] == 0.0 and report.lr_update_ratios["2.bias"] == 0.0
    assert ratio.stats is not None
    assert ratio.stats.ratios.tolist() == pytest.approx([report.update_ratios[n] for n in ratio.stats.names])
    device_est = s.lr_update_ratios()
    assert device_est is not None
    assert device_est.tolist() == pytest.approx([report.lr_update_ratios[n] for n in s.names], rel=1e-12)


def test_update_names_match_the_gradient_names_with_a_repeated_name_and_a_missing_gradient() -> None:
    """chain(enc.named_parameters(), dec.named_parameters()) yields "weight" twice; with the encoder frozen only the
    decoder's has a gradient and is called "weight" by grad_stats: its update ratio must be reported under that
    same name, next to its weight norm, not under "weight#1"."""
    import itertools

    torch.manual_seed(0)
    enc, dec = nn.Linear(3, 3, bias=False), nn.Linear(3, 2, bias=False)

    def named() -> itertools.chain[tuple[str, nn.Parameter]]:
        return itertools.chain(enc.named_parameters(), dec.named_parameters())

    enc.weight.requires_grad_(False)
    opt = torch.optim.SGD(dec.parameters(), lr=0.5)
    dec(enc(torch.randn(4, 3))).sum().backward()
    ratio = UpdateRatio(named())
    s = grad_and_weight_stats(named(), optimizer=opt)
    w0 = dec.weight.detach().clone()
    with ratio:
        opt.step()
    s.update = ratio.stats
    report = s.report()
    assert list(report.weight_norms) == ["weight"]
    assert report.weight_norms["weight"] == pytest.approx(_norm64(w0))
    true = float((dec.weight.detach().double() - w0.double()).norm() / dec.weight.detach().double().norm())
    assert report.update_ratios["weight"] == pytest.approx(true, rel=1e-6)
    assert report.update_ratios["weight#1"] == 0.0  # the frozen encoder's, under a name of its own


def test_lr_update_ratios_with_learning_rates_held_as_tensors_numbers_and_missing() -> None:
    """Learning rates may be Python numbers, 0-d tensors (capturable optimizers) or missing (None): each parameter
    gets its own, in order."""
    model = _model()
    _backward(model)
    s = grad_and_weight_stats(model.named_parameters())
    lrs: list[object] = [0.1, torch.tensor(0.2, dtype=torch.float32), None, torch.tensor(0.4, dtype=torch.float64)]
    s.lrs = lrs
    got = s.lr_update_ratios()
    assert got is not None
    params = list(model.parameters())
    for i, lr in enumerate(lrs):
        ratio = _norm64(params[i].grad) / _norm64(params[i])
        if lr is None:
            assert math.isnan(float(got[i]))
        else:
            assert float(got[i]) == pytest.approx(float(lr) * ratio, rel=1e-6)  # type: ignore[arg-type]
