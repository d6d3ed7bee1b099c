"""Aggregation and the round mechanics."""

import numpy as np
import torch
from fl_test_utils import fit, register_tensors, toy_data

from fl_lightning.data.datamodule import FederatedDataModule, sample_clients
from fl_lightning.federation import ClientUpload, weighted_average
from fl_lightning.methods import FedAvg


def test_weighted_average_equals_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, -2.0]), "n": torch.tensor(7)}
    out = weighted_average([a, b], [10, 30])
    torch.testing.assert_close(out["w"], torch.tensor([0.25 * 1 + 0.75 * 4, 0.25 * 2 - 0.75 * 2]))
    assert int(out["n"]) == 3  # integer buffers are not averaged


def test_fedavg_aggregate_weights_by_sample_count():
    x, y = toy_data(n=6, size=4)
    name = register_tensors(x, y)
    dm = FederatedDataModule(dataset=name, num_clients=1, partition="iid", min_size=1)
    method = FedAvg(model="mlp", data_spec=dm.spec, server_lr=1.0)
    method.round_start(0, [0, 1])
    ups = []
    for client, n, shift in [(0, 10, 1.0), (1, 30, -3.0)]:
        ups.append(ClientUpload(client, n, {k: v + shift for k, v in method.global_weights.items()}))
    method.aggregate(ups)
    for k, v in method.model.state_dict().items():
        torch.testing.assert_close(v, method.global_weights[k] + (0.25 * 1.0 + 0.75 * -3.0))


def test_server_lr_scales_the_averaged_update():
    x, y = toy_data(n=6, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=1, partition="iid", min_size=1)
    method = FedAvg(model="mlp", data_spec=dm.spec, server_lr=0.5)
    method.round_start(0, [0])
    method.aggregate([ClientUpload(0, 5, {k: v + 2.0 for k, v in method.global_weights.items()})])
    for k, v in method.model.state_dict().items():
        torch.testing.assert_close(v, method.global_weights[k] + 1.0)


def test_client_sampling_is_seeded_sized_and_without_replacement():
    for n, ratio, expected in [(100, 0.1, 10), (50, 0.2, 10), (7, 0.1, 1), (10, 1.0, 10)]:
        s = sample_clients(n, ratio, seed=3, round_idx=5)
        assert len(s) == expected == len(set(s))
        assert s == sample_clients(n, ratio, seed=3, round_idx=5)
    assert sample_clients(100, 0.1, 3, 5) != sample_clients(100, 0.1, 3, 6)


def test_round_plan_covers_local_epochs_and_batches():
    x, y = toy_data(n=40, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=4, sample_ratio=0.5, local_epochs=3,
                             batch_size=4, partition="iid", min_size=1)
    dm.setup()
    plan = dm.plan_round(2)
    assert [c.client for c in plan.clients] == sample_clients(4, 0.5, 0, 2)
    assert all(c.num_batches == 3 * int(np.ceil(c.num_samples / 4)) for c in plan.clients)
    from fl_lightning.data.datamodule import RoundBatchSampler

    batches = list(RoundBatchSampler(dm.client_parts, plan, 3, 4, seed=0))
    assert len(batches) == plan.num_batches
    first = plan.clients[0]
    seen = np.concatenate(batches[: first.num_batches])
    # every local epoch is one full pass over the client's own data
    assert sorted(seen.tolist()) == sorted(np.tile(dm.client_parts[first.client], 3).tolist())


def test_fit_runs_every_sampled_client_and_resets_momentum(monkeypatch):
    """Each sampled client starts from the round's global weights with empty optimizer state."""
    x, y = toy_data(n=24, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=3, sample_ratio=1.0, local_epochs=1,
                             batch_size=8, partition="iid", min_size=1)
    method = FedAvg(model="mlp", data_spec=dm.spec)
    starts = []
    original = FedAvg.client_start

    def spy(self, client, n):
        original(self, client, n)
        starts.append((client, len(self.optimizers().optimizer.state),
                       all(torch.equal(v, self.global_weights[k]) for k, v in self.model.state_dict().items())))

    monkeypatch.setattr(FedAvg, "client_start", spy)
    fit(method, dm, rounds=2)
    assert [s[0] for s in starts] == [0, 1, 2, 0, 1, 2]
    assert all(n_state == 0 and fresh for _, n_state, fresh in starts)


def test_method_and_data_options_of_the_same_name_are_both_logged():
    """FedDyn's alpha and the Dirichlet alpha: Lightning used to stop the run ("Error while merging
    hparams") whenever a logger was on; now the data's options are logged under `data`."""
    from lightning.pytorch.loggers import Logger

    from fl_lightning.methods import FedDyn

    class Recorder(Logger):
        name, version, logged = "recorder", 0, []

        def log_hyperparams(self, params, *args, **kwargs):
            self.logged.append(dict(params))

        def log_metrics(self, metrics, step=None):
            pass

    x, y = toy_data(n=40, size=4, num_classes=3)
    name = register_tensors(x, y, num_classes=3)
    dm = FederatedDataModule(dataset=name, num_clients=2, partition="dirichlet", alpha=0.3, min_size=1,
                             batch_size=10, local_epochs=1)
    method = FedDyn(model="mlp", alpha=0.05, data_spec=dm.spec)
    recorder = Recorder()
    fit(method, dm, logger=recorder)
    (params,) = recorder.logged
    assert params["alpha"] == 0.05 and params["data"]["alpha"] == 0.3
    assert params["data"]["partition"] == "dirichlet"
