"""Monitors left attached while the model generates text (``model.generate()``: many forwards, a KV cache, eval mode,
``no_grad`` / ``inference_mode``) or runs evaluation forwards between training steps: the training steps' figures
are those of the same run without the generation.

- ActivationWatch on GPT-2 and a ``TransformerEncoder``: greedy and sampled generation, with and without
  ``inference_mode``, a padded batch of different lengths with its attention mask; memory stays bounded.
- PerExampleNorms after generation and eval forwards (with grad on, never backpropagated): each example's norm
  against float64 per-example gradients, one backward per example.
- The Hugging Face callback with every monitor on and a callback generating samples at ``on_step_end``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from pathlib import Path
from typing import Any

import model_zoo
import pytest
import torch
from torch import nn

from torch_gradstats import ActivationWatch, FlightRecorder, PerExampleNorms, SpikeGuard

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.usefixtures("one_thread")

T = 8


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _quiet_gpt2(seed: int = 0) -> Any:
    model = model_zoo.gpt2(seed)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _generate(model: Any, *, sample: bool, inference: bool, cache: bool = True) -> Any:
    """A padded batch of two prompts of different lengths (left padding, as decoder-only generation wants)."""
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    was = model.training
    model.eval()
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=sample,
                             use_cache=cache, pad_token_id=0, top_k=0 if sample else None)
    model.train(was)
    return out


def _train_step(model: Any, batch: torch.Tensor) -> None:
    out = model(input_ids=batch, labels=batch, position_ids=torch.arange(batch.shape[1]).expand_as(batch))
    out.loss.backward()


def _figures(watch: ActivationWatch) -> dict[str, Any]:
    report = watch.report()
    return {"modules": report.modules, "origin": report.origin, "forward_order": report.forward_order,
            "backward_order": report.backward_order, "nonfinite": report.nonfinite}


# ================================================================================================ ActivationWatch
@pytest.mark.skipif(not _installed("transformers"), reason="needs transformers")
@pytest.mark.parametrize("every", [1, 3])
def test_watch_training_figures_after_generation_are_those_without_it(every: int) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, 64, (2, T), generator=g) for _ in range(7)]

    def run(generate: bool) -> list[dict[str, Any] | None]:
        model = _quiet_gpt2()
        watch = ActivationWatch(model, every_n_steps=every)
        seen: list[dict[str, Any] | None] = []
        for k, batch in enumerate(batches):
            if generate:  # before the step: its forwards are steps of the watch's count too
                _generate(model, sample=k % 2 == 1, inference=k % 3 != 0)
            model.zero_grad()
            _train_step(model, batch)
            seen.append(_figures(watch) if watch.report().step == watch.step else None)  # recorded
        watch.remove()
        return seen

    with_generation, plain = run(True), run(False)
    recorded = [f is not None for f in plain]
    assert recorded == [k % every == 0 for k in range(len(batches))]
    assert [f is not None for f in with_generation] == recorded  # the training steps recorded are the same ones
    for got, want in zip(with_generation, plain):
        assert got == want
