"""FedNTD (Lee et al., 2022): not-true distillation. The local model keeps the global model's view
of the classes other than the true one, and learns the true class from CE alone:

    L = CE + beta * tau^2 * KL(softmax(z_g,nt / tau) || softmax(z_nt / tau))

where _nt drops the true-class logit of each sample and z_g comes from the frozen round-start
global model under no_grad (KL averaged over the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.shared_model import SharedModelMethod


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, C] -> [B, C-1]: every sample's logits without its true class, in class order."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[torch.arange(len(y), device=y.device), y] = False
    return logits[keep].view(len(y), logits.shape[1] - 1)


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """tau^2 * KL(softmax(z_g,nt/tau) || softmax(z_nt/tau)), batch mean."""
    z_nt = not_true_logits(logits, y)
    zg_nt = not_true_logits(global_logits, y)
    kl = F.kl_div(F.log_softmax(z_nt / tau, dim=1), F.softmax(zg_nt / tau, dim=1), reduction="batchmean")
    return tau**2 * kl


class FedNTD(SharedModelMethod):
    """FedNTD (Lee et al., NeurIPS 2022): local CE plus distillation of the global model's
    not-true-class logits.

    Args:
        beta: weight of the not-true distillation loss (paper 1.0).
        tau: distillation temperature (paper 1.0).
    """

    needs_global_model = True

    def __init__(self, beta: float = 1.0, tau: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        if beta < 0 or tau <= 0:
            raise FLUserError(f"FedNTD needs beta >= 0 and tau > 0, got beta={beta}, tau={tau}")
        self.save_hyperparameters()

    def loss(self, model, batch, context: LossContext):
        """Distils from `context.teacher`: the round-start global model in local training, the
        model fine-tuning started from in personalised fine-tuning."""
        x, y = batch
        logits = model(x)
        with torch.no_grad():
            global_logits = context.teacher(x)
        ntd = ntd_loss(logits, global_logits, y, self.hparams.tau)
        if not context.finetuning:
            self.log_local({"fedntd/ntd_loss": ntd}, len(y))
        return F.cross_entropy(logits, y) + self.hparams.beta * ntd
