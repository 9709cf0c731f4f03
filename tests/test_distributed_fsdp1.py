"""FSDP1 (FullyShardedDataParallel) read by grad_stats, clip_grad_norm_, grad_and_weight_stats and the policies
(tests/_dist_fsdp1_workers.py), on CPU with gloo, 2 and 4 ranks: flat and original parameters, nested units,
SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, mixed precision, no_sync() accumulation and the model zoo, against the
unsharded model's gradients.

One spawn per world size runs every scenario; each is reported by its own test.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_fsdp1_workers
from test_distributed import GLOO_MARKS, assert_scenario, scenario_results

pytestmark = GLOO_MARKS
results = scenario_results("_dist_fsdp1_workers")


@pytest.mark.parametrize("scenario", list(_dist_fsdp1_workers.SCENARIOS))
def test_scenario(results, scenario: str) -> None:
    assert_scenario(results, scenario)
