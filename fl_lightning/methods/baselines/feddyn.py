"""FedDyn (Acar et al., 2021): a dynamic regulariser whose stationary points agree with the global
objective's.

    client loss:    CE - <g_i, w> + (alpha/2) ||w - w_g||^2
    client state:   g_i <- g_i - alpha (w_i - w_g)                      (after training)
    server state:   h <- h - (alpha/N) sum_S (w_i - w_g)                (N: all clients)
    global model:   w <- mean_S(w_i) - h / alpha                        (unweighted mean, as in the paper)

g_i starts at zero and is kept on CPU only for clients that have taken part; it is committed at
aggregation, so a client whose upload is rejected keeps its old g_i. Non-parameter buffers are
averaged as in FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext, SharedModelMethod
from fl_lightning.state import ServerStateMixin, state_or_zeros, to_cpu
from fl_lightning.uploads import RoundUploads


class FedDyn(ServerStateMixin, SharedModelMethod):
    """FedDyn (Acar et al., ICLR 2021): a dynamic regulariser that aligns local and global
    stationary points.

    Args:
        alpha: weight of the dynamic regulariser (FedSOL paper 0.1).
    """

    server_state = ("server_h",)

    def __init__(self, alpha: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        if alpha <= 0:
            raise FLUserError(f"FedDyn alpha must be > 0, got {alpha}")
        self.save_hyperparameters()
        self.server_h: dict[str, torch.Tensor] | None = None
        self._client_g: dict[str, torch.Tensor] = {}

    def round_start(self, round_idx: int, clients: list[int]) -> None:
        super().round_start(round_idx, clients)
        self.server_h = state_or_zeros(self.server_h, self.model, self.device)

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        self._client_g = state_or_zeros(self.client_states.get(client), self.model, self.device)

    def dynamic_regularizer(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """-<g_i, w> + (alpha/2) ||w - w_g||^2 at the weights `params` (by name; FedSOL+FedDyn
        perturbs along its gradient)."""
        g = self.global_params()
        linear, prox = 0.0, 0.0
        for n, p in params.items():
            if n in self._client_g:
                linear = linear + (self._client_g[n] * p).sum()
                prox = prox + ((p - g[n]) ** 2).sum()
        return 0.5 * self.hparams.alpha * prox - linear

    def loss(self, model, batch, context: LossContext):
        x, y = batch
        ce = F.cross_entropy(model(x), y)
        if context.finetuning:  # the regulariser is built on the client's g_i and this round's w_g
            return ce
        return ce + self.dynamic_regularizer(dict(model.named_parameters()))

    def aggregate(self, uploads: RoundUploads) -> None:
        alpha = self.hparams.alpha
        num_clients = self.trainer.datamodule.num_clients
        g = self.global_params()
        new = uploads.weighted_average(lambda u: u.weights, weight=lambda u: 1.0)
        for u in uploads:  # g_i on the process that trained client i
            old = self.client_states.get(u.client)
            state = {}
            for n, wg in g.items():
                if n not in self.server_h:
                    continue
                delta = u.weights[n].to(wg.device) - wg
                state[n] = (0 if old is None else old[n].to(wg.device)) - alpha * delta
            self.client_states[u.client] = to_cpu(state)
        deltas = uploads.sum(lambda u: {n: u.weights[n] - wg for n, wg in g.items() if n in self.server_h})
        for n, delta in deltas.items():  # h -= (alpha / N) sum_i (w_i - w_g)
            self.server_h[n] -= ((alpha / num_clients) * delta).to(self.server_h[n].dtype)
        for n, h in self.server_h.items():
            new[n] = new[n] - h / alpha
        self.load_global(new)
