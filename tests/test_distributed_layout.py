"""Ranks that hold different parameters (tests/_dist_layout_workers.py), on CPU with gloo, 2 and 4 ranks.

One spawn per world size runs every scenario; each is reported by its own test. A rank that dies (gloo aborts on
buffers of different sizes) or hangs leaves its later scenarios "not reached", which fails them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_layout_workers
from test_distributed import _spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def layout_results(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, str]]], str]:
    world = request.param
    outdir = str(tmp_path_factory.mktemp(f"layout{world}"))
    crash = ""
    try:
        _spawn(world, outdir, "_dist_layout_workers")
    except Exception as exc:  # noqa: BLE001 - a rank died or hung: its unfinished scenarios fail below
        crash = f"{type(exc).__name__}: {exc}"
    results = []
    for rank in range(world):
        path = os.path.join(outdir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({})
    return world, results, crash


@pytest.mark.parametrize("scenario", list(_dist_layout_workers.SCENARIOS))
def test_scenario(layout_results, scenario: str) -> None:
    world, results, crash = layout_results
    outcomes = [r.get(scenario, {"status": "fail", "detail": f"not reached ({crash or 'no result'})"}) for r in results]
    failed = [(rank, o["detail"]) for rank, o in enumerate(outcomes) if o["status"] == "fail"]
    if failed:
        pytest.fail("\n".join(f"--- rank {rank} of {world}:\n{detail}" for rank, detail in failed))
    if all(o["status"] == "skip" for o in outcomes):
        pytest.skip(outcomes[0]["detail"])
    assert all(o["status"] == "ok" for o in outcomes), outcomes


# ---------------------------------------------------------------------------------------------- single process
def test_bad_arguments_name_the_argument() -> None:
    from torch_gradstats.distributed import is_logging_rank, reduce_across_ranks
    from torch_gradstats.ops import multi_tensor_stats

    tensors = [torch.randn(3), torch.randn(2)]
    s, a, c = multi_tensor_stats(tensors)
    with pytest.raises(TypeError, match="names"):
        reduce_across_ranks(tensors, s, a, c, names="ab")
    with pytest.raises(ValueError, match="names must be unique"):
        reduce_across_ranks(tensors, s, a, c, names=["w", "w"])
    with pytest.raises(ValueError, match="names must be 2 strings"):
        reduce_across_ranks(tensors, s, a, c, names=["w"])
    with pytest.raises(TypeError, match="is_expert"):
        reduce_across_ranks(tensors, s, a, c, names=["a", "b"], expert_group=object(), is_expert="experts")
    with pytest.raises(ValueError, match="expert_group and is_expert"):
        reduce_across_ranks(tensors, s, a, c, names=["a", "b"], is_expert=lambda n: True)
    with pytest.raises(TypeError, match="tied"):
        reduce_across_ranks(tensors, s, a, c, names=["a", "b"], stage_group=object(), tied="a")
    with pytest.raises(ValueError, match="pass stage_group"):
        reduce_across_ranks(tensors, s, a, c, names=["a", "b"], tied={"a"})
    with pytest.raises(ValueError, match="pass names="):
        reduce_across_ranks(tensors, s, a, c, stage_group=object())
    with pytest.raises(TypeError, match="rank must be an int"):
        is_logging_rank(rank="0")


def test_grad_stats_rejects_a_string_as_tied() -> None:
    from torch_gradstats import grad_stats

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(TypeError, match="tied"):
        grad_stats([("emb", p)], stage_group=object(), tied="emb")


def test_without_init_process_group() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    from torch_gradstats.distributed import is_logging_rank, reduce_across_ranks
    from torch_gradstats.ops import multi_tensor_stats

    tensors = [torch.randn(3)]
    s, a, c = multi_tensor_stats(tensors)
    with pytest.raises(RuntimeError, match="not initialized"):
        reduce_across_ranks(tensors, s, a, c, names=["w"], stage_group=object())
    out = reduce_across_ranks(tensors, s, a, c, names=["w"])
    assert out.names == ["w"] and out.sumsq is s
    assert is_logging_rank() and is_logging_rank(rank=3)
