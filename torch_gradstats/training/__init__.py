"""A training-loop helper that watches gradient health and syncs with the host once per epoch.

:class:`Trainer` runs the usual loop (forward, backward, optimizer step) and, every ``stats_every`` optimizer steps,
reads the gradients once with the fused op (:func:`torch_gradstats.grad_stats`). What it learns stays **on the
device** and is folded into running epoch aggregates: max and mean global norm, worst health, total NaN/Inf counts,
the first step and parameter that went non-finite, skipped steps, and (optionally) one small row per step for plots.
All of it reaches the host in **one** transfer per epoch (or per ``sync_every`` steps), through
:func:`torch_gradstats.ops._transfer.to_host`. Nothing in the loop calls ``.item()``.

What it gets right:

* stats cover the whole epoch, not only the last batch;
* under AMP the stats are taken after ``GradScaler.unscale_``, so the loss scale does not pollute them;
* under gradient accumulation they are taken once per optimizer step, and each micro-batch's loss is weighted by
  its share of the window's samples, so a short last batch (or a short last window) is weighted correctly;
* an empty batch is counted and skipped, with or without accumulation;
* the epoch loss is averaged per sample, not per batch; an empty data loader is an error, not a silent 0;
* ``global_step`` advances exactly when the optimizer steps (or a step is skipped), so it agrees with the
  optimizer's own step counts after any interrupt;
* the optional compiled step (``torch.compile``) is cached per model *architecture*, and a compile failure logs a
  warning and falls back to eager instead of being swallowed;
* the device argument is checked up front with a clear message.

Host syncs this package can cost, all documented on the option that causes them:

* one per epoch (``sync_every=None``) or one per ``sync_every`` optimizer steps plus one at the epoch end;
* ``skip_nonfinite=True`` with an optimizer that cannot skip on the device (anything but ``fused=True`` Adam, AdamW,
  SGD, Adagrad): one per optimizer step, to decide whether to call ``optimizer.step()``;
* a :class:`torch.amp.GradScaler` syncs inside ``scaler.step`` for non-fused optimizers (that is the scaler's own
  behaviour, not this package's);
* ``log_to=[...]``: one transfer per logging step (every ``log_every`` optimizer steps), for the report the sinks get.

Modules: ``_trainer`` (the loop), ``_step`` (how one optimizer step is taken, skipped and counted), ``_summary``
(device-side epoch aggregates and their host-side summaries), ``_compile`` (the compiled step and its cache),
``_device`` (device validation, moving batches, batch sizes), ``_args`` (checks of the scalar arguments).
"""

from torch_gradstats.training._compile import clear_compile_cache
from torch_gradstats.training._device import validate_device
from torch_gradstats.training._skip import step_or_skip
from torch_gradstats.training._summary import EpochSummary, StepRecord, format_epoch_table
from torch_gradstats.training._trainer import Trainer

__all__ = [
    "EpochSummary",
    "StepRecord",
    "Trainer",
    "clear_compile_cache",
    "format_epoch_table",
    "step_or_skip",
    "validate_device",
]
