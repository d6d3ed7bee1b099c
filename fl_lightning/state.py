"""Pieces several baselines share: momentum-corrected step counts (SCAFFOLD, FedNova), server
state that survives checkpoint/resume (SCAFFOLD's c, FedDyn's h, FedExP's iterate, MOON's initial
model), and moving per-client state between the accelerator and CPU."""

from __future__ import annotations

import torch


def effective_steps(steps: int, momentum: float) -> float:
    """Total weight heavy-ball SGD gives its gradients over `steps` steps from a zero buffer:
    sum_k sum_{j<=K-k} m^j = (K - m(1 - m^K)/(1 - m)) / (1 - m); K when m = 0. The displacement
    of K momentum steps is lr * this * (average gradient), so it is what normalises a client's
    update into "one step's worth" of gradient (FedNova's a_i, SCAFFOLD's K in the official code).
    """
    if momentum == 0:
        return float(steps)
    m = float(momentum)
    return (steps - m * (1 - m**steps) / (1 - m)) / (1 - m)


def to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached CPU copy: per-client state must not hold accelerator memory for clients that wait."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tensors.items()}


class ServerStateMixin:
    """Saves the attributes named in `server_state` (each a dict of tensors, or None) in the round
    checkpoint and restores them on resume. Place it before the method base class in the bases."""

    server_state: tuple[str, ...] = ()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        state = {name: getattr(self, name) for name in self.server_state}
        checkpoint["fl_server_state"] = {name: None if v is None else to_cpu(v) for name, v in state.items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        for name, value in checkpoint.get("fl_server_state", {}).items():
            if name in self.server_state:
                setattr(self, name, value)


def trainable_zeros(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}


def state_or_zeros(stored: dict[str, torch.Tensor] | None, model: torch.nn.Module,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """A per-parameter state (SCAFFOLD's c / c_i, FedDyn's h / g_i) on the device, zero until the
    server or the client has one."""
    return trainable_zeros(model) if stored is None else to_device(stored, device)

