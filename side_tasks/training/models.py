"""The models of the training tasks, in plain torch (torchvision is not a dependency).

:class:`ResNet18` is the CIFAR variant of He et al.'s ResNet-18 (the one the reference system
trains and that CIFAR papers use): a 3x3 stride-1 stem without max-pooling, four stages of two
basic blocks at 64/128/256/512 channels, global average pooling and one linear layer. With
``width=64`` and 10 classes it has 11,173,962 parameters; ``width`` scales every stage, so tests
can run a tiny copy of the same architecture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 conv-BN projection) shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (CIFAR variant); ``width`` is the first stage's channels."""

    def __init__(self, num_classes: int = 10, width: int = 64, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        channels = width
        for stage in range(4):
            out_channels = width * 2**stage
            stride = 1 if stage == 0 else 2
            layers += [BasicBlock(channels, out_channels, stride), BasicBlock(out_channels, out_channels, 1)]
            channels = out_channels
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))

    @staticmethod
    def activation_bytes_per_sample(width: int, size: int = 32) -> int:
        """Bytes of activations autograd keeps per 32x32 sample (float32).

        Per stage: 4 convs (+1 projection after the first stage), each with its output, its
        BatchNorm output and a ReLU output saved for backward, about 3 tensors of C x H x W.
        """
        total = width * size * size * 3
        for stage in range(4):
            side = size // 2**stage
            convs = 4 if stage == 0 else 5
            total += 3 * convs * width * 2**stage * side * side
        return 4 * total


class LSTMLanguageModel(nn.Module):
    """Byte-level LSTM language model: embedding -> stacked LSTM -> linear over 256 bytes."""

    VOCAB = 256

    def __init__(self, embed: int = 64, hidden: int = 256, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, embed)
        self.lstm = nn.LSTM(embed, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.head = nn.Linear(hidden, self.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)
