from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.models.base import FLModel
from fl_lightning.models.resnet import norm_layer


class _DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.bn1 = norm_layer(cin, norm)
        self.pointwise = nn.Conv2d(cin, cout, 1, 1, 0, bias=False)
        self.bn2 = norm_layer(cout, norm)

    def forward(self, x):
        x = F.relu(self.bn1(self.depthwise(x)))
        return F.relu(self.bn2(self.pointwise(x)))


class CifarMobileNet(FLModel):
    """MobileNet v1 for 32x32 inputs (the CIFAR-100 model of FedBABU/FedDr+): a 3x3 stride-1 stem
    with 32 channels, 13 depthwise-separable blocks (64 ... 1024 channels, four stride-2 stages,
    so 32x32 ends at 2x2), global average pool, 1024 features, linear head."""

    # (out channels, stride) of each depthwise-separable block
    CONFIG = ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
              (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1))

    def __init__(self, in_channels: int, num_classes: int, norm: str = "bn"):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 32, 3, 1, 1, bias=False), norm_layer(32, norm), nn.ReLU())
        blocks, cin = [], 32
        for cout, stride in self.CONFIG:
            blocks.append(_DepthwiseSeparable(cin, cout, stride, norm))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)
        self.feature_dim = cin

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
