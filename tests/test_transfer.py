"""torch_gradstats.ops._transfer: packing, the one device-to-host transfer, and the sync-free small copies."""

from __future__ import annotations

import math

import pytest
import torch

import torch_gradstats.ops._transfer as transfer
from torch_gradstats.ops._transfer import (
    PinnedBuffer,
    fetch,
    host_int64,
    pack,
    repeated_int64,
    stream_device,
    to_device,
    to_host,
    unpack,
)

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_pack_round_trips_floats_and_ints_exactly():
    floats = [
        torch.tensor([1.5, -0.0, math.nan, math.inf, 5e-324, 1.7976931348623157e308], dtype=torch.float64),
        torch.tensor([[0.1, 3.0]], dtype=torch.float32),
    ]
    ints = [torch.tensor([2**53 + 1, -(2**62), 0]), torch.tensor([True, False])]
    f, i = to_host(floats, ints)
    assert f[:2] == [1.5, -0.0] and math.copysign(1.0, f[1]) == -1.0 and math.isnan(f[2]) and f[3] == math.inf
    assert f[4] == 5e-324 and f[5] == 1.7976931348623157e308
    assert f[6] == float(torch.tensor(0.1, dtype=torch.float32)) and f[7] == 3.0
    assert i == [2**53 + 1, -(2**62), 0, 1, 0]  # an int above 2**53 is not rounded through float64
    assert to_host([], []) == ([], [])


def test_unpack_reads_a_packed_host_buffer():
    buf = pack([torch.tensor([0.25])], [torch.tensor([7, 8])])
    assert buf.dtype == torch.int64 and buf.numel() == 3
    assert unpack(buf, 1) == ([0.25], [7, 8])


def test_to_device_never_copies_to_the_host():
    t = torch.zeros(3)
    assert to_device(t, torch.device("cpu")) is t  # already there: no copy
    with pytest.raises(RuntimeError, match="refusing a device-to-host copy from meta"):
        to_device(torch.zeros(3, device="meta"), torch.device("cpu"))
    assert host_int64([1, 2], torch.device("cpu")).tolist() == [1, 2]


def test_fetch_on_the_cpu_is_a_plain_copy():
    t = torch.arange(4.0)
    assert torch.equal(fetch(t), t)


def test_the_transfer_waits_on_the_buffers_own_device():
    """The event that ends a device-to-host copy is recorded on the stream of the BUFFER's device, which is not
    the current device when the buffer lives on another GPU (a Trainer on cuda:1 once read stale numbers)."""
    assert stream_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert stream_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="no CUDA stream"):
        stream_device(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fetch_reuses_a_pinned_staging_buffer():
    staging = PinnedBuffer()
    a = fetch(torch.arange(5, dtype=torch.int64, device="cuda"), staging)
    first = staging.tensor
    b = fetch(torch.arange(3, dtype=torch.int64, device="cuda"), staging)
    assert a.is_pinned() and staging.tensor is first and b.tolist() == [0, 1, 2]


def _busy_then_fill(device: torch.device, value: float, n: int) -> torch.Tensor:
    """A buffer on ``device`` that its current stream fills with ``value`` only after a long busy wait."""
    with torch.cuda.device(device):
        buf = torch.zeros(n, dtype=torch.float64, device=device)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on that device's stream
        buf.fill_(value)
    return buf


@pytest.mark.cuda
@two_gpus
def test_fetch_from_the_second_gpu_waits_for_its_stream():
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.set_device(0)  # the current device is NOT the buffer's
    staging = PinnedBuffer()
    staging.take(1024, torch.int64).fill_(-1)  # NaN bits: a read before the copy lands would see them
    buf = _busy_then_fill(torch.device("cuda", 1), 7.0, 1024)
    values, _ = to_host([buf], [], staging)
    assert values == [7.0] * 1024


@pytest.mark.cuda
@two_gpus
def test_trainer_on_the_second_gpu_reads_its_own_numbers():
    from torch import nn

    from torch_gradstats.training import Trainer

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def slow(trainer: Trainer) -> None:  # keep cuda:1 busy right before the stats of each step
        with torch.cuda.device(dev):
            torch.cuda._sleep(50_000_000)

    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), device=dev, after_backward=slow, progress=False)
    trainer._staging.take(4096, torch.int64).fill_(-1)  # NaN bits in the staging buffer
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    s = trainer.train_epoch([(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)])
    assert math.isfinite(s.loss) and s.loss > 0 and s.max_norm is not None and math.isfinite(s.max_norm)
    assert all(math.isfinite(r.total_norm) and r.total_norm > 0 for r in s.history)


def test_repeated_int64_keeps_the_last_few_off_the_cpu(monkeypatch):
    """Off the CPU (the meta device here, CUDA in test_cuda.py) the same values give the same device tensor; one
    changed in place is made again; at most _REPEATED_MAX are kept; on the CPU nothing is kept."""
    monkeypatch.setattr(transfer, "_REPEATED", type(transfer._REPEATED)())
    meta = torch.device("meta")
    first = repeated_int64([3, 4, 5], meta)
    assert first.device == meta and first.dtype == torch.int64 and first.shape == (3,)
    assert repeated_int64((3, 4, 5), meta) is first
    assert repeated_int64([3, 4], meta) is not first
    first.add_(1)  # a caller changed it: never handed out again
    again = repeated_int64([3, 4, 5], meta)
    assert again is not first and again._version == 0
    for k in range(transfer._REPEATED_MAX):
        repeated_int64([100 + k], meta)
    assert len(transfer._REPEATED) == transfer._REPEATED_MAX
    assert repeated_int64([3, 4, 5], meta) is not again  # the oldest was dropped
    cpu = repeated_int64([1, 2], torch.device("cpu"))
    assert cpu.tolist() == [1, 2] and repeated_int64([1, 2], torch.device("cpu")) is not cpu
