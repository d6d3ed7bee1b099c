"""FedBABU (Oh et al., ICLR 2022): the head stays at its random initialisation for the whole
federated run and only the body is trained and averaged, with plain cross-entropy. Its personalised
variant, FedBABU-FT, fine-tunes the whole model (head included) on each client afterwards:
`--personalization.finetune all` (see fl_lightning/personalization.py)."""

from __future__ import annotations

import torch

from fl_lightning.methods.frozen.base import FrozenClassifierMethod
from fl_lightning.models import FLModel, build_model


class FedBABU(FrozenClassifierMethod):
    def build_network(self, name, spec) -> FLModel:
        model = build_model(name, spec)
        # nn.Linear's default init range U(-1/sqrt(d), 1/sqrt(d)), drawn from classifier_seed so
        # every process holds the same random head without communicating it.
        g = torch.Generator().manual_seed(self._classifier_seed)
        head = model.head
        bound = 1.0 / head.in_features**0.5
        with torch.no_grad():
            for p in head.parameters():
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)
        head.requires_grad_(False)
        return model
