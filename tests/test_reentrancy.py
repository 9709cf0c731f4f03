"""Calls made while another call is running on the same thread (a gc callback) above the op: the shared state of
grad_stats's path must neither deadlock nor mix the two calls' values. The fallback's own cases are in
test_fallback.py."""

from __future__ import annotations

import subprocess
import sys

_CHILD = r"""
import gc, sys, torch
from torch_gradstats.ops import _transfer

meta = torch.device("meta")  # any device but the CPU takes the kept-tensor path (and its lock)
inner = []

def inside_repeated_int64():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _transfer.repeated_int64.__code__:
            return True
        frame = frame.f_back
    return False

def hook(phase, info):
    if phase == "start" and len(inner) < 5 and inside_repeated_int64():
        inner.append(_transfer.repeated_int64([len(inner), 7], meta))

gc.callbacks.append(hook)
gc.set_threshold(1)
outer = [_transfer.repeated_int64(list(range(i, i + 100)), meta) for i in range(40)]
gc.set_threshold(700)
assert all(t.shape == (100,) for t in outer) and all(t.shape == (2,) for t in inner)
print(len(inner))
"""


def test_repeated_int64_called_from_a_gc_callback_while_it_holds_its_lock():
    """repeated_int64 keeps device tensors under a lock (threads may train side by side); a gc callback that runs
    grad_stats inside it on the same thread took the same lock again and hung for good with a plain Lock."""
    try:
        child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        raise AssertionError("repeated_int64 deadlocked when called again from a gc callback") from None
    assert child.returncode == 0, child.stderr[-3000:]
    assert int(child.stdout) >= 1, "the callback never ran inside repeated_int64"
