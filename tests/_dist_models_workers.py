"""Worker side of tests/test_distributed_models.py: the model zoo's real models across gloo ranks that hold
different parameters, a few training steps each, against a single-process float64 reference on the whole model.

Each scenario is ``(rank, world) -> None | str`` as in tests/_dist_workers.py (whose run_worker runs them).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import model_zoo
import torch
import torch.distributed as dist
from _host_reads import AllHostReads
from torch import nn

from torch_gradstats import clip_grad_norm_, grad_stats

TIED = "transformer.wte.weight"  # GPT-2's embedding, tied to its output layer


def _copy(name: str, grad: torch.Tensor | None) -> tuple[str, nn.Parameter]:
    p = nn.Parameter(torch.zeros(1 if grad is None else grad.shape, dtype=torch.float64))
    p.grad = None if grad is None else grad.detach().double().clone()
    return name, p


def _reference(named: list[tuple[str, torch.Tensor | None]]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for _, g in named if g is not None))


def gpt2_pipeline_stages(rank: int, world: int) -> str | None:
    """A tiny Hugging Face GPT-2 (loss inside forward) split into two pipeline stages: stage 0 holds the embeddings
    and the first block, stage 1 the second block, the final norm and its own copy of the tied embedding. Each
    step's total norm and clip coefficient equal the whole model's (the embedding counted once); a block frozen on
    the last stage for a step (gradients None) and unfrozen again keeps the figures exact, and steps with an
    unchanged layout make no host read."""
    if world != 2:
        return "skip: two stages"
    if importlib.util.find_spec("transformers") is None:
        return "skip: transformers is not installed"
    model = model_zoo.gpt2(seed=0, n_layer=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    first = ("transformer.wte.", "transformer.wpe.", "transformer.h.0.")
    for step in range(5):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()  # the same step on both ranks: each keeps its stage's part
        frozen = step == 2  # the last stage's attention, frozen for one step
        full = [(n, None if frozen and n.startswith("transformer.h.1.attn.") else p.grad)
                for n, p in model.named_parameters()]
        if rank == 0:
            mine = [(n, g) for n, g in full if n.startswith(first)]
        else:
            mine = [(n, g) for n, g in full if not n.startswith(first)] + [(TIED, model.transformer.wte.weight.grad)]
        params = [_copy(n, g) for n, g in mine]
        with AllHostReads() as reads:
            stats = clip_grad_norm_(params, max_norm=1.0, stage_group=dist.group.WORLD, tied={TIED})
        want = _reference(full)
        rep = stats.report()
        assert math.isclose(rep.total_norm, want, rel_tol=1e-12), (step, rep.total_norm, want)
        assert math.isclose(rep.clip_coef, 1.0 / (want + 1e-6), rel_tol=1e-12), (step, rep.clip_coef)
        assert f"{TIED}@stage0" in rep.norms and f"{TIED}@stage1" in rep.norms, list(rep.norms)
        if step in (1, 4):  # the layout of the step before, unchanged
            assert reads.count == 0, (step, reads.count)
        opt.step()
    return None


def resnet_sharded_gradients(rank: int, world: int) -> None:
    """The zoo's ResNet (in-place residual, ReLU(inplace=True)) trained data-parallel with ZeRO-like gradient
    shards: every rank holds a flat piece of every gradient (`group=`). The last rank's piece of the classifier is
    missing for one step, one step is read under inference_mode, and on odd steps only rank 0 reports while the
    others call check_layout(); the totals equal the reference of what the ranks hold at every step."""
    model = model_zoo.resnet(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    for step in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pieces: list[list[tuple[str, torch.Tensor | None]]] = [[] for _ in range(world)]
        for name, p in model.named_parameters():
            for r, piece in enumerate(torch.tensor_split(p.grad.reshape(-1), world)):
                lost = step == 2 and r == world - 1 and name.startswith("fc.")
                pieces[r].append((name, None if lost else piece))
        mine = [_copy(n, g) for n, g in pieces[rank]]
        if step == 1:  # read under inference_mode (as in an evaluation loop): later calls are unaffected
            with torch.inference_mode():
                stats = grad_stats(mine, group=dist.group.WORLD)
        else:
            stats = grad_stats(mine, group=dist.group.WORLD)
        want = _reference([(n, g) for held in pieces for n, g in held])
        if rank != 0 and step % 2:  # one rank reports, the others read only the layout flags
            stats.check_layout()
            assert math.isclose(float(stats.total_norm), want, rel_tol=1e-12), (step, float(stats.total_norm))
        else:
            rep = stats.report()
            assert math.isclose(rep.total_norm, want, rel_tol=1e-12), (step, rep.total_norm, want)
            assert list(rep.norms) == [n for n, _ in model.named_parameters()], list(rep.norms)
        opt.step()


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f for f in (gpt2_pipeline_stages, resnet_sharded_gradients)  # type: ignore[misc]
}
