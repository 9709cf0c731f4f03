"""Where a NaN starts: the hooks of :class:`ActivationWatch`, which feed the library's op (reads: ``_reads.py``,
report: ``_report.py``).

A forward pre-hook on each watched module reads its floating-point and complex inputs before it runs, a forward hook
its outputs and own parameters, each with at most ONE op call; with ``backward=True`` a pre-hook on the autograd
node that made each output keeps ``grad_output``, and an identity autograd node on its inputs
(:class:`~torch_gradstats.monitors.activations._reads.Boundary`) reads it with ``grad_input`` in one op call.
The op's small results stay on the device: nothing is read on the host until :meth:`ActivationWatch.report`, which
moves the latest recorded step in one transfer and names the module that *produced* the first non-finite value: in
execution order, the first whose output is non-finite while its inputs were finite (forward), the first whose
``grad_input`` is non-finite while its ``grad_output`` was finite (backward). The root is always read (its inputs
and outputs), under the name ``"<root>"``.
"""

from __future__ import annotations

import logging
import numbers
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from torch_gradstats.monitors.activations._modules import ModuleSelection, is_compiled, named_modules, selector, unwrap
from torch_gradstats.monitors.activations._reads import (
    Call,
    Reader,
    boundary,
    gather_call,
    inside_transform,
    needing_grad,
    on_gradient,
    rebuild,
    top_level,
    top_level_call,
)
from torch_gradstats.monitors.activations._report import (
    ROOT,
    ActivationReport,
    HookFigures,
    TensorFigures,
    build_report,
)
from torch_gradstats.ops._transfer import to_device, to_host
from torch_gradstats.ops.op import INF, NAN, SUPPORTED_DTYPES

__all__ = ["ActivationWatch"]

logger = logging.getLogger("torch_gradstats.activations")

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


def _recomputing() -> bool:
    """A forward run by the autograd engine during a backward: activation checkpointing recomputing a region. It is
    no new call: its figures were read in the original forward, and only its backward nodes are needed again."""
    return bool(torch._C._current_graph_task_id() != -1)


def _foreign(called: nn.Module, module: nn.Module) -> bool:
    """A hook called for another module than the one it was put on: a copy of the model (``copy.deepcopy``: an EMA
    or teacher model) carries the hooks, and its calls are not the watched model's steps. DataParallel's replicas
    (shallow copies made for each forward, marked ``_is_replica``) are the watched model's own."""
    return called is not module and not getattr(called, "_is_replica", False)


def _floating(t: Tensor) -> bool:
    return t.dtype in SUPPORTED_DTYPES or t.is_complex()


def _storage(t: Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


#: A recorded step's calls: (step, forward calls, backward calls, the inputs' call, forward order, backward order).
_Held = tuple[int, list[Call], list[Call], "Call | None", list[str], list[str]]


class _Pending:
    """The backward of one forward call of one module: the gradients of its outputs (tensor hooks, one call per
    output) wait for those of its inputs (its :class:`Boundary` node), which run after them."""

    __slots__ = ("grad_output", "has_inputs", "index", "inputs", "step", "watch")

    def __init__(self, watch: ActivationWatch, index: int, step: int) -> None:
        self.watch, self.index, self.step = watch, index, step
        self.has_inputs = False
        self.inputs: list[tuple[Tensor, int]] = []  # the aliases handed to the module, and their version then
        self.grad_output: list[Tensor] = []

    def on_grad_output(self, grad: Tensor) -> None:
        if self.has_inputs:
            self.grad_output.append(grad)
        else:
            self.watch._record_backward(self.index, self.step, [grad], [])

    def on_grad_input(self, grads: tuple[Tensor | None, ...]) -> None:
        found, self.grad_output = self.grad_output, []
        self.watch._record_backward(self.index, self.step, found, [g for g in grads if g is not None])


class ActivationWatch:
    """Watch the activations (and gradients of activations) of ``model`` to name the module where a NaN/Inf starts.

    Args:
        model: the model; DDP, DataParallel, FSDP1 and checkpoint wrappers are seen through (paths have no
            ``module.`` / ``_fsdp_wrapped_module.`` / ``_orig_mod.`` parts). Its own inputs and outputs are always
            read, under the name ``"<root>"``.
        modules: None (every leaf module and every module owning parameters directly), a module type or tuple of
            types, or a predicate ``(path, module) -> bool``. Paths are dot-separated, as in ``named_modules()``.
        every_n_steps: record the training steps 0, n, 2n, ... (a step is one call of the model's forward, or, when
            the model's own forward is not called, of the first watched module called from outside it: the first in
            training mode, and in eval mode the first called then; a training step is one in training mode with grad
            enabled), and the other steps (evaluation, generation) 0, n, 2n, ... of their own count; on the other
            steps a module's call costs one Python check.
        backward: also watch ``grad_output`` / ``grad_input`` of the selected modules.

    Use as a handle (``remove()``) or a context manager (entering a removed watch puts its hooks back). Hooks never
    read a value on the host; :meth:`report` does, once. Raises TypeError / ValueError for bad arguments,
    RuntimeError when run inside a torch.compile'd region.
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
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, (int, numbers.Integral)):
            raise TypeError(f"ActivationWatch: every_n_steps must be an int, got {type(every_n_steps).__name__}")
        if every_n_steps < 1:
            raise ValueError(f"ActivationWatch: every_n_steps must be >= 1, got {every_n_steps}")
        if not isinstance(backward, bool):
            raise TypeError(f"ActivationWatch: backward must be a bool, got {type(backward).__name__}")
        if is_compiled(model):
            raise ValueError(f"ActivationWatch: model is compiled. {_COMPILE_ERROR}")
        select = selector(modules)
        self.every_n_steps = int(every_n_steps)
        self.backward = backward
        self._root = unwrap(model)
        # Index 0 is the root, read always; its backward only when selected.
        self._names: list[str] = [ROOT]
        self._modules: list[nn.Module] = [self._root]
        self._with_backward: list[bool] = [False]
        selected = False
        for path, module in named_modules(self._root):
            if not select(path, module):
                continue
            selected = True
            if module is self._root:
                self._with_backward[0] = backward
            else:
                self._names.append(path)
                self._modules.append(module)
                self._with_backward.append(backward)
        if not selected:
            raise ValueError("ActivationWatch: modules selected no module of the model")
        self._step = -1  # the step now running (or last run)
        self._begun = [0, 0]  # steps begun so far: [evaluation forwards, training forwards]
        self._recorded_training = False  # whether the latest recorded step is a training step
        self._training_held: _Held | None = None  # the latest recorded training step's, once one of the others was
        self._recorded = -1  # the latest recorded step
        self._recording = False
        # When the root's forward is not called: the module whose call starts a step, one for the root's training mode
        # and one for its eval mode, so that an evaluation calling other modules first (a GAN's validation calling the
        # discriminator alone, in Lightning's sanity check before training) does not decide where training steps start
        self._leads: dict[bool, int] = {}
        self._in_root = 0  # root forwards now running
        self._reader = Reader()
        self._fwd: list[Call] = []  # the recorded step's forward calls, in the order they finished
        self._bwd: list[Call] = []
        self._inputs: Call | None = None  # the call whose inputs are the step's inputs (the root's, or the lead's)
        # (module index, thread) -> the calls whose forward runs (DataParallel runs replicas on several threads)
        self._open: dict[tuple[int, int], list[tuple[Call | None, _Pending | None, bool]]] = {}
        self._fwd_names: dict[str, None] = {}  # execution order over every recorded step
        self._bwd_names: dict[str, None] = {}
        self._permanent: list[RemovableHandle] = []
        self._toggled: list[RemovableHandle] = []
        self._active = False
        self._warned_late = False  # said once: a backward that came after another step began
        self._install()

    # ------------------------------------------------------------------------------------------ handle
    def _install(self) -> None:
        root = self._root
        self._permanent.append(root.register_forward_pre_hook(self._pre_hook(0), with_kwargs=True, prepend=True))
        self._permanent.append(root.register_forward_hook(self._post_hook(0), with_kwargs=True, always_call=True))
        for i, module in enumerate(self._modules[1:], 1):  # a call of any may start a step (see _pre_hook)
            self._permanent.append(module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        self._active = True

    def remove(self) -> None:
        """Take every hook away (idempotent). The last figures stay readable through :meth:`report`."""
        for h in self._permanent + self._toggled:
            h.remove()
        self._permanent, self._toggled = [], []
        self._active = self._recording = False
        self._in_root = 0
        self._open.clear()

    def __enter__(self) -> ActivationWatch:  # noqa: PYI034
        if not self._active:  # a removed watch entered again: hooks back, the step count goes on
            self._install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def step(self) -> int:
        """The number of steps seen so far, minus one (the current or last step); -1 before the first."""
        return self._step

    @property
    def module_names(self) -> list[str]:
        """The watched module paths, in model order, ``"<root>"`` first (the root's inputs and outputs are always
        read)."""
        return list(self._names)

    # ------------------------------------------------------------------------------------------ steps
    def _set_hooks(self, on: bool) -> None:
        if on and not self._toggled:
            for i, module in enumerate(self._modules[1:], 1):
                self._toggled.append(module.register_forward_hook(self._post_hook(i), with_kwargs=True,
                                                                  always_call=True))  # fmt: skip
        elif not on:
            for h in self._toggled:
                h.remove()
            self._toggled = []

    def _begin_step(self) -> None:
        self._step += 1
        # Training forwards (training mode, grad on) and the others (evaluation, generation) each on a cadence of
        # their own: forwards of the one kind never shift which forwards of the other are recorded.
        kind = int(self._root.training and torch.is_grad_enabled())
        recording = self._begun[kind] % self.every_n_steps == 0
        self._begun[kind] += 1
        if recording != self._recording or (recording and not self._toggled):
            self._set_hooks(recording)
        self._recording = recording
        if recording:
            if self._recorded_training and not kind:  # a callback reports the training step's figures: keep them
                self._training_held = self._hold()
            self._recorded_training = bool(kind)
            self._recorded = self._step
            self._fwd, self._bwd, self._inputs = [], [], None
            self._reader.seen.clear()
            self._open.clear()

    # ------------------------------------------------------------------------------------------ hooks
    def _pre_hook(self, i: int) -> Callable[..., Any]:
        module, with_backward = self._modules[i], self._with_backward[i]
        opened, reader = self._open, self._reader

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if _foreign(_m, module) or inside_transform():
                return None
            recompute = _recomputing()
            if i == 0:
                if torch.compiler.is_compiling() or _inside_compiled_call():
                    raise RuntimeError(_COMPILE_ERROR)
                if self._in_root == 0 and not recompute:
                    self._begin_step()
                self._in_root += 1
            elif self._in_root == 0 and not recompute and self._leads.setdefault(self._root.training, i) == i:
                # The root's forward is not running (a Lightning training_step calling self.net(x)): the step
                # starts with the first watched module called in the root's mode, each time it is called again.
                self._begin_step()
            if not self._recording:
                if i == 0:
                    opened.setdefault((0, threading.get_ident()), []).append((None, None, False))
                return None
            if torch.compiler.is_compiling():
                raise RuntimeError(_COMPILE_ERROR)
            call = None
            if not recompute:  # inputs read before the module runs: an in-place change is the module's own
                tensors = gather_call(args, kwargs)
                call = Call(i, self._step)
                if tensors:
                    call.refs = reader.read(tensors)
                call.groups = (len(tensors),)
                if self._inputs is None:
                    self._inputs = call
            pending = None
            if with_backward and torch.is_grad_enabled():
                wrap = needing_grad(top_level_call(args, kwargs))
                if wrap:
                    pending = _Pending(self, i, self._recorded)
                    pending.has_inputs = True
                    aliases = boundary(pending.on_grad_input, wrap)
                    pending.inputs = [(a, a._version) for a in aliases]
                    swap = {id(t): a for t, a in zip(wrap, aliases)}
                    args = rebuild(args, swap)
                    if kwargs:
                        kwargs = {k: swap.get(id(v), v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
            opened.setdefault((i, threading.get_ident()), []).append((call, pending, True))
            return (args, kwargs) if pending is not None else None

        return hook

    def _post_hook(self, i: int) -> Callable[..., Any]:
        module, name, with_backward = self._modules[i], self._names[i], self._with_backward[i]
        opened, reader, own_params = self._open, self._reader, module._parameters

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if _foreign(_m, module) or inside_transform():  # its pre-hook did nothing either
                return None
            if i == 0:
                self._in_root = max(0, self._in_root - 1)
            stack = opened.get((i, threading.get_ident()))
            if not stack:
                return None
            call, pending, active = stack.pop()
            if not active:
                return None
            if pending is not None:
                _check_inputs_kept(name, module, pending, output)
                # The aliases hold their autograd node, which holds this pending: let go, or that cycle keeps the
                # activations alive until Python's garbage collector runs (and makes it run more often).
                pending.inputs = []
            if with_backward and torch.is_grad_enabled():
                # A hook, not an autograd node: the output stays the module's own tensor. Placed before any in-place
                # change the caller makes (out += identity), it gets the gradient of the value read.
                outs = needing_grad(top_level(output))
                if outs:
                    if pending is None:
                        pending = _Pending(self, i, self._recorded)
                    for t in outs:
                        on_gradient(t, pending.on_grad_output)
            if call is not None and call.step == self._recorded:
                tensors = gather_call(output)
                # DTensor shards are left out of the parameters
                params = [p for p in own_params.values()
                          if p is not None and type(p) in (Tensor, nn.Parameter) and _floating(p)]  # fmt: skip
                if tensors or i == 0:
                    if params:
                        tensors += params
                    if tensors:
                        call.refs += reader.read(tensors)
                    call.groups = (call.groups[0], len(tensors) - len(params), len(params))
                    self._fwd.append(call)
                    self._fwd_names[name] = None
            return None

        return hook

    def _record_backward(self, i: int, step: int, grad_output: list[Tensor], grad_input: list[Tensor]) -> None:
        if step != self._recorded or not self._active:
            if self._active and not self._warned_late:
                self._warned_late = True
                logger.warning("ActivationWatch: the backward of step %d ran after step %d began (another forward "
                               "in between, e.g. an evaluation): its gradients are not in any report",
                               step, self._step)  # fmt: skip
            return
        go = [g for g in grad_output if _floating(g)]
        gi = [g for g in grad_input if _floating(g)]
        if not go and not gi:
            return
        call = Call(i, step)
        call.refs = self._reader.read(go + gi)
        call.groups = (len(go), len(gi))
        self._bwd.append(call)
        self._bwd_names[self._names[i]] = None

    # ------------------------------------------------------------------------------------------ report
    def report(self) -> ActivationReport:
        """The figures and origins of the latest recorded step, in one device-to-host transfer."""
        return self._report_of(self._hold())

    def _hold(self, training: bool = False) -> _Held:
        """The latest recorded step's figures as they stand, still on the device (no host read); with ``training``,
        the latest recorded training step's, where one was (a model trained in eval mode has none). A callback keeps
        the training step's so that forwards run after it (a sample generated at step end, an evaluation) do not
        replace them."""
        if training and not self._recorded_training and self._training_held is not None:
            return self._training_held
        return (self._recorded, list(self._fwd), list(self._bwd), self._inputs, list(self._fwd_names),
                list(self._bwd_names))

    def _report_of(self, held: _Held) -> ActivationReport:
        step, fwd, bwd, inputs_call, forward_order, backward_order = held
        calls = fwd + bwd + ([inputs_call] if inputs_call is not None else [])
        reads = list({id(r): r for c in calls for r, _ in c.refs}.values())
        if step < 0 or not reads:
            return build_report(None if step < 0 else step, [], [], None, forward_order, backward_order)
        devices = [r.sumsq.device for r in reads]
        home = next((d for d in devices if d.type != "cpu"), devices[0])
        if home.type == "meta":
            raise ValueError(
                "ActivationWatch.report: the recorded activations are meta tensors, which have shapes but no values; "
                "run the model on a real device (e.g. after model.to_empty(device=...)) to have figures to report"
            )
        floats = [to_device(t, home) for r in reads for t in (r.sumsq, r.amax)]
        fvals, ivals = to_host(floats, [to_device(r.counts, home) for r in reads])  # the one transfer
        own: dict[int, list[TensorFigures]] = {}  # id(read) -> the figures of its tensors
        fpos = ipos = 0
        for r in reads:
            n = r.sumsq.numel()
            sumsq, amax = fvals[fpos : fpos + n], fvals[fpos + n : fpos + 2 * n]
            counts = ivals[ipos : ipos + 3 * n]
            fpos, ipos = fpos + 2 * n, ipos + 3 * n
            own[id(r)] = [(sumsq[k], amax[k], counts[3 * k + NAN], counts[3 * k + INF]) for k in range(n)]

        def figures(c: Call) -> HookFigures:
            return self._names[c.index], c.groups, [own[id(r)][k] for r, k in c.refs]

        inputs = None
        if inputs_call is not None:
            inputs = [own[id(r)][k] for r, k in inputs_call.refs[: inputs_call.groups[0]]]
        return build_report(step, [figures(c) for c in fwd], [figures(c) for c in bwd], inputs,
                            forward_order, backward_order)  # fmt: skip


def _check_inputs_kept(name: str, module: nn.Module, pending: _Pending, output: Any) -> None:
    """A module that changed an input in place and returned another tensor leaves its caller holding that input
    under the autograd history it had before (the module saw an alias): refuse rather than change gradients."""
    changed = [alias for alias, version in pending.inputs if alias._version != version]
    if not changed:
        return
    outs = {_storage(t) for t in top_level(output)}
    for alias in changed:
        if _storage(alias) not in outs:
            raise RuntimeError(
                f"ActivationWatch: module {name} ({type(module).__name__}) changed its input in place and returned "
                "another tensor; with backward=True the caller's input would keep its old autograd history. Return "
                "the changed input (x = module(x)), or watch with backward=False"
            )
