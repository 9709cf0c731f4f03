"""Lightning callback under DDP: two CPU ranks (gloo) launched by Lightning itself from
tests/_integrations_lightning_ddp_worker.py. About 30 s on a busy 2-core machine (two Python start-ups and
Lightning's DDP set-up dominate), hence the markers."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
]

WORKER = Path(__file__).with_name("_integrations_lightning_ddp_worker.py")
REPO = Path(__file__).resolve().parents[1]


def test_ddp_ranks_agree_and_only_rank_zero_logs(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], check=False, env=env, capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    # only rank 0 brings the figures to the host (steps 1 and 3, as Lightning logs every 2nd); rank 1 never does
    assert r0["reports"] == 2 and r1["reports"] == 0
    # the NaN came from rank 1's backward; DDP averaged it into every rank and every rank skipped that step
    assert r0["skipped"] == r1["skipped"] == [3]
    assert r0["weights"] == r1["weights"]
    assert all(math.isfinite(v) for w in r0["weights"] for v in w)
    # every rank holds the same averaged gradients
    assert r0["norms"].keys() == r1["norms"].keys()
    for step in r0["norms"]:
        for name, v in r0["norms"][step].items():
            u = r1["norms"][step][name]
            assert (math.isnan(v) and math.isnan(u)) or v == pytest.approx(u, rel=1e-12)
    (metrics,) = list(tmp_path.rglob("metrics.csv"))
    rows = {int(r["step"]): r for r in csv.DictReader(metrics.open())}
    assert sorted(rows) == [1, 3]
    for name, ref in r0["norms"]["1"].items():
        assert float(rows[1][f"grad_2.0_norm/{name}"]) == pytest.approx(ref, rel=1e-6)
    assert float(rows[3]["grad_stats/nan_count"]) == 1.0
    assert float(rows[3]["grad_stats/first_nonfinite_index"]) == 2.0  # net.2.weight
