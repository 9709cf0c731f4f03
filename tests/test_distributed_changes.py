"""Layouts that change between calls, with no host read in steady state (tests/_dist_change_workers.py), on CPU
with gloo, 2 and 4 ranks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_change_workers
from test_distributed import GLOO_MARKS, assert_scenario, scenario_results

pytestmark = GLOO_MARKS
results = scenario_results("_dist_change_workers")


@pytest.mark.parametrize("scenario", list(_dist_change_workers.SCENARIOS))
def test_scenario(results, scenario: str) -> None:
    assert_scenario(results, scenario)
