"""bench/accuracy.py, which measures the figures of docs/accuracy.md: a small run keeps them true."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def accuracy():
    spec = importlib.util.spec_from_file_location("_bench_accuracy", ROOT / "bench" / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sumsq_within_the_documented_bounds(accuracy) -> None:
    errors = accuracy.sumsq_errors("cpu", trials=4, show=False)
    assert set(errors) == {"float16", "bfloat16", "float32", "float64"}
    for dtype, per_kind in errors.items():
        assert set(per_kind) == set(accuracy.KINDS)
        bound = 1e-12 if dtype == "float64" else 4e-6  # docs/accuracy.md: <= 3.4e-6 measured, 1e-5 by contract
        assert all(0 <= e <= bound for e in per_kind.values()), (dtype, per_kind)
    # a fraction of the error of a float32 sum, so float64 inputs are summed in float64
    assert max(errors["float64"].values()) < 1e-13


def test_clip_differences_as_documented(accuracy) -> None:
    rows = {r["case"]: r for r in accuracy.clip_differences("cpu", trials=6, show=False)}
    f32 = rows["float32, max_norm 0.01-10, norm up to 1e6"]
    assert f32["diff"] < 1e-6 and f32["zeroed"] == 0
    usual = rows["float16, max_norm 0.01-10, coef >= 6.1e-5"]
    assert usual["diff"] < 2e-3 and usual["closer"] == usual["trials"]
    big = rows["float16, norm 7e4-3e5 (finite elements)"]
    assert big["zeroed"] == big["trials"]  # torch's float16 norm is inf and zeroes the gradients; ours scales them
    bf16 = rows["bfloat16, max_norm 0.01-10, norm up to 1e6"]
    assert 0 < bf16["diff"] < 0.01 and bf16["closer"] == bf16["trials"]
    for row in rows.values():
        assert math.isfinite(row["diff"]) and row["trials"] == 6
