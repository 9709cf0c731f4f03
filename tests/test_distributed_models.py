"""The model zoo's real models across ranks that hold different parameters (tests/_dist_models_workers.py), on
CPU with gloo, 2 and 4 ranks."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_models_workers
from test_distributed import assert_scenario, spawn_scenarios

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def models_results(request, tmp_path_factory) -> tuple[int, list[dict[str, dict[str, str]]], str]:
    return spawn_scenarios(request.param, str(tmp_path_factory.mktemp(f"models{request.param}")),
                           "_dist_models_workers")


@pytest.mark.parametrize("scenario", list(_dist_models_workers.SCENARIOS))
def test_scenario(models_results, scenario: str) -> None:
    assert_scenario(models_results, scenario)
