"""16-mixed's loss scaling for the gradients Lightning does not take itself.

On a GPU, `--trainer.precision 16-mixed` runs the local training's forward passes in float16 under
autocast and multiplies the loss by a GradScaler's scale (2**16 at first) before backward, so that
small float16 activation gradients do not underflow to zero; the gradients are divided by the
scale before anything reads them, and a step whose gradients hold inf/NaN is skipped and the scale
lowered. Lightning does all of this for the local step (`sgd_step`: `manual_backward`, then
`LightningOptimizer.step`, whose `on_before_optimizer_step` sees unscaled gradients). Two kinds of
gradient are taken past it, under the same autocast, and go through the same scaler here:

- gradients taken with `torch.autograd.grad` for a direction (FedSAM's and FedSOL's perturbation,
  Per-FedAvg's inner step): `grad` takes them of the scaled loss and divides the scale out. A
  power of two, so nothing changes where float16 neither underflows nor overflows; an overflow
  leaves inf/NaN in the direction, the step's own gradients then hold NaN and the scaler skips
  that step and lowers the scale.
- a second optimizer stepped inside the local training (Ditto's personal track): scaled backward,
  `scaler.unscale_`, clipping, `scaler.step` (skipped on inf/NaN) and `scaler.update`, as Lightning
  steps the local optimizer (methods/personalized/ditto.py).

Server-side training (FedGen's generator, FedGH's head, FedTGP's prototypes) runs in the round's
server step, a callback hook outside autocast: in float32 under 16-mixed, with nothing to scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fl_lightning import compat


def scaler_of(trainer) -> torch.amp.GradScaler | None:
    """The run's enabled loss scaler, or None (every precision but 16-mixed on a GPU)."""
    scaler = compat.loss_scaler(trainer)
    return scaler if scaler is not None and scaler.is_enabled() else None


def grad(loss: torch.Tensor, params: Sequence[torch.Tensor], scaler: torch.amp.GradScaler | None = None,
         **kwargs) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(loss, params, **kwargs)`, taken of the scaled loss when there is a
    scaler and divided by the scale (on the device: no sync), so float16 activation gradients
    under autocast do not underflow."""
    if scaler is None:
        return torch.autograd.grad(loss, params, **kwargs)
    scale = scaler.scale(torch.ones((), dtype=torch.float32, device=loss.device))
    grads = torch.autograd.grad(scaler.scale(loss), params, **kwargs)
    return tuple(None if g is None else g / scale.to(g.dtype) for g in grads)


def agree_on_scale(scaler: torch.amp.GradScaler, states: Sequence[dict]) -> None:
    """With clients in parallel each process's scaler saw only its own clients' steps: the
    processes agree on the smallest scale (and step count towards growing it) any of them reached,
    so the next round, and the checkpoint (rank 0's), continue alike. `states`: every process's
    `scaler.state_dict()`, in rank order."""
    agreed = {key: min(state[key] for state in states) for key in ("scale", "_growth_tracker")}
    scaler.load_state_dict({**scaler.state_dict(), **agreed})
