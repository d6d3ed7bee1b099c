"""FedDyn (Acar et al., 2021): a dynamic regulariser whose stationary points agree with the global
objective's.

    client loss:    CE - <g_i, w> + (alpha/2) ||w - w_g||^2
    client state:   g_i <- g_i - alpha (w_i - w_g)                      (after training)
    server state:   h <- h - (alpha/N) sum_S (w_i - w_g)                (N: all clients)
    global model:   w <- mean_S(w_i) - h / alpha                        (unweighted mean, as in the paper)

g_i starts at zero; a client keeps its new g_i (`upload.kept`, stored once the upload is accepted,
so a client whose upload is rejected keeps its old g_i); h is server state. Non-parameter buffers
are averaged as in FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.state import trainable_zeros
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate


class FedDyn(SharedModelMethod):
    """FedDyn (Acar et al., ICLR 2021): a dynamic regulariser that aligns local and global
    stationary points.

    Args:
        alpha: weight of the dynamic regulariser (FedSOL paper 0.1).
    """

    def __init__(self, alpha: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        if alpha <= 0:
            raise FLUserError(f"FedDyn alpha must be > 0, got {alpha}")
        self.save_hyperparameters()
        self.server.tensors("h", trainable_zeros(self.model))
        self._client_g: dict[str, torch.Tensor] = {}

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        stored = self.client_state(client, "g.")
        self._client_g = trainable_zeros(self.model) if stored is None else {
            n: v.to(self.device) for n, v in stored.items()}

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

    def client_end(self) -> ClientUpload:
        upload = super().client_end()
        alpha = self.hparams.alpha
        # g_i <- g_i - alpha (w_i - w_g)
        upload.kept.update(self.prefixed("g.", {n: self._client_g[n] - alpha * (upload.weights[n] - wg)
                                                for n, wg in self.global_params().items() if n in self._client_g}))
        return upload

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        alpha = self.hparams.alpha
        num_clients = self.trainer.datamodule.num_clients
        g, h = self.global_params(), self.server["h"]
        new = uploads.weighted_average(lambda u: u.weights, weight=lambda u: 1.0)
        deltas = uploads.sum(lambda u: {n: u.weights[n] - wg for n, wg in g.items() if n in h})
        # h -= (alpha / N) sum_i (w_i - w_g)
        new_h = {n: h[n] - ((alpha / num_clients) * deltas[n]).to(h[n].dtype) if n in deltas else h[n] for n in h}
        for n, value in new_h.items():
            new[n] = new[n] - value / alpha
        return ServerUpdate(global_state=new, server_state={"h": new_h})
