"""The Hugging Face callback's policy statistics in the Trainer's own checkpoint folders.

The Trainer's checkpoints keep only JSON-able callback state (``TrainerState.stateful_callbacks``), and a
``SpikeGuard``'s or an ``AdaptiveClip``'s statistics are tensors. So the callback writes them next to the Trainer's
files, as ``gradstats.pt`` in ``<output_dir>/checkpoint-<step>`` (the folder the Trainer has just written when it
calls ``on_save``), and a run resumed at step ``n`` reads them back from ``<output_dir>/checkpoint-<n>``.

Kept apart from transformers.py, which reads, judges and logs each step: this is file layout, read once per save
and once per resumed run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

__all__ = ["STATE_FILE", "load_saved_state", "save_state"]

#: The file of the policies' statistics in a checkpoint folder.
STATE_FILE = "gradstats.pt"
logger = logging.getLogger("torch_gradstats")


def _folder(args: Any, step: int) -> str:
    """The Trainer's checkpoint folder of optimizer step ``step`` (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``
    is ``"checkpoint"``)."""
    return os.path.join(str(args.output_dir), f"checkpoint-{step}")


def save_state(args: Any, state: Any, policy_state: dict[str, Any]) -> None:
    """Write ``policy_state`` into the checkpoint folder of ``state.global_step``, on the process that writes the
    Trainer's files (``args.should_save``: every rank holds the same statistics, and several writers of one file
    would corrupt it). A folder that is not there (a hyperparameter search's run folders) is said at debug level."""
    if not getattr(args, "should_save", True):
        return
    folder = _folder(args, int(state.global_step))
    if not os.path.isdir(folder):
        logger.debug("torch_gradstats: no checkpoint folder %s; the policies' statistics are not saved", folder)
        return
    torch.save(policy_state, os.path.join(folder, STATE_FILE))


def load_saved_state(args: Any, state: Any) -> tuple[dict[str, Any] | None, str]:
    """What :func:`save_state` wrote for the step a resumed run starts at, with its path; None where there is no such
    file (a checkpoint from elsewhere, or saved before the policies were given). A file that ``torch.load`` cannot
    read (cut short, or another program's) is a ValueError naming it."""
    path = os.path.join(_folder(args, int(state.global_step)), STATE_FILE)
    if not os.path.isfile(path):
        return None, path
    try:
        return torch.load(path, map_location="cpu", weights_only=True), path
    except Exception as exc:  # an unpickling error, EOFError, RuntimeError: which one depends on the damage
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(
            f"GradStatsCallback: the policies' statistics of the resumed run cannot be read from {path} "
            f"({type(exc).__name__}: {first}); remove that file to let them start afresh"
        ) from exc
