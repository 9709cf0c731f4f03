"""The end of the outermost backward. A reentrant ``torch.utils.checkpoint`` segment recomputes its forward and runs
a backward pass of its own, nested inside a node of the outer one; a callback queued on the autograd engine during
that nested pass runs when it ends, while the outer pass still has gradients to make."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["requeue_if_nested"]


def requeue_if_nested(callback: Callable[[], None]) -> bool:
    """Called from an engine callback: if it ran at the end of a nested backward (an outer node is current), queue
    ``callback`` again in the outer backward, once that node is done, and return True (nested again, the same
    happens one level up); False at the end of the outermost backward."""
    node = torch._C._current_autograd_node()
    if node is None:
        return False
    handle: Any = None

    def queue(grad_inputs: Any, grad_outputs: Any) -> None:
        handle.remove()
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    handle = node.register_hook(queue)
    return True
