"""FedAdam (Reddi et al., ICLR 2021): Adam on the server, v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2."""

from __future__ import annotations

from fl_lightning.methods.server_opt.adaptive import AdaptiveServerMethod


class FedAdam(AdaptiveServerMethod):
    """FedAdam (Reddi et al., ICLR 2021): an Adam server step on the average client update.

    Args:
        server_lr: the server's step size eta (the paper tunes it per task; 1e-2 is a common choice).
        beta1, beta2, tau: see AdaptiveServerMethod (paper: 0.9, 0.99, 1e-3).
    """

    def __init__(self, server_lr: float = 1e-2, **kwargs):
        super().__init__(server_lr=server_lr, **kwargs)

    def second_moment(self, v, delta_sq):
        beta2 = self.hparams.beta2
        return beta2 * v + (1 - beta2) * delta_sq
