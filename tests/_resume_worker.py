"""One run of a zoo model for tests/test_resume.py, in a process of its own: from the start, saving checkpoints, or
resumed from one of them. It writes everything it logged, for the test to compare line by line.

    python tests/_resume_worker.py trainer|loop resnet|gpt2 OUT_DIR [RESUME_STEP ...]

Without a step, the run from the start; with steps, one resumed run from each, one after the other.

- ``trainer``: the library's Trainer, CPU bf16 autocast, a GradScaler whose scale changes, 2 micro-batches a step,
  a SpikeGuard, an AdaptiveClip, a FlightRecorder and a JSONL sink logging every step; epochs of 5 steps; the loss
  x10 for good from step 12, and one x1000 spike at step 21. The checkpoint (model, optimizer, scaler, the policies,
  ``global_step``, ``epoch``) is saved after steps 5 and 15. Writes ``trainer-<start>.jsonl`` (the sink),
  ``trainer-<start>.json`` (each epoch's summary and ``policy_figures``) and ``flight-<start>/`` (the dumps).
- ``loop``: a plain loop, the same amp, scaler, accumulation and change of level, with a NoiseScale reading each
  micro-batch and the accumulated gradient; the guard and the clip applied by hand, ``step_or_skip`` with the
  scaler. Writes ``loop-<start>.json``, every step's figures.

The checkpoints are ``torch.save``'d dicts loaded with ``weights_only=True``; a resumed run builds every object anew
(the model too), in a process other than the one that saved it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import torch_gradstats as tg
from torch_gradstats.integrations.files import JSONLSink

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_policies_models import Task, task

STEPS, PER_EPOCH, MICRO, CHANGE, SPIKE = 25, 5, 2, 12, 21
SAVE_AT = (5, 15)  # in both policies' warm-up (min_history 6, warmup 8); after it, while the new level is adopted


def level(step: int) -> float:
    return (10.0 if step >= CHANGE else 1.0) * (1000.0 if step == SPIKE else 1.0)


def policies() -> tuple[tg.SpikeGuard, tg.AdaptiveClip]:
    return tg.SpikeGuard(window=8, sigma=3.0, min_history=6, adopt_after=3), tg.AdaptiveClip(warmup=8, adopt_after=4)


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)


def trainer_run(kind: str, out: Path, start: int) -> None:
    t = task(kind)
    guard, clip = policies()
    sink = JSONLSink(out / f"trainer-{start}.jsonl", mode="w")
    box: dict[str, tg.Trainer] = {}

    def loss_fn(outputs: Any, targets: Any) -> torch.Tensor:
        return t.loss_fn(outputs, targets) * level(box["trainer"].global_step)

    tr = box["trainer"] = tg.Trainer(
        t.model, torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True), loss_fn, scaler=scaler(),
        amp_dtype=torch.bfloat16, accumulation_steps=MICRO, progress=False, spike_guard=guard, adaptive_clip=clip,
        flight_recorder=tg.FlightRecorder(4, dump_dir=out / f"flight-{start}"), log_to=[sink], sync_every=2)
    assert tr.scaler is not None
    if start:
        state = torch.load(out / f"trainer-checkpoint-{start}.pt", weights_only=True)
        tr.model.load_state_dict(state["model"])
        tr.optimizer.load_state_dict(state["optimizer"])
        tr.scaler.load_state_dict(state["scaler"])
        guard.load_state_dict(state["guard"])
        clip.load_state_dict(state["clip"])
        tr.global_step, tr.epoch = state["step"], state["epoch"]
    loader = t.loader(PER_EPOCH * MICRO)
    epochs = []
    while tr.global_step < STEPS:
        torch.manual_seed(tr.epoch)  # GPT-2's dropout: the same draws in a resumed run
        summary = tr.train_epoch(loader)
        epochs.append({"summary": summary.to_dict(), "figures": dict(tr.policy_figures)})
        if tr.global_step in SAVE_AT and not start:
            torch.save({"model": tr.model.state_dict(), "optimizer": tr.optimizer.state_dict(),
                        "scaler": tr.scaler.state_dict(), "guard": guard.state_dict(), "clip": clip.state_dict(),
                        "step": tr.global_step, "epoch": tr.epoch}, out / f"trainer-checkpoint-{tr.global_step}.pt")
    sink.close()
    (out / f"trainer-{start}.json").write_text(json.dumps(epochs, default=str))


def _micro_loss(t: Task, step: int, i: int) -> torch.Tensor:
    x, y = t.batch(MICRO * step + i)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return t.loss_fn(t.model(x), y) * level(step) / MICRO


def loop_run(kind: str, out: Path, start: int) -> None:
    t = task(kind)
    guard, clip = policies()
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3, fused=True)
    amp = scaler()
    ns = tg.NoiseScale(8, ema=0.9, scaler=amp)
    if start:
        state = torch.load(out / f"loop-checkpoint-{start}.pt", weights_only=True)
        t.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        amp.load_state_dict(state["scaler"])
        guard.load_state_dict(state["guard"])
        clip.load_state_dict(state["clip"])
        ns.load_state_dict(state["noise_scale"])
    rows = []
    for step in range(start, STEPS):
        torch.manual_seed(step)
        opt.zero_grad()
        loss = torch.zeros((), dtype=torch.float64)
        for i in range(MICRO):
            with ns.micro_batch(t.model):
                micro = _micro_loss(t, step, i)
                amp.scale(micro).backward()
            loss += micro.detach().double()
        amp.unscale_(opt)
        ns.step(t.model)
        stats = clip.clip_(t.model.parameters())
        factor = guard.observe(stats.total_norm, loss)
        tg.step_or_skip(opt, factor, amp)
        rows.append({"step": step, "factor": float(factor), "total_norm": float(stats.total_norm),
                     "scale": amp.get_scale(), **guard.check(), **clip.figures(), **ns.to_dict()})
        if step + 1 in SAVE_AT and not start:
            torch.save({"model": t.model.state_dict(), "optimizer": opt.state_dict(), "scaler": amp.state_dict(),
                        "guard": guard.state_dict(), "clip": clip.state_dict(), "noise_scale": ns.state_dict()},
                       out / f"loop-checkpoint-{step + 1}.pt")
    (out / f"loop-{start}.json").write_text(json.dumps(rows))  # NaN and inf as JSON's extensions: compared as text


if __name__ == "__main__":
    mode, kind, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    for start in [int(a) for a in sys.argv[4:]] or [0]:
        (trainer_run if mode == "trainer" else loop_run)(kind, out_dir, start)
