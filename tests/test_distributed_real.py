"""Real wrappers whose ranks hold different parameters (tests/_dist_real_workers.py), on CPU with gloo, 2 and 4 ranks.

One spawn per world size runs every scenario; each is reported by its own test. A rank that dies (gloo aborts on
buffers of different sizes) or hangs leaves its later scenarios "not reached", which fails them.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_real_workers
from test_distributed import GLOO_MARKS, assert_scenario, scenario_results

pytestmark = GLOO_MARKS
results = scenario_results("_dist_real_workers")


@pytest.mark.parametrize("scenario", list(_dist_real_workers.SCENARIOS))
def test_scenario(results, scenario: str) -> None:
    assert_scenario(results, scenario)
