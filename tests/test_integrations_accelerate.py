"""The Hugging Face Accelerate loop of docs/integrations.md ("Hugging Face Accelerate loops") on the zoo's GPT-2
(loss inside ``forward``): figures read at each step's last micro-batch, clipped with the library's clip, against a
float64 twin trained by plain torch; in one process here, under accelerate's DDP over gloo in
tests/_accelerate_workers.py."""

from __future__ import annotations

import math

import _accelerate_workers
import model_zoo
import pytest
import torch
from test_distributed import assert_scenario, scenario_results

import torch_gradstats as tg

accelerate = pytest.importorskip("accelerate")


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The zoo's GPT-2 with its dropout off, so that a twin sees the same activations."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def test_gpt2_with_gradient_accumulation_matches_a_float64_twin() -> None:
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2)
    device = accelerator.device
    model = _no_dropout(model_zoo.gpt2(seed=0))
    twin = _no_dropout(model_zoo.gpt2(seed=0)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    twin.to(device)
    gen = torch.Generator().manual_seed(1)
    steps = 0
    for micro in range(4):
        ids = torch.randint(0, 64, (4, 8), generator=gen).to(device)
        with accelerator.accumulate(model):
            accelerator.backward(model(ids, labels=ids).loss)
            (twin(ids, labels=ids).loss / 2).backward()
            if accelerator.sync_gradients:
                assert micro % 2 == 1, micro  # the step's last micro-batch
                accelerator.unscale_gradients()
                stats = tg.clip_grad_norm_(accelerator.unwrap_model(model).named_parameters(), max_norm=0.1)
                report, want = stats.report(), tg.grad_stats(twin.named_parameters()).report()
                assert list(report.norms) == list(want.norms)
                assert math.isclose(report.total_norm, want.total_norm, rel_tol=1e-5)
                assert report.total_norm > 0.1  # so the clip below acts
                torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
                twin_optimizer.step()
                twin_optimizer.zero_grad()
                steps += 1
            optimizer.step()
            optimizer.zero_grad()
        model.eval()  # an evaluation forward between micro-batches reads nothing and changes nothing
        with torch.inference_mode():
            model(ids, labels=ids)
        model.train()
    assert steps == 2
    for (name, p), q in zip(accelerator.unwrap_model(model).named_parameters(), twin.parameters()):
        assert torch.allclose(p.detach().double(), q.detach(), atol=1e-5), name



def test_names_of_a_compiled_model_through_unwrap_model() -> None:
    """A model compiled before ``prepare`` stays compiled, and ``unwrap_model`` keeps that wrapper by default: its
    names start with ``_orig_mod.``. With ``keep_torch_compile=False`` (the docs' recipe) the rows are the model's own
    names and figures."""
    import inspect

    if "keep_torch_compile" not in inspect.signature(accelerate.Accelerator.unwrap_model).parameters:
        pytest.skip("accelerate before 1.3: unwrap_model has no keep_torch_compile")
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=1)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = accelerator.prepare(torch.compile(plain, backend="eager"))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(accelerator.device)
    accelerator.backward(model(x).pow(2).mean())
    assert next(n for n, _ in accelerator.unwrap_model(model).named_parameters()) == "_orig_mod.0.weight"
    report = tg.grad_stats(accelerator.unwrap_model(model, keep_torch_compile=False).named_parameters()).report()
    want = tg.grad_stats(plain.named_parameters()).report()
    assert list(report.norms) == ["0.weight", "0.bias", "2.weight", "2.bias"] == list(want.norms)
    assert report.total_norm == want.total_norm > 0

results = scenario_results("_accelerate_workers")


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(_accelerate_workers.SCENARIOS))
def test_scenario(results, scenario: str) -> None:
    assert_scenario(results, scenario)
