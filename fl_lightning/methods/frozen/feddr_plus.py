"""Dot-regression and FedDr+ (Kim et al., "FedDr+: Stabilizing Dot-regression with Global Feature
Distillation for Federated Learning").

Both freeze the classifier as a simplex ETF V and predict with cosine logits normalise(f(x)) V^T.
Dot-regression trains the body with L_DR = 0.5 (cos(f(x), v_y) - 1)^2 only; FedDr+ adds feature
distillation from the frozen round-start global model:

    L_Dr+ = beta * L_DR + (1 - beta) * (1/d) ||f(x) - f_g(x)||^2,     beta = 0.9

L_DR uses L2-normalised features (through the cosine); L_FD uses raw features.
"""

from __future__ import annotations

import torch

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.frozen.base import (
    FrozenClassifierMethod,
    dot_regression_loss,
    feature_distillation_loss,
)
from fl_lightning.models import FLModel


class DotRegression(FrozenClassifierMethod):
    """Plain dot-regression with a frozen simplex-ETF classifier (FedDr+ with beta = 1)."""

    fixed_head = ("etf", True)

    def loss(self, model: FLModel, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        return dot_regression_loss(model.features(x), y, model.head.weight)


class FedDrPlus(DotRegression):
    """FedDr+: beta * L_DR + (1 - beta) * L_FD (features distilled from the round-start global model).

    Args:
        beta: weight of the dot-regression term (paper: 0.9; beta = 1 is plain dot-regression).
    """

    needs_global_model = True

    def __init__(self, beta: float = 0.9, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= beta <= 1.0:
            raise FLUserError(f"FedDrPlus beta must be in [0, 1] (paper 0.9; 1 is plain dot-regression), got {beta}")
        self.save_hyperparameters()

    def loss(self, model: FLModel, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        beta = self.hparams.beta
        features = model.features(x)
        loss = beta * dot_regression_loss(features, y, model.head.weight)
        if context.teacher is not None and beta < 1.0:
            with torch.no_grad():
                teacher_features = context.teacher.features(x)
            loss = loss + (1.0 - beta) * feature_distillation_loss(features, teacher_features)
        return loss
