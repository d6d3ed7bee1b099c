"""FedNova (Wang et al., 2020): normalised averaging, so clients that take more local steps do
not pull the global model towards their own optimum.

    a_i = (tau_i - m(1 - m^tau_i)/(1 - m)) / (1 - m)      (tau_i local steps, momentum m; tau_i if m = 0)
    d_i = (w_g - w_i) / a_i                                (the client's normalised update)
    w   <- w_g - eta_g * (sum_i p_i a_i) * sum_i p_i d_i   (p_i: sample weights)

This is the paper's rule; the official code's cross-client correction term is never updated and
is not reproduced. Non-parameter buffers (e.g. BN statistics) are averaged as in FedAvg.
"""

from __future__ import annotations

from fl_lightning.methods.base import SharedModelMethod
from fl_lightning.state import effective_steps
from fl_lightning.uploads import ClientUpload, weighted_average


class FedNova(SharedModelMethod):
    def client_end(self) -> ClientUpload:
        upload = super().client_end()
        upload.local_steps = self.local_step
        return upload

    def aggregate(self, uploads: list[ClientUpload]) -> None:
        sizes = [u.num_samples for u in uploads]
        total = float(sum(sizes))
        p = [n / total for n in sizes]
        a = [effective_steps(u.local_steps, self.hparams.momentum) for u in uploads]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a, strict=True))
        new = weighted_average([u.weights for u in uploads], sizes)  # buffers; parameters are replaced below
        g = self.global_params()
        for name, wg in g.items():
            d = sum((pi / ai) * (wg - u.weights[name]) for pi, ai, u in zip(p, a, uploads, strict=True))
            new[name] = wg - self.hparams.server_lr * tau_eff * d
        self.log("fednova/tau_eff", tau_eff, on_step=False, on_epoch=True, batch_size=1)
        self.load_global(new)
