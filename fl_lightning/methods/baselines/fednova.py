"""FedNova (Wang et al., 2020): normalised averaging, so clients that take more local steps do
not pull the global model towards their own optimum.

    a_i = (tau_i - m(1 - m^tau_i)/(1 - m)) / (1 - m)      (tau_i local steps, momentum m; tau_i if m = 0)
    d_i = (w_g - w_i) / a_i                                (the client's normalised update)
    w   <- w_g - eta_g * (sum_i p_i a_i) * sum_i p_i d_i   (p_i: sample weights)

This is the paper's rule; the official code's cross-client correction term is never updated and
is not reproduced. Non-parameter buffers (e.g. BN statistics) are averaged as in FedAvg.
"""

from __future__ import annotations

import torch

from fl_lightning.methods.baselines.local_steps import effective_steps
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.uploads import WEIGHTS, ClientUpload, RoundUploads, ServerUpdate

LOCAL_STEPS = "local_steps"  # the upload's group holding tau_i ("tau"), the client's local steps


class FedNova(SharedModelMethod):
    def client_end(self) -> ClientUpload:
        upload = super().client_end()
        # a tensor in a group of its own: checked, moved and gathered as every other tensor is
        upload.set_group(LOCAL_STEPS, {"tau": torch.tensor(self.local_step)})
        return upload

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        new = uploads.weighted_average(WEIGHTS)  # buffers; parameters are replaced below
        g = self.global_params()
        momentum = self.hparams.momentum

        def terms(u):  # n_i a_i and (n_i / a_i)(w_g - w_i): p_i = n_i / n after the reduction
            a = effective_steps(int(u.group(LOCAL_STEPS)["tau"]), momentum)
            return {"n": float(u.num_samples), "n_a": u.num_samples * a,
                    **{name: (u.num_samples / a) * (wg.double() - u.weights[name].double()) for name, wg in g.items()}}

        sums = uploads.sum(terms)
        n = float(sums.pop("n"))
        tau_eff = float(sums.pop("n_a")) / n
        for name, wg in g.items():
            new[name] = (wg.double() - self.hparams.server_lr * tau_eff * sums[name] / n).to(wg.dtype)
        return ServerUpdate(global_state=new, metrics={"fednova/tau_eff": tau_eff})
