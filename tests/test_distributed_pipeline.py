"""Pipeline parallelism on CPU with gloo, 2 and 4 ranks (tests/_dist_pipeline_workers.py): a parameter tied across
stages, clipping by the whole model's norm.

One spawn per world size runs every scenario; each is reported by its own test. A rank that dies or hangs leaves
its later scenarios "not reached", which fails them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_pipeline_workers
from test_distributed import _spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def pipeline_results(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, str]]], str]:
    world = request.param
    outdir = str(tmp_path_factory.mktemp(f"pipeline{world}"))
    crash = ""
    try:
        _spawn(world, outdir, "_dist_pipeline_workers")
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


@pytest.mark.parametrize("scenario", list(_dist_pipeline_workers.SCENARIOS))
def test_scenario(pipeline_results, scenario: str) -> None:
    world, results, crash = pipeline_results
    outcomes = [r.get(scenario, {"status": "fail", "detail": f"not reached ({crash or 'no result'})"}) for r in results]
    failed = [(rank, o["detail"]) for rank, o in enumerate(outcomes) if o["status"] == "fail"]
    if failed:
        pytest.fail("\n".join(f"--- rank {rank} of {world}:\n{detail}" for rank, detail in failed))
    if all(o["status"] == "skip" for o in outcomes):
        pytest.skip(outcomes[0]["detail"])
    assert all(o["status"] == "ok" for o in outcomes), outcomes
