"""FedAvgM (Hsu, Qi & Brown, 2019, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification"): server momentum on the average client update,

    Delta_t = sum_i p_i (w_i - w_t),   u_t = beta u_{t-1} + Delta_t,   w_{t+1} = w_t + eta u_t

on the trainable parameters (u_{-1} = 0; eta = server_lr, 1 in the paper); buffers are averaged
as in FedAvg. With beta = 0 it is FedAvg. u is server state.
"""

from __future__ import annotations

from fl_lightning.errors import FLUserError
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.state import trainable_zeros
from fl_lightning.uploads import RoundUploads, ServerUpdate


class FedAvgM(SharedModelMethod):
    """FedAvgM (Hsu et al., 2019): FedAvg with server momentum.

    The defaults are Reddi et al.'s FedAvgM: momentum 0.9 and server step 1, FedAvg's own step, so
    that the first round is FedAvg's and momentum only adds what earlier rounds agreed on.
    Sources: Reddi et al. (ICLR 2021; their hyperparameter notes in google-research/federated,
    optimization/docs/hyperparameters.md) ran FedAvgM with momentum 0.9 and found server lr 1 best
    on four of their six tasks, 10^-0.5 on the other two (EMNIST character recognition,
    Shakespeare); FL-bench ships momentum 0.9 (Nesterov) with lr 1; Flower's FedAvgM ships momentum
    0 (plain FedAvg) with lr 1. On the offline demo setting these defaults keep FedAvgM level with
    FedAvg in the first rounds and ahead of it afterwards (docs/reference/method-defaults.md).

    Args:
        server_momentum: beta of the server's momentum (Hsu et al. and Reddi et al.: 0.9).
        server_lr: the server's step size eta on the momentum (1 as in FedAvg; Reddi et al.'s best
            was 1 or 10^-0.5 depending on the task).
    """

    def __init__(self, server_momentum: float = 0.9, server_lr: float = 1.0, **kwargs):
        super().__init__(server_lr=server_lr, **kwargs)
        if not 0 <= server_momentum < 1:
            raise FLUserError(f"FedAvgM needs 0 <= server_momentum < 1, got {server_momentum}")
        self.save_hyperparameters()
        self.server.tensors("momentum", trainable_zeros(self.model))

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        avg, u = uploads.weighted_average(lambda w: w.weights), self.server["momentum"]
        new, new_u = dict(avg), {}
        for n, w in self.global_params().items():
            if n in u:
                new_u[n] = self.hparams.server_momentum * u[n] + (avg[n] - w)
                new[n] = w + self.hparams.server_lr * new_u[n]
        return ServerUpdate(global_state=new, server_state={"momentum": new_u})
