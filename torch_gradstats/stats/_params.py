"""The walk over parameters that :func:`torch_gradstats.grad_stats` and its users share, and its checks.

Every public function that takes a ``params`` argument like :func:`~torch_gradstats.grad_stats` (clip, collector,
updates, noise scale, the adaptive clip) reads it through :func:`named_params` (generators are read once, unnamed
items named by position); :func:`unique_names` keeps two parameters from sharing a row; :func:`check_grads` names
the parameter whose gradient the op cannot read; :func:`stats_on_home` makes one op call per device and gathers
the results on the home device.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import host_int64, to_device
from torch_gradstats.ops.op import OP_NAME, SUPPORTED_DTYPES, check_inputs, multi_tensor_stats

__all__ = [
    "ParamsLike",
    "check_flat_param_group",
    "check_grads",
    "check_orig_param_group",
    "dtensor_types",
    "empty_orig_shard",
    "empty_rows_dtype",
    "flat_param_shards",
    "flat_param_types",
    "fsdp1_grad",
    "fsdp1_managed",
    "named_params",
    "stats_on_home",
    "unique_names",
    "without_shard_padding",
]

#: What :func:`~torch_gradstats.grad_stats` accepts: a tensor, or an iterable of tensors or of ``(name, tensor)`` pairs.
ParamsLike = Tensor | Iterable[Tensor | tuple[str, Tensor]]


def dtensor_types() -> tuple[type, ...]:
    """DTensor classes, only if torch's DTensor module is already imported.

    A gradient can only be a DTensor if someone imported the module that defines it, so looking in ``sys.modules``
    (instead of importing) keeps the plain single-process path free of any torch.distributed import.
    """
    types = []
    for mod_name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # new name, then torch < 2.5
        mod = sys.modules.get(mod_name)
        cls = getattr(mod, "DTensor", None) if mod is not None else None
        if isinstance(cls, type) and cls not in types:
            types.append(cls)
    return tuple(types)


def flat_param_types() -> tuple[type, ...]:
    """FSDP1's ``FlatParameter`` class, only if its module is already imported (as :func:`dtensor_types`)."""
    mod = sys.modules.get("torch.distributed.fsdp._flat_param")
    cls = getattr(mod, "FlatParameter", None) if mod is not None else None
    return (cls,) if isinstance(cls, type) else ()


def fsdp1_managed(params: list[Any]) -> bool:
    """Whether any item of ``params`` (tensors or (name, tensor) pairs) is a parameter FSDP1 manages: a flat
    parameter, or an original one under ``use_orig_params=True`` (FSDP marks both ``_fsdp_flattened``)."""
    return any(
        getattr(item[1] if isinstance(item, (tuple, list)) and len(item) == 2 else item, "_fsdp_flattened", False)
        is True
        for item in params
    )


def empty_orig_shard(p: Tensor) -> bool:
    """An original parameter of FSDP1 (``use_orig_params=True``) that is trained but has no element on this rank:
    read with a group, it counts as an empty row, so that every rank lists every parameter of a flat parameter
    (rows matched by position pair each one with its own pieces; rows matched by name come in model order)."""
    return p.grad is None and p.requires_grad and p.numel() == 0 and getattr(p, "_fsdp_flattened", False) is True


def empty_rows_dtype(pairs: Sequence[tuple[str, Tensor]]) -> torch.dtype | None:
    """The dtype of this rank's first gradient of an FSDP1 original parameter, which its empty rows take: FSDP
    gives them all one (the parameters', or ``param_dtype`` with ``keep_low_precision_grads``), and the ranks'
    rows of one parameter must agree. None where this rank holds none."""
    for _, p in pairs:
        if p.grad is not None and getattr(p, "_fsdp_flattened", False) is True:
            return p.grad.dtype
    return None


def without_shard_padding(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` without the zeros FSDP1 pads a flat parameter's shard with (``use_orig_params=False``): a view of
    its first elements, so the padding counts in no numel and no zero count. A gradient of another size (the
    unsharded one that ``no_sync`` accumulates) has no shard padding and is returned as it is."""
    padded = getattr(param, "_shard_numel_padded", 0)
    if not isinstance(padded, int) or padded <= 0 or grad.shape != param.shape or grad.dim() != 1:
        return grad
    return grad[: grad.numel() - padded]


def flat_param_shards(param: Tensor) -> int | None:
    """How many ranks FSDP1 splits a flat parameter over: 1 where each rank holds all of it (``NO_SHARD``, an FSDP
    group of one rank), the size of its sharding group otherwise (under ``HYBRID_SHARD``, the group within a
    replica). Read from the sizes FSDP sets at its first forward; None before it (a gradient set by hand)."""
    if not isinstance(getattr(param, "_local_shard", None), Tensor):
        return None
    padded = getattr(param, "_padded_unsharded_size", None)  # set for the sharded strategies alone
    if not isinstance(padded, torch.Size) or param.numel() == 0:
        return 1
    return max(padded.numel() // param.numel(), 1)


def check_flat_param_group(name: str, param: Tensor, group: Any, caller: str = "grad_stats") -> None:
    """An FSDP1 flat parameter read with ``group=`` must be sharded over exactly that group: where each rank of it
    holds a whole copy (``NO_SHARD``, or ``HYBRID_SHARD`` read over all ranks) the sum would count it once per copy.
    Its gradient must be the reduced shard: an unsharded one (``no_sync()``) is each rank's own partial sum."""
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        return
    grad = param.grad
    if isinstance(grad, Tensor) and grad.dim() == 1 and param.dim() == 1 and grad.numel() > param.numel():
        raise ValueError(
            f"{caller}: the gradient of the FSDP flat parameter {name!r} is unsharded ({grad.numel()} elements for a "
            f"shard of {param.numel()}): this rank's own partial sum, inside no_sync() or before the backward that "
            "reduces it. Read it with group= after that backward, or without group= for this rank's figures alone"
        )
    size, shards = dist.get_world_size(group), flat_param_shards(param)
    if shards is not None and size != shards:
        held = "whole on each rank" if shards == 1 else f"sharded over {shards} ranks"
        raise ValueError(
            f"{caller}: the FSDP flat parameter {name!r} is {held}, but group= has {size} ranks, so the sum over "
            "the group would not be its figures (each copy counted). Pass the group FSDP shards it over "
            "(model.process_group), or no group for NO_SHARD, whose gradients are whole on every rank as DDP's are"
        )


def check_orig_param_group(name: str, grad: Tensor, group: Any, caller: str = "grad_stats") -> None:
    """An original parameter of FSDP1 (``use_orig_params=True``) read with ``group=`` must hold FSDP's 1-D view of
    its shard of the reduced gradient. A gradient of its original shape (2-D or more) is a whole copy on every rank:
    ``NO_SHARD``'s, or inside ``no_sync()`` this rank's own unsharded partial sum, which the sum over the group would
    count once per rank. (A 1-D parameter's copy looks like a shard: only its 2-D and larger neighbours tell.)"""
    import torch.distributed as dist

    if grad.dim() <= 1 or not isinstance(group, dist.ProcessGroup) or dist.get_world_size(group) == 1:
        return
    raise ValueError(
        f"{caller}: the gradient of the FSDP parameter {name!r} (use_orig_params=True) has its whole shape "
        f"{tuple(grad.shape)}, not the 1-D shard FSDP leaves after the backward that reduces it: each rank holds a "
        "copy (NO_SHARD, or its own partial sum inside no_sync()), which the sum over group= would count once per "
        "rank. Read NO_SHARD without group= (its gradients are whole on every rank, as DDP's), and accumulated "
        "gradients after the backward that reduces them"
    )


def fsdp1_grad(name: str, p: Tensor, group: Any, empty_dtype: torch.dtype | None) -> Any:
    """What :func:`~torch_gradstats.grad_stats` reads of FSDP1's parameter ``p`` (marked ``_fsdp_flattened``): a
    flat parameter's gradient without its shard padding, an original one's, each checked against ``group``; with
    ``group``, an empty row (of ``empty_dtype``) for an original one with no piece here; None for no row."""
    g = p.grad
    if g is None:
        return p.detach().to(empty_dtype or p.dtype) if group is not None and empty_orig_shard(p) else None
    if not isinstance(g, Tensor):
        return g  # named by the op's failure
    if isinstance(p, flat_param_types()):
        if group is not None:
            check_flat_param_group(name, p, group)
        return without_shard_padding(p, g)
    dtensors = dtensor_types()
    if group is not None and not (dtensors and isinstance(g, dtensors)):
        check_orig_param_group(name, g, group)
    return g


def named_params(params: ParamsLike, caller: str = "grad_stats") -> list[tuple[str, Tensor]]:
    """Normalise the accepted inputs to ``[(name, param)]``; unnamed items are named by their position. Errors
    start with ``caller``, the public function that was given ``params``."""
    if isinstance(params, Tensor):
        items: Iterable[Any] = [params]
    elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(
            f"{caller}: expected parameters (model.parameters(), model.named_parameters(), a list of tensors or "
            f"of (name, tensor) pairs), got a {type(params).__name__}"
        )
    else:
        items = params
    out: list[tuple[str, Tensor]] = []
    for i, item in enumerate(items):
        if type(item) is tuple and len(item) == 2 and type(item[0]) is str and isinstance(item[1], Tensor):
            out.append(item)  # named_parameters(): the common case first, the pair kept as is
        elif isinstance(item, Tensor):
            out.append((str(i), item))
        elif (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Tensor)
        ):
            out.append((item[0], item[1]))
        else:
            raise TypeError(
                f"{caller}: item {i} is a {type(item).__name__} ({_short_repr(item)}); expected a parameter "
                "tensor or a (name, tensor) pair"
            )
    return out


def _short_repr(obj: Any, limit: int = 60) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unique_names(names: list[str]) -> list[str]:
    """Names as given, a repeat made unique as ``name#1``, ``name#2``... (e.g. ``chain(enc.named_parameters(),
    dec.named_parameters())`` yields ``weight`` twice), so that per-parameter reports never merge two parameters.
    A suffixed name is never one that is given or already taken: ``["a", "a#1", "a"]`` gives ``a#2`` last.

    Linear: each name resumes its suffix count where its last repeat stopped. A candidate passed over was taken
    or given, and stays so, so no candidate is tried twice (``name#k`` belongs to one name: the part before its
    last ``#``)."""
    if len(set(names)) == len(names):
        return names
    given = set(names)
    taken: set[str] = set()
    last_suffix: dict[str, int] = {}
    out = []
    for name in names:
        if name in taken:
            k = last_suffix.get(name, 0) + 1
            while (unique := f"{name}#{k}") in taken or unique in given:
                k += 1
            last_suffix[name] = k
            name = unique
        taken.add(name)
        out.append(name)
    return out


def check_grads(names: Sequence[str], grads: Sequence[Any]) -> None:
    """Raise a clear error naming the first parameter whose gradient the op cannot read (metadata only, no sync).

    Run only after a failure, so the hot path pays no per-parameter Python check.
    """
    for name, grad in zip(names, grads):
        _check_grad(name, grad)


def _check_grad(name: str, grad: Any) -> None:
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad_stats: parameter {name!r} has a .grad of type {type(grad).__name__}, not a tensor")
    if grad.layout != torch.strided:
        raise ValueError(
            f"grad_stats: parameter {name!r} has a {grad.layout} gradient; only dense (strided) gradients are "
            "supported (for nn.Embedding(sparse=True), convert with .to_dense() or use sparse=False)"
        )
    if grad.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"grad_stats: parameter {name!r} has a {grad.dtype} gradient; expected float16, bfloat16, float32 "
            "or float64"
        )
    try:  # the op's own checks (nested tensor, freed storage), reworded to name the parameter
        check_inputs([grad])
    except (TypeError, ValueError) as exc:
        detail = str(exc).replace(f"{OP_NAME}: tensors[0] ", "", 1)
        raise type(exc)(f"grad_stats: parameter {name!r} has a gradient that {detail}") from None


def _home_device(devices: Iterable[torch.device]) -> torch.device:
    """First accelerator device in order, else the CPU (see :mod:`torch_gradstats.stats.gradients` for why)."""
    first = None
    for d in devices:
        if first is None:
            first = d
        if d.type != "cpu":
            return d
    return first if first is not None else torch.device("cpu")


def stats_on_home(local: list[Tensor], histogram: bool) -> tuple[list[Tensor], torch.device]:
    """One op call per device; its outputs (three, or four with ``histogram``) gathered on the home device (see
    :mod:`torch_gradstats.stats.gradients`) in the order of ``local``, and that device."""
    op: Callable[[list[Tensor]], Sequence[Tensor]] = (
        (lambda ts: multi_tensor_stats(ts, histogram=True)) if histogram else multi_tensor_stats
    )
    if not torch.compiler.is_compiling():
        try:  # one device, the common case: no per-tensor Python at all
            out = list(op(local))
            return out, out[0].device
        except ValueError:
            pass  # several devices (grouped below), or a bad input: the grouped call raises it again
    by_device: dict[torch.device, list[int]] = {}  # metadata only, model order inside each group
    for i, t in enumerate(local):
        by_device.setdefault(t.device, []).append(i)
    home = _home_device(by_device)
    if len(by_device) == 1:
        return list(op(local)), home
    parts: list[list[Tensor]] = []
    order: list[int] = []
    for idx in by_device.values():
        parts.append([to_device(o, home) for o in op([local[i] for i in idx])])
        order.extend(idx)
    # Scatter the per-device results back into model order.
    inverse = [0] * len(order)
    for pos, i in enumerate(order):
        inverse[i] = pos
    inv = host_int64(inverse, home)
    return [torch.cat(outputs).index_select(0, inv) for outputs in zip(*parts)], home
