"""SCAFFOLD (Karimireddy et al., 2020): control variates correct each local gradient for client
drift.

    local step:     g <- g - c_i + c                     (c_i: this client's, c: the server's)
    after K steps:  c_i+ = c_i - c + (w_g - w_i) / (K_eff * lr)
    server:         w <- weighted average of w_i;  c <- c + (1/N) * sum_S (c_i+ - c_i)

N is the number of all clients. With momentum m the K steps move the weights lr * K_eff times the
average gradient, K_eff = (K - m(1 - m^K)/(1 - m)) / (1 - m) (as the official code of the FedSOL
authors does); `momentum_correction: false` uses the paper's plain K. A client that has not taken
part has c_i = 0; a client keeps its c_i+ (`upload.kept`, stored once the upload is accepted, so a
client whose upload is rejected as non-finite keeps its old c_i); the server's c is server state.
The upload carries c_i+ - c_i in its group "control_delta", which the server sums.
"""

from __future__ import annotations

import torch

from fl_lightning.methods.baselines.local_steps import effective_steps
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.state import trainable_zeros
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate

CONTROL_DELTA = "control_delta"  # the upload's group of c_i+ - c_i, by parameter name


class SCAFFOLD(SharedModelMethod):
    """SCAFFOLD (Karimireddy et al., ICML 2020): control variates correct the clients' drift.

    Args:
        momentum_correction: K_eff from the momentum (official code) instead of the plain step count K.
    """

    def __init__(self, momentum_correction: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.server.tensors("c", trainable_zeros(self.model))
        self._client_c: dict[str, torch.Tensor] = {}

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        stored = self.client_state(client, "c.")
        self._client_c = trainable_zeros(self.model) if stored is None else {
            n: v.to(self.device) for n, v in stored.items()}

    def drift_correction(self) -> dict[str, torch.Tensor]:
        """c - c_i, added to every local gradient (FedSOL+SCAFFOLD perturbs along it instead)."""
        c = self.server["c"]
        return {n: c[n] - self._client_c[n] for n in c}

    def after_backward(self) -> None:
        correction = self.drift_correction()
        for n, p in self.model.named_parameters():
            if p.grad is not None and n in correction:
                p.grad.add_(correction[n])
        super().after_backward()

    def steps_scale(self) -> float:
        """K_eff * lr: the factor that turns the client's displacement into an average gradient."""
        k = self.local_step
        k_eff = effective_steps(k, self.hparams.momentum) if self.hparams.momentum_correction else float(k)
        return k_eff * self.current_lr()

    def client_end(self) -> ClientUpload:
        upload = super().client_end()
        g, scale, c = self.global_params(), self.steps_scale(), self.server["c"]
        delta = upload.group(CONTROL_DELTA)
        for n, p in self.model.named_parameters():
            if n in c:
                # delta c_i = c_i+ - c_i = -c + (w_g - w_i) / (K_eff * lr)
                delta[n] = (g[n] - p.detach()) / scale - c[n]
        upload.kept.update(self.prefixed("c.", {n: d + self._client_c[n] for n, d in delta.items()}))
        return upload

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        update = super().server_step(uploads)
        num_clients = self.trainer.datamodule.num_clients
        c = self.server["c"]
        sums = uploads.sum(CONTROL_DELTA)  # c += sum_i delta c_i / N
        update.server_state["c"] = {n: c[n] + (sums[n] / num_clients).to(c[n].dtype) if n in sums else c[n] for n in c}
        return update
