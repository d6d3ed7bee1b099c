"""FedSOL combined with other methods' proximal objectives (FedSOL paper, Table 4 "Combined").

In the "Base" column each method adds its regulariser to the local loss; in "Combined" the same
regulariser is FedSOL's proximal loss L_p instead: it only sets the perturbation direction, and
the update is the gradient of CE at the perturbed weights. Everything else of the method stays:
its per-client state (MOON's previous model, FedDyn's g_i, SCAFFOLD's c_i) and its server rule.
As in the paper, the whole model is perturbed by default. FedProx combined is
`FedSOL` with `proximal: l2`. FedNova has no proximal term of its own, so it has no entry here.

Each class puts FedSOL first in its bases so FedSOL's minibatch_step is the local step, and
overrides only `proximal_loss` (and whether that term's gradient vanishes at w == w_g).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from fl_lightning.methods.base import FederatedMethod
from fl_lightning.methods.baselines.feddyn import FedDyn
from fl_lightning.methods.baselines.moon import MOON
from fl_lightning.methods.baselines.scaffold import SCAFFOLD
from fl_lightning.methods.fedsol.fedsol import FedSOL

Scope = Literal["head", "body", "all"]


class FedSOLMOON(FedSOL, MOON):
    """L_p = mu * MOON's model-contrastive loss of the features (gradient non-zero at w == w_g,
    where z is pushed away from the previous local model's z)."""

    def __init__(self, perturb: Scope = "all", mu: float = 0.1, **kwargs):
        # FedSOL's proximal weight and MOON's contrastive weight are the same `mu` here; it only
        # scales L_p, so FedSOL's (normalised) perturbation does not depend on it.
        super().__init__(perturb=perturb, mu=mu, **kwargs)

    def proximal_loss(self, x, features, logits, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.contrastive_term(x, features)

    @property
    def proximal_vanishes_at_global(self) -> bool:
        return False


class FedSOLFedDyn(FedSOL, FedDyn):
    """L_p = -<g_i, w> + (alpha/2) ||w - w_g||^2 (gradient -g_i at w == w_g)."""

    def __init__(self, perturb: Scope = "all", **kwargs):
        super().__init__(perturb=perturb, **kwargs)

    def proximal_loss(self, x, features, logits, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.dynamic_regularizer(params)

    @property
    def proximal_vanishes_at_global(self) -> bool:
        return False


class FedSOLSCAFFOLD(FedSOL, SCAFFOLD):
    """L_p = <c - c_i, w>: its gradient is SCAFFOLD's drift correction, which here sets the
    perturbation instead of being added to the update. c and c_i are still estimated and
    aggregated as in SCAFFOLD."""

    def __init__(self, perturb: Scope = "all", **kwargs):
        super().__init__(perturb=perturb, **kwargs)

    def proximal_loss(self, x, features, logits, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        correction = self.drift_correction()
        return sum((correction[n] * p).sum() for n, p in params.items() if n in correction)

    @property
    def proximal_vanishes_at_global(self) -> bool:
        return False

    def after_backward(self) -> None:
        # skip SCAFFOLD's gradient correction: in the combined form it is the perturbation
        FederatedMethod.after_backward(self)
