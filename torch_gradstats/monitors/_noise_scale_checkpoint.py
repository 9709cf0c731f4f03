"""NoiseScale's checkpoints and copies (:class:`Checkpoints`, a base of NoiseScale): ``state_dict`` /
``load_state_dict`` with the checks of a loaded state, ``copy.deepcopy`` and pickling. Split from noise_scale.py
(past 500 lines): a second job, saving and restoring the estimator, beside the estimator itself.
"""

import copy
import math
import numbers
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import fetch

__all__ = ["Checkpoints"]

_Self = TypeVar("_Self", bound="Checkpoints")


class Checkpoints:
    """The state of a :class:`~torch_gradstats.monitors.noise_scale.NoiseScale` saved, restored and copied. NoiseScale
    holds the attributes declared here; ``_state`` is one packed float64 tensor whose views ``_set_state`` makes."""

    ema: float
    steps: int
    _state: Tensor | None
    _grad_sq_ema: Tensor | None
    _trace_ema: Tensor | None
    _weight: Tensor | None
    _lock: threading.Lock
    _micro_batches: int
    _micro_sq: Tensor | None

    if TYPE_CHECKING:
        def _set_state(self, state: Tensor) -> None: ...

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The EMAs, their bias correction (``weight``), the step count and the decay (the bias correction needs
        the same decay on reload)."""
        return {
            "ema": self.ema,
            "steps": self.steps,
            "grad_sq_ema": None if self._grad_sq_ema is None else self._grad_sq_ema.clone(),  # 0-d copies
            "trace_sigma_ema": None if self._trace_ema is None else self._trace_ema.clone(),
            "weight": None if self._weight is None else self._weight.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the decay must be this instance's. A window of micro-batches in
        progress is dropped (after a rollback to the state, the window is read again from its start)."""
        if not isinstance(state, dict):
            raise TypeError(f"NoiseScale.load_state_dict: state must be a dict, got a {type(state).__name__}")
        missing = {"ema", "steps", "grad_sq_ema", "trace_sigma_ema"} - state.keys()
        if missing:
            raise ValueError(f"NoiseScale.load_state_dict: state lacks {sorted(missing)}")
        ema = state["ema"]
        if isinstance(ema, bool) or not isinstance(ema, numbers.Real):  # a str such as "0.9" is not a saved state
            raise TypeError(f"NoiseScale.load_state_dict: ema must be a float, got a {type(ema).__name__}")
        if float(ema) != self.ema:
            raise ValueError(
                f"NoiseScale.load_state_dict: the state was saved with ema={state['ema']}, this instance has "
                f"ema={self.ema} (the bias correction assumes one decay)"
            )
        steps, g, tr = state["steps"], state["grad_sq_ema"], state["trace_sigma_ema"]
        if isinstance(steps, bool) or not isinstance(steps, (int, numbers.Integral)) or steps < 0:  # numpy's too
            raise ValueError(f"NoiseScale.load_state_dict: steps must be an int >= 0, got {steps!r}")
        steps = int(steps)
        if (g is None) != (tr is None) or (g is None) != (steps == 0):
            raise ValueError("NoiseScale.load_state_dict: grad_sq_ema and trace_sigma_ema must be set iff steps > 0")
        for name, t in (("grad_sq_ema", g), ("trace_sigma_ema", tr)):
            if t is not None and (not isinstance(t, Tensor) or t.numel() != 1 or not t.dtype.is_floating_point
                                  or t.device.type == "meta"):
                raise ValueError(
                    f"NoiseScale.load_state_dict: {name} must be a one-element floating-point tensor with a value, "
                    f"got {t!r}"
                )
        weight = state.get("weight")  # absent from states saved before steps could be left out: every step counted
        if weight is not None and (not isinstance(weight, Tensor) or weight.numel() != 1
                                   or not weight.dtype.is_floating_point or weight.device.type == "meta"):
            raise ValueError(f"NoiseScale.load_state_dict: weight must be a one-element floating-point tensor with "
                             f"a value, got {weight!r}")
        # A NaN or inf EMA, or a weight outside [0, 1], would make every later estimate NaN or wrong.
        for name, t in (("grad_sq_ema (the EMA of |G|^2)", g), ("trace_sigma_ema (the EMA of tr(Sigma))", tr),
                        ("weight (the EMAs' bias correction)", weight)):
            if t is not None and not math.isfinite(float(fetch(t).reshape(()))):
                raise ValueError(f"NoiseScale.load_state_dict: {name} must be finite, got {float(fetch(t))}")
        # Past the bound by no more than the rounding of a state cast to a lower precision (float32, bfloat16).
        slack = max(1e-12, torch.finfo(weight.dtype).eps) if weight is not None else 0.0
        if weight is not None and not 0.0 <= float(fetch(weight)) <= 1.0 - self.ema**steps + slack:
            raise ValueError(
                f"NoiseScale.load_state_dict: weight (the EMAs' bias correction, 1 - ema**steps folded in) must be in "
                f"[0, {1.0 - self.ema**steps:.6g}] after {steps} steps, got {float(fetch(weight))}"
            )
        with self._lock:
            self.steps = steps
            # The accumulation window in progress is not part of a state: micro-batches read before a rollback to
            # this state would otherwise be counted in the next step with the ones read again after it (as
            # discard_window() drops them; here under the same lock as the new state).
            self._micro_batches, self._micro_sq = 0, None
            if g is None or tr is None:
                self._state = self._grad_sq_ema = self._trace_ema = self._weight = None
                return
            w = torch.full((), 1.0 - self.ema**steps, dtype=torch.float64) if weight is None else weight
            parts = [t.detach().reshape(1).to(device=g.device, dtype=torch.float64) for t in (g, tr, w)]
            self._set_state(torch.cat(parts))

    # ------------------------------------------------------------------------------------------- copies
    def __deepcopy__(self: _Self, memo: dict[int, Any]) -> _Self:  # noqa: PYI019 (typing.Self needs Python 3.11)
        """An independent NoiseScale with copies of the EMAs and of the window in progress, reading through the same
        ``scaler`` and ``process_group``: those are the training loop's own (a copied GradScaler would start with
        no scale, and the copy's readings of scaled gradients would no longer be unscaled)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = self.__getstate__()
        shared = {key: state.pop(key) for key in ("scaler", "process_group")}
        new.__setstate__({**copy.deepcopy(state, memo), **shared})
        return new

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the lock (which cannot be pickled) and the views of the state: pickling gives a NoiseScale
        with the same EMAs, window in progress and scaler (pickled with it: a GradScaler pickles only between
        iterations, with its scale kept as a number until its next ``scale()``)."""
        state = self.__dict__.copy()
        del state["_lock"]
        for view in ("_grad_sq_ema", "_trace_ema", "_weight"):  # views of _state: made again from the copy's
            del state[view]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        if self._state is None:
            self._grad_sq_ema = self._trace_ema = self._weight = None
        else:
            self._set_state(self._state)
