"""The per-example figures :class:`~torch_gradstats.monitors.per_example.PerExampleNorms` combines: each hooked
layer's *contributions* (an outer product, one-hot rows, a dense per-example gradient, or a sum over positions), made
from the inputs kept in the forward and the gradient at the output, and their squared norms and cross terms
(:class:`Norms`), by the Gram form or by making the gradient, whichever costs fewer multiplications.

Split from ``per_example`` (past 500 lines, and a second job: the mathematics of one layer; ``per_example`` keeps
the hooks, their order and the accumulation over backwards). See that module's docstring for the forms per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_gradstats.monitors.activations._reads import top_level  # a module's output tensors, in order

__all__ = ["EXACT", "Autocast", "Contribution", "Dense", "Norms", "autocast_state", "exact_contributions", "func_grads"]

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
EXACT = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, *_NORMS)


# ---------------------------------------------------------------------------------------------- contributions
@dataclass
class _Outer:
    """One use's per-example gradient ``sum_t g[:, j, t]^T a[:, j, t]`` for each block j (a Conv's groups)."""

    a: Tensor  # [B, J, T, in]
    g: Tensor  # [B, J, T, out]


@dataclass
class _Rows:
    """An embedding's per-example gradient: row ``idx[b, t]`` gets ``g[b, t]``."""

    idx: Tensor  # [B, T]
    g: Tensor  # [B, T, D]
    rows: int


@dataclass
class Dense:
    """A per-example gradient made in full: ``[B, *param.shape]``."""

    grad: Tensor


@dataclass
class _Sum:
    """A bias's per-example gradient ``sum_t g[:, j, t]`` (the ``g`` of its layer's weight's _Outer)."""

    g: Tensor  # [B, J, T, out]


Contribution = _Outer | _Rows | Dense | _Sum


def _batched(x: Tensor, bd: int) -> Tensor:
    return x if bd == 0 else x.movedim(bd, 0)


def _chunks(b: int, per_example: int, limit: int) -> Iterator[slice]:
    """Slices of the batch whose intermediates hold at most ``limit`` elements (at least one example each)."""
    step = max(1, limit // max(per_example, 1))
    for start in range(0, b, step):
        yield slice(start, min(b, start + step))


def _gram(x: Tensor, y: Tensor) -> Tensor:
    return torch.matmul(x, y.transpose(-1, -2))


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """Per-example ``sum(x * y)`` of two ``[B, ...]`` tensors, in one batched product (no ``x * y`` made)."""
    b = x.shape[0]
    return torch.bmm(x.reshape(b, 1, -1), y.reshape(b, -1, 1)).reshape(b)


class Norms:
    """Squared norms and inner products of contributions, per example (``[B]``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Within one backward: id(input) -> (input, a a^T), shared by the layers that read one input (a block's q,
        # k and v projections); id(g) -> (g, g g^T), which also gives the bias's norm.
        self.grams: dict[int, tuple[Tensor, Tensor]] = {}
        self.out_grams: dict[int, tuple[Tensor, Tensor]] = {}

    @staticmethod
    def _kept(cache: dict[int, tuple[Tensor, Tensor]], key: Tensor, make: Tensor) -> Tensor:
        kept = cache.get(id(key))
        if kept is not None and kept[0] is key:
            return kept[1]
        gram = _gram(make, make)
        cache[id(key)] = (key, gram)
        while len(cache) > 2:  # the layers that share an input run one after the other in the backward
            del cache[next(iter(cache))]
        return gram

    def square(self, c: Contribution, key: Tensor | None = None) -> Tensor:
        if isinstance(c, Dense):
            return _dot(c.grad, c.grad)
        if isinstance(c, _Sum):
            kept = self.out_grams.get(id(c.g))
            if kept is not None and kept[0] is c.g:  # ||sum_t g_t||^2 = sum_ts g_t . g_s
                return kept[1].sum((1, 2, 3))
            return self.square(Dense(self.dense(c)))
        if isinstance(c, _Rows):
            return self.square(Dense(_row_sums(c)))
        b, j, t, i = c.a.shape
        o = c.g.shape[-1]
        if t * t * (i + o) <= t * i * o + i * o:  # the Gram form costs fewer multiplications
            if b * j * t * t <= self.limit:
                ga = _gram(c.a, c.a) if key is None else self._kept(self.grams, key, c.a)
                return _dot(ga, self._kept(self.out_grams, c.g, c.g))
            return self.inner(c, c)
        parts = [self.square(Dense(torch.matmul(c.g[s].transpose(-1, -2), c.a[s])))
                 for s in _chunks(b, j * i * o, self.limit)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def inner(self, u: _Outer | _Rows, v: _Outer | _Rows) -> Tensor:
        """Per-example ``<u, v>`` through Gram matrices of positions (neither is a Dense)."""
        if isinstance(u, _Outer) and isinstance(v, _Rows):
            u, v = v, u
        b = u.g.shape[0]
        t_u, t_v = u.g.shape[-2], v.g.shape[-2]
        parts = []
        for s in _chunks(b, t_u * t_v * (u.g.shape[1] if isinstance(u, _Outer) else 1), self.limit):
            if isinstance(u, _Outer) and isinstance(v, _Outer):
                prod = _gram(u.a[s], v.a[s]) * _gram(u.g[s], v.g[s])
            elif isinstance(u, _Rows) and isinstance(v, _Rows):
                prod = (u.idx[s, :, None] == v.idx[s, None, :]) * _gram(u.g[s], v.g[s])
            else:  # embedding rows (u) against a linear use of the same [V, D] weight (v: out V, in D)
                assert isinstance(u, _Rows) and isinstance(v, _Outer)
                vg, va = v.g[s, 0], v.a[s, 0]  # [b, T_v, V], [b, T_v, D]
                picked = vg.gather(2, u.idx[s, None, :].expand(-1, t_v, -1))  # vg[b, t, idx[b, s]]
                prod = picked * _gram(va, u.g[s])
            parts.append(prod.reshape(prod.shape[0], -1).sum(1))  # (a product of three: no _dot)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def dense(self, c: Contribution) -> Tensor:
        """The contribution made in full, ``[B, ...]`` (the layout of its parameter, flattened past the batch)."""
        if isinstance(c, Dense):
            return c.grad.reshape(c.grad.shape[0], -1)
        if isinstance(c, _Sum):
            return c.g.sum(2).reshape(c.g.shape[0], -1)
        if isinstance(c, _Rows):
            b, _, d = c.g.shape
            rows = c.idx + torch.arange(b, device=c.idx.device)[:, None] * c.rows
            out = torch.zeros(b * c.rows, d, dtype=c.g.dtype, device=c.g.device)
            return out.index_add_(0, rows.reshape(-1), c.g.reshape(-1, d)).reshape(b, -1)
        return torch.matmul(c.g.transpose(-1, -2), c.a).reshape(c.a.shape[0], -1)

    def combined(self, name: str, uses: list[Contribution], numel: int) -> Tensor:
        """The squared norm of the sum of several uses of one parameter, cross terms included."""
        if len(uses) == 1:
            return self.square(uses[0])
        b = self.dense(uses[0]).shape[0] if isinstance(uses[0], Dense) else uses[0].g.shape[0]
        grams = [u for u in uses if isinstance(u, (_Outer, _Rows))]
        if len(grams) == len(uses):
            # Gram matrices of positions, a slice of the batch at a time: one example's must fit.
            pair = max(u.g.shape[-2] * v.g.shape[-2] * (u.g.shape[1] if isinstance(u, _Outer) else 1)
                       for u in grams for v in grams)
            if pair <= self.limit and (pair <= numel or b * numel > self.limit):
                total = sum(self.inner(u, v) * (1 if k == m else 2)
                            for k, u in enumerate(grams) for m, v in enumerate(grams) if m >= k)
                assert isinstance(total, Tensor)
                return total
        if b * numel > self.limit:
            raise RuntimeError(
                f"PerExampleNorms: parameter {name!r} is used {len(uses)} times in one forward; the cross terms of "
                f"its per-example norm need its {b} per-example gradients ({b * numel:,} elements) or Gram matrices "
                f"of positions larger than max_materialize ({self.limit:,}) allows; raise max_materialize or use "
                "shorter sequences or smaller micro-batches"
            )
        full = self.dense(uses[0])
        for u in uses[1:]:
            full = full + self.dense(u)
        return _dot(full, full)


def _row_sums(c: _Rows) -> Tensor:
    """An embedding's per-example gradient, its rows compacted: ``[B, T, D]``, row k of example b the sum of the
    gradients at the positions of b's k-th distinct index (rows past its distinct indices zero). The tokens are
    sorted per example, so equal indices are runs, numbered by a cumulative sum: no host read, ``B*T*D`` elements
    however large the vocabulary."""
    b, t, d = c.g.shape
    ordered, order = c.idx.sort(dim=1)
    starts = torch.ones_like(ordered, dtype=torch.int64)
    starts[:, 1:] = (ordered[:, 1:] != ordered[:, :-1]).to(torch.int64)
    run = torch.empty_like(order).scatter_(1, order, starts.cumsum(1) - 1)  # each position's run, in place order
    slots = (run + torch.arange(b, device=run.device)[:, None] * t).reshape(-1)
    out = torch.zeros(b * t, d, dtype=c.g.dtype, device=c.g.device)
    return out.index_add_(0, slots, c.g.reshape(-1, d)).reshape(b, t, d)


# ---------------------------------------------------------------------------------------------- layers
def _conv_contributions(m: nn.Conv1d | nn.Conv2d, x: Tensor, g: Tensor) -> tuple[_Outer, _Sum]:
    """The unfolded input and the output gradient of a convolution as an _Outer per group; and the bias's part."""
    one_d = isinstance(m, nn.Conv1d)
    if one_d:  # a Conv1d is a Conv2d of height 1
        x, g = x.unsqueeze(2), g.unsqueeze(2)
    size, stride, dilation = (tuple(v) if not one_d else (1, v[0]) for v in (m.kernel_size, m.stride, m.dilation))
    padding: Any = m.padding if not one_d else (0, m.padding[0]) if not isinstance(m.padding, str) else m.padding
    if m.padding_mode != "zeros" or isinstance(padding, str):  # pad as the module did, then unfold without padding
        pads = list(m._reversed_padding_repeated_twice) + ([0, 0] if one_d else [])
        x = F.pad(x, pads, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        padding = 0
    cols = F.unfold(x, size, dilation=dilation, padding=padding, stride=stride)  # [B, C_in * K, L]
    b, j = x.shape[0], m.groups
    a = cols.reshape(b, j, cols.shape[1] // j, -1).transpose(-1, -2)
    gg = g.reshape(b, j, g.shape[1] // j, -1).transpose(-1, -2)
    return _Outer(a, gg), _Sum(gg)


def _normalized(m: nn.Module, x: Tensor) -> Tensor:
    """A norm layer's input normalised as its forward does, before the affine part."""
    if isinstance(m, nn.LayerNorm):
        return F.layer_norm(x, m.normalized_shape, None, None, m.eps)
    if isinstance(m, nn.RMSNorm):
        return F.rms_norm(x, m.normalized_shape, None, m.eps)
    assert isinstance(m, nn.GroupNorm)
    return F.group_norm(x, m.num_groups, None, None, m.eps)


def exact_contributions(m: nn.Module, x: Tensor, g: Tensor, bd: int) -> dict[str, Contribution]:
    """The contributions of one call of a layer with a closed form: ``{"weight": ..., "bias": ...}``."""
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        outer, bias = _conv_contributions(m, x, g)
        return {"weight": outer, "bias": bias}
    if isinstance(m, nn.GroupNorm):  # [N, C, *]: per channel, over every other dimension
        xg = (_normalized(m, x) * g).reshape(x.shape[0], x.shape[1], -1).sum(2)
        return {"weight": Dense(xg), "bias": Dense(g.reshape(g.shape[0], g.shape[1], -1).sum(2))}
    x, g = _batched(x, bd), _batched(g, bd)
    b = x.shape[0]
    if isinstance(m, nn.Linear):
        gg = g.reshape(b, 1, -1, g.shape[-1])
        return {"weight": _Outer(x.reshape(b, 1, -1, x.shape[-1]), gg), "bias": _Sum(gg)}
    if isinstance(m, nn.Embedding):
        idx, gg = x.reshape(b, -1), g.reshape(b, -1, g.shape[-1])
        if m.padding_idx is not None:  # the padding row gets no gradient
            gg = gg.masked_fill((idx == m.padding_idx)[..., None], 0.0)
        return {"weight": _Rows(idx, gg, m.num_embeddings)}
    assert isinstance(m, (nn.LayerNorm, nn.RMSNorm))
    shape = tuple(m.normalized_shape)  # LayerNorm, RMSNorm: over the trailing dimensions
    xg = (_normalized(m, x) * g).reshape(b, -1, *shape).sum(1)
    return {"weight": Dense(xg), "bias": Dense(g.reshape(b, -1, *shape).sum(1))}


#: The autocast settings of a forward: (device type, enabled, dtype) for each device type it may compute on.
Autocast = tuple[tuple[str, bool, torch.dtype], ...]


def autocast_state(device_type: str) -> Autocast:
    """The autocast settings in force now for ``device_type`` and the CPU: what a module's forward computed under,
    for its replay in the backward (which runs outside autocast), as activation checkpointing keeps them."""
    kinds = sorted({device_type, "cpu"})
    return tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                 for k in kinds if torch.amp.is_autocast_available(k))


def func_grads(m: nn.Module, params: dict[str, nn.Parameter], args: tuple[Any, ...], kwargs: dict[str, Any],
               out_index: int, g: Tensor, bd: int, b: int, amp: Autocast = ()) -> dict[str, Tensor]:
    """Per-example gradients ``[B, *shape]`` of ``params`` through the output ``out_index`` of ``m``, by torch.func:
    each example runs alone, as a batch of one, under the forward's autocast settings ``amp``, and its gradient is
    ``vjp`` of that output's gradient. A tensor argument (positional or keyword) with ``b`` rows along the batch
    dimension is split by example; every other argument is passed whole."""
    values = (*args, *kwargs.values())
    batched = [isinstance(v, Tensor) and v.dim() > bd and v.shape[bd] == b for v in values]
    inputs = tuple(v.detach() if isinstance(v, Tensor) else v for v in values)

    def one(p: dict[str, Tensor], vs: tuple[Any, ...], g_i: Tensor) -> dict[str, Tensor]:
        vs = tuple(v.unsqueeze(bd) if bt else v for v, bt in zip(vs, batched))
        xs, kw = vs[:len(args)], dict(zip(kwargs, vs[len(args):]))

        def forward(p: dict[str, Tensor]) -> Tensor:
            with contextlib.ExitStack() as stack:
                for kind, enabled, dtype in amp:
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=False))
                out = torch.func.functional_call(m, p, xs, kw)
            return top_level(out)[out_index]

        out, pull = torch.func.vjp(forward, p)[:2]  # (typed as a tuple of any length)
        # The output's gradient in the output's dtype (a 16-bit one under autocast), as the backward had it.
        grads: dict[str, Tensor] = pull(g_i.unsqueeze(bd).to(out.dtype))[0]
        return grads

    dims = tuple(bd if bt else None for bt in batched)
    detached = {k: v.detach() for k, v in params.items()}
    grads: dict[str, Tensor] = torch.func.vmap(one, in_dims=(None, dims, bd))(detached, inputs, g)
    return grads
