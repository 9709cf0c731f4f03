"""Per-group figures: GradStats.grouped(by) and GradWeightStats.grouped(by), checked against the gradients read
directly, the op count per figure whatever the group count, no host read before report(), and two gloo ranks."""

from __future__ import annotations

import json
import math
import re
import socket
import time

import _groups_dist_worker
import pytest
import torch
from _host_reads import HostReads
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_gradstats as tg
from torch_gradstats.monitors.updates import UpdateRatio, grad_and_weight_stats
from torch_gradstats.stats.groups import GroupStats, group_names, group_stats


class Tiny(nn.Module):
    """Names as in a decoder: model.embed_tokens, model.layers.<i>.mlp.<j>, lm_head, a root parameter."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(11, 4)
        self.model.layers = nn.ModuleList(
            nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))}) for _ in range(n_layers)
        )
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x)
        for layer in self.model.layers:
            h = h + layer["mlp"](h)
        return self.lm_head(h) * self.scale


def _trained(n_layers: int = 2) -> Tiny:
    torch.manual_seed(0)
    m = Tiny(n_layers)
    m(torch.arange(6)).square().mean().backward()
    return m


def _direct(model: nn.Module, group_of) -> dict[str, float]:
    """The keys of GroupReport.to_dict from the gradients themselves."""
    grads: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        g = group_of(name)
        if g is not None and p.grad is not None:
            grads.setdefault(g, []).append(p.grad.reshape(-1).double())
    out = {}
    for g, parts in grads.items():
        flat = torch.cat(parts)
        out[f"group/{g}/norm"] = flat.norm().item()
        out[f"group/{g}/max_abs"] = math.nan if flat.isnan().any() else flat.abs().max().item()
        out[f"group/{g}/nonfinite"] = int((~flat.isfinite()).sum())
    return out


def _assert_close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, value in want.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[k]), k
        else:
            assert got[k] == pytest.approx(value, rel=1e-6), k


# ---------------------------------------------------------------------------------------------- naming
def test_layer_groups_outermost_numbered_block_else_owning_module() -> None:
    names = [
        "model.embed_tokens.weight", "model.layers.0.mlp.0.weight", "model.layers.0.mlp.2.bias",
        "model.layers.1.mlp.0.weight", "transformer.h.3.attn.c_attn.weight",
        "encoder.layer.3.attention.self.query.bias",
        "blocks.12.norm.weight", "0.weight", "lm_head.weight", "scale",
    ]
    groups, index = group_names(names, "layer")
    assert groups == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "transformer.h.3", "encoder.layer.3", "blocks.12",
        "0", "lm_head", "scale",
    ]
    assert index == [0, 1, 1, 2, 3, 4, 5, 6, 7, 8]


def test_depth_regex_and_callable() -> None:
    names = ["model.layers.0.mlp.0.weight", "model.embed_tokens.weight", "lm_head.weight", "scale"]
    assert group_names(names, 1) == (["model", "lm_head", "scale"], [0, 0, 1, 2])
    assert group_names(names, 3)[0] == ["model.layers.0", "model.embed_tokens", "lm_head", "scale"]
    # re.search: the first capture group names the group; a name it misses is left out
    assert group_names(names, r"layers\.(\d+)") == (["0"], [0, -1, -1, -1])
    assert group_names(names, re.compile(r"weight|scale")) == (["weight", "scale"], [0, 0, 0, 1])
    assert group_names(names, lambda n: None if n == "scale" else n.split(".")[0]) == (
        ["model", "lm_head"], [0, 0, 1, -1])


@pytest.mark.parametrize("by", ["layer", 1, 2, r"layers\.(\d+)", lambda n: "w" if n.endswith("weight") else None])
def test_figures_equal_the_gradients_read_directly(by) -> None:
    model = _trained()
    stats = tg.grad_stats(model.named_parameters())
    got = stats.grouped(by).report().to_dict()
    groups, index = group_names([n for n, _ in model.named_parameters()], by)
    of = dict(zip([n for n, _ in model.named_parameters()], [groups[i] if i >= 0 else None for i in index]))
    _assert_close(got, _direct(model, of.get))


def test_nan_and_inf_in_a_group() -> None:
    model = _trained()
    model.model.layers[1]["mlp"][0].weight.grad[0, 0] = math.nan
    model.model.layers[1]["mlp"][2].bias.grad[1] = math.inf
    model.lm_head.weight.grad[2, 2] = -math.inf
    report = tg.grad_stats(model.named_parameters()).grouped("layer").report()
    d = report.to_dict()
    assert math.isnan(d["group/model.layers.1/norm"]) and math.isnan(d["group/model.layers.1/max_abs"])
    assert d["group/model.layers.1/nonfinite"] == 2
    assert d["group/lm_head/max_abs"] == math.inf and d["group/lm_head/nonfinite"] == 1
    assert d["group/model.layers.0/nonfinite"] == 0 and math.isfinite(d["group/model.layers.0/norm"])
    assert report.nonfinite == ["model.layers.1", "lm_head"]
    assert report.nan_counts["model.layers.1"] == 1 and report.inf_counts["model.layers.1"] == 1


def test_group_stats_are_device_tensors_with_numel_and_members() -> None:
    model = _trained()
    g = tg.grad_stats(model.named_parameters()).grouped("layer")
    assert isinstance(g, GroupStats) and len(g) == 5
    assert g.sumsq.dtype == torch.float64 and g.counts.shape == (5, 3)
    numel = g.report().numel
    assert numel["model.layers.0"] == 4 * 8 + 8 + 8 * 4 + 4 and numel["scale"] == 1
    assert g.members["model.layers.0.mlp.2.bias"] == "model.layers.0"


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_one_scatter_per_figure_whatever_the_group_count_and_no_host_read() -> None:
    traces = {}
    for n_layers in (2, 40):
        stats = tg.grad_stats(_trained(n_layers).named_parameters())
        stats.grouped("layer")  # the index is made once and kept
        with _Ops() as ops, HostReads() as reads:
            stats.grouped("layer")
        assert reads.count == 0
        traces[n_layers] = ops.ops
    assert traces[2] == traces[40]
    scatters = [op for op in traces[2] if op.startswith(("aten.index_add", "aten.scatter"))]
    assert scatters == ["aten.index_add_", "aten.scatter_reduce_", "aten.index_add_", "aten.index_add_"]


def test_index_is_made_once_per_names_and_by() -> None:
    calls = []

    def by(name: str) -> str:
        calls.append(name)
        return name.split(".")[0]

    stats = tg.grad_stats(_trained().named_parameters())
    first = stats.grouped(by).report().to_dict()
    assert stats.grouped(by).report().to_dict() == first
    assert len(calls) == len(stats.names)


def test_report_is_one_transfer() -> None:
    g = tg.grad_stats(_trained().named_parameters()).grouped("layer")
    with HostReads() as reads:
        g.report()
    assert reads.count <= 1  # on the CPU the one transfer is a plain copy: nothing to count, never more than one


def test_empty_stats_and_all_left_out() -> None:
    empty = tg.grad_stats([torch.zeros(2, requires_grad=True)])  # no .grad
    assert empty.grouped("layer").report().to_dict() == {}
    stats = tg.grad_stats(_trained().named_parameters())
    assert stats.grouped(lambda n: None).report().to_dict() == {}


@pytest.mark.parametrize("by, exc, words", [
    (1.5, TypeError, "by must be 'layer', an int"),
    (True, TypeError, "by must be 'layer'"),
    (0, ValueError, "must be >= 1"),
    ("(", ValueError, "not a valid regular expression"),
    (lambda n: 3, TypeError, "returned a int"),
])
def test_bad_by(by, exc, words) -> None:
    stats = tg.grad_stats(_trained().named_parameters())
    with pytest.raises(exc, match=re.escape(words)):
        stats.grouped(by)


def test_reduced_stats_need_names_of_their_length() -> None:
    stats = tg.grad_stats(_trained().named_parameters())
    with pytest.raises(ValueError, match="3 names for the figures of 11 parameters"):
        group_stats(stats, "layer", names=["a", "b", "c"])


# ---------------------------------------------------------------------------------------------- weights, updates
def test_weight_norm_and_update_ratios_per_group() -> None:
    model = _trained()
    opt = torch.optim.SGD([{"params": [model.lm_head.weight], "lr": 0.5},
                           {"params": [p for n, p in model.named_parameters() if n != "lm_head.weight"], "lr": 0.1}])
    named = list(model.named_parameters())
    ratio = UpdateRatio(named)
    ratio.snapshot()
    before = {n: p.detach().clone() for n, p in named}
    gw = grad_and_weight_stats(named, optimizer=opt)
    opt.step()
    gw.update = ratio.measure()
    report = gw.grouped("layer").report()
    groups, index = group_names([n for n, _ in named], "layer")
    lr = {n: (0.5 if n == "lm_head.weight" else 0.1) for n, _ in named}
    for g in groups:
        members = [(n, p) for (n, p), i in zip(named, index) if groups[i] == g]
        w = torch.cat([p.detach().reshape(-1) for _, p in members]).double()
        w0 = torch.cat([before[n].reshape(-1) for n, _ in members]).double()
        sgd = math.sqrt(sum(lr[n] ** 2 * p.grad.double().square().sum().item() for n, p in members))
        assert report.weight_norms[g] == pytest.approx(w0.norm().item(), rel=1e-6)
        assert report.lr_update_ratios[g] == pytest.approx(sgd / w0.norm().item(), rel=1e-6)
        # plain SGD: the measured update is the lr-scaled gradient
        assert report.update_ratios[g] == pytest.approx((w0 - w).norm().item() / w.norm().item(), rel=1e-5)
        assert report.update_ratios[g] == pytest.approx(sgd / w.norm().item(), rel=1e-4)
    d = report.to_dict()
    assert {"group/lm_head/weight_norm", "group/lm_head/lr_update_ratio", "group/lm_head/update_ratio"} <= d.keys()


def test_weight_groups_without_optimizer_have_no_ratios() -> None:
    report = grad_and_weight_stats(_trained().named_parameters()).grouped(1).report()
    assert set(report.weight_norms) == {"model", "lm_head", "scale"}
    assert report.lr_update_ratios is None and report.update_ratios is None


# ---------------------------------------------------------------------------------------------- two gloo ranks
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_two_ranks_group_the_reduced_figures_without_a_collective(tmp_path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_groups_dist_worker.run_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "2-rank run did not finish in 120 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["status"] == "ok", result.get("detail")
        assert result["groups"] == "embed,layers.0,layers.1,lm_head"


# ------------------------------------------------------------------------------------ in the report's transfer
def _count_fetches(monkeypatch) -> list[int]:
    from torch_gradstats.ops import _transfer

    calls: list[int] = []
    real = _transfer.fetch
    monkeypatch.setattr(_transfer, "fetch", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_groups_ride_in_the_reports_one_transfer(monkeypatch) -> None:
    stats = tg.grad_stats(_trained().named_parameters())
    grouped = stats.grouped("layer")
    alone = grouped.report()
    calls = _count_fetches(monkeypatch)
    report = stats.report(groups=grouped)
    assert len(calls) == 1
    assert report.groups == alone
    d = report.to_dict()
    assert d["group/lm_head/norm"] == alone.norms["lm_head"] and d["total_norm"] == report.total_norm


def test_weight_groups_ride_in_the_update_reports_one_transfer(monkeypatch) -> None:
    model = _trained()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = grad_and_weight_stats(model.named_parameters(), optimizer=opt)
    grouped = gw.grouped("layer")
    alone = grouped.report()
    calls = _count_fetches(monkeypatch)
    gw.report()
    without = len(calls)  # the transfer, then a host-side copy that GradStats.report reads (no device involved)
    report = gw.report(groups=grouped)
    assert len(calls) == 2 * without
    assert report.grads.groups == alone
    assert alone.weight_norms is not None
    assert report.to_dict()["group/model.layers.0/weight_norm"] == alone.weight_norms["model.layers.0"]


def test_sinks_metrics_carry_the_groups() -> None:
    from torch_gradstats.integrations import metrics

    stats = tg.grad_stats(_trained().named_parameters())
    figures = metrics(stats.report(groups=stats.grouped("layer")))
    assert figures["grad/group/model.layers.1/nonfinite"] == 0.0
    assert figures["grad/group/lm_head/norm"] > 0 and "grad/total_norm" in figures


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouping_never_syncs_and_keeps_nan() -> None:
    model = _trained().cuda()
    model(torch.arange(6, device="cuda")).square().mean().backward()
    model.model.layers[0]["mlp"][0].weight.grad[1, 1] = math.nan
    stats = tg.grad_stats(model.named_parameters())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # made, then from the kept index
            grouped = stats.grouped("layer")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert grouped.device.type == "cuda"
    report = grouped.report()
    assert math.isnan(report.max_abs["model.layers.0"]) and report.nan_counts["model.layers.0"] == 1
    assert math.isfinite(report.max_abs["model.layers.1"])


def test_a_call_in_inference_mode_leaves_every_cache_usable() -> None:
    from torch_gradstats.ops._transfer import repeated_int64

    model = _trained()
    by = r"^(model\.layers\.\d+)"  # a `by` no other test uses: the first call makes its index
    want = _direct(model, lambda n: (re.match(by, n) or [None, None])[1])
    with torch.inference_mode():
        first = tg.grad_stats(model.named_parameters()).grouped(by).report()
        coef = tg.clip_grad_norm_(model.named_parameters(), 1e9).report().clip_coef
        kept = repeated_int64([5, 7, 11], torch.device("meta"))  # off the CPU values are kept on the device
    for inference in (False, True, False):
        with torch.inference_mode(inference):
            again = tg.grad_stats(model.named_parameters()).grouped(by).report()
            assert again.norms == first.norms
            assert tg.clip_grad_norm_(model.named_parameters(), 1e9).report().clip_coef == coef == 1.0
            assert repeated_int64([5, 7, 11], torch.device("meta")) is kept
    assert {f"group/{g}/norm": v for g, v in first.norms.items()} == pytest.approx(
        {k: v for k, v in want.items() if k.endswith("/norm")}, rel=1e-6)


@pytest.mark.parametrize("framework", ["transformers", "lightning"])
@pytest.mark.parametrize("bad,error", [(5.5, TypeError), (0, ValueError), ("([", ValueError)])
def test_a_callbacks_bad_group_by_is_named_as_its_argument(framework: str, bad: object, error: type) -> None:
    """The callbacks check ``group_by`` when made; the error said ``grouped: by ...``, naming an argument of a
    method the user never called, not the ``group_by=`` they gave."""
    pytest.importorskip(framework)
    if framework == "transformers":
        pytest.importorskip("accelerate")
        from torch_gradstats.integrations.transformers import GradStatsCallback
    else:
        from torch_gradstats.integrations.lightning import GradStatsCallback  # type: ignore[assignment]
    with pytest.raises(error, match=re.escape(f"GradStatsCallback: group_by={bad!r}")):
        GradStatsCallback(group_by=bad)  # type: ignore[arg-type]
