"""FedAdam (Reddi et al., ICLR 2021): Adam on the server, v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2."""

from __future__ import annotations

from fl_lightning.methods.server_opt.adaptive import AdaptiveServerMethod


class FedAdam(AdaptiveServerMethod):
    """FedAdam (Reddi et al., ICLR 2021): an Adam server step on the average client update.

    Defaults: server_lr 1e-2, beta1 0.9, beta2 0.99, tau 1e-3. Reddi et al.'s best server lr for
    FedAdam ranged from 10^-2.5 to 1 over their six tasks (10^-2 on Shakespeare and Stack Overflow
    next-word prediction) and their recommended tau is 1e-3 (hyperparameter notes in
    google-research/federated, optimization/docs/hyperparameters.md). Flower's FedAdam ships eta
    0.1, beta 0.9/0.99, tau 1e-9 with Adam's bias correction; FL-bench's FedOpt ships server lr 0.1,
    beta 0.9/0.999, tau 1e-3; both start v at 0. These defaults train on the offline demo setting
    (docs/reference/method-defaults.md).

    Args:
        server_lr: the server's step size eta (the paper tunes it per task).
        beta1, beta2, tau: see AdaptiveServerMethod (paper: 0.9, 0.99, 1e-3).
    """

    def __init__(self, server_lr: float = 1e-2, **kwargs):
        super().__init__(server_lr=server_lr, **kwargs)

    def second_moment(self, v, delta_sq):
        beta2 = self.hparams.beta2
        return beta2 * v + (1 - beta2) * delta_sq
