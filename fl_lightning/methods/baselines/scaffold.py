"""SCAFFOLD (Karimireddy et al., 2020): control variates correct each local gradient for client
drift.

    local step:     g <- g - c_i + c                     (c_i: this client's, c: the server's)
    after K steps:  c_i+ = c_i - c + (w_g - w_i) / (K_eff * lr)
    server:         w <- weighted average of w_i;  c <- c + (1/N) * sum_S (c_i+ - c_i)

N is the number of all clients. With momentum m the K steps move the weights lr * K_eff times the
average gradient, K_eff = (K - m(1 - m^K)/(1 - m)) / (1 - m) (as the official code of the FedSOL
authors does); `momentum_correction: false` uses the paper's plain K. A client that has not taken
part has c_i = 0; c_i is kept on CPU only for clients that have, and it is committed at
aggregation, so a client whose upload is rejected as non-finite keeps its old c_i.
"""

from __future__ import annotations

import torch

from fl_lightning.methods.base import SharedModelMethod
from fl_lightning.state import ServerStateMixin, effective_steps, state_or_zeros, to_cpu
from fl_lightning.uploads import ClientUpload, RoundUploads


class SCAFFOLD(ServerStateMixin, SharedModelMethod):
    """SCAFFOLD (Karimireddy et al., ICML 2020): control variates correct the clients' drift.

    Args:
        momentum_correction: K_eff from the momentum (official code) instead of the plain step count K.
    """

    server_state = ("server_c",)

    def __init__(self, momentum_correction: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.server_c: dict[str, torch.Tensor] | None = None
        self._client_c: dict[str, torch.Tensor] = {}

    def round_start(self, round_idx: int, clients: list[int]) -> None:
        super().round_start(round_idx, clients)
        self.server_c = state_or_zeros(self.server_c, self.model, self.device)

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        self._client_c = state_or_zeros(self.client_states.get(client), self.model, self.device)

    def drift_correction(self) -> dict[str, torch.Tensor]:
        """c - c_i, added to every local gradient (FedSOL+SCAFFOLD perturbs along it instead)."""
        return {n: self.server_c[n] - self._client_c[n] for n in self.server_c}

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
        g, scale = self.global_params(), self.steps_scale()
        for n, p in self.model.named_parameters():
            if n in self.server_c:
                # delta c_i = c_i+ - c_i = -c + (w_g - w_i) / (K_eff * lr)
                upload.control_delta[n] = (g[n] - p.detach()) / scale - self.server_c[n]
        return upload

    def aggregate(self, uploads: RoundUploads) -> None:
        avg = uploads.weighted_average(lambda u: u.weights)
        num_clients = self.trainer.datamodule.num_clients
        for u in uploads:  # c_i on the process that trained client i
            delta = u.control_delta
            old = self.client_states.get(u.client)
            new = {n: d.detach() + (0 if old is None else old[n].to(d.device)) for n, d in delta.items()}
            self.client_states[u.client] = to_cpu(new)
        for n, d in uploads.sum(lambda u: u.control_delta).items():  # c += sum_i delta c_i / N
            self.server_c[n] += (d / num_clients).to(self.server_c[n].dtype)
        self.load_global(self.server_step(avg))
