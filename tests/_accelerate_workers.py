"""Scenarios run on every rank of a gloo group (tests/test_integrations_accelerate.py): the loop of
docs/integrations.md, "Hugging Face Accelerate loops", under accelerate's own DDP wrapping."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import model_zoo
import torch
import torch.distributed as dist

import torch_gradstats as tg


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The zoo's GPT-2 with its dropout off, so that a twin sees the same activations."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def gpt2_ddp_under_accelerate(rank: int, world: int) -> str | None:
    """Each rank trains the zoo's GPT-2 on its own micro-batches, two per step; at each step's last micro-batch the
    figures of the unwrapped model's names equal float64 figures of the whole batch's gradients (DDP's average of
    the ranks' accumulated gradients), the same on every rank, and the clip steps as torch's clip of those."""
    try:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType
    except ImportError as exc:
        return f"skip: {exc}"
    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    model = _no_dropout(model_zoo.gpt2(seed=0))
    reference = _no_dropout(model_zoo.gpt2(seed=0)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    own = [n for n, _ in reference.named_parameters()]
    gen = torch.Generator().manual_seed(3)
    for micro in range(4):
        ids = torch.randint(0, 64, (world, 2, 8), generator=gen)  # one row of micro-batches per rank
        with accelerator.accumulate(model):
            accelerator.backward(model(ids[rank], labels=ids[rank]).loss)
            for r in range(world):  # the reference: every rank's loss, averaged as DDP averages, accumulated
                (reference(ids[r], labels=ids[r]).loss / (2 * world)).backward()
            if accelerator.sync_gradients:
                accelerator.unscale_gradients()
                stats = tg.clip_grad_norm_(accelerator.unwrap_model(model).named_parameters(), max_norm=0.05)
                report = stats.report()
                want = tg.grad_stats(reference.named_parameters()).report()
                assert list(report.norms) == own, list(report.norms)[:3]
                assert math.isclose(report.total_norm, want.total_norm, rel_tol=1e-5), (report.total_norm,
                                                                                       want.total_norm)
                for name in own:
                    assert math.isclose(report.norms[name], want.norms[name], rel_tol=1e-4, abs_tol=1e-9), name
                seen: list[object] = [None] * world
                dist.all_gather_object(seen, report.total_norm)
                assert len(set(seen)) == 1, seen
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
                ref_optimizer.step()
                ref_optimizer.zero_grad()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(accelerator.unwrap_model(model).named_parameters(), reference.parameters()):
        assert torch.allclose(p.detach().double(), q.detach(), atol=1e-5), name
    return None


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f for f in (gpt2_ddp_under_accelerate,)  # type: ignore[misc]
}
