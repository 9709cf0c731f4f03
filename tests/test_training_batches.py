"""The Trainer's batches: an ``(inputs, targets)`` pair (tuple, list or namedtuple) whose inputs and targets may be
tensors, dicts, namedtuples, dataclasses or nested mixes of them; moved to the device the way Lightning's
``move_data_to_device`` moves them, with the batch size read from the first batched tensor inside."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_gradstats.training import Trainer, _device

Inner = namedtuple("Inner", "x scale")
Outer = namedtuple("Outer", "inner note")


class Pair(NamedTuple):
    inputs: Any
    targets: Any


@dataclasses.dataclass
class Features:
    dense: Tensor
    extra: dict[str, Tensor]
    name: str = "features"


@dataclasses.dataclass
class Labels:
    y: Tensor
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenLabels:
    y: Tensor
    weight: float = 1.0


class Box:
    """Not a collection, but has ``to``: moved by calling it (as Lightning does)."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def to(self, device: torch.device) -> Box:
        return Box(self.t.to(device))


class BadBox(Box):
    """A ``to`` that forgets to return: the object is kept as it is."""

    def to(self, device: torch.device) -> None:  # type: ignore[override]
        self.t = self.t.to(device)


def _x(inputs: Any) -> Tensor:
    """The (n, 6) features back out of any of the structures below."""
    if isinstance(inputs, Tensor):
        return inputs
    if isinstance(inputs, Features):
        return torch.cat([inputs.dense, inputs.extra["rest"]], dim=1)
    if isinstance(inputs, Outer):
        return inputs.inner.x * inputs.inner.scale
    if isinstance(inputs, Inner):
        return inputs.x * inputs.scale
    if isinstance(inputs, dict) and "parts" in inputs:
        return torch.cat([_x(inputs["parts"][0]), inputs["parts"][1]["rest"]], dim=1)
    return inputs["x"]


def _y(targets: Any) -> Tensor:
    if isinstance(targets, Tensor):
        return targets
    if isinstance(targets, Labels):
        return targets.y
    if isinstance(targets, (tuple, list)):
        return targets[0]
    return targets["y"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)

    def forward(self, inputs: Any) -> Tensor:
        return self.lin(_x(inputs))


def _loss(out: Tensor, targets: Any) -> Tensor:
    return F.cross_entropy(out, _y(targets))


LabelT = namedtuple("LabelT", "y weight")

STRUCTURES = {
    "tuple of tensors": lambda x, y: (x, y),
    "list, dict inputs": lambda x, y: [{"x": x, "note": "text"}, y],
    "namedtuple pair": lambda x, y: Pair(x, {"y": y}),
    "namedtuple inputs": lambda x, y: (Inner(x, 1.0), y),
    "nested namedtuple inputs": lambda x, y: (Outer(Inner(x, 1.0), "n"), LabelT(y, None)),
    "dataclasses": lambda x, y: (Features(x[:, :4], {"rest": x[:, 4:]}), Labels(y)),
    "nested mix": lambda x, y: Pair(
        {"parts": [Inner(x[:, :3], 1.0), {"rest": x[:, 3:]}], "step": torch.tensor(7)}, [y, torch.tensor(0.5)]
    ),
}


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (5, 3, 4)]


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_structured_batches_train_like_plain_tensors(kind):
    make = STRUCTURES[kind]
    results = []
    for structured in (False, True):
        model = Net()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, progress=False,
                          accumulation_steps=2)  # fmt: skip
        batches = [make(x, y) if structured else (x, y) for x, y in _batches()]
        summary = trainer.train_epoch(batches)
        results.append((summary, [p.detach().clone() for p in model.parameters()]))
    (plain, plain_params), (got, got_params) = results
    assert got.samples == plain.samples == 12 and got.steps == plain.steps == 2
    assert got.loss == plain.loss
    assert all(torch.equal(a, b) for a, b in zip(plain_params, got_params))


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_batch_size_is_read_inside_every_structure(kind):
    x, y = torch.zeros(5, 6), torch.zeros(5, dtype=torch.long)
    inputs, targets = _device.as_pair(STRUCTURES[kind](x, y), 0, torch.device("cpu"))
    assert _device.batch_size(inputs, targets) == 5


def _leaves(a: Any, b: Any, path: str = "batch") -> list[tuple[str, Any, Any]]:
    """Walk two structures side by side: the same types everywhere; (path, a, b) for every leaf."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, (Tensor, Box)):
        return [(path, a, b)]
    if dataclasses.is_dataclass(a):
        return [leaf for f in dataclasses.fields(a)
                for leaf in _leaves(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")]  # fmt: skip
    if isinstance(a, dict):
        assert list(a) == list(b), path
        return [leaf for k in a for leaf in _leaves(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return [leaf for i, (u, v) in enumerate(zip(a, b)) for leaf in _leaves(u, v, f"{path}[{i}]")]
    assert a == b, path
    return [(path, a, b)]


def test_move_matches_lightning_move_data_to_device():
    """The same structure moved by both (to the meta device, which this machine always has): same types at every
    level, same tensors moved, same non-tensor leaves kept."""
    move_data_to_device = pytest.importorskip("lightning_fabric.utilities.apply_func").move_data_to_device
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    counter: defaultdict[str, list[Tensor]] = defaultdict(list, {"a": [x]})
    batch = {
        "structures": [make(x, y) for make in STRUCTURES.values()],
        "ordered": OrderedDict(b=y, a=(x, "s", 3, None)),
        "counter": counter,
        "box": Box(x),
        "bad_box": BadBox(x),
        "bytes": b"raw",
    }
    meta = torch.device("meta")
    ours, theirs = _device.move(batch, meta), move_data_to_device(batch, meta)
    leaves = _leaves(ours, theirs)
    tensors = [(p, a, b) for p, a, b in leaves if isinstance(a, Tensor)]
    assert len(tensors) > 20
    for path, a, b in tensors:
        assert a.device == b.device == meta and a.shape == b.shape and a.dtype == b.dtype, path
    assert ours["counter"].default_factory is list and ours["counter"]["a"][0].device == meta
    assert ours["box"].t.device == meta and ours["bad_box"] is batch["bad_box"]
    assert x.device.type == "cpu" and batch["structures"][0][0] is x  # the input is not changed in place


def test_move_copies_dataclasses_frozen_ones_too():
    @dataclasses.dataclass
    class WithCache:
        x: Tensor
        tag: str = "t"
        derived: int = dataclasses.field(default=0, init=False)

        @functools.cached_property
        def total(self) -> Tensor:
            return self.x.sum()

    obj = WithCache(torch.ones(3))
    obj.derived = 7
    _ = obj.total  # cached on the CPU tensor: must not survive the move
    moved = _device.move(obj, torch.device("meta"))
    assert moved is not obj and moved.x.device.type == "meta" and moved.tag == "t" and moved.derived == 7
    assert moved.total.device.type == "meta" and obj.x.device.type == "cpu"
    frozen = _device.move(FrozenLabels(torch.ones(2), 0.5), torch.device("meta"))  # Lightning refuses these
    assert isinstance(frozen, FrozenLabels) and frozen.y.device.type == "meta" and frozen.weight == 0.5


@pytest.mark.parametrize(
    "batch, error, message",
    [
        (torch.zeros(2, 6), TypeError, r"batch 0 is a Tensor; expected an \(inputs, targets\) pair"),
        ({"inputs": 1, "targets": 2}, TypeError, r"batch 0 is a dict; expected an \(inputs, targets\) pair"),
        ((torch.zeros(2, 6),) * 3, ValueError, r"batch 0 has 3 items; expected an \(inputs, targets\) pair"),
    ],
    ids=["tensor", "dict", "triple"],
)
def test_a_batch_that_is_not_a_pair(batch, error, message):
    model = Net()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, progress=False)
    with pytest.raises(error, match=message):
        trainer.train_epoch([batch])
