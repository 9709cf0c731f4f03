"""compat.deepspeed.engine_grad_stats on real DeepSpeed ZeRO 1/2 engines: 2 gloo ranks on the CPU against a float64
reference (tests/_deepspeed_worker.py). Skipped where DeepSpeed is not installed."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
import torch
from torch import nn

from torch_gradstats.compat.deepspeed import engine_grad_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _deepspeed_worker


def test_not_a_zero_engine_is_a_type_error():
    with pytest.raises(TypeError, match="ZeRO stage 1 or 2"):
        engine_grad_stats(nn.Linear(2, 2))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    import torch.multiprocessing as mp

    world, outdir = 2, str(tmp_path_factory.mktemp("deepspeed"))
    ctx = mp.start_processes(
        _deepspeed_worker.run_worker, args=(world, _free_port(), outdir), nprocs=world, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the 2-rank DeepSpeed run did not finish in 240 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    out = []
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(_deepspeed_worker.SCENARIOS))
def test_two_ranks(dist_results, scenario):
    failed = [f"--- rank {r}:\n{res.get(scenario, 'not reached')}" for r, res in enumerate(dist_results)
              if res.get(scenario) != "ok"]
    assert not failed, "\n".join(failed)
