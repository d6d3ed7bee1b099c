"""MOON (Li et al., 2021): model-contrastive learning. The local representation is pulled towards
the global model's and pushed away from the client's own previous local model's:

    l_con = -log( exp(cos(z, z_g)/tau) / (exp(cos(z, z_g)/tau) + exp(cos(z, z_prev)/tau)) )
          = CE([cos(z, z_g), cos(z, z_prev)] / tau, label 0)
    L     = CE(head(z), y) + mu * l_con

z = model.features(x) (no extra projection head); z_g and z_prev come from frozen working copies
under no_grad. A client's previous model is its last accepted upload, which it keeps
(`upload.kept`); before that it is the initial global model (server state, as in the official
code, where every client's previous model starts as the round-0 model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.models import FLModel
from fl_lightning.uploads import ClientUpload


def moon_contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_prev: torch.Tensor,
                          tau: float) -> torch.Tensor:
    """CE over (positive = global, negative = previous local) cosine similarities / tau, batch mean."""
    pos = F.cosine_similarity(z, z_global, dim=1)
    neg = F.cosine_similarity(z, z_prev, dim=1)
    logits = torch.stack([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class MOON(SharedModelMethod):
    """MOON (Li et al., CVPR 2021): a model-contrastive loss pulls the local representation toward
    the global model's and away from the client's previous one.

    Args:
        mu: weight of the contrastive loss (FedSOL paper 0.1).
        tau: temperature of the contrastive loss (FedSOL paper 0.5).
    """

    needs_global_model = True

    def __init__(self, mu: float = 0.1, tau: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        if mu < 0 or tau <= 0:
            raise FLUserError(f"MOON needs mu >= 0 and tau > 0, got mu={mu}, tau={tau}")
        self.save_hyperparameters()
        self.server.tensors("initial", self.model.state_dict())

    @property
    def prev_model(self) -> FLModel:
        return self.copies["previous"]

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        previous = self.client_state(client, "previous.") or self.server["initial"]
        self.copies.get("previous", self.model, previous, self.device)

    def contrastive_term(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """mu * l_con of the representation z of x (MOON's regulariser; FedSOL+MOON perturbs along it)."""
        with torch.no_grad():
            z_global = self.global_model.features(x)
            z_prev = self.prev_model.features(x)
        con = moon_contrastive_loss(z, z_global, z_prev, self.hparams.tau)
        self.log_local({"moon/contrastive_loss": con}, len(x))
        return self.hparams.mu * con

    def loss(self, model, batch, context: LossContext):
        x, y = batch
        if context.finetuning:  # the contrastive term needs the client's previous-round model
            return F.cross_entropy(model(x), y)
        z = model.features(x)
        return F.cross_entropy(model.head(z), y) + self.contrastive_term(x, z)

    def client_end(self) -> ClientUpload:
        upload = super().client_end()
        upload.kept.update(self.prefixed("previous.", upload.weights))
        return upload
