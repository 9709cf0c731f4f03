"""Cost of watching activations: time per training step of a small transformer with each way of finding a NaN's origin.

Variants, each on its own copy of one model (same weights), interleaved in blocks of ``--steps`` steps (the order
rotates every round) so that they share the machine's noise. Each variant's overhead is taken round by round, against
the plain step of the same round, and the median over the rounds is reported with the spread of those per-round
figures (interquartile range): a slow minute of a shared machine then moves both sides of a ratio together. The
variants are:

    none                  forward, backward, optimizer step
    watch                 + ``ActivationWatch`` on every module (forward and backward hooks), every step
    watch+report          + that, and ``report()`` every step (one device-to-host transfer)
    watch_every10         + ``ActivationWatch(every_n_steps=10)``, ``report()`` every 10th step
    debug_underflow       + transformers' ``DebugUnderflowOverflow`` (forward hooks on every module)
    detect_anomaly        forward and backward under ``torch.autograd.detect_anomaly()``

Goals (CPU): ``watch`` under 15% of the step, and at least 5x cheaper than ``debug_underflow`` (overheads compared).

On the CPU the step runs on one thread (``--threads``) and is timed on that thread's CPU clock as well as the wall
clock: on a shared machine the wall clock also counts the time other processes hold the cores (and torch's worker
threads spin-wait badly when cores are oversubscribed), while the thread's CPU time counts only the step's own work.
The goals are judged on the CPU clock there, on the wall clock on CUDA.

    python bench/bench_activations.py [--device cpu|cuda] [--rounds 5] [--steps 10] [--threads 1] [--out FILE]
                                      [--variants none,watch,...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import torch_gradstats
from torch_gradstats.bench import machine_description
from torch_gradstats.monitors.activations import ActivationWatch

VOCAB, D_MODEL, N_LAYER, N_HEAD, SEQ, BATCH = 2048, 128, 4, 4, 64, 16


class Block(nn.Module):
    """A pre-norm transformer block with a hand-written causal attention."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.act, self.out = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)  # fmt: skip
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEAD) for _ in range(N_LAYER))
        self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Runner:
    """One variant: its own model copy and optimizer, and what it adds around the step."""

    def __init__(self, name: str, model: nn.Module, device: torch.device) -> None:
        self.name, self.model = name, copy.deepcopy(model).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.watch: ActivationWatch | None = None
        self.report_every = 0
        self.context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
        if name in ("watch", "watch+report"):
            self.watch = ActivationWatch(self.model, modules=lambda path, m: path != "")
            self.report_every = 1 if name == "watch+report" else 0
        elif name == "watch_every10":
            self.watch = ActivationWatch(self.model, modules=lambda path, m: path != "", every_n_steps=10)
            self.report_every = 10
        elif name == "debug_underflow":
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(self.model)
        elif name == "detect_anomaly":
            self.context = lambda: torch.autograd.detect_anomaly(check_nan=True)
        self.steps = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.context():
            loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.watch is not None and self.report_every and self.steps % self.report_every == 0:
            report = self.watch.report()
            assert not report.nonfinite, report.summary()
        self.steps += 1


VARIANTS = ("none", "watch", "watch+report", "watch_every10", "debug_underflow", "detect_anomaly")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (none is always run)")
    args = parser.parse_args(argv)
    chosen = ["none"] + [v for v in VARIANTS if v != "none" and v in args.variants.split(",")]
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {sorted(unknown)}; choose from {VARIANTS}")
    logging.getLogger("torch_gradstats").setLevel(logging.ERROR)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    # One thread's CPU clock measures the step's own work only where all of it runs on that thread.
    cpu_clock = device.type == "cpu" and args.threads == 1
    torch.manual_seed(0)
    base = LM()
    runners = [Runner(name, base, device) for name in chosen]
    n_watched = next((len(r.watch.module_names) for r in runners if r.watch is not None), 0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    walls: dict[str, list[float]] = {r.name: [] for r in runners}
    for r in runners:  # warm-up block (first-step buffers, allocator, lazy init)
        for _ in range(args.steps):
            r.step(x, y)
    for rnd in range(args.rounds):
        order = runners[rnd % len(runners) :] + runners[: rnd % len(runners)]
        for r in order:
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                r.step(x, y)
            sync()
            walls[r.name].append((time.perf_counter() - t0) / args.steps * 1e3)
            times[r.name].append((time.thread_time() - c0) / args.steps * 1e3)
    if not cpu_clock:
        times = walls
    med = {name: statistics.median(v) for name, v in times.items()}
    wall_med = {name: statistics.median(v) for name, v in walls.items()}
    # Overheads round by round, each against the plain step of its own round.
    over = {name: [t / p - 1 for t, p in zip(v, times["none"])] for name, v in times.items()}
    lines = [
        "  ".join(f"{k}: {v}" for k, v in machine_description(device).items()),
        f"compiled extension loaded: {torch_gradstats.HAS_EXTENSION}",
        (
            f"model: {N_LAYER} pre-norm blocks, d={D_MODEL}, vocab {VOCAB}, batch {BATCH} x {SEQ}; "
            f"{sum(p.numel() for p in base.parameters()):,} parameters; {n_watched} modules watched; "
            f"median of {args.rounds} rounds x {args.steps} steps"
        ),
        (
            f"clock: {'CPU time of the one torch thread' if cpu_clock else 'wall'}; wall ms/step shown too; overhead: "
            "median over rounds of each round's ratio to its plain step, IQR: interquartile range of those ratios"
        ),
        f"{'variant':<18}{'ms/step':>10}{'overhead':>10}{'IQR':>18}{'wall ms':>10}",
    ]
    for name in chosen:
        q1, _, q3 = statistics.quantiles(over[name], n=4) if len(over[name]) > 1 else [over[name][0]] * 3
        iqr = f"{q1 * 100:+.1f}..{q3 * 100:+.1f}%"
        lines.append(f"{name:<18}{med[name]:>10.2f}{statistics.median(over[name]) * 100:>9.1f}%{iqr:>18}"
                     f"{wall_med[name]:>10.2f}")  # fmt: skip
    if "watch" in over:
        watch_over = statistics.median(over["watch"])
        lines.append(f"[{'PASS' if watch_over < 0.15 else 'FAIL'}] watch on every module < 15% of the step: "
                     f"{watch_over * 100:+.1f}%")  # fmt: skip
    if "watch" in over and "debug_underflow" in over:
        debug_over = statistics.median(over["debug_underflow"])
        ratio = debug_over / watch_over if watch_over > 0 else float("inf")
        lines.append(f"[{'PASS' if ratio >= 5 else 'FAIL'}] watch >= 5x cheaper than DebugUnderflowOverflow: "
                     f"{ratio:.1f}x (overheads)")  # fmt: skip
    text = "\n".join(line for line in lines if line)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
