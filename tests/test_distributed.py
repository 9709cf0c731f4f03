"""Global gradient statistics across ranks (torch_gradstats.distributed.reduce), on CPU with gloo, 2 and 4 ranks.

One spawn per world size runs every scenario of tests/_dist_workers.py (process start-up dominates the cost, so the
checks are grouped); each scenario is then reported by its own test. Children start from a forkserver that has
already imported torch, so a 4-rank run starts in well under a second after the first.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import time
from typing import Any

import pytest
import torch

from torch_gradstats.distributed.reduce import ReducedStats, reduce_across_ranks
from torch_gradstats.ops.op import multi_tensor_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_workers

#: The marks of every test that spawns gloo ranks (this module's and the other test_distributed_*.py).
GLOO_MARKS = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
]
pytestmark = GLOO_MARKS

SPAWN_TIMEOUT_S = 120.0  # whole run of one world size
COLLECTIVE_TIMEOUT_S = 60.0  # a rank stuck in a collective gives up after this
# Imported once by the forkserver, inherited by every rank. torch._dynamo and fsdp are imported lazily by the first
# distribute_tensor / fully_shard (seconds each on a small machine); pytest is what each child re-imports as __main__.
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "pytest",
    "_dist_workers",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, outdir: str, scenarios_module: str = "_dist_workers") -> None:
    """Run _dist_workers.run_worker on ``world`` ranks; kill them all if they overrun SPAWN_TIMEOUT_S."""
    import torch.multiprocessing as mp

    # Preloading in the forkserver pays the imports once for all ranks (ignored if a forkserver already runs).
    multiprocessing.set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(
        _dist_workers.run_worker,
        args=(world, _free_port(), outdir, COLLECTIVE_TIMEOUT_S, scenarios_module),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world}-rank run did not finish in {SPAWN_TIMEOUT_S:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def spawn_scenarios(world: int, outdir: str, scenarios_module: str) -> tuple[int, list[dict[str, dict[str, str]]], str]:
    """Run every scenario of ``scenarios_module`` on ``world`` ranks: (world, each rank's outcomes, the crash if a
    rank died or hung; its unfinished scenarios then read "not reached" in assert_scenario)."""
    crash = ""
    try:
        _spawn(world, outdir, scenarios_module)
    except Exception as exc:  # noqa: BLE001 - reported per scenario
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


def scenario_results(scenarios_module: str) -> Any:
    """A module-scoped fixture named ``results``: one spawn per world size (2 and 4) that runs every scenario of
    ``scenarios_module``; ``assert_scenario(results, name)`` then reports each."""

    @pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}", name="results")
    def results(request: Any, tmp_path_factory: Any) -> tuple[int, list[dict[str, dict[str, str]]], str]:
        outdir = str(tmp_path_factory.mktemp(f"{scenarios_module.strip('_')}{request.param}"))
        return spawn_scenarios(request.param, outdir, scenarios_module)

    return results


def assert_scenario(spawned: tuple[int, list[dict[str, dict[str, str]]], str], scenario: str) -> None:
    """One scenario's outcome on every rank: a failure on any rank fails it, naming the rank; skipped if all skip."""
    world, results, crash = spawned
    outcomes = [r.get(scenario, {"status": "fail", "detail": f"not reached ({crash or 'no result'})"}) for r in results]
    failed = [(rank, o["detail"]) for rank, o in enumerate(outcomes) if o["status"] == "fail"]
    if failed:
        pytest.fail("\n".join(f"--- rank {rank} of {world}:\n{detail}" for rank, detail in failed))
    if all(o["status"] == "skip" for o in outcomes):
        pytest.skip(outcomes[0]["detail"])
    assert all(o["status"] == "ok" for o in outcomes), outcomes


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def dist_results(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, str]]], str]:
    return spawn_scenarios(request.param, str(tmp_path_factory.mktemp(f"dist{request.param}")), "_dist_workers")


@pytest.mark.parametrize("scenario", list(_dist_workers.SCENARIOS))
def test_scenario(dist_results, scenario: str) -> None:
    assert_scenario(dist_results, scenario)


# ---------------------------------------------------------------------------------------------- single process
def _local_stats():
    tensors = [torch.randn(3, 2), torch.randn(4)]
    return tensors, multi_tensor_stats(tensors)


def test_no_group_no_dtensor_is_a_no_op() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    tensors, (s, a, c) = _local_stats()
    out = reduce_across_ranks(tensors, s, a, c, None)
    assert isinstance(out, ReducedStats)
    assert out.sumsq is s and out.amax is a and out.counts is c and out.rank_nonfinite is None
    assert out.numel.tolist() == [6, 4]


def test_group_without_init_process_group_is_a_clear_error() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    tensors, (s, a, c) = _local_stats()
    with pytest.raises(RuntimeError, match="not initialized"):
        reduce_across_ranks(tensors, s, a, c, object())


def test_bad_inputs_name_the_argument() -> None:
    tensors, (s, a, c) = _local_stats()
    with pytest.raises(ValueError, match="sumsq"):
        reduce_across_ranks(tensors[:1], s, a, c)
    with pytest.raises(ValueError, match="counts"):
        reduce_across_ranks(tensors, s, a, c.to(torch.float64))
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        reduce_across_ranks([tensors[0], "x"], s, a, c)
