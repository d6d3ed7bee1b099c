from __future__ import annotations

import torch
from torch import nn

from fl_lightning.models.base import FLModel


class MLP(FLModel):
    """Flatten - Linear - Tanh - head. Small enough to check a method's step by hand in tests, and
    a fast model for the 8x8 digits. With `batch_norm`, a BatchNorm1d after the linear layer (a
    small model for the methods that treat BatchNorm layers apart, such as FedBN)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 16, batch_norm: bool = False):
        super().__init__()
        norm = [nn.BatchNorm1d(hidden)] if batch_norm else []
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), *norm, nn.Tanh())
        self.head = nn.Linear(hidden, num_classes)
        self.feature_dim = hidden

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class TwoNN(FLModel):
    """The FedAvg paper's "2NN" (McMahan et al., 2017): two hidden layers of 200 units with ReLU,
    199,210 parameters on MNIST. Large enough that its local step is arithmetic rather than
    per-operation overhead, unlike `mlp`."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 200):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)
        self.feature_dim = hidden

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
