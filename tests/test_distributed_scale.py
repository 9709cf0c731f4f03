"""What the reductions across ranks cost and in which order they run (tests/_dist_scale_workers.py), on CPU with
gloo, 2 and 4 ranks: bytes per all-reduce independent of the world size, the same collectives in the same order on
every rank whatever it holds."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_scale_workers
from test_distributed import GLOO_MARKS, assert_scenario, scenario_results

pytestmark = GLOO_MARKS
results = scenario_results("_dist_scale_workers")


@pytest.mark.parametrize("scenario", list(_dist_scale_workers.SCENARIOS))
def test_scenario(results, scenario: str) -> None:
    assert_scenario(results, scenario)
