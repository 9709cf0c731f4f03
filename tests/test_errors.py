"""Bad input to the public API: a wrong type raises TypeError, a bad value ValueError, each naming the argument and
what it accepts; numpy integers are accepted wherever a Python int is; ``torch.vmap`` over the op works."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import torch_gradstats as tg
from torch_gradstats.compat import collector as C
from torch_gradstats.ops.op import reference_multi_tensor_stats
from torch_gradstats.training import Trainer


def _trainer(**kw: object) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), progress=False, **kw)


def _batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]


# ----------------------------------------------------------------------------------------------- the op's input
@pytest.mark.parametrize(
    "bad, named",
    [
        (3, "an int"),
        (None, "None"),
        (2.5, "a float"),
        ("abc", "a str"),
        (b"abc", "a bytes"),
        ({"w": torch.ones(2)}, "a dict"),
        ({torch.ones(2)}, "a set"),
    ],
    ids=["int", "None", "float", "str", "bytes", "dict", "set"],
)
def test_op_input_that_is_not_a_list_of_tensors_is_a_type_error(bad, named):
    msg = f"multi_tensor_stats: tensors must be a tensor or a list or tuple of tensors, got {named}"
    with pytest.raises(TypeError, match=msg):
        tg.multi_tensor_stats(bad)
    with pytest.raises(TypeError, match=msg):  # the reference checks its input the same way
        reference_multi_tensor_stats(bad)


def test_op_still_takes_a_tuple_a_generator_and_a_single_tensor():
    ts = [torch.ones(3), torch.zeros(2)]
    want = tg.multi_tensor_stats(ts).sumsq
    assert torch.equal(tg.multi_tensor_stats(tuple(ts)).sumsq, want)
    assert torch.equal(tg.multi_tensor_stats(t for t in ts).sumsq, want)
    assert tg.multi_tensor_stats(torch.ones(2, 2)).sumsq.tolist() == [4.0]


# ----------------------------------------------------------------------------------------------- torch.vmap
def test_vmap_over_the_op_equals_a_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g)
    y = torch.randn(4, 5, generator=g).to(torch.bfloat16)
    fixed = torch.tensor([1.0, float("nan"), 0.0])

    def stats(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(tg.multi_tensor_stats([a, b, fixed]))

    batched = torch.vmap(stats, in_dims=(0, 1))(x, y)
    looped = [torch.stack(z) for z in zip(*(stats(x[i], y[:, i]) for i in range(5)))]
    assert [t.shape for t in batched] == [(5, 3), (5, 3), (5, 3, 3)]
    for got, want in zip(batched, looped):
        assert torch.equal(got, want) or torch.allclose(got, want, equal_nan=True)
    nested = torch.vmap(torch.vmap(lambda t: tg.multi_tensor_stats(t).sumsq))(torch.ones(2, 3, 4))
    assert nested.shape == (2, 3, 1) and bool((nested == 4).all())
    empty = torch.vmap(lambda t: tg.multi_tensor_stats([t]).counts)(torch.ones(0, 3))
    assert empty.shape == (0, 1, 3)


# ----------------------------------------------------------------------------------------------- Trainer
@pytest.mark.parametrize("value", ["1", [1.0], torch.tensor([1.0, 2.0])], ids=["str", "list", "tensor"])
def test_trainer_max_grad_norm_of_a_wrong_type(value):
    with pytest.raises(TypeError, match="max_grad_norm must be a positive number or None, got"):
        _trainer(max_grad_norm=value)


@pytest.mark.parametrize("value", [0.0, -1, float("nan")])
def test_trainer_max_grad_norm_of_a_bad_value(value):
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        _trainer(max_grad_norm=value)


@pytest.mark.parametrize("arg", ["stats_every", "accumulation_steps", "log_every", "sync_every"])
def test_trainer_int_arguments(arg):
    for bad in (2.0, "3", True, None if arg != "sync_every" else 1.5):
        with pytest.raises(TypeError, match=f"{arg} must be a positive int"):
            _trainer(**{arg: bad})
    for bad in (0, -2, np.int64(0)):
        with pytest.raises(ValueError, match=f"{arg} must be >= 1, got 0|{arg} must be >= 1, got -2"):
            _trainer(**{arg: bad})
    trainer = _trainer(**{arg: np.int64(2)})
    assert type(getattr(trainer, arg)) is int and getattr(trainer, arg) == 2


@pytest.mark.parametrize("epochs", [0, -1])
def test_fit_with_no_epochs_is_an_error_not_an_empty_list(epochs):
    with pytest.raises(ValueError, match=f"epochs must be >= 1, got {epochs}"):
        _trainer().fit(_batches(), epochs=epochs)


@pytest.mark.parametrize("epochs", [1.0, "2", None, True])
def test_fit_epochs_of_a_wrong_type(epochs):
    with pytest.raises(TypeError, match="epochs must be a positive int"):
        _trainer().fit(_batches(), epochs=epochs)


def test_numpy_integers_are_accepted_like_ints():
    trainer = _trainer(accumulation_steps=np.int32(2), stats_every=np.int64(1), sync_every=np.uint8(1),
                       log_every=np.int16(1))  # fmt: skip
    summaries = trainer.fit(_batches(4), epochs=np.int64(2))
    assert len(summaries) == 2 and trainer.global_step == 4
    trainer.global_step = np.int64(10)
    assert trainer.global_step == 10 and type(trainer.global_step) is int
    with pytest.raises(TypeError, match="global_step must be a non-negative int, got 1.5"):
        trainer.global_step = 1.5
    with pytest.raises(ValueError, match="global_step must be >= 0, got -1"):
        trainer.global_step = np.int64(-1)
    # the k of a report's top norms: numpy integers too
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    assert len(tg.grad_stats(model.named_parameters()).report(np.int64(1)).top_norms) == 1


def test_validate_device_types_and_indexes():
    from torch_gradstats.training import validate_device

    for bad in (1.5, True, [0]):
        with pytest.raises(TypeError, match="device must be a torch.device, a string such as 'cpu' or 'cuda:0', or a "
                                            "CUDA index; got"):  # fmt: skip
            validate_device(bad)
    with pytest.raises(ValueError, match="device index must be >= 0, got -1"):
        validate_device(np.int64(-1))
    with pytest.raises(ValueError, match="device 'meta' holds no data"):
        validate_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:0' requested but CUDA is not available"):
            validate_device(np.int64(0))
    else:  # pragma: no cover
        assert validate_device(np.int64(0)) == torch.device("cuda:0")


# ----------------------------------------------------------------------------------------------- collector
@pytest.mark.parametrize("bad", [{}, {"gradient_norm": 1.0}, {"_empty": False}], ids=["empty", "other", "partial"])
def test_materialize_grad_stats_of_a_foreign_dict(bad):
    with pytest.raises(TypeError, match=r"materialize_grad_stats: expected the dict returned by collect_async\(\)"):
        C.materialize_grad_stats(bad)


@pytest.mark.parametrize("bad", [None, [1.0], 3])
def test_materialize_grad_stats_of_a_non_dict(bad):
    with pytest.raises(TypeError, match=r"expected the dict returned by collect_async\(\), got"):
        C.materialize_grad_stats(bad)


def test_materialize_dual_grad_stats_of_a_foreign_dict():
    with pytest.raises(TypeError, match=r"materialize_dual_grad_stats: expected the dict returned by "
                                        r"collect_dual_gradients_async\(\)"):  # fmt: skip
        C.materialize_dual_grad_stats({})


def test_collector_dicts_with_numpy_counts_materialize():
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    stats = C.SeedGradientCollector().collect_async(model.parameters())
    stats["_n_grads"] = np.int64(stats["_n_grads"])
    assert C.materialize_grad_stats(stats)["gradient_norm"] > 0
    dual = C.collect_dual_gradients_async(model.parameters(), model.parameters())
    dual["_host_param_count"] = np.int64(dual["_host_param_count"])
    assert C.materialize_dual_grad_stats(dual).host_param_count == 8
