"""How the pure-PyTorch kernels cut a tensor into the pieces they read: its distinct elements (a broadcast
dimension once), then views of at most a chunk each, made one at a time.

Split from fallback.py: :mod:`torch_gradstats.ops.fallback` and :mod:`torch_gradstats.ops.fallback_histogram` both read
tensors this way.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

__all__ = ["distinct_elements", "is_dense", "iter_pieces"]


def is_dense(t: Tensor) -> bool:
    """True if ``t``'s elements fill a contiguous range of its storage in some order (contiguous or permuted)."""
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride()) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def distinct_elements(t: Tensor) -> tuple[Tensor, int]:
    """``t`` without its broadcast dimensions (stride 0, size > 1), and how many times that view's elements each
    appear in ``t``: a tensor made by ``expand`` is read once per distinct element, never materialized."""
    copies = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride == 0 and size > 1:
            copies *= size
    if copies == 1:
        return t, 1
    return t.as_strided([1 if st == 0 else s for s, st in zip(t.shape, t.stride())], t.stride()), copies


def iter_pieces(t: Tensor, chunk: int) -> Iterator[Tensor]:
    """Views of ``t`` of at most ``chunk`` elements that together hold each of its elements exactly once (an
    element that overlapping strides repeat, once per repeat), made one at a time: however large ``t``, only the
    views being read exist."""
    n = t.numel()
    if n <= chunk:
        yield t
        return
    if is_dense(t):  # one flat view in storage order (the statistics do not depend on element order)
        flat = t.as_strided((n,), (1,))
        for start in range(0, n, chunk):
            yield flat.narrow(0, start, min(chunk, n - start))
        return
    dim = next(d for d, s in enumerate(t.shape) if s > 1)
    size = t.shape[dim]
    per_slice = n // size
    if per_slice <= chunk:
        step = chunk // per_slice
        for start in range(0, size, step):
            yield t.narrow(dim, start, min(step, size - start))
        return
    for j in range(size):
        yield from iter_pieces(t.select(dim, j), chunk)
