"""How far the op's sums of squares, and clipping, are from float64 and from torch: the figures of docs/accuracy.md.

Two measurements on random inputs:

* ``sumsq``: the relative error of ``multi_tensor_stats(x).sumsq`` against the exact sum of squares (``math.fsum``
  of the float64 squares, or a float64 ``torch.sum`` for long tensors), per dtype and distribution (random
  normal, uniform, log-normal, and constant tensors, where every rounding goes the same way), for each CPU kernel:
  the compiled one per instruction set (``ATEN_CPU_CAPABILITY``, each in its own process) and the pure-PyTorch
  fallback (``TORCH_GRADSTATS_FORCE_FALLBACK=1``). A norm's relative error is half its ``sumsq``'s.
* ``clip``: ``torch_gradstats.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the same float16,
  bfloat16 and float32 gradients: the relative difference of the norms of the clipped gradients, and of torch's
  total norm from the exact one.

    python bench/accuracy.py                 # ~2 min on a 2-core machine
    python bench/accuracy.py --quick         # fewer trials
    python bench/accuracy.py --device cuda   # the CUDA kernel (sumsq only) and clipping on the GPU
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from typing import Any

import torch

LENGTHS = [7, 100, 1000, 2047, 4096, 10_000, 65536, 300_001, 1 << 20]
KINDS = ["normal", "uniform", "lognormal", "constant"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _sample(g: torch.Generator, dtype: torch.dtype, n: int, kind: str) -> torch.Tensor:
    if kind == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "uniform":
        x = torch.rand(n, generator=g, dtype=torch.float64)
    elif kind == "lognormal":
        x = torch.randn(n, generator=g, dtype=torch.float64).mul(2).exp()
        x = x / x.max()
    else:
        x = torch.full((n,), 1 + torch.rand((), generator=g, dtype=torch.float64).item(), dtype=torch.float64)
    lo, hi = (-3, 2) if dtype == torch.float16 else (-15, 15)  # float16: no overflow, few subnormals
    return (x * 10 ** (lo + (hi - lo) * torch.rand((), generator=g).item())).to(dtype)


def sumsq_errors(device: str, trials: int, show: bool = True) -> dict[str, dict[str, float]]:
    """The largest relative error of sumsq per dtype and distribution (printed, one line per dtype, if ``show``)."""
    import torch_gradstats as tg

    if device == "cpu":
        kernel = "pure-PyTorch fallback"
        if tg.HAS_EXTENSION:
            from torch_gradstats import _C

            kernel = f"compiled, {_C.cpu_capability()}"
        if show:
            print(f"  (kernel in use: {kernel})")
    g = torch.Generator().manual_seed(1)
    out: dict[str, dict[str, float]] = {}
    for dtype in DTYPES:
        worst = out[str(dtype)[6:]] = {}
        for kind in KINDS:
            worst[kind] = 0.0
            for t in range(trials):
                n = LENGTHS[t % len(LENGTHS)]
                x = _sample(g, dtype, n, kind)
                squares = x.double() ** 2
                exact = math.fsum(squares.tolist()) if n <= 10_000 else float(squares.sum())
                if exact == 0 or not math.isfinite(exact):
                    continue
                got = float(tg.multi_tensor_stats([x.to(device)]).sumsq[0])
                worst[kind] = max(worst[kind], abs(got - exact) / exact)
        if show:
            print(f"  {str(dtype)[6:]:9s} " + "  ".join(f"{k} {worst[k]:.2g}" for k in KINDS), flush=True)
    return out


def _clip_case(
    g: torch.Generator, dtype: torch.dtype, device: str, norm: float, max_norm: float, norm_type: float
) -> tuple[float, float, float, float, bool]:
    """For random gradients of about ``norm``: the exact total norm of order ``norm_type``, torch's total norm, the
    L2 norms after torch's clip and after ours, and whether ours is at least as close to the exact clip (each
    gradient times the float64 coefficient)."""
    import torch_gradstats as tg

    shapes = [
        int(torch.randint(100, 5000, (1,), generator=g)) for _ in range(int(torch.randint(1, 11, (1,), generator=g)))
    ]
    raw = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    scale = norm / math.sqrt(sum(float((r**2).sum()) for r in raw))
    grads = [(r * scale).to(dtype).to(device) for r in raw]
    theirs = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    ours = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for a, b, x in zip(theirs, ours, grads):
        a.grad, b.grad = x.clone(), x.clone()

    def norm_of(ps: list[torch.nn.Parameter]) -> float:
        return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in ps if p.grad is not None))

    exact = norm_of(theirs) if norm_type == 2 else max(float(p.grad.double().abs().max()) for p in theirs)
    total = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type))
    tg.clip_grad_norm_(ours, max_norm, norm_type)
    coef = min(max_norm / (exact + 1e-6), 1.0)

    def distance(ps: list[torch.nn.Parameter]) -> float:
        return sum(float(((p.grad.double() - x.double() * coef) ** 2).sum()) for p, x in zip(ps, grads))

    return exact, total, norm_of(theirs), norm_of(ours), distance(ours) <= distance(theirs)


def clip_differences(device: str, trials: int, show: bool = True) -> list[dict[str, Any]]:
    """Per case, the largest relative difference between the two clips (L2 norms after clipping), the largest error
    of torch's total norm, how often torch's norm was inf (gradients zeroed) and how often ours was the closer clip
    (printed, one line per case, if ``show``)."""
    g = torch.Generator().manual_seed(2)
    f16_max = math.log10(65000)
    always = lambda c: True  # noqa: E731
    cases = [
        # label, dtype, norm_type, log10 of the max_norm range, log10 of the norm range (None: from max_norm),
        # which coefficients max_norm / norm to keep
        ("float32, max_norm 0.01-10, norm up to 1e6", torch.float32, 2.0, (-2, 1), (None, 6), always),
        (
            "float16, max_norm 0.01-10, coef >= 6.1e-5",
            torch.float16,
            2.0,
            (-2, 1),
            (None, f16_max),
            lambda c: c >= 2**-14,
        ),
        (
            "float16, max_norm 0.006-0.1, coef < 6.1e-5",
            torch.float16,
            2.0,
            (-2.2, -1),
            (None, f16_max),
            lambda c: c < 2**-14,
        ),
        ("float16, norm 7e4-3e5 (finite elements)", torch.float16, 2.0, (-2, 1), (4.85, 5.5), always),
        ("bfloat16, max_norm 0.01-10, norm up to 1e6", torch.bfloat16, 2.0, (-2, 1), (None, 6), always),
        ("float16, norm_type inf", torch.float16, math.inf, (-2, 1), (None, 4.8), always),
        ("bfloat16, norm_type inf", torch.bfloat16, math.inf, (-2, 1), (None, 6), always),
    ]
    rows = []
    for label, dtype, norm_type, (lo, hi), (bottom, top), keep in cases:
        worst_clip = worst_norm = 0.0
        zeroed = done = closer = 0
        example = ""
        while done < trials:
            max_norm = 10 ** (lo + (hi - lo) * torch.rand((), generator=g).item())
            low = math.log10(max_norm) if bottom is None else bottom
            norm = 10 ** (low + (top - low) * torch.rand((), generator=g).item())
            if not keep(max_norm / norm):
                continue
            done += 1
            exact, total, theirs, ours, ours_closer = _clip_case(g, dtype, device, norm, max_norm, norm_type)
            closer += ours_closer
            if not math.isfinite(total):
                zeroed += theirs == 0
                continue
            worst_norm = max(worst_norm, abs(total - exact) / exact)
            diff = abs(theirs - ours) / ours
            if diff > worst_clip:
                worst_clip = diff
                example = f"norm {exact:.3g}, max_norm {max_norm:.3g}: torch {theirs:.4g}, ours {ours:.4g}"
        rows.append(
            {
                "case": label,
                "diff": worst_clip,
                "torch_norm_err": worst_norm,
                "zeroed": zeroed,
                "closer": closer,
                "trials": trials,
            }
        )
        if show:
            print(
                f"  {label:44s} clipped norms differ <= {worst_clip:.2g}; torch's norm off <= {worst_norm:.2g}; "
                f"ours closer to the exact clip {closer}/{trials}; "
                f"torch's norm inf (gradients zeroed) {zeroed}/{trials}; worst: {example or '-'}",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="fewer trials")
    p.add_argument("--only", choices=["sumsq", "clip"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    trials = 9 if args.quick else 40
    if args.only == "sumsq":
        sumsq_errors(args.device, trials)
        return 0
    print(
        f"sumsq: largest relative error against the exact sum of squares ({trials} tensors per cell, "
        f"{LENGTHS[0]} to {LENGTHS[-1]:,} elements)"
    )
    variants = (
        [("cuda kernel", {})]
        if args.device == "cuda"
        else [
            ("compiled CPU kernel, default (baseline) ISA", {"ATEN_CPU_CAPABILITY": "default"}),
            ("compiled CPU kernel, AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}),
            ("compiled CPU kernel, AVX512", {"ATEN_CPU_CAPABILITY": "avx512"}),
            ("pure-PyTorch fallback", {"TORCH_GRADSTATS_FORCE_FALLBACK": "1"}),
        ]
    )
    for label, env in variants:
        print(label, flush=True)
        # A fresh process each: the instruction set is chosen when torch loads.
        cmd = [sys.executable, __file__, "--only", "sumsq", "--device", args.device] + (
            ["--quick"] if args.quick else []
        )
        subprocess.run(cmd, env={**os.environ, **env}, check=True)
    print("clip: torch_gradstats.clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_ (norms after clipping)")
    clip_differences(args.device, 40 if args.quick else 300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
