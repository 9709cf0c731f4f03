"""The Hugging Face callback's policy statistics in the Trainer's own checkpoint folders.

The Trainer's checkpoints keep only JSON-able callback state (``TrainerState.stateful_callbacks``), and a
``SpikeGuard``'s or an ``AdaptiveClip``'s statistics are tensors. So the callback writes them next to the Trainer's
files, as ``gradstats.pt`` in ``<output_dir>/checkpoint-<step>`` (the folder the Trainer has just written when it
calls ``on_save``), and a run resumed at step ``n`` reads them back from ``<output_dir>/checkpoint-<n>``.

Kept apart from transformers.py, which reads, judges and logs each step: this runs once per save and once per
resumed run, and says what a resumed run does not restore.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["STATE_FILE", "load_saved_state", "restore_saved_state", "save_state"]

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


def restore_saved_state(callback: Any, args: Any, state: Any, policies: list[str]) -> None:
    """A run resumed at ``state.global_step`` with nothing loaded into ``callback``: load what :func:`save_state`
    wrote there into it (its ``load_state_dict``; an error names the file), and say in a warning what is not as
    before: no file (``policies`` start afresh), a policy the file holds nothing of, or saved settings that replace
    the callback's own."""
    saved, path = load_saved_state(args, state)
    step = state.global_step
    if saved is None:
        logger.warning("torch_gradstats: GradStatsCallback resumed at step %d: there is no %s, so %s statistics "
                       "start afresh (restore them with load_state_dict from the checkpoint's %s)", step, path,
                       " and ".join(f"the {n}'s" for n in policies), STATE_FILE)
        return
    changed = _changed_settings(callback, saved)
    try:
        callback.load_state_dict(saved)
    except (TypeError, ValueError) as exc:  # not a callback's state, or a policy's that does not load
        raise type(exc)(f"{exc} (read from {path})") from exc
    logger.info("torch_gradstats: GradStatsCallback resumed at step %d with the statistics of %s", step, path)
    for name, diffs in changed.items():
        logger.warning("torch_gradstats: GradStatsCallback resumed at step %d: the %s decides with the settings saved "
                       "in %s (%s), as the run that saved them did; remove that file to run with this callback's (its "
                       "statistics then start afresh)", step, name, path,
                       ", ".join(f"{k}={v!r}, not {mine!r}" for k, (v, mine) in diffs.items()))
    missing = [n for n in policies if n not in saved]
    if missing:  # saved by a callback without that policy
        logger.warning("torch_gradstats: GradStatsCallback resumed at step %d: %s holds no statistics of the %s, which "
                       "start afresh (warm-up included)", step, path, " and ".join(missing))


def _changed_settings(callback: Any, saved: Any) -> dict[str, dict[str, tuple[Any, Any]]]:
    """Per policy of ``callback`` that ``saved`` (its state_dict) restores: the settings (a policy state's entries
    that are no tensors) whose saved value differs from the policy's own, as ``{setting: (saved, own)}``."""
    out: dict[str, dict[str, tuple[Any, Any]]] = {}
    if not isinstance(saved, dict):
        return out  # refused by load_state_dict
    for name in ("spike_guard", "adaptive_clip"):
        policy, theirs = getattr(callback, name), saved.get(name)
        if policy is None or not isinstance(theirs, dict):
            continue
        mine = policy.state_dict()
        diffs = {k: (v, mine[k]) for k, v in theirs.items()
                 if k in mine and not isinstance(v, Tensor) and not isinstance(mine[k], Tensor) and v != mine[k]}
        if diffs:
            out[name] = diffs
    return out
