"""FedGELA (Fan et al., NeurIPS 2023, "Federated Learning with Bilateral Curation for Partially
Class-Disjoint Data").

The classifier is a simplex ETF, fixed and shared globally, and adapted locally to each client's
label distribution: during local training class c's logit is scaled by C * pi_c (pi = the client's
class proportions), so classes the client never sees get a constant zero logit and are not pushed
away; the global model predicts with the unscaled ETF logits f(x) V^T. FedDr+'s paper states no
details; the scaling C * pi_c follows the FedGELA authors' public code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fl_lightning.methods.base import LossContext
from fl_lightning.methods.frozen.base import FrozenClassifierMethod
from fl_lightning.models import FLModel


def locally_adapted_logits(logits: torch.Tensor, class_counts: torch.Tensor) -> torch.Tensor:
    scale = class_counts / class_counts.sum() * class_counts.numel()
    return logits * scale.to(logits.dtype)


class FedGELA(FrozenClassifierMethod):
    fixed_head = ("etf", False)

    def loss(self, model: FLModel, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        if context.class_counts is not None:
            logits = locally_adapted_logits(logits, context.class_counts)
        return F.cross_entropy(logits, y)
