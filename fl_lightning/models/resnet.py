from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.models.base import FLModel


def norm_layer(channels: int, norm: str) -> nn.Module:
    # The FedSOL code uses BatchNorm with track_running_stats=False: statistics of the current
    # batch in train and eval alike, so no running buffers drift between clients. "none" is
    # FedCONST's BN-free variant.
    if norm == "bn_batchstats":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    if norm == "bn":
        return nn.BatchNorm2d(channels)
    if norm == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm '{norm}'; choose bn_batchstats, bn or none")


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str, bias: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=bias)
        self.bn1 = norm_layer(cout, norm)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=bias)
        self.bn2 = norm_layer(cout, norm)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=bias), norm_layer(cout, norm))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(FLModel):
    """CIFAR-style ResNet-18: 3x3 stem, no max-pool, [2, 2, 2, 2] basic blocks, 512 features."""

    def __init__(self, in_channels: int, num_classes: int, blocks=(2, 2, 2, 2), norm: str = "bn_batchstats",
                 bias: bool = False, head_bias: bool = True):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=bias), norm_layer(64, norm), nn.ReLU())
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            cout = 64 * 2**i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1, norm, bias))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes, bias=head_bias)
        self.feature_dim = cin

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
