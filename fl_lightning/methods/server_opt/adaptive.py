"""The adaptive server optimizers of Reddi et al., ICLR 2021 ("Adaptive Federated Optimization",
Algorithm 2, FedOpt): the clients run local SGD as in FedAvg; the server treats the average client
update as a pseudo-gradient and steps with momentum and a per-coordinate second moment,

    Delta_t = sum_i p_i (w_i - w_t)                     (p_i: sample weights, as FedAvg's average)
    m_t     = beta1 m_{t-1} + (1 - beta1) Delta_t       (m_{-1} = 0)
    v_t     = second_moment(v_{t-1}, Delta_t^2)         (v_{-1} = tau^2; FedAdam/FedYogi/FedAdagrad)
    w_{t+1} = w_t + eta m_t / (sqrt(v_t) + tau)         (eta: server_lr)

on the trainable parameters; buffers (BatchNorm statistics) are averaged as in FedAvg. As in the
paper's Algorithm 2 there is no bias correction and v starts at tau^2 (Flower, FL-bench and the
Keras optimizers of the authors' code start it at 0). m and v are server state.

Each method's docstring gives its defaults with their sources; the paper tunes the server's step
size and tau per task, and docs/reference/method-defaults.md shows what the defaults do on the
offline demo setting.
"""

from __future__ import annotations

import torch

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import abstract_base
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.state import trainable_zeros
from fl_lightning.uploads import RoundUploads, ServerUpdate


@abstract_base
class AdaptiveServerMethod(SharedModelMethod):
    """FedOpt's server step (see the module docstring); subclasses give `second_moment`.

    Args:
        beta1: momentum of the pseudo-gradient (paper 0.9).
        beta2: decay of the second moment (paper 0.99; FedAdagrad has none).
        tau: adaptivity: the second moment's floor and the step's denominator term (paper 1e-3).
    """

    def __init__(self, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, **kwargs):
        super().__init__(**kwargs)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1) or not tau > 0:
            raise FLUserError(f"{type(self).__name__} needs 0 <= beta1, beta2 < 1 and tau > 0, got beta1={beta1}, "
                              f"beta2={beta2}, tau={tau}")
        self.save_hyperparameters()
        self.server.tensors("m", trainable_zeros(self.model))
        self.server.tensors("v", self._initial_v())

    def _initial_v(self) -> dict[str, torch.Tensor]:
        """v_{-1} = tau^2 in the model's current dtype: tau^2 is not a binary fraction, so made in
        float32 and converted it would differ from the float64 formula."""
        return {n: torch.full_like(p, self.hparams.tau**2) for n, p in self.model.named_parameters() if p.requires_grad}

    def setup(self, stage: str) -> None:
        # The round callback converts the module to the run's precision (float64 under 64-true)
        # before this hook and a checkpoint is restored after it: v_{-1} is made again here, in
        # that dtype, unless this module has already run rounds.
        super().setup(stage)
        if self.round_idx < 0:
            self.server.assign({"v": self._initial_v()})

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        h, avg = self.hparams, uploads.weighted_average(lambda u: u.weights)
        m, v, new = self.server["m"], self.server["v"], dict(avg)
        new_m, new_v = {}, {}
        for n, w in self.global_params().items():
            if n not in m:
                continue
            delta = avg[n] - w
            new_m[n] = h.beta1 * m[n] + (1 - h.beta1) * delta
            new_v[n] = self.second_moment(v[n], delta * delta)
            new[n] = w + h.server_lr * new_m[n] / (new_v[n].sqrt() + h.tau)
        return ServerUpdate(global_state=new, server_state={"m": new_m, "v": new_v})
