"""The server optimizers' shipped defaults: with them FedAdagrad and FedAvgM leave chance within
two rounds on a small non-IID setting like the demo's (the full check of every method is
benchmarks/method_defaults.py), and a float64 run starts the adaptive methods' second moment at
tau^2 computed in float64 and follows Algorithm 2 of Reddi et al. in float64."""

from __future__ import annotations

import pytest
import torch
from fl_test_utils import assert_same_run, fit, four_clients, one_client_module, straight_and_resumed, toy_data
from lightning.pytorch.callbacks import Callback

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.methods import FedAdagrad, FedAdam, FedAvgM, FedYogi

# the demo setting (configs/settings/mnist5k.yaml) in small: scikit-learn's digits, LDA alpha 0.1,
# half the clients a round, 5 local epochs of SGD 0.01 with momentum 0.9 (the methods' defaults),
# the FedAvg CNN
SMALL_DEMO = dict(dataset="digits", num_clients=10, sample_ratio=0.5, local_epochs=5, batch_size=20,
                  partition="dirichlet", alpha=0.1, min_size=10, partition_seed=0)


class RoundAccuracy(Callback):
    def __init__(self):
        self.accuracy = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.accuracy.append(float(trainer.callback_metrics["global/test_acc"]))


@pytest.mark.parametrize("cls", [FedAdagrad, FedAvgM])
def test_shipped_defaults_leave_chance_within_two_rounds(cls):
    """Chance is 0.10 (ten balanced classes); FedAvg reaches 0.32 here in round 1. A server step
    too large for clients that train several epochs with momentum (FedAdagrad with eta 0.1 and
    tau 1e-3) throws the CNN to a constant prediction, 0.10, round after round."""
    torch.manual_seed(0)
    dm = FederatedDataModule(**SMALL_DEMO)
    method = cls(model="fedavg_cnn", data_spec=dm.spec)
    rounds = RoundAccuracy()
    fit(method, dm, rounds=2, callbacks=[rounds])
    assert len(rounds.accuracy) == 2
    assert max(rounds.accuracy) >= 0.25, rounds.accuracy


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


def test_a_resumed_run_keeps_the_checkpoints_v(tmp_path):
    """v_{-1} is made again when a fit starts (in the run's dtype), before Lightning restores a
    checkpoint: a resumed run continues from the checkpoint's v, bit for bit."""

    def build(seed):
        torch.manual_seed(seed)
        dm = four_clients()
        return FedAdagrad(model="mlp", data_spec=dm.spec), dm

    straight, first, resumed = straight_and_resumed(build, tmp_path)
    assert_same_run(straight, resumed)
    for name, v in straight.server["v"].items():
        assert torch.equal(resumed.server["v"][name], v), name
        assert not torch.equal(v, torch.full_like(v, straight.hparams.tau**2))  # v has moved
