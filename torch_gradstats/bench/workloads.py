"""What is measured: lists of tensor shapes and dtypes (points), their sizes per device, and their random inputs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: Workload names as ``--workloads`` takes them.
WORKLOADS = ("gpt2", "small_many", "count", "big4", "sweep")
#: Dtype names as ``--dtypes`` takes them (they apply to the large lists, gpt2 and big4); "mixed" alternates
#: float32 and bfloat16 tensor by tensor.
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64, "mixed": None}
#: Workloads whose points carry the large-list goals.
LARGE_WORKLOADS = ("gpt2", "big4")
SWEEP_TENSORS = 64  # tensors per sweep point
SMALL_NUMEL = 1024  # elements per tensor of small_many and count


def gpt2_shapes(d_model: int = 1024, n_layer: int = 24, vocab: int = 50257, n_ctx: int = 1024) -> list[tuple]:
    """Parameter shapes of a GPT-2-style model (d_model=1024, 24 layers: GPT-2 medium, 355M parameters)."""
    d = d_model
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (n_ctx, d)] + block * n_layer + [(d,), (d,)]


def gpt2_scaled(target_bytes: int, elem_size: int = 4) -> list[tuple]:
    """GPT-2-medium's layer structure (24 layers, full vocabulary) with the width whose float32 size is closest."""
    best = min(range(64, 1025, 64), key=lambda d: abs(sum(map(math.prod, gpt2_shapes(d))) * elem_size - target_bytes))
    return gpt2_shapes(best)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: int) -> str:
    return f"{n >> 20}M" if n % MiB == 0 else (f"{n >> 10}K" if n % KiB == 0 else str(n))


@dataclasses.dataclass
class Point:
    """One measured configuration: a list of shapes with a dtype per tensor."""

    workload: str
    label: str
    shapes: list[tuple]
    dtypes: list[torch.dtype]

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(s) * dt.itemsize for s, dt in zip(self.shapes, self.dtypes))

    @property
    def dtype_label(self) -> str:
        return "+".join(sorted({str(dt).replace("torch.", "") for dt in self.dtypes}))


@dataclasses.dataclass
class Sizes:
    """Workload sizes for one device and mode."""

    gpt2: list[tuple]
    big4_numel: int
    many_count: int
    sweep_bytes: list[int]
    counts: list[int]


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    """GPU: the real sizes (GPT-2 medium, 4 x 256M); CPU: the same structure scaled to ~128 MiB; quick: tiny."""
    counts = [1, 8, 64, 512, 2048, 10_000]
    if quick:
        return Sizes(gpt2_shapes(64, n_layer=2, vocab=1000, n_ctx=128), 64 * KiB, 300,
                     [64 * KiB, 1 * MiB], [1, 128])  # fmt: skip
    if device.type == "cuda":
        return Sizes(gpt2_shapes(1024), 256 * MiB, 10_000, _doubling(64 * KiB, 4 * GiB), counts)
    return Sizes(gpt2_scaled(128 * MiB), 8 * MiB, 10_000, _doubling(64 * KiB, 256 * MiB), counts)


def _doubling(start: int, end: int) -> list[int]:
    out = [start]
    while out[-1] * 2 <= end:
        out.append(out[-1] * 2)
    return out


def _dtypes_of(name: str, n: int) -> list[torch.dtype]:
    dt = DTYPES[name]
    if dt is None:  # mixed
        return [torch.float32 if i % 2 == 0 else torch.bfloat16 for i in range(n)]
    return [dt] * n


def build_points(workloads: Sequence[str], dtypes: Sequence[str], sizes: Sizes) -> list[Point]:
    """The points to run, goal-bearing ones first: gpt2 f32, 10,000 x 1,024, the count series (host-time fit),
    then the other gpt2 dtypes, big4 and the sweep (dropped first when a time budget runs out)."""
    f32 = torch.float32
    first = [d for d in dtypes if d == "f32"]
    rest = [d for d in dtypes if d != "f32"]
    big4 = [(sizes.big4_numel,)] * 4
    big4_label = f"4x{_fmt_count(sizes.big4_numel)}"
    points: list[Point] = []
    plan = [("gpt2", first), ("small_many", None), ("count", None), ("gpt2", rest), ("big4", first + rest),
            ("sweep", None)]  # fmt: skip
    for name, dts in plan:
        if name not in workloads:
            continue
        if name == "gpt2":
            points += [Point(name, "gpt2", sizes.gpt2, _dtypes_of(d, len(sizes.gpt2))) for d in dts or []]
        elif name == "big4":
            points += [Point(name, big4_label, big4, _dtypes_of(d, 4)) for d in dts or []]
        elif name == "small_many":
            n = sizes.many_count
            points.append(Point(name, f"{n}x{SMALL_NUMEL}", [(SMALL_NUMEL,)] * n, [f32] * n))
        elif name == "count":
            points += [Point(name, f"{n}x{SMALL_NUMEL}", [(SMALL_NUMEL,)] * n, [f32] * n) for n in sizes.counts]
        elif name == "sweep":
            for total in sizes.sweep_bytes:
                per = max(1, total // (4 * SWEEP_TENSORS))
                points.append(Point(name, fmt_bytes(total), [(per,)] * SWEEP_TENSORS, [f32] * SWEEP_TENSORS))
    return points


def last_level_cache_bytes(device: torch.device) -> int:
    """The L2 of a GPU; the largest CPU cache sysfs lists (32 MiB when unknown)."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * MiB))
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 * MiB


class GradsAsModule:
    """Just enough of an ``nn.Module`` for code that walks ``named_parameters()`` and reads each ``.grad``."""

    def __init__(self, params: list[tuple[str, Tensor]]) -> None:
        self._params = params

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self._params)

    def parameters(self) -> Iterator[Tensor]:
        return (p for _, p in self._params)


@dataclasses.dataclass
class Sample:
    """One rotation copy of a point's inputs.

    ``tensors`` are the inputs; ``flat`` a float32 buffer of the same bytes (the ceilings read it) and ``dst`` its
    copy target (only when ceiling_copy runs); ``params`` gives each tensor as the ``.grad`` of a parameter that
    costs no memory (a zero-stride view), for code that takes parameters (grad_stats, Lightning's grad_norm).
    """

    tensors: list[Tensor]
    flat: Tensor
    dst: Tensor | None
    params: list[tuple[str, Tensor]]

    @property
    def module(self) -> GradsAsModule:
        return GradsAsModule(self.params)


def as_params(tensors: Sequence[Tensor]) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` pairs whose ``.grad`` are ``tensors``; each parameter is a zero-stride view."""
    out = []
    for i, t in enumerate(tensors):
        holder = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
        holder.grad = t
        out.append((f"p{i}", holder))
    return out


#: At most this many input copies on CUDA: the op keeps the metadata of its last 16 tensor lists on the device, and
#: a training loop (same gradient buffers every step) always finds its list there; more copies than that would time
#: a metadata upload on every call. Lists under ~12 MB are then partly read from the GPU's L2.
CUDA_MAX_COPIES = 8


def make_samples(point: Point, device: torch.device, llc: int, seed: int, copy_target: bool = True) -> list[Sample]:
    """Random-normal inputs (never zeros), in enough copies that the rotated working set exceeds twice the LLC
    (within the limits: at most 256 copies, 200,000 tensors in all, and CUDA_MAX_COPIES on CUDA). On the CPU at least
    two when rotating (``llc > 0``): the timed blocks read the copies in turn, so a block never starts on the copy
    the block before it has just left in the cache (a list read right after another contender read it would find
    part of it in the last-level cache)."""
    total = point.total_bytes
    limit = CUDA_MAX_COPIES if device.type == "cuda" else 256
    max_copies = max(1, min(limit, 200_000 // max(1, len(point.shapes))))
    min_copies = 2 if device.type == "cpu" and llc > 0 else 1
    copies = max(min_copies, min(max_copies, math.ceil(2 * llc / max(total, 1))))
    gen = torch.Generator(device=device).manual_seed(seed)
    flat_numel = max(1, total // 4)
    samples = []
    for _ in range(copies):
        tensors = [torch.randn(s, dtype=dt, device=device, generator=gen) for s, dt in zip(point.shapes, point.dtypes)]
        flat = torch.randn(flat_numel, dtype=torch.float32, device=device, generator=gen)
        dst = torch.empty_like(flat) if copy_target else None
        samples.append(Sample(tensors, flat, dst, as_params(tensors)))
    return samples
