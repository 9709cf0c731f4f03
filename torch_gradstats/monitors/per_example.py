"""Per-example gradient norms from the forward and backward the training already runs: :class:`PerExampleNorms`.

Forward hooks on every module that owns parameters keep that call's inputs and hook its output; when the backward
reaches the output, the gradient there and the kept inputs give each example's own parameter gradient, or straight
away its squared norm:

* ``nn.Linear`` (any leading dimensions) and ``nn.Conv1d``/``nn.Conv2d`` (unfolded): the per-example weight gradient
  is ``sum_t g_t a_t^T``; its squared norm is either ``sum((A A^T) * (G G^T))`` over positions t, s (the Gram or
  "ghost norm" form, which never makes the gradient) or the gradient made and squared, whichever costs fewer
  multiplications for that layer;
* ``nn.Embedding``: the same with one-hot rows, ``sum([idx_t == idx_s] * (g_t . g_s))``;
* ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` and every bias: the per-example gradient itself (small);
* any other module that owns parameters directly: ``torch.func`` (``vmap`` of ``vjp``) over its own forward.

A parameter used more than once in a forward (tied embeddings) adds the cross terms between its uses. The backward
ends with one callback that turns the micro-batch's figures into per-example squared norms; results accumulate over
backwards until :meth:`PerExampleNorms.reset`. Nothing here reads a value on the host.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_gradstats.ops._transfer import to_device

__all__ = ["PerExampleNorms"]

logger = logging.getLogger("torch_gradstats.per_example")

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_EXACT = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, *_NORMS)


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
class _Dense:
    """A per-example gradient made in full: ``[B, *param.shape]``."""

    grad: Tensor


@dataclass
class _Sum:
    """A bias's per-example gradient ``sum_t g[:, j, t]`` (the ``g`` of its layer's weight's _Outer)."""

    g: Tensor  # [B, J, T, out]


_Contribution = _Outer | _Rows | _Dense | _Sum


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


class _Norms:
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

    def square(self, c: _Contribution, key: Tensor | None = None) -> Tensor:
        if isinstance(c, _Dense):
            return _dot(c.grad, c.grad)
        if isinstance(c, _Sum):
            kept = self.out_grams.get(id(c.g))
            if kept is not None and kept[0] is c.g:  # ||sum_t g_t||^2 = sum_ts g_t . g_s
                return kept[1].sum((1, 2, 3))
            return self.square(_Dense(self.dense(c)))
        if isinstance(c, _Rows):
            return self.square(_Dense(_row_sums(c)))
        b, j, t, i = c.a.shape
        o = c.g.shape[-1]
        if t * t * (i + o) <= t * i * o + i * o:  # the Gram form costs fewer multiplications
            if b * j * t * t <= self.limit:
                ga = _gram(c.a, c.a) if key is None else self._kept(self.grams, key, c.a)
                return _dot(ga, self._kept(self.out_grams, c.g, c.g))
            return self.inner(c, c)
        parts = [self.square(_Dense(torch.matmul(c.g[s].transpose(-1, -2), c.a[s])))
                 for s in _chunks(b, j * i * o, self.limit)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def inner(self, u: _Outer | _Rows, v: _Outer | _Rows) -> Tensor:
        """Per-example ``<u, v>`` through Gram matrices of positions (neither is a _Dense)."""
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

    def dense(self, c: _Contribution) -> Tensor:
        """The contribution made in full, ``[B, ...]`` (the layout of its parameter, flattened past the batch)."""
        if isinstance(c, _Dense):
            return c.grad.reshape(c.grad.shape[0], -1)
        if isinstance(c, _Sum):
            return c.g.sum(2).reshape(c.g.shape[0], -1)
        if isinstance(c, _Rows):
            b, _, d = c.g.shape
            rows = c.idx + torch.arange(b, device=c.idx.device)[:, None] * c.rows
            out = torch.zeros(b * c.rows, d, dtype=c.g.dtype, device=c.g.device)
            return out.index_add_(0, rows.reshape(-1), c.g.reshape(-1, d)).reshape(b, -1)
        return torch.matmul(c.g.transpose(-1, -2), c.a).reshape(c.a.shape[0], -1)

    def combined(self, name: str, uses: list[_Contribution], numel: int) -> Tensor:
        """The squared norm of the sum of several uses of one parameter, cross terms included."""
        if len(uses) == 1:
            return self.square(uses[0])
        b = self.dense(uses[0]).shape[0] if isinstance(uses[0], _Dense) else uses[0].g.shape[0]
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


def _exact(m: nn.Module, x: Tensor, g: Tensor, bd: int) -> dict[str, _Contribution]:
    """The contributions of one call of a layer with a closed form: ``{"weight": ..., "bias": ...}``."""
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        outer, bias = _conv_contributions(m, x, g)
        return {"weight": outer, "bias": bias}
    if isinstance(m, nn.GroupNorm):  # [N, C, *]: per channel, over every other dimension
        xg = (_normalized(m, x) * g).reshape(x.shape[0], x.shape[1], -1).sum(2)
        return {"weight": _Dense(xg), "bias": _Dense(g.reshape(g.shape[0], g.shape[1], -1).sum(2))}
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
    return {"weight": _Dense(xg), "bias": _Dense(g.reshape(b, -1, *shape).sum(1))}


def _func_grads(m: nn.Module, params: dict[str, nn.Parameter], args: tuple[Any, ...], kwargs: dict[str, Any],
                out_index: int, g: Tensor, bd: int, b: int) -> dict[str, Tensor]:
    """Per-example gradients ``[B, *shape]`` of ``params`` through the output ``out_index`` of ``m``, by torch.func:
    each example runs alone, as a batch of one, and its gradient is ``vjp`` of that output's gradient. A tensor
    argument (positional or keyword) with ``b`` rows along the batch dimension is split by example; every other
    argument is passed whole."""
    values = (*args, *kwargs.values())
    batched = [isinstance(v, Tensor) and v.dim() > bd and v.shape[bd] == b for v in values]
    inputs = tuple(v.detach() if isinstance(v, Tensor) else v for v in values)

    def one(p: dict[str, Tensor], vs: tuple[Any, ...], g_i: Tensor) -> dict[str, Tensor]:
        vs = tuple(v.unsqueeze(bd) if bt else v for v, bt in zip(vs, batched))
        xs, kw = vs[:len(args)], dict(zip(kwargs, vs[len(args):]))

        def forward(p: dict[str, Tensor]) -> Tensor:
            out = torch.func.functional_call(m, p, xs, kw)
            return _tensors(out)[out_index]

        pull = torch.func.vjp(forward, p)[1]
        grads: dict[str, Tensor] = pull(g_i.unsqueeze(bd))[0]
        return grads

    dims = tuple(bd if bt else None for bt in batched)
    detached = {k: v.detach() for k, v in params.items()}
    grads: dict[str, Tensor] = torch.func.vmap(one, in_dims=(None, dims, bd))(detached, inputs, g)
    return grads


def _tensors(out: Any) -> list[Tensor]:
    """The tensors a module returned, in order (a tensor, or a tuple or list of them and other values)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


# ---------------------------------------------------------------------------------------------- PerExampleNorms
@dataclass
class _Layer:
    """A hooked module: how its contributions are made, and the parameters they are for."""

    module: nn.Module
    name: str
    exact: bool  # a closed form (_EXACT), else torch.func
    params: list[tuple[str, str, nn.Parameter]]  # (name in the module, name in the model, parameter)


def _what(name: str, m: nn.Module) -> str:
    return f"module {name or '<root>'!r} ({type(m).__name__})"


class PerExampleNorms:
    """Each example's own gradient norm, from the backward the training runs anyway (see the module docstring).

    Args:
        model: the model; every module that owns parameters is hooked.
        loss_reduction: how each backward's loss is made from its examples' losses: ``"mean"`` or ``"sum"``. Both
            give the same norms: those of each example's own loss gradient.
        batch_dim: the batch dimension of the inputs and outputs of the hooked modules (convolutions and GroupNorm
            always take it first).
        max_materialize: the most elements one intermediate may hold: Gram matrices are made a slice of the batch at
            a time within it, and a parameter used several times per forward whose per-example norm needs more is
            refused by name.

    Raises:
        ValueError: a module that mixes examples (BatchNorm in training mode or without running statistics, an
            Embedding with ``scale_grad_by_freq``), named.
        TypeError: a recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: torch.func cannot batch them), named.
    """

    def __init__(self, model: nn.Module, *, loss_reduction: str = "mean", batch_dim: int = 0,
                 max_materialize: int = 2**27) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerExampleNorms: model must be a torch.nn.Module, got a {type(model).__name__}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"PerExampleNorms: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        for arg, value, low in (("batch_dim", batch_dim, 0), ("max_materialize", max_materialize, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PerExampleNorms: {arg} must be an int >= {low}, got {value!r}")
        self.loss_reduction = loss_reduction
        self.batch_dim = batch_dim
        self.max_materialize = max_materialize
        self._layers: dict[nn.Module, _Layer] = {}
        self._handles: list[Any] = []
        names = {id(p): n for n, p in model.named_parameters()}
        self._order = list(names.values())
        whole: list[str] = []  # modules handled with all their submodules' parameters (MultiheadAttention)
        for mname, m in model.named_modules():
            if any(mname.startswith(w + ".") for w in whole):
                continue
            own = list(m.named_parameters(recurse=isinstance(m, nn.MultiheadAttention)))
            if not own:
                continue
            if isinstance(m, nn.MultiheadAttention):
                whole.append(mname)
            self._check(mname, m)
            params = [(local, names[id(p)], p) for local, p in own]
            self._layers[m] = _Layer(m, mname, isinstance(m, _EXACT), params)
            self._handles.append(m.register_forward_hook(self._forward, with_kwargs=True))
        for p_name, p in model.named_parameters():
            if p.requires_grad:  # a gradient reaching a parameter that no hooked call saw is refused by name
                self._handles.append(p.register_hook(lambda _g, n=p_name: self._arrived(n)))
        self._norms = _Norms(max_materialize)
        self._batches: list[tuple[Tensor, dict[str, Tensor]]] = []  # per backward: (sum of squares, per parameter)
        self._replaying = False
        self._clear_backward()

    @staticmethod
    def _check(name: str, m: nn.Module) -> None:
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            raise ValueError(
                f"PerExampleNorms: {_what(name, m)} normalises with the statistics of the whole batch, which mixes "
                "the examples' gradients; put it in eval mode (running statistics) or use LayerNorm/GroupNorm"
            )
        if isinstance(m, nn.RNNBase):
            raise TypeError(f"PerExampleNorms: {_what(name, m)} has no per-example rule here, and torch.func cannot "
                            "vmap its fused recurrent kernels")
        if isinstance(m, nn.Embedding) and m.scale_grad_by_freq:
            raise ValueError(f"PerExampleNorms: {_what(name, m)} has scale_grad_by_freq=True, which scales each "
                             "example's gradient by counts over the whole batch")

    def _clear_backward(self) -> None:
        self._uses: dict[str, int] = defaultdict(int)  # calls hooked since the last backward, per parameter
        self._pending: dict[str, list[_Contribution]] = defaultdict(list)
        self._sq: dict[str, Tensor] = {}
        self._arrivals: set[str] = set()
        self._batch: int | None = None
        self._queued = False
        self._norms.grams.clear()

    # ------------------------------------------------------------------------------------------- hooks
    def _forward(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._replaying or not torch.is_grad_enabled():
            return
        layer = self._layers[m]
        self._check(layer.name, m)  # the module may have been put in training mode since
        live = [full for _, full, p in layer.params if p.requires_grad]
        outs = _tensors(out)[:1] if layer.exact else _tensors(out)
        for i, o in enumerate(outs if live else []):
            if o.requires_grad:  # the gradient there, with this call's inputs, gives this use's contribution
                o.register_hook(lambda g, i=i: self._backward(layer, args, kwargs, i, g))
                for full in live:
                    self._uses[full] += 1

    def _arrived(self, name: str) -> None:
        self._queue()
        self._arrivals.add(name)

    def _queue(self) -> None:
        if not self._queued:  # once per backward: the engine runs it when this backward ends
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _backward(self, layer: _Layer, args: tuple[Any, ...], kwargs: dict[str, Any], index: int, g: Tensor) -> None:
        self._queue()
        m, bd = layer.module, self.batch_dim
        if not args or not isinstance(args[0], Tensor):
            raise TypeError(f"PerExampleNorms: {_what(layer.name, m)} was called without a tensor as its first input")
        x = args[0]
        dim = 0 if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.GroupNorm)) else bd
        if x.dim() <= dim or (self._batch is not None and x.shape[dim] != self._batch):
            raise RuntimeError(
                f"PerExampleNorms: {_what(layer.name, m)} got an input of shape {tuple(x.shape)}, without "
                f"{self._batch or 'any'} examples along its batch dimension {dim}, which this backward's other "
                "modules had"
            )
        b = x.shape[dim]
        self._batch = b
        if g.dtype in (torch.float16, torch.bfloat16):  # exact sums of squares need more than 8-bit mantissas
            g = g.float()
            x = x.float() if x.is_floating_point() else x
        want = {local for local, _, p in layer.params if p.requires_grad}
        if layer.exact:
            made = _exact(m, x, g, bd)
        else:
            params = {local: p for local, _, p in layer.params if local in want}
            self._replaying = True
            try:
                made = {k: _Dense(v) for k, v in _func_grads(m, params, args, kwargs, index, g, bd, b).items()}
            finally:
                self._replaying = False
        for local, full, p in layer.params:
            if local not in want or local not in made:
                continue
            pending = self._pending[full]
            pending.append(made[local])
            if len(pending) >= self._uses[full]:  # every hooked use has arrived: reduce now and free the inputs
                key = x if isinstance(m, nn.Linear) and len(pending) == 1 else None
                self._sq[full] = (self._norms.square(pending[0], key) if len(pending) == 1
                                  else self._norms.combined(full, pending, p.numel()))
                del self._pending[full]
        self._norms.out_grams.clear()  # g g^T served this call's bias

    def _finish(self) -> None:
        """End of a backward: the micro-batch's per-example squared norms, scaled for the loss's reduction."""
        try:
            for full, pending in self._pending.items():
                numel = next(p.numel() for layer in self._layers.values() for _, n, p in layer.params if n == full)
                self._sq[full] = self._norms.combined(full, pending, numel)
            outside = sorted(self._arrivals - set(self._sq) - set(self._pending))
            if outside:
                raise RuntimeError(
                    f"PerExampleNorms: parameter {outside[0]!r} received a gradient outside the calls of the module "
                    "that owns it (its tensor was used directly by another module), so its per-example gradients "
                    "are unknown; compute with it inside its own module's forward"
                )
            if not self._sq or self._batch is None:
                return
            scale = float(self._batch) ** 2 if self.loss_reduction == "mean" else 1.0
            home = next((t.device for t in self._sq.values() if t.device.type != "cpu"), torch.device("cpu"))
            per = {n: to_device(t.float() * scale, home) for n, t in self._sq.items()}
            total = torch.stack(list(per.values())).sum(0)
            self._batches.append((total, per))
        finally:
            self._clear_backward()

    # ------------------------------------------------------------------------------------------- results
    def norms(self) -> Tensor:
        """float32 ``[B]``: each example's gradient norm over every parameter, every backward since the last
        :meth:`reset` in order (empty before any); on the gradients' device, no host read."""
        if not self._batches:
            return torch.zeros(0)
        return torch.cat([total for total, _ in self._batches]).sqrt()

    def per_parameter(self) -> dict[str, Tensor]:
        """``{name: float32 [B]}``: each example's gradient norm for each parameter that received a gradient (0 for
        the examples of a backward it took no part in), in the model's order."""
        seen = {n for _, per in self._batches for n in per}
        out = {}
        for name in (n for n in self._order if n in seen):
            parts = [per[name] if name in per else torch.zeros_like(total) for total, per in self._batches]
            out[name] = torch.cat(parts).sqrt()
        return out

    def top(self, k: int) -> tuple[Tensor, Tensor]:
        """``(indices, norms)`` of the ``k`` largest per-example norms, largest first (a NaN first of all)."""
        norms = self.norms()
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= norms.shape[0]:
            raise ValueError(f"PerExampleNorms.top: k must be an int from 0 to the {norms.shape[0]} examples "
                             f"recorded, got {k!r}")
        values, indices = torch.topk(norms, k)
        return indices, values

    @property
    def num_examples(self) -> int:
        """Examples recorded since the last :meth:`reset` (from the shapes: no host read)."""
        return sum(int(total.shape[0]) for total, _ in self._batches)

    def reset(self) -> None:
        """Start a new optimizer step: forget the examples recorded so far."""
        self._batches = []

    def remove(self) -> None:
        """Remove every hook (results stay readable)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> PerExampleNorms:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
