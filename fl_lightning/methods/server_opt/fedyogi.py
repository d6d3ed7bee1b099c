"""FedYogi (Reddi et al., ICLR 2021): Yogi on the server,
v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2): v moves towards Delta_t^2 by an
amount that does not grow with v, unlike Adam's, so a large v adapts faster."""

from __future__ import annotations

import torch

from fl_lightning.methods.server_opt.adaptive import AdaptiveServerMethod


class FedYogi(AdaptiveServerMethod):
    """FedYogi (Reddi et al., ICLR 2021): a Yogi server step on the average client update.

    Args:
        server_lr: the server's step size eta (the paper tunes it per task; 1e-2 is a common choice).
        beta1, beta2, tau: see AdaptiveServerMethod (paper: 0.9, 0.99, 1e-3).
    """

    def __init__(self, server_lr: float = 1e-2, **kwargs):
        super().__init__(server_lr=server_lr, **kwargs)

    def second_moment(self, v, delta_sq):
        return v - (1 - self.hparams.beta2) * delta_sq * torch.sign(v - delta_sq)
