"""Small versions of the architectures people train, for tests that need real model code (seconds each on a CPU).

- :class:`ResNet`: torchvision's BasicBlock pattern written out (conv-bn-relu, an in-place residual ``out += identity``,
  one ``nn.ReLU(inplace=True)`` called twice per block), a strided block with a 1x1 downsample.
- :func:`gpt2`: a Hugging Face ``GPT2LMHeadModel`` from a tiny config (random init, no download); it computes its
  loss inside ``forward`` when given ``labels=``.
- :class:`CheckpointedEncoder`: an ``nn.TransformerEncoder`` whose layers run under ``torch.utils.checkpoint``.
- :func:`lightning_module`: a LightningModule whose ``training_step`` calls ``self.net(x)`` (not ``self(x)``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


# ------------------------------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """Stem, two stages of two BasicBlocks (8 and 16 channels), global average pool, linear head."""

    def __init__(self, classes: int = 5, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(seed: int = 0) -> ResNet:
    torch.manual_seed(seed)
    return ResNet()


# ------------------------------------------------------------------------------------------------- GPT-2
def gpt2(seed: int = 0, n_layer: int = 2) -> Any:
    """A ``transformers.GPT2LMHeadModel`` of 2 blocks, d=32, vocab 64 (eager attention: the scores are a matmul in
    the attention module's own forward). The calling test skips where transformers is not installed."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


# ------------------------------------------------------------------------------------------------- checkpointing
class CheckpointedEncoder(nn.Module):
    """Linear embedding, an ``nn.TransformerEncoder`` of two layers each run under ``torch.utils.checkpoint`` (when
    ``checkpointed``), linear head."""

    def __init__(self, use_reentrant: bool, checkpointed: bool = True, d: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.use_reentrant, self.checkpointed = use_reentrant, checkpointed
        self.embed = nn.Linear(8, d)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.encoder.layers:
            if self.checkpointed:
                h = checkpoint(layer, h, use_reentrant=self.use_reentrant)
            else:
                h = layer(h)
        return self.head(h)


# ------------------------------------------------------------------------------------------------- Lightning
def lightning_module(seed: int = 0) -> Any:
    """A LightningModule with ``self.net`` (Linear, ReLU, Linear) whose training and validation steps call
    ``self.net(x)``, as the docs' Lightning example does; its own ``forward`` is never called. The calling test skips
    where Lightning is not installed."""
    pl = pytest.importorskip("lightning.pytorch")

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Net()


def classification_data(n: int = 8, batch: int = 4, seed: int = 0) -> torch.utils.data.DataLoader:
    """A loader of ``n`` batches of 6 features and a label in 0..2."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n * batch, 6, generator=g), torch.randint(0, 3, (n * batch,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


class GPT2LM(nn.Module):
    """:func:`gpt2` behind a forward that takes token ids and returns the language-modelling loss GPT-2 computes
    inside its own forward (``labels=`` the ids), so a loop or the Trainer can call ``model(ids)``."""

    def __init__(self, seed: int = 0, n_layer: int = 2) -> None:
        super().__init__()
        self.gpt = gpt2(seed, n_layer)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=ids, labels=ids).loss
