"""FedSAM (Qu et al., 2022; Caldarola et al., 2022) and FedASAM (Caldarola et al., 2022): each
local step is a sharpness-aware step on CE.

    g   = grad CE(w)
    eps = rho * g / ||g||_2                               (SAM)
    eps = rho * (w^2 (.) g) / || |w| (.) g ||_2           (ASAM, element-wise adaptive; no eta,
                                                           as in the official code)
    w  <- base optimizer step with grad_w CE(f(w + eps))

As in fedsol.py, the perturbed pass calls the model functionally with w + eps as new tensors, so
the weights themselves are never modified or restored; the gradient w.r.t. w equals the gradient
at w + eps because eps is a constant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fl_lightning import compat, loss_scaling
from fl_lightning.errors import FLUserError
from fl_lightning.methods.shared_model import SharedModelMethod


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in at least float32 for a norm (bfloat16 -> float32; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def sam_perturbation(params: list[torch.Tensor], grads: list[torch.Tensor], rho: float,
                     adaptive: bool) -> list[torch.Tensor]:
    """SAM's eps = rho g / ||g||, or ASAM's eps = rho w^2 g / || |w| g || (global norms, + 1e-12)."""
    if adaptive:
        scaled = [p.detach().abs() * g for p, g in zip(params, grads, strict=True)]
        norm = torch.sqrt(sum((_wide(s) ** 2).sum() for s in scaled))
        return [(rho * p.detach().abs() * s / (norm + 1e-12)).to(p.dtype)
                for p, s in zip(params, scaled, strict=True)]
    norm = torch.sqrt(sum((_wide(g) ** 2).sum() for g in grads))
    return [(rho * g / (norm + 1e-12)).to(p.dtype) for p, g in zip(params, grads, strict=True)]


class FedSAM(SharedModelMethod):
    """FedSAM: sharpness-aware minimisation (SAM) in every local step.

    Args:
        rho: SAM radius (FedSOL paper 0.1; the official code's default 0.5).
    """

    adaptive = False

    def __init__(self, rho: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        if rho < 0:
            raise FLUserError(f"rho must be >= 0, got {rho}")
        self.save_hyperparameters()

    def minibatch_step(self, batch):
        x, y = batch
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        clean = F.cross_entropy(self.model(x), y)
        # 16-mixed: float16 gradients scaled, as the step's
        scaler = loss_scaling.scaler_of(compat.attached_trainer(self))
        grads = self.mean_across_devices(list(loss_scaling.grad(clean, params, scaler)))
        eps = sam_perturbation(params, grads, self.hparams.rho, self.adaptive)
        perturbed = {n: p + e for (n, p), e in zip(named, eps, strict=True)}
        loss = F.cross_entropy(functional_call(self.model, perturbed, (x,), strict=False), y)
        self.sgd_step(loss)
        self.log_local({"train/loss": clean, "sam/perturbed_loss": loss}, len(y))
        return loss.detach()


class FedASAM(FedSAM):
    """FedASAM: FedSAM with adaptive, scale-invariant (ASAM) perturbations.

    Args:
        rho: ASAM radius (FedSOL paper 1.0).
    """

    adaptive = True

    def __init__(self, rho: float = 1.0, **kwargs):
        super().__init__(rho=rho, **kwargs)
        self.save_hyperparameters()
