"""The Lightning callback with several optimizers under DDP: a tiny GAN in manual optimization on two CPU ranks
(gloo), launched by Lightning itself from tests/_integrations_lightning_optimizers_ddp_worker.py. Each optimizer's
logged figures are checked against float64 norms of the average of both ranks' local gradients of that optimizer's
parameters; a loss spike and a NaN on rank 1's generator alone must make both ranks skip the generator's step and
neither the discriminator's, and dump the generator's own flight recorder (on the logging rank, whose report reads
the rows); the activation watch counts the same steps on both ranks, with validations between them. About 15 s on
a busy 2-core machine (two Python start-ups and Lightning's DDP set-up dominate), hence the markers."""

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

WORKER = Path(__file__).with_name("_integrations_lightning_optimizers_ddp_worker.py")
REPO = Path(__file__).resolve().parents[1]
SPIKE_BATCH, NAN_BATCH, BATCHES = 7, 10, 12  # as in the worker
NAMES = {
    "generator": ["generator.0.weight", "generator.0.bias", "generator.2.weight", "generator.2.bias"],
    "discriminator": ["discriminator.0.weight", "discriminator.0.bias", "discriminator.2.weight",
                      "discriminator.2.bias"],
}


def _rows(out: Path) -> dict[int, dict[str, float]]:
    """Rank 0's CSV rows merged by logger step (each optimizer's figures are written by a call of their own)."""
    (metrics,) = list(out.rglob("metrics.csv"))
    rows: dict[int, dict[str, float]] = {}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update(
                {k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return rows


def test_ddp_each_optimizer_reads_the_averaged_gradients_and_the_ranks_skip_alike(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], check=False, env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    rows = _rows(tmp_path)
    assert sorted(rows) == list(range(BATCHES))  # one logger step per batch, both optimizers' figures at it
    for batch, row in rows.items():
        for which, names in NAMES.items():
            key = f"{batch}/{which}"
            # the global average of the two ranks' local gradients of this optimizer's parameters, in float64
            loc0, loc1 = r0["local"][key], r1["local"][key]
            assert sorted(loc0) == sorted(loc1) == sorted(names), key  # no other parameter's gradient was made
            avg = {n: (torch.tensor(loc0[n], dtype=torch.float64) + torch.tensor(loc1[n], dtype=torch.float64)) / 2
                   for n in names}
            norms = {n: float(a.norm()) for n, a in avg.items()}
            total = math.sqrt(sum(v * v for v in norms.values()))
            if batch == NAN_BATCH and which == "generator":
                assert math.isnan(total)
                assert row[f"grad_stats/{which}/nan_count"] == 1.0
                assert row[f"grad_stats/{which}/first_nonfinite_index"] == 2.0  # generator.2.weight, among its own
                assert math.isnan(row[f"grad_2.0_norm/{which}/generator.2.weight"])
                continue
            assert loc0 != loc1, key  # the ranks' own gradients differ: the average is not either one
            assert row[f"grad_stats/{which}/total_norm"] == pytest.approx(total, rel=1e-6), key
            assert row[f"grad_2.0_norm_total/{which}"] == pytest.approx(total, rel=1e-6), key
            assert row[f"grad_stats/{which}/num_tensors"] == len(names), key
            assert row[f"grad_stats/{which}/nan_count"] == 0.0, key
            for n in names:
                assert row[f"grad_2.0_norm/{which}/{n}"] == pytest.approx(norms[n], rel=1e-6), (key, n)
                # what each rank's optimizer stepped with: the same average (DDP's, in float32) on both
                assert r0["norms"][key][n] == r1["norms"][key][n] == pytest.approx(norms[n], rel=1e-6), (key, n)
    # rank 1's generator alone spiked (its loss) and went NaN (its gradient): both ranks skipped those generator
    # steps, and neither skipped a discriminator step
    expected = [f"{SPIKE_BATCH}/generator", f"{NAN_BATCH}/generator"]
    assert r0["unchanged"] == r1["unchanged"] == expected
    assert r0["skipped"] == r1["skipped"] == [2 * NAN_BATCH]  # on_nonfinite: each rank's own check, the same step
    for batch, row in rows.items():
        skipped = sum(b <= batch for b in (SPIKE_BATCH, NAN_BATCH))
        assert row["guard/generator/skipped"] == float(skipped), batch
        assert row["guard/discriminator/skipped"] == 0.0, batch
    assert rows[SPIKE_BATCH]["guard/generator/loss_z"] > 100.0  # the loss judged is the ranks' mean
    assert abs(rows[SPIKE_BATCH]["guard/discriminator/loss_z"]) < 6.0
    # the guards' statistics and the weights are the same on both ranks after the run
    assert sorted(r0["guards"]) == ["discriminator", "generator"]
    assert r0["guards"] == r1["guards"]
    assert r0["weights"] == r1["weights"]
    assert all(math.isfinite(v) for w in r0["weights"] for v in w)
    # The activation watch: under DDP Lightning runs every training and validation step through DDP's forward, which
    # calls the LightningModule's, so each batch is one step of the watch on both ranks, both optimizers' steps in
    # it, and each batch of the sanity check and of the validations (every 4 batches, the discriminator alone) is a
    # step of its own. Each rank watches its own activations: rank 0's, finite throughout, are the ones logged.
    for batch in range(BATCHES):
        want = 2 + batch + 2 * (batch // 4)
        for which in NAMES:
            key = f"{batch}/{which}"
            assert r0["watch_steps"][key] == r1["watch_steps"][key] == want, key
    for batch, row in rows.items():
        for which in NAMES:
            assert (row[f"act/{which}/nonfinite"], row[f"act/{which}/origin_index"]) == (0.0, -1.0), (batch, which)
    assert "ran after step" not in proc.stdout + proc.stderr  # no backward was left out of the watch's reports
    # Each optimizer's per-example figures are logged under its name. The generator's two skipped steps dumped its
    # own flight recorder (none of the discriminator's), with the rows of the averaged gradients: on rank 0, whose
    # report reads the rows (rank 1 makes none: its recorder holds the same steps, never read)
    for which in NAMES:
        assert all(row[f"examples/{which}/max_norm"] > 0 for row in rows.values()), which
    names = [f"flight-generator-{2 * SPIKE_BATCH}.jsonl", f"flight-generator-{2 * NAN_BATCH}.jsonl"]
    assert sorted(r0["dumps"]) == sorted(names) and r1["dumps"] == {}
    for name, last in zip(names, (SPIKE_BATCH, NAN_BATCH)):
        dumped = r0["dumps"][name]
        assert [r["step"] for r in dumped] == [2 * b for b in range(last + 1)], name
        for batch, r in enumerate(dumped):
            if batch == NAN_BATCH:
                assert r["total_norm"] is None and r["nan_count"] == 1
                continue
            want = math.sqrt(sum(v * v for v in r0["norms"][f"{batch}/generator"].values()))
            assert r["total_norm"] == pytest.approx(want, rel=1e-6), (name, batch)
        assert dumped[-1]["guard/consecutive"] == 1
    # rank 1 never reports: it lets its rows go at each logging step instead of keeping them (none pending at the end)
    assert r0["pending"] == r1["pending"] == {"generator": False, "discriminator": False}
