"""FedAdagrad (Reddi et al., ICLR 2021): Adagrad on the server, v_t = v_{t-1} + Delta_t^2 (the
second moment only grows, so the server's step shrinks where updates have been large)."""

from __future__ import annotations

from fl_lightning.methods.server_opt.adaptive import AdaptiveServerMethod


class FedAdagrad(AdaptiveServerMethod):
    """FedAdagrad (Reddi et al., ICLR 2021): an Adagrad server step on the average client update.

    Args:
        server_lr: the server's step size eta (the paper tunes it per task; 1e-1 is a common choice).
        beta1: momentum of the pseudo-gradient (0: Adagrad has none, as the Keras Adagrad behind
            the paper's experiments; Algorithm 2 allows any).
        beta2, tau: see AdaptiveServerMethod (beta2 is not used).
    """

    def __init__(self, server_lr: float = 1e-1, beta1: float = 0.0, **kwargs):
        super().__init__(server_lr=server_lr, beta1=beta1, **kwargs)

    def second_moment(self, v, delta_sq):
        return v + delta_sq
