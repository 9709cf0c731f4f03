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
ends with one callback that turns the micro-batch's figures into per-example squared norms (with reentrant
checkpointing, at the end of the outermost backward, so every segment's nested backward counts); results accumulate
over backwards until :meth:`PerExampleNorms.reset`. Nothing here reads a value on the host.

The norms are those of the loss each backward differentiates: a loss divided by the micro-batch count, or scaled by
a GradScaler, gives norms divided or multiplied alike (the Trainer and the callbacks undo both; docs/per_example.md).
"""

from __future__ import annotations

import logging
import numbers
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torch_gradstats.monitors._backward_end import requeue_if_nested
from torch_gradstats.monitors._per_example_math import (
    EXACT,
    Autocast,
    Contribution,
    Dense,
    Norms,
    autocast_state,
    exact_contributions,
    func_grads,
)
from torch_gradstats.monitors.activations._modules import is_compiled
from torch_gradstats.monitors.activations._reads import inside_transform, top_level
from torch_gradstats.ops._transfer import to_device

__all__ = ["PerExampleNorms"]

logger = logging.getLogger("torch_gradstats.per_example")

# ---------------------------------------------------------------------------------------------- PerExampleNorms
_USE_KEY = "torch_gradstats_per_example"  # in the metadata of the autograd node that made a hooked output


class _Use:
    """One hooked use of a module's parameters, kept in the metadata of the autograd node of its output. A forward
    with grad on whose graph is freed without a backward (an evaluation loss, never backpropagated) frees it before
    its gradient arrived: the use is then no longer awaited, so the next backward reduces each layer's figures as
    they arrive instead of keeping them all to its end."""

    __slots__ = ("arrived", "backwards", "names", "norms")

    def __init__(self, norms: PerExampleNorms, names: list[str]) -> None:
        self.norms, self.names, self.backwards, self.arrived = norms, names, norms._backwards, False

    def __del__(self) -> None:
        norms = self.norms
        if not self.arrived and norms._backwards == self.backwards:
            for name in self.names:
                norms._uses[name] -= 1


@dataclass
class _Layer:
    """A hooked module: how its contributions are made, and the parameters they are for."""

    module: nn.Module
    name: str
    exact: bool  # a closed form (EXACT), else torch.func
    params: list[tuple[str, str, nn.Parameter]]  # (name in the module, name in the model, parameter)


def _what(name: str, m: nn.Module) -> str:
    return f"module {name or '<root>'!r} ({type(m).__name__})"


class PerExampleNorms:
    """Each example's own gradient norm, from the backward the training runs anyway (see the module docstring).

    Args:
        model: the model; every module that owns parameters is hooked. A ``torch.compile``'d model is read as the
            module it wraps (its parameter names, without ``_orig_mod.``).
        loss_reduction: how each backward's loss is made from its examples' losses: ``"mean"`` or ``"sum"``. Both
            give the same norms: those of each example's own loss gradient (times any factor the loss was
            multiplied by, such as ``1 / micro-batches`` or a GradScaler's scale).
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
        while is_compiled(model):  # the module torch.compile wraps: its names, and no wrapper kept in our hooks
            model = model.get_submodule("_orig_mod")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"PerExampleNorms: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        for arg, value, low in (("batch_dim", batch_dim, 0), ("max_materialize", max_materialize, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, numbers.Integral)) or value < low:
                raise ValueError(f"PerExampleNorms: {arg} must be an int >= {low}, got {value!r}")
        self.loss_reduction = loss_reduction
        self.batch_dim = int(batch_dim)
        self.max_materialize = int(max_materialize)
        self._layers: dict[nn.Module, _Layer] = {}
        self._handles: list[Any] = []
        names = {id(p): n for n, p in model.named_parameters()}
        self._order = list(names.values())
        for mname, m in model.named_modules():  # every module refused before any is hooked: none left hooked
            if any(id(p) in names for p in m.parameters(recurse=False)):
                self._check(mname, m)
        whole: list[str] = []  # modules handled with all their submodules' parameters (MultiheadAttention)
        for mname, m in model.named_modules():
            if any(mname.startswith(w + ".") for w in whole):
                continue
            # only the model's own parameters: a view of a model (one optimizer's) may leave some of a module's out
            own = [(n, p) for n, p in m.named_parameters(recurse=isinstance(m, nn.MultiheadAttention))
                   if id(p) in names]
            if not own:
                if isinstance(m, nn.modules.batchnorm._BatchNorm):  # no parameter read, but it may mix the examples
                    self._handles.append(m.register_forward_pre_hook(self._check_mixing(mname)))
                continue
            if isinstance(m, nn.MultiheadAttention):
                whole.append(mname)
            params = [(local, names[id(p)], p) for local, p in own]
            self._layers[m] = _Layer(m, mname, isinstance(m, EXACT), params)
            self._handles.append(m.register_forward_hook(self._forward, with_kwargs=True))
        self._model = model
        self._arrival_handles: list[Any] = []
        self._arrival_key: tuple[int, ...] | None = None
        self._hook_arrivals()
        self._norms = Norms(max_materialize)
        self._batches: list[tuple[Tensor, dict[str, Tensor]]] = []  # per backward: (sum of squares, per parameter)
        self._replaying = False
        self._backwards = 0  # backwards ended: a _Use counted before the last one is no longer awaited
        self._clear_backward()

    def _check_mixing(self, name: str) -> Any:
        """A forward pre-hook for a BatchNorm with no parameter read: refused at a call whose input carries a
        gradient (a parameter before it: the examples' gradients mix there), not on raw inputs (its batch statistics
        are then constants of the examples, as a normalisation of the data is)."""

        def check(m: nn.Module, args: tuple[Any, ...]) -> None:
            if torch.is_grad_enabled() and args and isinstance(args[0], Tensor) and args[0].requires_grad:
                self._check(name, m)

        return check

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

    def _hook_arrivals(self) -> None:
        """A hook on each parameter that requires grad now: a gradient reaching one that no hooked call saw is
        refused by name. Made again when the trainable set changed (layers unfrozen or frozen during training),
        checked at the first hooked call of each backward's forward: a tuple of ids, no host sync."""
        trainable = [(n, p) for n, p in self._model.named_parameters() if p.requires_grad]
        key = tuple(id(p) for _, p in trainable)
        if key == self._arrival_key:
            return
        for h in self._arrival_handles:
            h.remove()
        self._arrival_handles = [p.register_hook(lambda _g, n=n: self._arrived(n)) for n, p in trainable]
        self._arrival_key = key

    def _clear_backward(self) -> None:
        self._backwards += 1
        self._arrivals_checked = False  # whether this backward's forward has checked the trainable set
        self._uses: dict[str, int] = defaultdict(int)  # calls hooked since the last backward, per parameter
        self._pending: dict[str, list[Contribution]] = defaultdict(list)
        self._sq: dict[str, Tensor] = {}
        self._arrivals: set[str] = set()
        self._batch: int | None = None
        self._queued = False
        self._norms.grams.clear()

    # ------------------------------------------------------------------------------------------- hooks
    def _forward(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._replaying or not torch.is_grad_enabled() or inside_transform():  # none of the step's forwards
            return
        if not self._arrivals_checked and self._handles:
            self._arrivals_checked = True
            self._hook_arrivals()
        layer = self._layers[m]
        self._check(layer.name, m)  # the module may have been put in training mode since
        live = [full for _, full, p in layer.params if p.requires_grad]
        outs = top_level(out)[:1] if layer.exact else top_level(out)
        amp: Autocast = ()
        if not layer.exact and args and isinstance(args[0], Tensor):  # a replay computes as this forward did
            amp = autocast_state(args[0].device.type)
        for i, o in enumerate(outs if live else []):
            if o.requires_grad:  # the gradient there, with this call's inputs, gives this use's contribution
                use = _Use(self, live)
                o.register_hook(lambda g, i=i, use=use: self._backward(layer, args, kwargs, i, g, amp, use))
                for full in live:
                    self._uses[full] += 1
                if o.grad_fn is not None:  # freed with the graph: unused, it was an evaluation's (see _Use)
                    meta: dict[str, Any] = o.grad_fn.metadata  # type: ignore[assignment]  # a dict (a property)
                    meta.setdefault(_USE_KEY, []).append(use)

    def _arrived(self, name: str) -> None:
        self._queue()
        self._arrivals.add(name)

    def _queue(self) -> None:
        if not self._queued:  # once per backward: the engine runs it when this backward ends
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _backward(self, layer: _Layer, args: tuple[Any, ...], kwargs: dict[str, Any], index: int, g: Tensor,
                  amp: Autocast = (), use: _Use | None = None) -> None:
        if use is not None:
            use.arrived = True
        self._queue()
        m, bd = layer.module, self.batch_dim
        if torch.is_grad_enabled():  # the engine runs a create_graph backward so: a gradient penalty's autograd.grad
            raise RuntimeError(
                f"PerExampleNorms: a backward with create_graph=True (torch.autograd.grad of a gradient penalty, a "
                f"double backward) went through {_what(layer.name, m)}; per-example norms of a loss made of "
                "gradients are not computed: keep per-example norms off for a model trained so"
            )
        if not args or not isinstance(args[0], Tensor):
            raise TypeError(f"PerExampleNorms: {_what(layer.name, m)} was called without a tensor as its first input")
        x = args[0]
        dim = 0 if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.GroupNorm)) else bd
        if x.dim() <= dim or (self._batch is not None and x.shape[dim] != self._batch):
            shared = x.dim() > dim and x.shape[dim] == 1
            raise RuntimeError(
                f"PerExampleNorms: {_what(layer.name, m)} got an input of shape {tuple(x.shape)}, without "
                f"{self._batch or 'any'} examples along its batch dimension {dim}, which this backward's other "
                "modules had" + (
                    ": one row shared by the batch has no per-example gradient (Hugging Face models make their "
                    "positions so without position_ids: pass position_ids of shape [B, T]; docs/per_example.md)"
                    if shared else "")
            )
        b = x.shape[dim]
        self._batch = b
        if g.dtype in (torch.float16, torch.bfloat16):  # exact sums of squares need more than 8-bit mantissas
            g = g.float()
            x = x.float() if x.is_floating_point() else x
        want = {local for local, _, p in layer.params if p.requires_grad}
        if layer.exact:
            made = exact_contributions(m, x, g, bd)
        else:
            params = {local: p for local, _, p in layer.params if local in want}
            self._replaying = True
            try:
                made = {k: Dense(v) for k, v in func_grads(m, params, args, kwargs, index, g, bd, b, amp).items()}
            except RuntimeError as exc:  # torch.func's own message names no module
                raise RuntimeError(
                    f"PerExampleNorms: torch.func cannot replay the forward of {_what(layer.name, m)} for each "
                    f"example ({str(exc).splitlines()[0]}); a module that checkpoints inside its own forward is one "
                    "such: checkpoint around it instead"
                ) from exc
            finally:
                self._replaying = False
        for local, full, p in layer.params:
            if local not in want or local not in made:
                continue
            # A reentrant checkpoint counts a use only when its segment is recomputed, in the backward: this one came
            # after the others were reduced, whose inputs are gone (keeping every layer's until the backward ends
            # would undo what checkpointing saves).
            if full in self._sq:
                raise RuntimeError(
                    f"PerExampleNorms: parameter {full!r} of {_what(layer.name, m)} is used again, in a reentrant "
                    "checkpoint recomputed after its other uses' per-example gradients were reduced, so the cross "
                    "terms between its uses are lost; checkpoint with use_reentrant=False (or call it once per "
                    "forward)"
                )
            pending = self._pending[full]
            pending.append(made[local])
            # every hooked use has arrived: reduce now and free the inputs. None counted: a graph backpropagated
            # again (retain_graph=True), whose uses the first backward took; its gradients are combined at the end.
            if 0 < self._uses[full] <= len(pending):
                key = x if isinstance(m, nn.Linear) and len(pending) == 1 else None
                self._sq[full] = (self._norms.square(pending[0], key) if len(pending) == 1
                                  else self._norms.combined(full, pending, p.numel()))
                del self._pending[full]
        self._norms.out_grams.clear()  # g g^T served this call's bias

    def _finish(self) -> None:
        """End of a backward: the micro-batch's per-example squared norms, scaled for the loss's reduction."""
        if requeue_if_nested(self._finish):  # a reentrant checkpoint's own backward ended, not the outer one
            return
        try:
            for full, pending in self._pending.items():
                numel = next(p.numel() for layer in self._layers.values() for _, n, p in layer.params if n == full)
                self._sq[full] = self._norms.combined(full, pending, numel)
            outside = sorted(self._arrivals - set(self._sq) - set(self._pending))
            if outside and self._batch is None:  # gradients, yet not one hooked call: the hooks were bypassed
                raise RuntimeError(
                    f"PerExampleNorms: parameter {outside[0]!r} received a gradient, but no hooked module's forward "
                    "ran in this step: either the parameters were used outside their modules' calls, or a "
                    "torch.compile'd forward compiled and run before PerExampleNorms was made replayed its graph "
                    "without the hooks (make PerExampleNorms before the first compiled call, or call "
                    "torch._dynamo.reset() after making it)"
                )
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
        """``(indices, norms)`` of the ``k`` largest per-example norms, largest first (a NaN first of all).

        Args:
            k: how many, an int from 0 to :attr:`num_examples` (else ``ValueError``).
        """
        norms = self.norms()
        if isinstance(k, bool) or not isinstance(k, (int, numbers.Integral)) or not 0 <= k <= norms.shape[0]:
            raise ValueError(f"PerExampleNorms.top: k must be an int from 0 to the {norms.shape[0]} examples "
                             f"recorded, got {k!r}")
        values, indices = torch.topk(norms, int(k))
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
        for h in self._handles + self._arrival_handles:
            h.remove()
        self._handles, self._arrival_handles = [], []
        self._arrival_key = None

    def __enter__(self) -> PerExampleNorms:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
