"""The device side of :class:`~torch_gradstats.ActivationWatch`: reading tensors with the library's op,
and the identity autograd node that hands a module's gradients to the watch (hooks: ``_watch.py``).

A read is one op call; its three small outputs stay on the device, unread, until the report. A tensor already read
in the step (one module's output is the next one's input) is not read again.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import to_device
from torch_gradstats.ops.op import SUPPORTED_DTYPES, multi_tensor_stats

__all__ = [
    "Boundary",
    "Call",
    "Read",
    "Reader",
    "boundary",
    "gather",
    "gather_call",
    "inside_transform",
    "needing_grad",
    "on_gradient",
    "rebuild",
    "top_level",
    "top_level_call",
]

_COMPLEX = (torch.complex32, torch.complex64, torch.complex128)


def inside_transform() -> bool:
    """Whether a torch.func transform (vmap, grad, vjp) is running: PerExampleNorms replaying a module for each
    example, or the caller's own functional code. A forward there is none of the step's: its tensors are wrappers
    without storage, and its backward is the transform's. The hooks of the monitors read nothing of it."""
    return torch._C._functorch.maybe_current_level() is not None


def _watched_dtype(t: Tensor) -> bool:
    return t.dtype in SUPPORTED_DTYPES or t.dtype in _COMPLEX


def gather(obj: Any, out: list[Tensor]) -> None:
    """Append every floating-point or complex tensor found in ``obj`` (nested tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, Tensor):
        if _watched_dtype(obj):
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            gather(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            gather(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            gather(getattr(obj, f.name), out)


def gather_call(args: Any, kwargs: dict[str, Any] | None = None) -> list[Tensor]:
    """:func:`gather` over a call's positional and keyword arguments (or a module's output), as a new list."""
    if type(args) is tuple and len(args) == 1 and not kwargs:  # the common call: one tensor
        args = args[0]
    if isinstance(args, Tensor) and not kwargs:
        return [args] if _watched_dtype(args) else []
    out: list[Tensor] = []
    gather(args, out)
    if kwargs:
        gather(kwargs, out)
    return out


class Read:
    """The op's outputs for the tensors of one read: sum of squares, max |x|, and (zero, NaN, Inf) counts."""

    __slots__ = ("amax", "counts", "sumsq")

    def __init__(self, tensors: list[Tensor]) -> None:
        self.sumsq, self.amax, self.counts = multi_tensor_stats(tensors)


#: Where one tensor's figures are: the read that holds them, and the index there.
Ref = tuple[Read, int]


class Call:
    """One hook call of a recorded step: a module's forward (inputs, outputs, own parameters) or backward
    (grad_output, grad_input): how many tensors of each kind, and where their figures are."""

    __slots__ = ("groups", "index", "refs", "step")

    def __init__(self, index: int, step: int) -> None:
        self.index, self.step = index, step
        self.groups: tuple[int, ...] = ()
        self.refs: list[Ref] = []


def _key(t: Tensor) -> tuple[Any, ...] | None:
    """Same elements (memory, dtype, and shape and strides unless contiguous: the figures do not depend on the
    order) at the same in-place version: the same figures. Inference tensors keep no version counter, and nested
    tensors no single memory, so they are never taken as already read."""
    if t.is_nested:
        return None
    try:
        version = t._version
    except RuntimeError:
        return None
    if t.is_contiguous():
        return (t.data_ptr(), t.dtype, version, t.numel())
    return (t.data_ptr(), t.dtype, version, t.shape, t.stride())


class Reader:
    """Reads tensors with ONE op call, skipping those already read in the step (``seen``, cleared per step)."""

    def __init__(self) -> None:
        # key -> (a weak reference proving the memory was not freed and reused since, the read, the index there)
        self.seen: dict[tuple[Any, ...], tuple[weakref.ref[Tensor], Ref]] = {}

    def read(self, tensors: Sequence[Tensor]) -> list[Ref]:
        seen = self.seen
        out: list[Any] = []  # Ref, or None where a fresh read goes
        fresh: list[tuple[int, Tensor, tuple[Any, ...] | None]] = []
        for t in tensors:
            key = _key(t)
            if key is not None:
                hit = seen.get(key)
                if hit is not None and hit[0]() is not None:
                    out.append(hit[1])
                    continue
            fresh.append((len(out), t, key))
            out.append(None)
        if fresh:
            read = Read(_prepare([t for _, t, _ in fresh]))
            for k, (pos, t, key) in enumerate(fresh):
                out[pos] = ref = (read, k)
                if key is not None:
                    seen[key] = (weakref.ref(t), ref)
        return out


def _prepare(tensors: list[Tensor]) -> list[Tensor]:
    """What the op reads: |z| for a complex tensor (max |z|, sum |z|^2, a NaN/Inf in either part is non-finite), a
    nested tensor's components, and every tensor on one device, the first non-CPU one (a copy to it is ordered
    before the op; never to the CPU, where a non-blocking copy could be read before it lands)."""
    device = tensors[0].device
    if all(t.device == device and not t.is_complex() and not t.is_nested for t in tensors):
        return tensors
    # A nested tensor (nn.TransformerEncoder's fast path over a padded batch, in evaluation) is read as its
    # components' elements, padding left out, in one flat copy.
    out = [_flat(t.detach()) if t.is_nested else t for t in tensors]
    out = [t.detach().abs() if t.is_complex() else t for t in out]  # the op itself is not differentiable
    home = next((t.device for t in out if t.device.type != "cpu"), device)
    return [t if t.device == home else to_device(t, home) for t in out]


def _flat(t: Tensor) -> Tensor:
    parts = [c.reshape(-1) for c in t.unbind()]
    return torch.cat(parts) if parts else t.new_zeros(0)


class Boundary(torch.autograd.Function):
    """Identity on tensors, whose backward hands their gradients to ``hook``: placed on a module's inputs, it gets the
    gradient that flows into them through the module alone (its grad_input), as full backward hooks do.

    Its outputs alias their inputs' memory (and in-place version counter) without being autograd views, so the
    module may change them in place (``ReLU(inplace=True)``, an in-place ``Dropout``); PyTorch's own
    ``BackwardHookFunction`` returns views, which a custom Function forbids to modify in place.
    """

    @staticmethod
    def forward(ctx: Any, hook: Callable[[tuple[Tensor | None, ...]], None], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return tuple([t.detach() for t in tensors])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        ctx.hook(grads)
        return (None, *grads)


# Function.apply's Python wrapper only matters under functorch transforms (and for tensors that outlived one): the
# C entry point it ends in skips a pytree walk of the arguments on each call.
_apply_unwrapped: Callable[..., tuple[Tensor, ...]] | None = getattr(
    torch._C._FunctionBase.__dict__.get("apply"), "__get__", lambda *_: None
)(None, Boundary)


def boundary(hook: Callable[[tuple[Tensor | None, ...]], None], tensors: list[Tensor]) -> tuple[Tensor, ...]:
    """``Boundary.apply(hook, *tensors)``."""
    if (
        _apply_unwrapped is None
        or torch._C._are_functorch_transforms_active()
        or any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)
    ):
        return Boundary.apply(hook, *tensors)
    return _apply_unwrapped(hook, *tensors)


def on_gradient(t: Tensor, hook: Callable[[Tensor], None]) -> None:
    """Call ``hook`` with the gradient of ``t``'s value now, even if ``t`` is changed in place later: a pre-hook on
    the autograd node that made it (a tensor hook for a leaf)."""
    node = t.grad_fn
    if node is None:
        t.register_hook(hook)
        return
    k = t.output_nr

    def prehook(grads: tuple[Tensor | None, ...]) -> None:
        g = grads[k]
        if g is not None:
            hook(g)

    node.register_prehook(prehook)


def rebuild(obj: Any, swap: dict[int, Tensor]) -> Any:
    """``obj`` with the tensors whose id is in ``swap`` replaced, for a tensor or a (named) tuple or list of them at
    the top level; anything else is returned as it is."""
    if isinstance(obj, Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, (tuple, list)):
        items = [swap.get(id(x), x) if isinstance(x, Tensor) else x for x in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def top_level(obj: Any) -> list[Tensor]:
    """The tensors that :func:`rebuild` can replace in ``obj``."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [x for x in obj if isinstance(x, Tensor)]
    return []


def top_level_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors that :func:`rebuild` can replace in a call's arguments (keyword values included)."""
    found = top_level(args)
    if kwargs:
        found += [v for v in kwargs.values() if isinstance(v, Tensor)]
    return found


def needing_grad(tensors: list[Tensor]) -> list[Tensor]:
    """The floating-point or complex tensors among ``tensors`` that require grad, each once."""
    found = [t for t in tensors if t.requires_grad and _watched_dtype(t)]
    if len(found) > 1:
        found = list({id(t): t for t in found}.values())
    return found
