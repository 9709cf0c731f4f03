"""Worker side of tests/test_distributed_fsdp1.py: FSDP1 (FullyShardedDataParallel) with flat parameters
(use_orig_params=False) and with the original ones (use_orig_params=True), read with and without group=, on every
rank of a gloo process group on the CPU.

The reference is the unsharded model's gradient as FSDP computes it: each rank runs an unsharded copy on its own
micro-batch and the gradients are averaged over the ranks (so BatchNorm's per-rank batch statistics match too), then
read in float64 in one process. See _dist_workers for the scenario protocol.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import model_zoo
import torch
import torch.distributed as dist
from _dist_workers import _params_with_grads, _seq
from torch import nn

from torch_gradstats import AdaptiveClip, SpikeGuard, clip_grad_norm_, grad_stats
from torch_gradstats.updates import grad_and_weight_stats

RTOL = 1e-5
WRAPPED = "_fsdp_wrapped_module."


def _fsdp() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _net(seed: int = 10) -> nn.Module:
    """41 elements in 6 parameters: padding on 2 and 4 ranks (flat parameters of 41, or per layer 15, 20 and 6)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))


def _batch(rank: int, world: int, seed: int = 11, rows: int = 2) -> torch.Tensor:
    x = torch.randn(rows * world, 4, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 0.0  # the first weight column's gradient: 3 exact zeros
    return x[rows * rank: rows * rank + rows]


def _reference(ref: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The unsharded model's gradients as FSDP computes them: this rank's micro-batch, averaged over the ranks."""
    loss(ref).backward()
    out = []
    for name, p in ref.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().double()
            dist.all_reduce(g)
            out.append((name, g / dist.get_world_size()))
    return out


def _report(named: list[tuple[str, torch.Tensor]]) -> Any:
    return grad_stats(_params_with_grads(named)).report()


def _check_totals(what: str, rep: Any, want: Any) -> None:
    assert math.isclose(rep.total_norm, want.total_norm, rel_tol=RTOL), (what, rep.total_norm, want.total_norm)
    assert math.isclose(rep.inf_norm, want.inf_norm, rel_tol=RTOL), (what, rep.inf_norm, want.inf_norm)
    assert (rep.numel, rep.zero_count, rep.nonfinite) == (want.numel, want.zero_count, want.nonfinite), (
        what, (rep.numel, rep.zero_count, rep.nonfinite), (want.numel, want.zero_count, want.nonfinite))


def _check_rows(what: str, rep: Any, want: Any) -> None:
    """use_orig_params=True: one row per original parameter, in model order, named as the model's own but for
    FSDP's prefixes."""
    rows = {n.replace(WRAPPED, ""): v for n, v in rep.norms.items()}
    assert list(rows) == list(want.norms), (what, list(rows), list(want.norms))
    for name, norm in want.norms.items():
        assert math.isclose(rows[name], norm, rel_tol=RTOL), (what, name, rows[name], norm)


def _check_first_nonfinite(what: str, model: nn.Module, group: Any) -> None:
    """NaN in every piece of the last two parameters (each rank's own, wherever FSDP put them): the first
    non-finite one is the earlier in model order, on every rank, also where no rank holds pieces of both (its rows
    once came in the order of the ranks' lists: 4.bias before 4.weight on 2 ranks)."""
    named = list(model.named_parameters())
    for _, p in named[-2:]:
        if p.grad is not None and p.grad.numel():
            p.grad.view(-1)[0] = float("nan")
    rep = grad_stats(model.named_parameters(), group=group).report()
    assert rep.first_nonfinite == named[-2][0], (what, rep.first_nonfinite, named[-2][0], list(rep.norms))


def _check_clip(what: str, model: Any, named: Callable[[], Any], group: Any, want_norm: float) -> None:
    """clip_grad_norm_(group=) clips by the model's norm, FSDP's own clip_grad_norm_ agrees, and the norm after it is
    max_norm."""
    max_norm = want_norm / 3
    stats = clip_grad_norm_(named(), max_norm, group=group)
    assert math.isclose(float(stats.clip_norm), want_norm, rel_tol=RTOL), (what, float(stats.clip_norm), want_norm)
    after = grad_stats(named(), group=group).report().total_norm
    assert math.isclose(after, max_norm, rel_tol=RTOL), (what, after, max_norm)
    theirs = float(model.clip_grad_norm_(1e30))  # FSDP's own norm of the clipped gradients
    assert math.isclose(theirs, max_norm, rel_tol=RTOL), (what, theirs, max_norm)


def _check_weights(what: str, ref: nn.Module, named: Any, want: Any) -> None:
    """grad_and_weight_stats(group=): its gradients' figures and its weights' are the model's. (With original
    parameters, each rank holding pieces of different ones, its rows matched by position mixed parameters, or the
    ranks' lists differed in length: a ValueError.)"""
    both = grad_and_weight_stats(named, group=dist.group.WORLD).report()
    _check_totals(f"{what} grad_and_weight_stats", both.grads, want)
    weights = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in ref.parameters() if p.requires_grad))
    got = math.sqrt(sum(v * v for v in both.weight_norms.values()))
    assert math.isclose(got, weights, rel_tol=RTOL), (what, got, weights)
    if not any(n.endswith("_flat_param") for n in both.weight_norms):  # a row per original parameter
        norms = {n.replace(WRAPPED, ""): v for n, v in both.weight_norms.items()}
        for name, p in ref.named_parameters():
            if p.requires_grad:
                assert math.isclose(norms[name], float(p.detach().double().norm()), rel_tol=RTOL), (what, name)


# ------------------------------------------------------------------------------------------------ scenarios
def orig_params_whole_copies_refused_with_group(rank: int, world: int) -> str | None:
    """use_orig_params=True: a gradient that each rank holds whole (NO_SHARD; inside no_sync(), this rank's own
    unsharded partial sum) read with group= is a ValueError naming the parameter, on every rank; the sum counted
    every copy (NO_SHARD on 4 ranks: numel 164 for 41, norm twice the model's). After the backward that reduces the
    accumulated gradients, the figures and the clip are the model's."""
    from torch.distributed.fsdp import ShardingStrategy

    fsdp, cpu, world_group = _fsdp(), torch.device("cpu"), dist.group.WORLD
    ref = _net()
    want = _report(_reference(copy.deepcopy(ref), lambda m: m(_batch(rank, world)).pow(2).mean()))
    model = fsdp(copy.deepcopy(ref), use_orig_params=True, device_id=cpu, sharding_strategy=ShardingStrategy.NO_SHARD)
    model(_batch(rank, world)).pow(2).mean().backward()
    try:
        grad_stats(model.named_parameters(), group=world_group)
    except ValueError as exc:
        assert f"'{WRAPPED}0.weight'" in str(exc) and "use_orig_params" in str(exc), str(exc)
    else:
        raise AssertionError("NO_SHARD gradients (whole on every rank) were summed over group= as shards")
    rep = grad_stats(model.named_parameters()).report()  # no group: whole copies, as DDP's
    _check_totals("NO_SHARD without group", rep, want)
    _check_rows("NO_SHARD without group", rep, want)

    # Accumulation: two micro-batches, the first under no_sync().
    model = fsdp(copy.deepcopy(ref), use_orig_params=True, device_id=cpu)
    with model.no_sync():
        model(_batch(rank, world)).pow(2).mean().backward()
        for call in (lambda: grad_stats(model.named_parameters(), group=world_group),
                     lambda: clip_grad_norm_(model.named_parameters(), 1.0, group=world_group),
                     lambda: grad_and_weight_stats(model.named_parameters(), group=world_group)):
            try:
                call()
            except ValueError as exc:
                assert f"'{WRAPPED}0.weight'" in str(exc) and "no_sync" in str(exc), str(exc)
            else:
                raise AssertionError("an unsharded gradient inside no_sync() was read with group= as a shard")
    model(_batch(rank, world, seed=12)).pow(2).mean().backward()
    acc = copy.deepcopy(ref)
    want = _report(_reference(acc, lambda m: m(_batch(rank, world)).pow(2).mean()
                              + m(_batch(rank, world, seed=12)).pow(2).mean()))
    rep = grad_stats(model.named_parameters(), group=world_group).report()
    _check_totals("accumulated", rep, want)
    _check_rows("accumulated", rep, want)
    _check_clip("accumulated", model, model.named_parameters, world_group, want.total_norm)
    return None


def flat_shard_as_stored_without_group(rank: int, world: int) -> str | None:
    """Without group=, each rank's figures are those of its flat parameter shard as stored, FSDP's padding (zeros)
    included, with the compiled walk and the pure-PyTorch one alike (the Python walk once left the padding out and
    the compiled one did not); with group=, the padding counts nowhere (a NaN put there included)."""
    fsdp = _fsdp()
    model = fsdp(_net(), use_orig_params=False, device_id=torch.device("cpu"))
    (flat,) = list(model.parameters())
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(11))  # no exact zero in the gradient
    model(x[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
    want = _report([("_fsdp_wrapped_module._flat_param", flat.grad.detach())])
    rep = grad_stats(model.named_parameters()).report()
    _check_totals(f"rank {rank} without group", rep, want)
    assert rep.zero_count == flat._shard_numel_padded, (rep.zero_count, flat._shard_numel_padded)
    rep = grad_stats(list(model.parameters())).report()  # unnamed, as model.parameters() gives them
    _check_totals(f"rank {rank} unnamed", rep, want)
    if flat._shard_numel_padded:
        flat.grad[-1] = float("nan")  # padding: no gradient of the model
    rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    assert rep.nan_count == 0 and rep.zero_count == 0 and math.isfinite(rep.total_norm), rep
    return None


def nested_units_match_reference(rank: int, world: int) -> str | None:
    """One FSDP unit per Linear (several flat parameters, each padded on 2 and 4 ranks), FULL_SHARD and
    SHARD_GRAD_OP, use_orig_params False and True, one frozen weight (use_orig_params=True lets it share a unit with
    trainable ones): totals, rows, the clip (FSDP's own clip_grad_norm_ agrees), grad_and_weight_stats and the
    policies given those figures equal the unsharded model's."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    fsdp, world_group = _fsdp(), dist.group.WORLD
    for orig in (False, True):
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            what = f"use_orig_params={orig} {strategy.name}"
            ref = _net()
            if orig:
                ref[2].weight.requires_grad_(False)
            model = fsdp(copy.deepcopy(ref), use_orig_params=orig, device_id=torch.device("cpu"),
                         sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
            model(_batch(rank, world)).pow(2).mean().backward()
            want = _report(_reference(ref, lambda m: m(_batch(rank, world)).pow(2).mean()))
            for call in range(2):  # the first call agrees on the layout, the second is the steady state
                before = _seq(world_group)
                rep = grad_stats(model.named_parameters(), group=world_group).report()
                _check_totals(f"{what} call {call}", rep, want)
            assert _seq(world_group) - before == 2, (what, _seq(world_group) - before)  # one SUM, one MAX
            if orig:
                _check_rows(what, rep, want)
            else:
                rows = [f"{WRAPPED}{i}.{WRAPPED}_flat_param" for i in (0, 2, 4)]
                assert list(rep.norms) == rows, (what, list(rep.norms))
                for i, row in zip((0, 2, 4), rows):  # a unit's row: its Linear's weight and bias
                    unit = math.hypot(want.norms[f"{i}.weight"], want.norms[f"{i}.bias"])
                    assert math.isclose(rep.norms[row], unit, rel_tol=RTOL), (what, row, rep.norms[row], unit)
            _check_weights(what, ref, model.named_parameters(), want)
            clip = AdaptiveClip()
            stats = clip.clip_(model.named_parameters(), group=world_group)  # the first steps: no clip yet
            assert math.isclose(float(stats.total_norm), want.total_norm, rel_tol=RTOL), (what, "adaptive")
            guard = SpikeGuard()
            assert float(guard.observe(stats.total_norm)) == 1.0  # warming up: the step is taken on every rank
            assert guard.check()["guard/skipped"] == 0.0, guard.check()
            _check_clip(what, model, model.named_parameters, world_group, want.total_norm)
            if orig:
                _check_first_nonfinite(what, model, world_group)
    return None


def mixed_precision_bf16(rank: int, world: int) -> str | None:
    """MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32), use_orig_params=False: the figures equal float64
    ones of the reduced shards gathered without their padding, and the clip's norm FSDP's own; with
    keep_low_precision_grads=True and original parameters, the bfloat16 gradients' figures."""
    from torch.distributed.fsdp import MixedPrecision

    fsdp = _fsdp()
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp(_net(), use_orig_params=False, device_id=torch.device("cpu"), mixed_precision=policy)
    model(_batch(rank, world)).pow(2).mean().backward()
    (flat,) = list(model.parameters())
    assert flat.grad.dtype == torch.float32, flat.grad.dtype
    pieces: list[Any] = [None] * world
    dist.all_gather_object(pieces, flat.grad[: flat.numel() - flat._shard_numel_padded].double())
    want = _report([("_fsdp_wrapped_module._flat_param", torch.cat(pieces))])
    rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    _check_totals("bf16", rep, want)
    assert rep.numel == 41, rep.numel
    _check_clip("bf16", model, model.named_parameters, dist.group.WORLD, want.total_norm)

    # keep_low_precision_grads=True, original parameters: bfloat16 gradients, and a parameter with no piece on a
    # rank is an empty row of that dtype there (a float32 one, the parameter's own, clashed with the others').
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True)
    model = fsdp(_net(), use_orig_params=True, device_id=torch.device("cpu"), mixed_precision=policy)
    model(_batch(rank, world)).pow(2).mean().backward()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    assert {p.grad.dtype for _, p in named} == {torch.bfloat16}, [p.grad.dtype for _, p in named]
    sumsq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for _, p in named)], dtype=torch.float64)
    dist.all_reduce(sumsq)
    for call in (lambda: grad_stats(model.named_parameters(), group=dist.group.WORLD).report(),
                 lambda: grad_and_weight_stats(model.named_parameters(), group=dist.group.WORLD).report().grads):
        rep = call()
        assert math.isclose(rep.total_norm, math.sqrt(float(sumsq)), rel_tol=RTOL), (rep.total_norm, float(sumsq))
        assert rep.numel == 41 and len(rep.norms) == 6, (rep.numel, list(rep.norms))
    return None


def hybrid_shard_over_its_group(rank: int, world: int) -> str | None:
    """HYBRID_SHARD, two replicas each sharded over half the ranks: read over model.process_group (the shard group),
    the figures and the clip are the model's on every rank, for flat and original parameters."""
    if world % 2 or world < 4:
        return "skip: needs two replicas of at least two ranks"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy

    fsdp = _fsdp()
    mesh = init_device_mesh("cpu", (2, world // 2))
    for orig in (False, True):
        ref = _net()
        model = fsdp(copy.deepcopy(ref), use_orig_params=orig, device_id=torch.device("cpu"), device_mesh=mesh,
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        model(_batch(rank, world)).pow(2).mean().backward()
        want = _report(_reference(ref, lambda m: m(_batch(rank, world)).pow(2).mean()))
        rep = grad_stats(model.named_parameters(), group=model.process_group).report()
        _check_totals(f"HYBRID_SHARD use_orig_params={orig}", rep, want)
        _check_clip(f"HYBRID_SHARD use_orig_params={orig}", model, model.named_parameters, model.process_group,
                    want.total_norm)
    return None


def model_zoo_under_fsdp1(rank: int, world: int) -> str | None:
    """The zoo's ResNet (a unit per BasicBlock, flat parameters), checkpointed TransformerEncoder (original
    parameters) and GPT-2 (tied embedding and head, one unit) under FSDP1: the figures are the unsharded model's."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    fsdp, cpu, world_group = _fsdp(), torch.device("cpu"), dist.group.WORLD
    gen = torch.Generator().manual_seed(20)
    images = torch.randn(2 * world, 3, 8, 8, generator=gen)[2 * rank: 2 * rank + 2]
    labels = torch.randint(0, 5, (2 * world,), generator=gen)[2 * rank: 2 * rank + 2]
    tokens = torch.randn(2 * world, 5, 8, generator=gen)[2 * rank: 2 * rank + 2]
    cases: list[tuple[str, nn.Module, dict[str, Any], Callable[[nn.Module], torch.Tensor]]] = [
        ("resnet", model_zoo.resnet(seed=0), {"auto_wrap_policy": ModuleWrapPolicy({model_zoo.BasicBlock})},
         lambda m: nn.functional.cross_entropy(m(images), labels)),
        ("encoder", model_zoo.CheckpointedEncoder(use_reentrant=False), {"use_orig_params": True},
         lambda m: m(tokens).pow(2).mean()),
    ]
    if importlib.util.find_spec("transformers") is not None:
        gpt2 = model_zoo.gpt2(seed=0).eval()  # no dropout: the same forward on both copies
        ids = torch.randint(0, 64, (2 * world, 8), generator=gen)[2 * rank: 2 * rank + 2]
        cases.append(("gpt2", gpt2, {}, lambda m: m(ids, labels=ids).loss))
    for what, ref, kw, loss in cases:
        model = fsdp(copy.deepcopy(ref), device_id=cpu, **kw)
        loss(model).backward()
        want = _report(_reference(ref, loss))
        rep = grad_stats(model.named_parameters(), group=world_group).report()
        _check_totals(what, rep, want)
        if kw.get("use_orig_params"):
            _check_rows(what, rep, want)
        _check_clip(what, model, model.named_parameters, world_group, want.total_norm)
    return None


def lightning_callback_group_read_when_used(rank: int, world: int) -> str | None:
    """Lightning's GradStatsCallback is made before Lightning makes the process group, where
    torch.distributed.group.WORLD is still None: group= then takes a callable, read when the figures are (a callable
    was passed on to grad_stats as the group itself), and the logged total norm is the model's (FSDP's own
    clip_grad_norm_); FSDP1 shards read without a group log a warning naming a parameter (their figures were each
    rank's own, silently). Each rank runs its own one-device Trainer of a LightningModule holding an FSDP1 unit
    over the existing gloo group (Lightning's FSDPStrategy needs a GPU)."""
    if world != 2 or importlib.util.find_spec("lightning") is None:
        return "skip: one 2-rank run is enough (Lightning starts slowly), and it needs lightning"
    import logging
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.loggers.logger import Logger

    from torch_gradstats.integrations.lightning import GradStatsCallback

    class Keep(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict[str, float]] = []

        @property
        def name(self) -> str:
            return "keep"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append(dict(metrics))

    class Sharded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module = _net()

        def configure_model(self) -> None:
            self.net = _fsdp()(self.net, device_id=torch.device("cpu"), use_orig_params=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class FSDPNorm(pl.Callback):  # FSDP's own norm of the same gradients, before the callback reads them
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.norms.append(float(pl_module.net.clip_grad_norm_(1e30)))

    class Caught(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    data = torch.utils.data.TensorDataset(torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(5)))
    caught = Caught()
    logging.getLogger("torch_gradstats").addHandler(caught)
    try:
        logged = {}
        for label, group in (("callable", lambda: dist.group.WORLD), ("none", None)):
            fsdp_norm, keep = FSDPNorm(), Keep()
            callback = GradStatsCallback(every_n_steps=1, group=group)
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=keep,
                                 callbacks=[fsdp_norm, callback], enable_progress_bar=False,
                                 enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
            mine = torch.utils.data.Subset(data, range(2 * rank, 4 * world, 2 * world))  # this rank's batches
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(Sharded(), torch.utils.data.DataLoader(mine, batch_size=2))
            totals = [row["grad_2.0_norm_total"] for row in keep.rows if "grad_2.0_norm_total" in row]
            assert len(totals) == 2 == len(fsdp_norm.norms), (label, totals, fsdp_norm.norms)
            logged[label] = (totals, fsdp_norm.norms)
    finally:
        logging.getLogger("torch_gradstats").removeHandler(caught)
    totals, theirs = logged["callable"]
    assert all(math.isclose(a, b, rel_tol=RTOL) for a, b in zip(totals, theirs)), (totals, theirs)
    told = [m for m in caught.messages if "no group= was given" in m]
    assert len(told) == 1 and "_flat_param" in told[0] and "lambda" in told[0], caught.messages
    return None


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f
    for f in (orig_params_whole_copies_refused_with_group, flat_shard_as_stored_without_group,
              nested_units_match_reference, mixed_precision_bf16, hybrid_shard_over_its_group, model_zoo_under_fsdp1,
              lightning_callback_group_read_when_used)
}
