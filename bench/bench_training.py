"""Training overhead: steps/s of a small transformer training loop with and without per-step gradient statistics.

Variants, interleaved in blocks of ``--steps`` steps so they share the machine's noise; the median block rate is
reported, and the overhead is relative to the plain loop measured in the same run:

    baseline           forward, backward, AdamW step
    grad_stats         + ``torch_gradstats.grad_stats(model.named_parameters())`` every step (device side, no sync)
    grad_stats+report  + ``.report()`` every step (one device-to-host transfer per step)
    composite          + ``_foreach_norm`` and per-tensor zero/NaN/Inf counts (what users write today)
    orig_collector     + the original gradient collector (float64 copies, torch.cat, masks, one ``.tolist()``)

    .venv/bin/python bench/bench_training.py [--device cpu|cuda] [--rounds 5] [--steps 10] [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import torch_gradstats
from torch_gradstats.bench import machine_description, original_collector
from torch_gradstats.stats import grad_stats


class TinyLM(nn.Module):
    """A small pre-norm transformer language model (the shape of a real one, sized for a 2-core CPU)."""

    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        x = self.blocks(x, mask=self.mask[: idx.shape[1], : idx.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def _composite(model: nn.Module) -> object:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = torch._foreach_norm(grads)
    return norms, [(g == 0).sum() for g in grads], [g.isnan().sum() for g in grads], [g.isinf().sum() for g in grads]


VARIANTS: dict[str, Callable[[nn.Module], object] | None] = {
    "baseline": None,
    "grad_stats": lambda m: grad_stats(m.named_parameters()),
    "grad_stats+report": lambda m: grad_stats(m.named_parameters()).report(),
    "composite": _composite,
    "orig_collector": lambda m: original_collector([p.grad for p in m.parameters() if p.grad is not None]),
}


def run(device: torch.device, rounds: int, steps: int, variants: list[str], size: str = "small") -> list[dict]:
    """Train one model, switching variant every ``steps`` steps; return one result dict per variant."""
    cfg = {
        "small": {"vocab": 2048, "d_model": 128, "n_layer": 4, "n_head": 4, "seq": 64, "batch": 16},
        "tiny": {"vocab": 256, "d_model": 32, "n_layer": 1, "n_head": 2, "seq": 16, "batch": 4},
    }[size]
    torch.manual_seed(0)
    model = TinyLM(cfg["vocab"], cfg["d_model"], cfg["n_layer"], cfg["n_head"], cfg["seq"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, cfg["vocab"], (8, cfg["batch"], cfg["seq"] + 1), device=device)
    loss_fn = nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_i = 0

    def block(extra: Callable[[nn.Module], object] | None) -> float:
        nonlocal step_i
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = data[step_i % data.shape[0]]
            step_i += 1
            opt.zero_grad(set_to_none=True)
            logits = model(batch[:, :-1])
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            if extra is not None:
                extra(model)
            opt.step()
        sync()
        return steps / (time.perf_counter() - t0)

    for name in variants:  # warm-up: allocator, first-call costs
        block(VARIANTS[name])
    rates: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(rounds):
        for k in range(len(variants)):
            name = variants[(r + k) % len(variants)]
            rates[name].append(block(VARIANTS[name]))
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = sum(1 for _ in model.parameters())
    base = statistics.median(rates["baseline"]) if "baseline" in rates else float("nan")
    out = []
    for name in variants:
        sps = statistics.median(rates[name])
        out.append({
            "device": device.type, "variant": name, "params": n_params, "tensors": n_tensors, "rounds": rounds,
            "steps_per_round": steps, "steps_per_s": sps, "ms_per_step": 1e3 / sps,
            "overhead_pct": 100.0 * (base / sps - 1.0),
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median over them)")
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--size", default="small", choices=("small", "tiny"), help="model size (tiny: smoke test)")
    p.add_argument("--csv", default=None, help="also write the results to this CSV file")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "baseline" not in variants:
        p.error(f"unknown variant(s) {unknown} (choose from {', '.join(VARIANTS)}); 'baseline' is required")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda asked for, but torch sees no CUDA device")
    info = machine_description(device)
    print("  ".join(f"{k}: {v}" for k, v in info.items()))
    if not torch_gradstats.HAS_EXTENSION:
        print("NOTE: compiled extension not loaded: grad_stats runs the pure-PyTorch fallback here.")
    res = run(device, args.rounds, args.steps, variants, args.size)
    print(f"model: {res[0]['params']:,} parameters in {res[0]['tensors']} tensors; median of {args.rounds} rounds "
          f"x {args.steps} steps")  # fmt: skip
    print(f"{'variant':<20}{'steps/s':>10}{'ms/step':>10}{'overhead':>10}")
    for r in res:
        print(f"{r['variant']:<20}{r['steps_per_s']:>10.2f}{r['ms_per_step']:>10.2f}{r['overhead_pct']:>9.1f}%")
    if args.csv:
        with Path(args.csv).open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(res[0]))
            w.writeheader()
            w.writerows(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
