"""FedExP (Jhunjhunwala et al., 2023): a server step size chosen each round by extrapolation,

    Delta_i = w_i - w_g,   Delta = sum_i p_i Delta_i       (p_i: sample weights, S clients)
    eta_g   = max(1, 0.5 * sum_i p_i ||Delta_i||^2 / (||Delta||^2 + S * eps)),  eps = 1e-3
    w      <- w_g + eta_g * Delta

The iterates oscillate, so the reported model is the average of the last two iterates: between
rounds `self.model` (what validation, checkpoints and test see) holds (w_t + w_{t-1}) / 2, the
iterate w_t itself is server state, and the next round starts from it.
"""

from __future__ import annotations

import torch

from fl_lightning.errors import FLUserError
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.uploads import RoundUploads, ServerUpdate


def fedexp_step(spread: float, mean_sq: float, num_clients: int, eps: float) -> float:
    """max(1, 0.5 * spread / (mean_sq + S * eps)) with spread = sum_i p_i ||Delta_i||^2 and
    mean_sq = ||sum_i p_i Delta_i||^2."""
    return max(1.0, 0.5 * spread / (mean_sq + num_clients * eps))


def fedexp_step_size(deltas: list[dict[str, torch.Tensor]], weights: list[float], eps: float) -> float:
    """The step size from the clients' updates themselves, in float64 (a reference for tests)."""
    total = float(sum(weights))
    p = [w / total for w in weights]
    spread = sum(pi * sum(float((d.double() ** 2).sum()) for d in delta.values())
                 for pi, delta in zip(p, deltas, strict=True))
    mean_sq = sum(float((sum(pi * delta[k].double() for pi, delta in zip(p, deltas, strict=True)) ** 2).sum())
                  for k in deltas[0])
    return fedexp_step(spread, mean_sq, len(deltas), eps)


class FedExP(SharedModelMethod):
    """FedExP (Jhunjhunwala et al., ICLR 2023): an adaptive server step size from the clients'
    updates (extrapolation).

    Args:
        eps: the step-size denominator's regulariser (paper 1e-3).
    """

    def __init__(self, eps: float = 1e-3, **kwargs):
        super().__init__(**kwargs)
        if self.hparams.server_lr != 1.0:
            raise FLUserError("FedExP chooses its own server step size; leave server_lr at 1.0")
        if eps <= 0:
            raise FLUserError(f"FedExP eps must be > 0, got {eps}")
        self.save_hyperparameters()
        self.server.tensors("iterate", self.model.state_dict())

    def round_start(self, round_idx: int, clients: list[int]) -> None:
        # clients start from the iterate, not from the reported average
        self.model.load_state_dict(self.server["iterate"])
        super().round_start(round_idx, clients)

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        g = self.global_params()
        new = uploads.weighted_average(lambda u: u.weights)  # buffers as in FedAvg
        # sum_i p_i ||Delta_i||^2 is a weighted sum too; ||Delta||^2 is the average's distance
        spread = uploads.sum(lambda u: {"n": float(u.num_samples), "sq": float(u.num_samples) * sum(
            float(((u.weights[n].double() - wg.double()) ** 2).sum()) for n, wg in g.items())})
        mean_sq = sum(float(((new[n].double() - wg.double()) ** 2).sum()) for n, wg in g.items())
        eta = fedexp_step(float(spread["sq"] / spread["n"]), mean_sq, uploads.count, self.hparams.eps)
        for n, wg in g.items():
            new[n] = wg + eta * (new[n] - wg)
        reported = {k: (v + self.global_weights[k]) / 2 if torch.is_floating_point(v) else v
                    for k, v in new.items()}
        return ServerUpdate(global_state=reported, server_state={"iterate": new}, metrics={"fedexp/eta_g": eta})
