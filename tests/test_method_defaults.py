"""The server optimizers' shipped defaults: a float64 run starts the adaptive methods' second
moment at tau^2 computed in float64 and follows Algorithm 2 of Reddi et al. in float64."""

from __future__ import annotations

import pytest
import torch
from fl_test_utils import fit, one_client_module, toy_data
from lightning.pytorch.callbacks import Callback

from fl_lightning.methods import FedAdagrad, FedAdam, FedYogi


class FirstRound(Callback):
    """Records the server's v when training starts (after the precision conversion and any
    checkpoint restore), and checks the first server step against the formula in the model's dtype."""

    def on_train_start(self, trainer, pl_module):
        self.initial_v = {k: v.clone() for k, v in pl_module.server["v"].items()}
        real, h = pl_module.server_step, pl_module.hparams

        def checked(uploads):
            avg, w = uploads.weighted_average(lambda u: u.weights), pl_module.global_params()
            update = real(uploads)
            for n, v in update.server_state["v"].items():
                delta = avg[n] - w[n]
                v_prev = torch.full_like(w[n], h.tau**2)
                assert torch.equal(v, pl_module.second_moment(v_prev, delta * delta)), n
                m = (1 - h.beta1) * delta
                torch.testing.assert_close(update.global_state[n], w[n] + h.server_lr * m / (v.sqrt() + h.tau),
                                           rtol=1e-14, atol=0)
            self.checked = True
            return update

        pl_module.server_step = checked
        self.checked = False


@pytest.mark.parametrize("cls", [FedAdagrad, FedAdam, FedYogi])
def test_a_float64_run_starts_v_at_tau_squared_in_float64(cls):
    torch.manual_seed(0)
    x, y = toy_data(n=24, size=4, num_classes=3)
    dm = one_client_module(x, y, num_clients=2, batch_size=6)
    method = cls(model="mlp", data_spec=dm.spec)
    spy = FirstRound()
    fit(method, dm, rounds=1, callbacks=[spy], precision="64-true")
    tau2 = torch.tensor(method.hparams.tau, dtype=torch.float64) ** 2
    assert tau2.item() == method.hparams.tau**2  # the Python float, itself a float64
    for name, v in spy.initial_v.items():
        assert v.dtype == torch.float64
        assert torch.equal(v, torch.full_like(v, method.hparams.tau**2)), name
    assert spy.checked
