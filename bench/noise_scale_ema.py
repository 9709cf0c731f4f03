"""How the EMA's decay and its bias correction set the accuracy of NoiseScale's B_simple (docs/noise_scale.md).

A simulated DDP run like the tests': each sample's gradient is ``G + z`` with ``z ~ N(0, I)`` over ``d = 256``
parameters and ``|G|^2 = d / 16``, so the true B_simple is 16; each of ``ranks`` ranks averages ``4`` samples per
step. Each step gives the pair of squared norms the DDP hook reads, one rank's own batch mean (B_small = 4) and
the mean over the ranks (B_big = 4 x ranks), folded into the two EMAs as :meth:`NoiseScale.update` folds them
(checked against ``NoiseScale`` itself on the first seed). After ``--steps`` steps the relative error of B_simple
over ``--seeds`` seeds: median, 99th percentile, and the share within 10%. Also the EMA seeded with its first value
and no bias correction, for the slowest decay.

    python bench/noise_scale_ema.py [--steps 500] [--seeds 400]
"""

from __future__ import annotations

import argparse

import torch

from torch_gradstats import NoiseScale

D, SAMPLES, B_TRUE = 256, 4, 16.0


def pairs(ranks: int, steps: int, seeds: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[seeds, steps]`` squared norms of rank 0's batch mean and of the mean over the ranks."""
    g = torch.full((D,), (D / B_TRUE / D) ** 0.5, dtype=torch.float64)
    small = torch.empty(seeds, steps, dtype=torch.float64)
    big = torch.empty(seeds, steps, dtype=torch.float64)
    for t in range(steps):  # a rank's batch mean of SAMPLES samples: G + N(0, I / SAMPLES)
        means = g + torch.randn(seeds, ranks, D, generator=gen, dtype=torch.float64) / SAMPLES**0.5
        small[:, t] = means[:, 0].square().sum(-1)
        big[:, t] = means.mean(1).square().sum(-1)
    return small, big


def b_simple(small: torch.Tensor, big: torch.Tensor, b_big: float, ema: float, corrected: bool = True) -> torch.Tensor:
    """B_simple after every step of the ``[seeds, steps]`` pairs, as NoiseScale computes it (or seeded, uncorrected)."""
    b_small = float(SAMPLES)
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    if corrected:  # both EMAs start at 0; the bias corrections cancel in the ratio
        eg = torch.zeros(small.shape[0], dtype=torch.float64)
        et = torch.zeros_like(eg)
    else:
        eg, et = grad_sq[:, 0].clone(), trace[:, 0].clone()
    for t in range(0 if corrected else 1, small.shape[1]):
        eg = ema * eg + (1 - ema) * grad_sq[:, t]
        et = ema * et + (1 - ema) * trace[:, t]
    return et / eg


def check_against_noise_scale(small: torch.Tensor, big: torch.Tensor, b_big: int, ema: float) -> None:
    ns = NoiseScale(SAMPLES, ema=ema)
    for s, b in zip(small[0].tolist(), big[0].tolist(), strict=True):
        ns.update(s, b, big_batch_size=b_big)
    mine = float(b_simple(small[:1], big[:1], float(b_big), ema)[0])
    theirs = float(ns.b_simple)
    assert abs(mine - theirs) <= 1e-9 * abs(theirs), (mine, theirs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=400)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    print(f"relative error of b_simple after {args.steps} steps, {args.seeds} seeds, B_simple {B_TRUE:g}, "
          f"{SAMPLES} samples per rank, {D} parameters")
    print(f"{'ranks':>5}  {'decay':<50} {'median':>7} {'p99':>7} {'within 10%':>10}")
    for ranks, decays in ((2, (0.9, 0.99, 0.999, None)), (4, (0.9, 0.99))):
        small, big = pairs(ranks, args.steps, args.seeds, gen)
        b_big = SAMPLES * ranks
        check_against_noise_scale(small, big, b_big, 0.99)
        for ema in decays:
            if ema is None:
                label, est = "0.999, seeded with the first value, no correction", b_simple(
                    small, big, float(b_big), 0.999, corrected=False)
            else:
                label, est = f"{ema:g}", b_simple(small, big, float(b_big), ema)
            err = ((est - B_TRUE) / B_TRUE).abs()
            print(f"{ranks:>5}  {label:<50} {float(err.median()):>7.1%} {float(err.quantile(0.99)):>7.1%} "
                  f"{float((err <= 0.1).double().mean()):>10.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
