"""FedProx (Li et al., 2020): local CE plus a proximal term that pulls the local weights towards
the round-start global weights,

    L = CE + (mu / 2) * ||w - w_g||_2^2     (over all trainable parameters).

mu = 1.0 is the FedSOL paper's setting; the FedCONST paper uses 0.01.
"""

from __future__ import annotations

import torch.nn.functional as F

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.shared_model import SharedModelMethod


class FedProx(SharedModelMethod):
    """FedProx (Li et al., MLSys 2020): local CE plus (mu / 2) ||w - w_g||^2.

    Args:
        mu: weight of the proximal term (FedSOL paper 1.0; FedCONST paper 0.01).
    """

    vectorized = True  # its local step is its loss (--federation.engine vectorized)
    vectorized_padding = True  # mean cross-entropy plus a term free of the batch

    def __init__(self, mu: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        if mu < 0:
            raise FLUserError(f"FedProx mu must be >= 0, got {mu}")
        self.save_hyperparameters()

    def loss(self, model, batch, context: LossContext):
        x, y = batch
        ce = F.cross_entropy(model(x), y)
        if context.finetuning:  # the proximal anchor is this round's global model
            return ce
        g = self.global_params()
        prox = sum(((p - g[n]) ** 2).sum() for n, p in model.named_parameters() if p.requires_grad)
        return ce + 0.5 * self.hparams.mu * prox
