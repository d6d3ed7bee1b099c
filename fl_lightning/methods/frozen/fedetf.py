"""FedETF (Li et al., ICCV 2023, "No Fear of Classifier Biases: Neural Collapse Inspired Federated
Learning with Synthetic and Fixed Classifier").

The body's features pass through a learnable projection layer and are L2-normalised; the
classifier is a fixed simplex ETF; a learnable temperature tau scales the cosines:
logits = tau * normalise(P f(x)) V^T. Locally the loss is the balanced softmax (cross-entropy on
logits + log n_c with n_c the client's class counts), which removes the client's label prior; the
projection and tau are averaged like the body. The global model predicts with the plain logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.methods.base import LossContext
from fl_lightning.methods.frozen.base import FixedClassifier, FrozenClassifierMethod, simplex_etf
from fl_lightning.models import FLModel, build_model


class ProjectedETFHead(nn.Module):
    def __init__(self, in_dim: int, proj_dim: int, etf: torch.Tensor, temperature: float):
        super().__init__()
        self.projection = nn.Linear(in_dim, proj_dim)
        self.classifier = FixedClassifier(etf, cosine=True)
        self.temperature = nn.Parameter(torch.tensor(float(temperature)))

    @property
    def weight(self) -> torch.Tensor:  # the class vectors, for the alignment analyses
        return self.classifier.weight

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.temperature * self.classifier(self.projection(features))


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, class_counts: torch.Tensor) -> torch.Tensor:
    """CE(logits + log n_c, y): classes absent from the client get log 0 = -inf, i.e. no mass."""
    return F.cross_entropy(logits + torch.log(class_counts.to(logits.dtype)), y)


class FedETF(FrozenClassifierMethod):
    """FedETF: a fixed simplex-ETF classifier behind a learnable projection, balanced softmax locally.

    Args:
        proj_dim: output size of the projection layer (0 = the body's feature size; must be >= classes).
        temperature: initial value of the learnable temperature.
        balanced_loss: balanced softmax locally (the paper); False = plain CE.
    """

    def __init__(self, proj_dim: int = 0, temperature: float = 1.0, balanced_loss: bool = True, **kwargs):
        self._proj_dim, self._temperature = proj_dim, temperature
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def build_network(self, name, spec) -> FLModel:
        model = build_model(name, spec)
        dim = self._proj_dim or model.feature_dim
        etf = simplex_etf(dim, spec.num_classes, self._classifier_seed)
        model.head = ProjectedETFHead(model.feature_dim, dim, etf, self._temperature)
        return model

    def loss(self, model: FLModel, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        if self.hparams.balanced_loss and context.class_counts is not None:
            return balanced_softmax_loss(logits, y, context.class_counts)
        return F.cross_entropy(logits, y)
