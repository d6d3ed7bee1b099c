"""FedYogi (Reddi et al., ICLR 2021): Yogi on the server,
v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2): v moves towards Delta_t^2 by an
amount that does not grow with v, unlike Adam's, so a large v adapts faster."""

from __future__ import annotations

import torch

from fl_lightning.methods.server_opt.adaptive import AdaptiveServerMethod


class FedYogi(AdaptiveServerMethod):
    """FedYogi (Reddi et al., ICLR 2021): a Yogi server step on the average client update.

    Defaults: server_lr 1e-2, beta1 0.9, beta2 0.99, tau 1e-3, as for FedAdam: Reddi et al.'s best
    server lr for FedYogi is FedAdam's on every task (10^-2.5 to 1; 10^-2 on Shakespeare and Stack
    Overflow next-word prediction), their recommended tau 1e-3 (hyperparameter notes in
    google-research/federated, optimization/docs/hyperparameters.md). Flower's FedYogi ships the
    same eta 1e-2, beta 0.9/0.99 and tau 1e-3; FL-bench's FedOpt ships server lr 0.1, beta
    0.9/0.999, tau 1e-3; both start v at 0. These defaults train on the offline demo setting
    (docs/reference/method-defaults.md).

    Args:
        server_lr: the server's step size eta (the paper tunes it per task).
        beta1, beta2, tau: see AdaptiveServerMethod (paper: 0.9, 0.99, 1e-3).
    """

    def __init__(self, server_lr: float = 1e-2, **kwargs):
        super().__init__(server_lr=server_lr, **kwargs)

    def second_moment(self, v, delta_sq):
        return v - (1 - self.hparams.beta2) * delta_sq * torch.sign(v - delta_sq)
