"""Per-example gradient norms: the cost of PerExampleNorms on a training step, beside Opacus and BackPACK.

The model is a 4-layer pre-norm transformer without tied weights (d_model 256, 4 heads, sequences of 128 tokens,
batches of 32, a vocabulary of 1000; token and position embeddings, separate q/k/v/o projections, a 4x MLP),
trained with AdamW on next-token cross-entropy. Each contender is one training step, from the forward to the
optimizer step, with its own copy of the same model:

    plain            forward, backward, optimizer step
    PerExampleNorms  the same, with one PerExampleNorms on the model: reset() at the start of the step, and the
                     step's norms() and top(3) on the device at the end
    Opacus ghost     Opacus's GradSampleModuleFastGradientClipping (ghost clipping) around the model: one backward
                     with its hooks, then its per_sample_gradient_norms (get_norm_sample())
    BackPACK         BackPACK's BatchL2Grad extension on the extended model, the norms from every batch_l2

Time: the median and the fastest of the steps of each contender, the contenders interleaved in ``--rounds`` rounds
of ``--steps`` steps each, after one warm-up step each (on a shared machine the fastest step is the one least
disturbed by other work), and the median CPU time of the process over a step (``time.process_time``: the work done,
whatever other processes take of the machine). On CUDA the device is synchronised after each step.
Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over one step above what was allocated before it; on the
CPU, each contender runs in a process of its own (glibc returning every large block to the system, so that the
resident set follows what is allocated), and the peak resident set of one step above the resident set before it.
A contender that cannot run (a package not installed, a layer it does not support) is listed with the reason.

    python bench/bench_per_example.py [--device cpu|cuda] [--rounds 5] [--steps 2] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_gradstats.monitors.per_example import PerExampleNorms

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 1000, 256, 4, 4, 128, 32


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: Tensor) -> Tensor:
        b, t, d = h.shape
        a = self.ln1(h)
        q, k, v = (f(a).reshape(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o(att.transpose(1, 2).reshape(b, t, d))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.Sequential(*(Block(D_MODEL, HEADS) for _ in range(LAYERS)))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.shape
        positions = torch.arange(t, device=idx.device).repeat(b, 1)  # batched and contiguous, as Opacus needs
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(positions))))


def loss_of(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


Step = Callable[[Tensor, Tensor], object]


def make_plain(model: nn.Module) -> Step:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(idx: Tensor, target: Tensor) -> object:
        loss_of(model(idx), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return None

    return step


def make_per_example(model: nn.Module) -> Step:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pe = PerExampleNorms(model)

    def step(idx: Tensor, target: Tensor) -> object:
        pe.reset()
        loss_of(model(idx), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return pe.norms(), pe.top(3)

    return step


def make_opacus(model: nn.Module) -> Step:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean", max_grad_norm=1.0,
                                               use_ghost_clipping=True)
    opt = torch.optim.AdamW(gsm.parameters(), lr=1e-4)

    def step(idx: Tensor, target: Tensor) -> object:
        loss_of(gsm(idx), target).backward()
        norms = gsm.get_norm_sample()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norms

    return step


#: Parameters BackPACK computed no batch_l2 for (the layers it does not support), as found by the warm-up step.
BACKPACK_MISSING: list[str] = []


def make_backpack(model: nn.Module) -> Step:
    from backpack import backpack, extend
    from backpack.extensions import BatchL2Grad

    model = extend(model)
    lossfn = extend(nn.CrossEntropyLoss())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(idx: Tensor, target: Tensor) -> object:
        loss = lossfn(model(idx).reshape(-1, VOCAB), target.reshape(-1))
        with backpack(BatchL2Grad()):
            loss.backward()
        found = [p.batch_l2 for p in model.parameters() if hasattr(p, "batch_l2")]
        BACKPACK_MISSING[:] = [n for n, p in model.named_parameters() if not hasattr(p, "batch_l2")]
        norms = torch.stack(found).sum(0).sqrt()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norms

    return step


CONTENDERS: dict[str, Callable[[nn.Module], Step]] = {
    "plain": make_plain,
    "PerExampleNorms": make_per_example,
    "Opacus ghost": make_opacus,
    "BackPACK": make_backpack,
}


def batch(device: torch.device, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


def build(name: str, device: torch.device) -> Step:
    torch.manual_seed(0)
    return CONTENDERS[name](Transformer().to(device))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_peak_bytes(name: str, device: torch.device) -> int:
    """Peak memory of one step above what was in use before it (after a warm-up step)."""
    step = build(name, device)
    idx, target = batch(device, 0)
    step(idx, target)
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(idx, target)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    step(idx, target)
    return (_status_kib("VmHWM") - before) * 1024


def peak_in_child(name: str, device: torch.device, threads: int) -> int | str:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, __file__, "--memory-of", name, "--device", str(device), "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    return int(proc.stdout.strip().splitlines()[-1])


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps of one contender in a row, per round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--only", nargs="*", default=list(CONTENDERS), help="contenders to run")
    ap.add_argument("--out", type=Path, help="also write the table (and the raw figures as JSON beside it)")
    ap.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.memory_of:
        print(step_peak_bytes(args.memory_of, device))
        return 0

    steps: dict[str, Step] = {}
    failed: dict[str, str] = {}
    first: dict[str, object] = {}  # each contender's norms at the warm-up step (same weights, same batch)
    idx, target = batch(device, 0)
    for name in args.only:
        try:
            steps[name] = build(name, device)
            first[name] = steps[name](idx, target)  # warm-up, and a check that it runs at all
            sync(device)
        except Exception as exc:  # noqa: BLE001 - an optional package missing or refusing the model: reported
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"
            steps.pop(name, None)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}  # process CPU time: what the step itself used
    for r in range(args.rounds):
        idx, target = batch(device, r + 1)
        for name, step in steps.items():
            for _ in range(args.steps):
                sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                step(idx, target)
                sync(device)
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    peaks: dict[str, int | str] = {}
    for name in steps:
        peaks[name] = step_peak_bytes(name, device) if device.type == "cuda" else peak_in_child(name, device,
                                                                                               args.threads)

    base_t = statistics.median(times["plain"]) if "plain" in times else float("nan")
    base_min = min(times["plain"]) if "plain" in times else float("nan")
    base_cpu = statistics.median(cpu["plain"]) if "plain" in cpu else float("nan")
    base_m = peaks.get("plain")
    lines = [
        f"# bench_per_example on {device.type}: {machine(device)}",
        (f"# transformer: {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, T {SEQ}, B {BATCH}, vocab {VOCAB}, "
         f"untied; torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps, interleaved"),
        "",
        ("| contender | median step (ms) | x plain | fastest step (ms) | x plain | median CPU time (ms) | x plain "
         "| peak step memory (MiB) | x plain |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in steps:
        t = statistics.median(times[name])
        m = peaks[name]
        mem = f"{m / 2**20:.1f}" if isinstance(m, int) else f"failed: {m}"
        ratio = f"{m / base_m:.2f}" if isinstance(m, int) and isinstance(base_m, int) and base_m > 0 else "-"
        fastest, c = min(times[name]), statistics.median(cpu[name])
        lines.append(f"| {name} | {1e3 * t:.0f} | {t / base_t:.2f} | {1e3 * fastest:.0f} | {fastest / base_min:.2f} "
                     f"| {1e3 * c:.0f} | {c / base_cpu:.2f} | {mem} | {ratio} |")
    for name, why in failed.items():
        lines.append(f"| {name} | did not run: {why} | | | | | | | |")
    if BACKPACK_MISSING and "BackPACK" in steps:
        lines += ["", (f"BackPACK does not support the model: it computed no batch_l2 for {len(BACKPACK_MISSING)} "
                       f"parameters ({', '.join(BACKPACK_MISSING)}), so its time covers the other parameters only.")]
    ours = first.get("PerExampleNorms")
    if isinstance(ours, tuple) and isinstance(first.get("Opacus ghost"), Tensor):
        theirs = first["Opacus ghost"]
        assert isinstance(theirs, Tensor)
        diff = ((ours[0] - theirs).abs() / theirs).max().item()
        lines += ["", f"At the warm-up step the norms of PerExampleNorms and Opacus differ by at most {diff:.1e}."]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        raw = {"times_s": times, "cpu_s": cpu, "peak_bytes": peaks, "failed": failed, "machine": machine(device)}
        args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
