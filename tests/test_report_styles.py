"""Report keys: the fused clip's coefficient and post-clip norm, and GradReport.to_dict(style=...) checked against the
keys the frameworks themselves log."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torch_gradstats as tg


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    m(torch.randn(5, 4)).square().sum().mul(100).backward()
    return m


# ---------------------------------------------------------------------------------------------- clip
def test_clip_exposes_coefficient_and_post_clip_norm_on_the_device() -> None:
    m = _model()
    reference = [p.grad.clone() for p in m.parameters()]
    stats = tg.clip_grad_norm_(m.named_parameters(), max_norm=1.0)
    assert stats.clip_coef is not None and stats.clipped_norm is not None and stats.clip_norm is not None
    assert stats.clipped_norm.dtype == torch.float64 and stats.clipped_norm.device == stats.device
    pre = torch.cat([g.reshape(-1) for g in reference]).double().norm().item()
    post = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).double().norm().item()
    report = stats.report()
    assert pre > 1.0
    assert report.total_norm == pytest.approx(pre, rel=1e-6)
    assert report.clip_coef == pytest.approx(1.0 / (pre + 1e-6), rel=1e-6)
    assert report.clipped_norm == pytest.approx(post, rel=1e-6)  # what the gradients hold after the clip
    assert report.clipped_norm == pytest.approx(1.0, rel=1e-5)
    d = report.to_dict()
    assert d["clip_coef"] == report.clip_coef and d["clipped_norm"] == report.clipped_norm


def test_clip_below_max_norm_keeps_the_norm() -> None:
    m = _model()
    report = tg.clip_grad_norm_(m.parameters(), max_norm=1e9).report()
    assert report.clip_coef == 1.0 and report.clipped_norm == report.total_norm


def test_unclipped_reports_have_no_clip_keys() -> None:
    d = tg.grad_stats(_model().named_parameters()).report().to_dict()
    assert "clip_coef" not in d and "clipped_norm" not in d


def test_clip_with_a_nan_reports_nan_coefficient_and_norm() -> None:
    m = _model()
    m[0].weight.grad[0, 0] = math.nan
    report = tg.clip_grad_norm_(m.parameters(), max_norm=1.0).report()
    assert math.isnan(report.clip_coef) and math.isnan(report.clipped_norm)  # type: ignore[arg-type]


def test_clip_of_no_gradients() -> None:
    report = tg.clip_grad_norm_([torch.zeros(2, requires_grad=True)], max_norm=1.0).report()
    assert report.clip_coef == 1.0 and report.clipped_norm == 0.0
