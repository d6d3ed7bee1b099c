"""Heterogeneous FL through a shared head: LG-FedAvg and FedGH.

Every client's body is its own; the head Linear(K, C) is the part all clients share, so the server
keeps one global head, and every client's model holds it whenever it is loaded from the store
(all clients start from the same head; between rounds every client has the newest one). Clients
train their whole model on CE.

    LG-FedAvg (Liang et al., 2020)  upload: the client's head;  server: sample-weighted average
    FedGH (Yi et al., 2023)         upload: class prototypes;   server: trains the global head with
                                    CE on the (prototype, class) pairs (1 epoch, SGD 0.01, batch 32)
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import abstract_base
from fl_lightning.methods.hetero.base import HeteroMethod
from fl_lightning.methods.hetero.prototypes import class_prototypes, prototype_upload, train_on_pairs, uploaded_pairs
from fl_lightning.uploads import RoundUploads, ServerUpdate

HEAD = "head"  # LG-FedAvg's upload group: the client's head, by the head's own state_dict names


@abstract_base
class SharedHeadMethod(HeteroMethod):
    """Holds the global head and sends it to every client."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.server.module("global_head", nn.Linear(self.hparams.feature_dim, self.hparams.data_spec.num_classes))

    @torch.no_grad()
    def on_client_model_loaded(self, client: int, model) -> None:
        """Every client holds the global head (from the start: one shared initial head); it is
        applied whenever a client's model is loaded, instead of written into every client's file
        after every round."""
        model.head.load_state_dict(self.server["global_head"].state_dict())


class LGFedAvg(SharedHeadMethod):
    """LG-FedAvg: local bodies, a FedAvg-averaged head. Only the head crosses the network."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def upload(self) -> dict:
        return {HEAD: {k: v.detach().clone() for k, v in self.model.head.state_dict().items()}}

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        return ServerUpdate(server_state={"global_head": uploads.weighted_average(HEAD)})


class FedGH(SharedHeadMethod):
    """FedGH: the server trains a generalised global head on the clients' class prototypes.

    Args:
        server_epochs: epochs of the server's training of the head on the prototypes.
        head_lr: SGD learning rate of that training.
        server_batch_size: prototypes per server step.
    """

    def __init__(
        self, server_epochs: int = 1, head_lr: float = 0.01, server_batch_size: int = 32, **kwargs
    ):
        super().__init__(**kwargs)
        if server_epochs < 1 or server_batch_size < 1 or head_lr <= 0:
            raise FLUserError("server_epochs and server_batch_size must be >= 1 and head_lr > 0")
        self.save_hyperparameters()

    def upload(self) -> dict:
        return prototype_upload(
            class_prototypes(self.model, self.client_train_loader(self.current_client), self.device)
        )

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        h = self.hparams
        protos, labels = uploaded_pairs(uploads.gathered(), self.device)  # trains on pairs: not a sum
        head = copy.deepcopy(self.server["global_head"])  # trained here, applied by the round callback
        loss = train_on_pairs(
            head,
            protos,
            labels,
            lambda head, p, y: F.cross_entropy(head(p), y),
            h.server_epochs,
            h.head_lr,
            h.server_batch_size,
            self.server_seed(),
        )
        return ServerUpdate(server_state={"global_head": head.state_dict()}, metrics={"server/loss": loss})
