"""The fallback's per-thread reusable workspace: the buffers every batch of a call writes into.

:mod:`torch_gradstats.ops.fallback` takes a workspace at the start of a call (:func:`take_workspace`) and gives it back
at the end (:func:`give_back`); on the CPU a thread keeps one between its calls, which :func:`release_workspace`
frees. A module of its own: keeping buffers per thread is a job apart from computing the statistics.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["FALLBACK_CHUNK_ELEMS", "Workspace", "give_back", "release_workspace", "take_workspace"]

#: Elements in one batch of the fallback; bounds its extra memory (see
#: :func:`torch_gradstats.ops.fallback.fallback_multi_tensor_stats`).
FALLBACK_CHUNK_ELEMS = 1 << 18


class Workspace:
    """Buffers reused by every batch of a call. Fresh large allocations come back from the OS as untouched pages,
    and faulting them in costs more than the arithmetic: a batch writes into these instead. One byte buffer per
    role, of a fixed size (8 bytes per element of a chunk: every batch fits), all made at once when the workspace
    is made (so none is made in the middle of a call, above the call's other memory) and never replaced; viewed
    as whatever dtype the batch needs, so mixed dtypes share it. Buffers and views are made outside inference
    mode, so a workspace first used inside ``torch.inference_mode()`` can be written outside it. One call at a time
    uses a workspace (see :func:`take_workspace`), and the views it made are dropped when it ends."""

    _ROLES = ("rows", "bits", "tmp", "squares")
    _MAX_VIEWS = 256  # batch shapes vary with the last batch of each group: keep the cache small

    def __init__(self, device: torch.device, chunk: int) -> None:
        self.device = device
        self.chunk = chunk  # the largest chunk this workspace serves
        with torch.inference_mode(False):
            self.buffers = {role: torch.empty(8 * chunk, dtype=torch.uint8, device=device) for role in self._ROLES}
        self.views: dict[tuple[str, torch.dtype, tuple[int, int]], Tensor] = {}  # batches mostly repeat a shape
        self.row_lists: dict[str, tuple[Tensor, list[Tensor]]] = {}

    def get(self, role: str, dtype: torch.dtype, shape: tuple[int, int]) -> Tensor:
        view = self.views.get((role, dtype, shape))
        if view is not None:
            return view
        nbytes = shape[0] * shape[1] * dtype.itemsize
        with torch.inference_mode(False):
            if len(self.views) >= self._MAX_VIEWS:
                self.views.clear()
            view = self.views[role, dtype, shape] = self.buffers[role][:nbytes].view(dtype).view(shape)
        return view

    def rows(self, role: str, dtype: torch.dtype, shape: tuple[int, int]) -> list[Tensor]:
        """The rows of :meth:`get`'s view, as a list kept with it (selecting a row costs a torch call)."""
        view = self.get(role, dtype, shape)
        rows = self.row_lists.get(role)
        if rows is None or rows[0] is not view:
            with torch.inference_mode(False):
                rows = self.row_lists[role] = (view, list(view.unbind()))
        return rows[1]


#: The calling thread's kept CPU workspace, while no call of that thread is using it.
_thread_state = threading.local()


def take_workspace(device: torch.device, chunk: int) -> Workspace:
    """The workspace of one call, which no other call uses until :func:`give_back`.

    On the CPU a thread keeps one between its calls (``32 * FALLBACK_CHUNK_ELEMS`` bytes, 8 MiB;
    :func:`release_workspace` frees it): torch's CPU allocator does not cache, and faulting a fresh one in costs
    more than a batch's arithmetic. A call takes it away while it runs, so a call made during that one on the
    same thread (from a gc callback, a signal handler, a ``__del__``) finds none and makes its own; calls with
    another chunk always make their own, of their own size. Other devices' allocators cache blocks themselves, so
    a workspace there lives for one call."""
    if device.type != "cpu" or chunk != FALLBACK_CHUNK_ELEMS:
        return Workspace(device, chunk)
    ws = _thread_state.__dict__.pop("cpu_workspace", None)
    return ws if ws is not None else Workspace(device, chunk)


def give_back(ws: Workspace) -> None:
    """End a call's use of ``ws``: a CPU workspace of the default size is kept by the thread for its next call,
    without the call's views (made in the middle of the call, kept they would pin the memory below them)."""
    ws.views.clear()
    ws.row_lists.clear()
    if ws.device.type == "cpu" and ws.chunk == FALLBACK_CHUNK_ELEMS:
        _thread_state.cpu_workspace = ws


def release_workspace() -> None:
    """Free the calling thread's CPU workspace (the fallback makes a new one on its next call on the CPU)."""
    _thread_state.__dict__.pop("cpu_workspace", None)
