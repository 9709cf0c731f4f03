"""Where a NaN starts: the hooks of :class:`ActivationWatch`, which feed the library's op (report: ``_report.py``).

Forward hooks (and full backward hooks) on the selected modules read each module's floating-point inputs, outputs
and own parameters (in the backward: ``grad_output`` and ``grad_input``) with ONE op call per hook and copy the
three small results into buffers kept on the device. Nothing is read on the host until :meth:`ActivationWatch.report`,
which moves every buffer of the latest recorded step in one transfer and names the module that *produced* the first
non-finite value: in execution order, the first whose output is non-finite while its inputs were finite (forward),
the first whose ``grad_input`` is non-finite while its ``grad_output`` was finite (backward).
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from torch_gradstats.monitors.activations._report import ActivationReport, HookFigures, TensorFigures, build_report
from torch_gradstats.ops._transfer import to_device, to_host
from torch_gradstats.ops.op import INF, NAN, SUPPORTED_DTYPES, multi_tensor_stats

__all__ = ["ActivationWatch"]

#: Which modules to watch: None (the default set), module types, or a predicate on (path, module).
ModuleSelection: TypeAlias = "type | tuple[type, ...] | Callable[[str, nn.Module], bool] | None"

#: A child attribute that a wrapper adds to every path below it (torch.compile, FSDP1, activation checkpointing).
_WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_FWD, _BWD, _ROOT = 0, 1, 2

_COMPILE_ERROR = (
    "ActivationWatch cannot run inside a torch.compile'd region: its hooks keep per-step state in Python. Watch the "
    "model outside the compiled region (compile its submodules, e.g. each block, not the watched model), or remove "
    "the watch (watch.remove()) before compiling."
)


def _inside_compiled_call() -> bool:
    """Whether a torch.compile'd function is on the Python stack (Dynamo runs a frame it could not trace, such as a
    hook that raised while traced, eagerly under its compiled entry point ``compile_wrapper``)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None:
        return False
    filename = dynamo.__file__
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename == filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _is_compiled(module: nn.Module) -> bool:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def _is_wrapper_child(parent: nn.Module, attr: str) -> bool:
    if attr in _WRAPPER_ATTRS:
        return True
    # DistributedDataParallel and DataParallel keep the user's model as `.module`.
    return attr == "module" and isinstance(parent, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / torch.compile / FSDP1 / checkpoint wrappers."""
    while True:
        children = dict(model.named_children())
        inner = next((c for a, c in children.items() if _is_wrapper_child(model, a)), None)
        if inner is None or len(children) != 1:
            return model
        model = inner


def _named_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` with every wrapper's own component left out of the paths (and wrappers skipped)."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if _is_compiled(module) and module is not root:
            yield path, module  # one graph: watched as a whole, from outside
            continue
        children = list(module.named_children())
        wrapper = any(_is_wrapper_child(module, a) for a, _ in children)
        if not wrapper:
            yield path, module
        for attr, child in reversed(children):
            if _is_wrapper_child(module, attr):
                stack.append((path, child))
            else:
                stack.append((f"{path}.{attr}" if path else attr, child))


def _default_selection(module: nn.Module) -> bool:
    """Every leaf module, and every module that owns parameters directly (not through its children)."""
    if _is_compiled(module):
        return True
    return next(module.children(), None) is None or next(module.parameters(recurse=False), None) is not None


def _gather(obj: Any, out: list[Tensor]) -> None:
    """Append every floating-point tensor the op accepts found in ``obj`` (nested tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, Tensor):
        if obj.dtype in SUPPORTED_DTYPES:
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _gather(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _gather(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _gather(getattr(obj, f.name), out)


#: A tensor's identity and contents version -> (a weak reference to it, the slot that read it, its index there).
_Seen = dict[tuple[Any, ...], tuple["weakref.ref[Tensor]", "_Slot", int]]


class _Slot:
    """The device buffers of one hook call of one step: per tensor read, sum of squares, max |x| and counts.

    A tensor already read in this step (one module's output is the next one's input; one module's grad_input the
    previous one's grad_output) is not read again: ``layout`` points at the slot that read it.
    """

    __slots__ = ("amax", "counts", "device", "groups", "index", "layout", "phase", "step", "sumsq")

    def __init__(self, phase: int, index: int) -> None:
        self.phase, self.index = phase, index
        self.groups: tuple[int, ...] = ()  # how many tensors of each kind, in list order
        self.layout: list[tuple[_Slot, int]] = []  # per tensor: the slot whose buffers hold it, and where
        self.step = -1  # the step these buffers describe
        self.device: torch.device | None = None
        self.sumsq = self.amax = self.counts = torch.empty(0)

    def write(self, tensors: list[Tensor], groups: tuple[int, ...], step: int, seen: _Seen) -> None:
        own: list[Tensor] = []
        layout: list[tuple[_Slot, int]] = []
        for t in tensors:
            # Same memory, shape, strides, dtype and in-place version: the same values. The weak reference proves
            # the memory was not freed and reused by another tensor since.
            key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t._version)
            hit = seen.get(key)
            if hit is not None and hit[0]() is not None:
                layout.append((hit[1], hit[2]))
                continue
            seen[key] = (weakref.ref(t), self, len(own))
            layout.append((self, len(own)))
            own.append(t)
        self.groups, self.layout, self.step = groups, layout, step
        if not own:
            return
        stats = multi_tensor_stats(own)
        n, device = len(own), own[0].device
        if self.sumsq.numel() != n or self.device != device:  # first use, or the module emitted other tensors
            self.sumsq = torch.empty(n, dtype=torch.float64, device=device)
            self.amax = torch.empty(n, dtype=torch.float64, device=device)
            self.counts = torch.empty(n, 3, dtype=torch.int64, device=device)
            self.device = device
        torch._foreach_copy_([self.sumsq, self.amax, self.counts], list(stats))


class ActivationWatch:
    """Watch the activations (and gradients of activations) of ``model`` to name the module where a NaN/Inf starts.

    Args:
        model: the model; DDP, DataParallel, FSDP1 and checkpoint wrappers are seen through (paths have no
            ``module.`` / ``_fsdp_wrapped_module.`` / ``_orig_mod.`` parts).
        modules: None (every leaf module and every module owning parameters directly), a module type or tuple of
            types, or a predicate ``(path, module) -> bool``. Paths are dot-separated, as in ``named_modules()``.
        every_n_steps: record steps 0, n, 2n, ... (a step is one call of the model's forward); on the other steps
            the hooks are off and a step costs one Python check.
        backward: also watch ``grad_output`` / ``grad_input`` with full backward hooks.

    Use as a handle (``remove()``) or a context manager. Hooks never read a value on the host; :meth:`report` does,
    once. Raises TypeError / ValueError for bad arguments, RuntimeError when run inside a torch.compile'd region.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        modules: ModuleSelection = None,
        every_n_steps: int = 1,
        backward: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ActivationWatch: model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise TypeError(f"ActivationWatch: every_n_steps must be an int, got {type(every_n_steps).__name__}")
        if every_n_steps < 1:
            raise ValueError(f"ActivationWatch: every_n_steps must be >= 1, got {every_n_steps}")
        if not isinstance(backward, bool):
            raise TypeError(f"ActivationWatch: backward must be a bool, got {type(backward).__name__}")
        if _is_compiled(model):
            raise ValueError(f"ActivationWatch: model is compiled. {_COMPILE_ERROR}")
        select = _selector(modules)
        self.every_n_steps = every_n_steps
        self.backward = backward
        self._root = _unwrap(model)
        self._names: list[str] = []
        self._modules: list[nn.Module] = []
        for path, module in _named_modules(self._root):
            if select(path, module):
                self._names.append(path)
                self._modules.append(module)
        if not self._modules:
            raise ValueError("ActivationWatch: modules selected no module of the model")
        if backward:
            for path, module in _named_modules(self._root):
                if getattr(module, "inplace", False) is True:
                    # PyTorch's full backward hooks wrap outputs in a view that an in-place op may not modify.
                    raise ValueError(
                        f"ActivationWatch: module {path or '<root>'} ({type(module).__name__}) works in place, which "
                        "full backward hooks do not allow; set its inplace=False, or watch with backward=False"
                    )
        self._step = -1  # the step now running (or last run)
        self._recorded = -1  # the latest recorded step
        self._recording = False
        self._calls: list[int] = [0] * len(self._modules)
        self._bwd_calls: list[int] = [0] * len(self._modules)
        self._slots: dict[tuple[int, int, int], _Slot] = {}
        self._fwd_order: list[_Slot] = []  # in the order the slots were first written: execution order
        self._bwd_order: list[_Slot] = []
        self._root_slot = _Slot(_ROOT, -1)
        self._seen: _Seen = {}  # the tensors read in the recorded step
        self._root_has_inputs = False
        self._permanent: list[RemovableHandle] = []
        self._toggled: list[RemovableHandle] = []
        self._active = True
        self._permanent.append(self._root.register_forward_pre_hook(self._on_step, with_kwargs=True, prepend=True))
        # The root's own hooks (if selected) are captured by its call before its pre-hooks run: keep them on.
        for i, module in enumerate(self._modules):
            if module is self._root:
                self._permanent.extend(self._hooks_of(i))

    # ------------------------------------------------------------------------------------------ handle
    def remove(self) -> None:
        """Take every hook away (idempotent). The last figures stay readable through :meth:`report`."""
        for h in self._permanent + self._toggled:
            h.remove()
        self._permanent, self._toggled = [], []
        self._active = False

    def __enter__(self) -> ActivationWatch:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def step(self) -> int:
        """The number of forward calls seen so far, minus one (the current or last step); -1 before the first."""
        return self._step

    @property
    def module_names(self) -> list[str]:
        """The watched module paths, in model order."""
        return list(self._names)

    # ------------------------------------------------------------------------------------------ hooks
    def _hooks_of(self, i: int) -> list[RemovableHandle]:
        module = self._modules[i]
        handles = [module.register_forward_hook(self._forward_hook(i), with_kwargs=True)]
        if self.backward:
            handles.append(module.register_full_backward_hook(self._backward_hook(i)))
        return handles

    def _set_hooks(self, on: bool) -> None:
        if on and not self._toggled:
            for i, module in enumerate(self._modules):
                if module is not self._root:
                    self._toggled.extend(self._hooks_of(i))
        elif not on:
            for h in self._toggled:
                h.remove()
            self._toggled = []

    def _on_step(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() or _inside_compiled_call():
            raise RuntimeError(_COMPILE_ERROR)
        self._step += 1
        recording = self._step % self.every_n_steps == 0
        if recording != self._recording or (recording and not self._toggled):
            self._set_hooks(recording)
        self._recording = recording
        if not recording:
            return
        self._recorded = self._step
        self._calls = [0] * len(self._modules)
        self._bwd_calls = [0] * len(self._modules)
        self._seen.clear()
        tensors: list[Tensor] = []
        _gather(args, tensors)
        _gather(kwargs, tensors)
        self._root_has_inputs = bool(tensors)
        if tensors:
            self._root_slot.write(tensors, (len(tensors),), self._step, self._seen)

    def _slot(self, phase: int, i: int, calls: list[int]) -> _Slot:
        key = (phase, i, calls[i])
        calls[i] += 1
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(phase, i)
            (self._fwd_order if phase == _FWD else self._bwd_order).append(slot)
        return slot

    def _forward_hook(self, i: int) -> Callable[..., None]:
        module = self._modules[i]

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self._recording:
                return
            if torch.compiler.is_compiling():
                raise RuntimeError(_COMPILE_ERROR)
            tensors: list[Tensor] = []
            _gather(args, tensors)
            _gather(kwargs, tensors)
            n_in = len(tensors)
            _gather(output, tensors)
            n_out = len(tensors) - n_in
            for p in module.parameters(recurse=False):
                if p.dtype in SUPPORTED_DTYPES and type(p) in (Tensor, nn.Parameter):  # DTensor shards are skipped
                    tensors.append(p)
            if n_out == 0:
                return  # no floating output: nothing to watch
            device = tensors[n_in].device
            if any(t.device != device for t in tensors):
                tensors = [t if t.device == device else t.detach().to(device, non_blocking=True) for t in tensors]
            groups = (n_in, n_out, len(tensors) - n_in - n_out)
            self._slot(_FWD, i, self._calls).write(tensors, groups, self._step, self._seen)

        return hook

    def _backward_hook(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, grad_input: tuple[Tensor | None, ...], grad_output: tuple[Tensor | None, ...]) -> None:
            if not self._recording:
                return
            tensors: list[Tensor] = []
            _gather(grad_output, tensors)
            n_out = len(tensors)
            _gather(grad_input, tensors)
            if not tensors:
                return
            device = tensors[0].device
            if any(t.device != device for t in tensors):
                tensors = [t if t.device == device else t.to(device, non_blocking=True) for t in tensors]
            groups = (n_out, len(tensors) - n_out)
            self._slot(_BWD, i, self._bwd_calls).write(tensors, groups, self._recorded, self._seen)

        return hook

    # ------------------------------------------------------------------------------------------ report
    def report(self) -> ActivationReport:
        """The figures and origins of the latest recorded step, in one device-to-host transfer."""
        step = self._recorded
        fwd = [s for s in self._fwd_order if s.step == step]
        bwd = [s for s in self._bwd_order if s.step == step]
        slots = fwd + bwd
        root = self._root_has_inputs and self._root_slot.step == step and step >= 0
        if root:
            slots.append(self._root_slot)
        names = self._names
        forward_order = list(dict.fromkeys(names[s.index] for s in self._fwd_order))
        backward_order = list(dict.fromkeys(names[s.index] for s in self._bwd_order))
        if not slots:
            return build_report(None if step < 0 else step, [], [], None, forward_order, backward_order)
        read = [s for s in slots if s.device is not None]  # a slot may only point at tensors others read
        devices = [s.device for s in read if s.device is not None]
        home = next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))
        if home.type == "meta":
            raise ValueError(
                "ActivationWatch.report: the recorded activations are meta tensors, which have shapes but no values; "
                "run the model on a real device (e.g. after model.to_empty(device=...)) to have figures to report"
            )
        floats = [to_device(t, home) for s in read for t in (s.sumsq, s.amax)]
        ints = [to_device(s.counts, home) for s in read]
        fvals, ivals = to_host(floats, ints)  # the one transfer
        own: dict[int, list[TensorFigures]] = {}  # id(slot) -> the figures of the tensors it read itself
        fpos = ipos = 0
        for s in read:
            n = s.sumsq.numel()
            sumsq, amax = fvals[fpos : fpos + n], fvals[fpos + n : fpos + 2 * n]
            counts = ivals[ipos : ipos + 3 * n]
            fpos, ipos = fpos + 2 * n, ipos + 3 * n
            own[id(s)] = [(sumsq[k], amax[k], counts[3 * k + NAN], counts[3 * k + INF]) for k in range(n)]
        per_slot = [[own[id(ref)][k] for ref, k in s.layout] for s in slots]
        forward: list[HookFigures] = [(names[s.index], s.groups, v) for s, v in zip(fwd, per_slot)]
        backward: list[HookFigures] = [(names[s.index], s.groups, v) for s, v in zip(bwd, per_slot[len(fwd) :])]
        inputs = per_slot[-1] if root else None
        return build_report(step, forward, backward, inputs, forward_order, backward_order)


def _selector(modules: ModuleSelection) -> Callable[[str, nn.Module], bool]:
    if modules is None:
        return lambda _path, module: _default_selection(module)
    if isinstance(modules, type):
        modules = (modules,)
    if isinstance(modules, tuple):
        if not modules or not all(isinstance(t, type) for t in modules):
            raise TypeError(
                "ActivationWatch: modules must be None, a module type, a non-empty tuple of types or a "
                f"callable (path, module) -> bool, got {modules!r}"
            )
        types = modules
        return lambda _path, module: isinstance(module, types)
    if callable(modules):
        predicate = modules
        return lambda path, module: bool(predicate(path, module))
    raise TypeError(
        "ActivationWatch: modules must be None, a module type, a tuple of types or a callable "
        f"(path, module) -> bool, got {type(modules).__name__}"
    )
