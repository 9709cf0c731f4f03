"""Pipeline parallelism on CPU with gloo, 2 and 4 ranks (tests/_dist_pipeline_workers.py): a parameter tied across
stages, clipping by the whole model's norm.

One spawn per world size runs every scenario; each is reported by its own test. A rank that dies or hangs leaves
its later scenarios "not reached", which fails them.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_pipeline_workers
from test_distributed import assert_scenario, spawn_scenarios

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def pipeline_results(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, str]]], str]:
    outdir = str(tmp_path_factory.mktemp(f"pipeline{request.param}"))
    return spawn_scenarios(request.param, outdir, "_dist_pipeline_workers")


@pytest.mark.parametrize("scenario", list(_dist_pipeline_workers.SCENARIOS))
def test_scenario(pipeline_results, scenario: str) -> None:
    assert_scenario(pipeline_results, scenario)
