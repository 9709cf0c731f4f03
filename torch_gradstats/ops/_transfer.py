"""Values stay on the device until one transfer: the only module that moves statistics between devices.

Every layer above the op keeps its numbers on the device where they were computed and brings them to the host in
exactly one device-to-host transfer per report. This module owns that rule:

* :func:`pack` puts float64 values and int64 counts into ONE int64 buffer (a float64 travels as its bit pattern, so
  integer counts are never rounded through float64), and :func:`unpack` reads them back as Python numbers;
* :func:`fetch` is the one device-to-host transfer. On CUDA it is a non-blocking copy into pinned memory, then an
  event recorded on the current stream *of the buffer's device* (the stream the copy was enqueued on, whatever the
  current device is) and a wait on that event; elsewhere a plain copy;
* :func:`to_host` is the two together: values in, Python numbers out, one transfer;
* :func:`to_device` and :func:`host_int64` make the small copies the layers need *without* a host sync: CPU ->
  CUDA through pinned memory, device -> device ordered on the stream. They refuse to copy device -> host.
  :func:`repeated_int64` keeps the last few such tensors on the device, for values that repeat every step.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "PinnedBuffer",
    "fetch",
    "host_int64",
    "pack",
    "repeated_int64",
    "stream_device",
    "to_device",
    "to_host",
    "unpack",
]


# ---------------------------------------------------------------------------------------------- host -> device
def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Copy a small tensor to ``device`` without a host sync.

    CPU -> CUDA goes through pinned memory with ``non_blocking=True`` (a pageable copy would wait for the stream);
    device -> device copies are ordered on the stream. Never used for device -> CPU (that needs a sync: use
    :func:`fetch`).
    """
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    if device.type == "cpu":
        raise RuntimeError(
            f"torch_gradstats internal error: refusing a device-to-host copy from {t.device} outside fetch()"
        )
    return t.to(device, non_blocking=True)


def host_int64(values: Sequence[int], device: torch.device) -> Tensor:
    """Python ints (e.g. indices or element counts known from metadata) as an int64 tensor on ``device``, no sync.

    Made through an ``array`` (torch.tensor on a list converts element by element: 0.053 us each against 0.015 us
    through the array, 10,000 ints on a 2-core AMD EPYC, one thread; ``bench/bench_host_costs.py``).
    While compiling, the values are constants of the graph: torch.tensor traces, an array or pinned memory does not."""
    if torch.compiler.is_compiling():
        return torch.tensor(list(values), dtype=torch.int64, device=device)
    buf = array("q", values)
    if not buf:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return to_device(torch.frombuffer(buf, dtype=torch.int64), device)  # shares (and keeps alive) the array


#: (device, values) -> the device tensor last made of them; see :func:`repeated_int64`.
_REPEATED: OrderedDict[tuple[torch.device, tuple[int, ...]], Tensor] = OrderedDict()
_REPEATED_MAX = 32  # a distributed call keeps a few index lists per group
_REPEATED_LOCK = threading.RLock()  # reentrant: a gc callback may call grad_stats while a call holds it


def repeated_int64(values: Sequence[int], device: torch.device) -> Tensor:
    """:func:`host_int64` for values that come back call after call (a model's gradient sizes, every step).

    Off the CPU the last few such tensors stay on the device, so the steady state copies nothing: each copy needs a
    pinned buffer, and while the device runs behind the host the pinned buffers of earlier copies are still in
    flight, so every step would pin new memory. A kept tensor changed in place
    (``_version``) is made again. Kept tensors are made outside inference mode, so a call under
    ``torch.inference_mode()`` leaves them usable in and out of it. While compiling or capturing a CUDA graph it
    falls back to :func:`host_int64`.
    """
    if device.type == "cpu" or torch.compiler.is_compiling():
        return host_int64(values, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return host_int64(values, device)
    key = (device, tuple(values))
    with _REPEATED_LOCK:  # threads may train side by side (one model per GPU)
        kept = _REPEATED.get(key)
        if kept is not None and kept._version == 0:
            _REPEATED.move_to_end(key)
            return kept
        with torch.inference_mode(False):  # a kept inference tensor has no _version: every later call would fail
            made = host_int64(key[1], device)
        _REPEATED[key] = made
        _REPEATED.move_to_end(key)
        while len(_REPEATED) > _REPEATED_MAX:
            _REPEATED.popitem(last=False)
        return made


# ---------------------------------------------------------------------------------------------- packing
def pack(floats: Sequence[Tensor], ints: Sequence[Tensor]) -> Tensor:
    """Flatten tensors of one device into one int64 buffer: every float as float64 bits, then every int as int64."""
    parts = [t.reshape(-1).to(torch.float64).view(torch.int64) for t in floats]
    parts += [t.reshape(-1).to(torch.int64) for t in ints]
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(parts)


def unpack(host: Tensor, n_floats: int) -> tuple[list[float], list[int]]:
    """Python numbers from a host buffer made by :func:`pack`: the first ``n_floats`` values are floats."""
    values = host.numpy()  # already on the host: numpy reads the buffer without another trip through torch
    return values[:n_floats].view("float64").tolist(), values[n_floats:].tolist()


# ---------------------------------------------------------------------------------------------- device -> host
def stream_device(device: torch.device) -> torch.device:
    """The device whose current stream a device-to-host copy from ``device`` is ordered on: ``device`` itself.

    ``Tensor.copy_`` enqueues a copy from a CUDA tensor on the current stream of *that tensor's* device, so the event
    that says the copy is done must be recorded on the same stream: ``torch.cuda.current_stream(stream_device(d))``.
    ``torch.cuda.Event.record()`` without a stream would use the current device's stream instead, which for a
    buffer on another GPU is idle and returns at once, before the copy has landed.
    """
    if device.type != "cuda":
        raise ValueError(f"stream_device: {device} has no CUDA stream; only CUDA buffers are copied through one")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class PinnedBuffer:
    """A reusable pinned host buffer for repeated transfers (e.g. one per epoch), grown on demand."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    @property
    def tensor(self) -> Tensor | None:
        """The pinned storage, or None before the first CUDA transfer."""
        return self._buf

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A pinned host tensor of ``numel`` elements of ``dtype`` (a view of the reused storage)."""
        if self._buf is None or self._buf.dtype != dtype or self._buf.numel() < numel:
            self._buf = torch.empty(max(numel, 256), dtype=dtype, pin_memory=True)
        return self._buf[:numel]


def fetch(buf: Tensor, staging: PinnedBuffer | None = None) -> Tensor:
    """THE device-to-host transfer: ``buf`` as a CPU tensor, after the device has produced it (this waits).

    On CUDA: a non-blocking copy into pinned memory (``staging`` when given, so repeated calls reuse one buffer),
    then an event recorded on the current stream of ``buf``'s device and a wait for that event only (other streams
    and devices keep running). Elsewhere: ``buf.cpu()`` (a no-op for a CPU tensor). A result read through
    ``staging`` is a view of it, valid until the next transfer through the same staging buffer.
    """
    if buf.device.type != "cuda":
        return buf.cpu()
    host = (staging or PinnedBuffer()).take(buf.numel(), buf.dtype).view(buf.shape)
    device = stream_device(buf.device)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        host.copy_(buf, non_blocking=True)  # enqueued on `stream`
        event = torch.cuda.Event()
        event.record(stream)
    event.synchronize()
    return host


def to_host(
    floats: Sequence[Tensor], ints: Sequence[Tensor], staging: PinnedBuffer | None = None
) -> tuple[list[float], list[int]]:
    """Tensors of one device, flattened, as Python numbers in ONE device-to-host transfer (it waits for the device).

    Returns the values of ``floats`` (as float64) and of ``ints`` (as int64), each list in order.
    """
    host = fetch(pack(floats, ints), staging)
    return unpack(host, sum(t.numel() for t in floats))
