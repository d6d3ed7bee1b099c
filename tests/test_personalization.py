"""Personalised evaluation: per-client test sets follow the training partition, fine-tuning is
evaluated on each client's own test set, and the global model (and the next round) is untouched."""

import numpy as np
import pytest
import torch
from fl_test_utils import fit, learnable_shard_module, params

from fl_lightning.data import partition as partitioners
from fl_lightning.errors import FLUserError
from fl_lightning.methods import FedAvg, FedDrPlus
from fl_lightning.personalization import PersonalizationCallback


def _shard_module(client_test="partition", **kw):
    return learnable_shard_module(client_test=client_test, **kw)


def test_partitioned_client_test_sets_follow_training_classes():
    dm = _shard_module()
    dm.setup()
    seen = set()
    for c in range(4):
        train_classes = set(np.unique(dm.train_set.labels[dm.client_parts[c]]).tolist())
        idx = dm.client_test_parts[c]
        assert len(idx) == 25  # one shard of the 100 test samples per client
        assert set(np.unique(dm.test_set.labels[idx]).tolist()) == train_classes
        assert not seen & set(idx.tolist())  # disjoint
        seen |= set(idx.tolist())
        xb, yb = next(iter(dm.client_loader(c, "test")))
        assert set(yb.tolist()) <= train_classes


def test_test_like_train_proportional_and_aligned_distribution():
    counts = np.array([[30, 10, 0], [0, 10, 20]])
    test_labels = np.repeat(np.arange(3), 20)
    parts = partitioners.test_like_train(counts, test_labels, seed=0)
    got = np.stack([np.bincount(test_labels[p], minlength=3) for p in parts])
    np.testing.assert_array_equal(got, [[20, 10, 0], [0, 10, 20]])
    counts = np.array([[12, 6, 0], [0, 6, 12]])
    parts = partitioners.test_aligned(counts, test_labels, seed=0)
    # |test| / |train| = 60 / 36; client 0: 18 * 5/3 = 30 test samples, split 2:1 like its train data
    got = np.stack([np.bincount(test_labels[p], minlength=3) for p in parts])
    np.testing.assert_array_equal(got, [[20, 10, 0], [0, 10, 20]])
    assert len(set(parts[0].tolist())) == 30  # no repeats within a client


def test_aligned_client_test_sets_via_datamodule():
    dm = _shard_module(client_test="align", partition="dirichlet", alpha=0.3, min_size=5)
    dm.setup()
    for c in range(4):
        train = np.bincount(dm.train_set.labels[dm.client_parts[c]], minlength=4)
        test = np.bincount(dm.test_set.labels[dm.client_test_parts[c]], minlength=4)
        assert set(np.flatnonzero(test)) <= set(np.flatnonzero(train))


def test_bad_client_test_options_fail_fast():
    with pytest.raises(FLUserError):
        _shard_module(client_test="split")
    with pytest.raises(FLUserError):
        _shard_module(client_test="align", client_test_fraction=0.2)


@pytest.mark.parametrize("method_cls,objective", [(FedAvg, "ce"), (FedDrPlus, "method")])
def test_personalised_accuracy_uses_own_test_set_and_leaves_global_untouched(method_cls, objective):
    torch.manual_seed(0)
    dm = _shard_module()
    method = method_cls(model="mlp", lr=0.1, data_spec=dm.spec)
    cb = PersonalizationCallback(enabled=True, epochs=[0, 3], objective=objective, local_only=True,
                                 local_only_epochs=2)
    trainer = fit(method, dm, rounds=2, callbacks=[cb])
    global_state = params(method.model)
    res = cb.evaluate(trainer, method, local_only=True)
    # the global model is bit-identical after fine-tuning every client
    after = params(method.model)
    assert all(torch.equal(global_state[k], after[k]) for k in global_state)
    # epoch 0 = the global model itself on each client's own test set
    for c in range(4):
        idx = dm.client_test_parts[c]
        x = torch.stack([dm.test_set[i][0] for i in idx])
        y = torch.tensor([dm.test_set[i][1] for i in idx])
        with torch.no_grad():
            acc = int((method.model(x).argmax(1) == y).sum()) / len(y)
        assert abs(cb.per_client["ft0"][c] - acc) < 1e-9
        assert abs(cb.per_client["global"][c] - acc) < 1e-9
    assert res["personal/ft0_acc_mean"] == pytest.approx(np.mean(cb.per_client["ft0"]))
    assert res["personal/ft3_acc_std"] == pytest.approx(np.std(cb.per_client["ft3"]))
    assert len(cb.per_client["local_only"]) == 4
    # fine-tuning on one client's data (all of one class here) makes its own test set easy
    assert res["personal/ft3_acc_mean"] > res["personal/ft0_acc_mean"]


def test_finetuning_during_training_does_not_leak_into_next_round():
    """The same run with and without per-round personalised evaluation ends in the same global model."""
    finals = []
    for enabled in (False, True):
        torch.manual_seed(0)
        dm = _shard_module()
        method = FedAvg(model="mlp", lr=0.1, data_spec=dm.spec)
        cb = PersonalizationCallback(enabled=enabled, epochs=[2], every_n_rounds=1, at_end=False)
        fit(method, dm, rounds=3, callbacks=[cb])
        finals.append(params(method.model))
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_finetune_all_trains_the_frozen_head_only_when_asked():
    torch.manual_seed(0)
    dm = _shard_module()
    from fl_lightning.methods import FedBABU

    method = FedBABU(model="mlp", lr=0.1, data_spec=dm.spec)
    trainer = fit(method, dm, rounds=1)
    head = method.model.head.weight.detach().clone()
    captured = {}
    real = PersonalizationCallback.accuracy

    def spy(model, loader, device):
        captured.setdefault("heads", []).append(model.head.weight.detach().clone())
        return real(model, loader, device)

    for mode in ("trainable", "all"):
        captured.clear()
        cb = PersonalizationCallback(enabled=True, epochs=[2], finetune=mode, max_clients=1)
        cb.accuracy = spy
        cb.evaluate(trainer, method)
        ft_head = captured["heads"][1]  # calls: global on client test, fine-tuned, global on test set
        assert torch.equal(ft_head, head) == (mode == "trainable")
    assert torch.equal(method.model.head.weight, head)


class _ConstantPrediction(torch.nn.Module):
    def __init__(self, cls, num_classes):
        super().__init__()
        self.cls, self.num_classes = cls, num_classes

    def forward(self, x):
        return torch.nn.functional.one_hot(torch.full((len(x),), self.cls), self.num_classes).float()


class _OwnModels(FedAvg):
    """Client k's own personalised model always predicts class k."""

    def personal_model(self, client):
        return _ConstantPrediction(client, self.hparams.data_spec.num_classes)


def test_a_methods_own_personal_models_are_tested_on_each_clients_test_set():
    dm = _shard_module()
    method = _OwnModels(model="mlp", data_spec=dm.spec)
    pers = PersonalizationCallback(enabled=True, epochs=[1])
    fit(method, dm, rounds=1, callbacks=[pers])
    dm.setup()
    expected = [float((dm.test_set.labels[dm.client_test_parts[c]] == c).mean()) for c in range(4)]
    assert len(set(expected)) > 1  # clients differ: a per-client evaluation, not one shared number
    assert pers.per_client["own"] == pytest.approx(expected)
    assert pers.results["personal/own_acc_mean"] == pytest.approx(np.mean(expected))
    assert "personal/own_acc_mean" not in PersonalizationCallback(enabled=True).results


def test_personalised_evaluation_of_a_heterogeneous_method_starts_from_each_clients_own_model():
    """The same callback serves both method families: a model-heterogeneous method fine-tunes
    each client's own model (which stays untouched) and reports no global-model accuracy."""
    from fl_lightning.methods import FedProto

    torch.manual_seed(0)
    dm = _shard_module(client_test="split", client_test_fraction=0.25)
    method = FedProto(model="mlp", feature_dim=8, lr=0.1, data_spec=dm.spec)
    cb = PersonalizationCallback(enabled=True, epochs=[0, 2], local_only=True, local_only_epochs=1)
    trainer = fit(method, dm, rounds=1, callbacks=[cb])
    before = [params(m) for m in method.client_models]
    res = cb.evaluate(trainer, method, local_only=True)
    assert "final/global_test_acc" not in res
    for c, model in enumerate(method.client_models):
        assert all(torch.equal(before[c][k], v) for k, v in params(model).items())
        own = cb.accuracy(model, dm.client_loader(c, "test"), method)
        assert cb.per_client["global"][c] == cb.per_client["ft0"][c] == own
    assert len(cb.per_client["local_only"]) == 4
