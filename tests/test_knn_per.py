"""kNN-Per: the kNN probabilities and the interpolation against hand-computed values, the personal
model of a real run against a loop-by-loop re-implementation of the definition, lambda chosen on
held-out data, small clients, and training that is FedAvg's, bit for bit."""

import math

import numpy as np
import pytest
import torch
from fl_test_utils import fit, fixed_parts_module, params, register_tensors, toy_data
from torch import nn

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.errors import FLUserError
from fl_lightning.methods import FedAvg, KNNPer, KNNPerModel
from fl_lightning.methods.personalized.knn_per import holdout_split, interpolate, knn_probabilities
from fl_lightning.models import FLModel
from fl_lightning.personalization import PersonalizationCallback

# 4 stored points in 2-D and their labels
KEYS = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
LABELS = torch.tensor([0, 1, 1, 2])


def test_knn_probabilities_match_closed_form():
    q = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # query (0,0): squared distances 0, 1, 4, 9; query (1,1): 2, 1, 2, 5
    got = knn_probabilities(q, KEYS, LABELS, 3, k=3, temperature=0.5, distance="squared")
    e = math.exp
    z0 = e(0) + e(-2) + e(-8)  # 3 nearest: labels 0, 1, 1
    z1 = e(-4) + e(-2) + e(-4)  # 3 nearest: (1,0) at 1, then (0,0) and (0,2) at 2; (3,0) left out
    want = torch.tensor([[1 / z0, (e(-2) + e(-8)) / z0, 0.0],
                         [e(-4) / z1, (e(-2) + e(-4)) / z1, 0.0]])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # plain Euclidean distances: 0, 1, 2 for the 3 nearest of (0,0); T = 1
    got = knn_probabilities(q[:1], KEYS, LABELS, 3, k=3, temperature=1.0, distance="euclidean")
    z = 1 + e(-1) + e(-2)
    torch.testing.assert_close(got, torch.tensor([[1 / z, (e(-1) + e(-2)) / z, 0.0]]), rtol=1e-6, atol=1e-7)
    # k larger than the datastore: all 4 points count
    got = knn_probabilities(q[:1], KEYS, LABELS, 3, k=10, temperature=1.0, distance="squared")
    z = 1 + e(-1) + e(-4) + e(-9)
    torch.testing.assert_close(got, torch.tensor([[1 / z, (e(-1) + e(-4)) / z, e(-9) / z]]), rtol=1e-6, atol=1e-8)
    # k = 1 is the nearest neighbour's one-hot label
    got = knn_probabilities(q, KEYS, LABELS, 3, k=1, temperature=1.0)
    assert torch.equal(got, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_far_queries_do_not_underflow_to_nan():
    got = knn_probabilities(torch.tensor([[1000.0, 0.0]]), KEYS, LABELS, 3, k=2, temperature=1e-3)
    # squared distances 997^2 and 999^2 (labels 2, 1): the weight ratio exp(-3992 / 1e-3) is 0
    assert torch.equal(got, torch.tensor([[0.0, 0.0, 1.0]]))


class _IdentityFeatures(FLModel):
    """features(x) = x (2-D), a fixed linear head: the datastore keys are the inputs themselves."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 3)
        self.feature_dim = 2
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
            self.head.bias.copy_(torch.tensor([0.0, 0.5, 0.0]))

    def features(self, x):
        return x


@pytest.mark.parametrize("lam", [0.0, 1.0, 0.3])
def test_interpolation_of_knn_and_global_probabilities(lam):
    x = torch.tensor([[0.0, 0.0], [2.0, 1.0]])
    pm = KNNPerModel(_IdentityFeatures(), KEYS, LABELS, 3, k=2, temperature=1.0, lam=lam)
    e = math.exp
    # kNN, squared distances, k = 2: (0,0) -> keys 0 (d 0, label 0) and 1 (d 1, label 1);
    # (2,1) -> keys 1 (d 2, label 1) and 3 (d 2, label 2)
    p_knn = [[1 / (1 + e(-1)), e(-1) / (1 + e(-1)), 0.0], [0.0, 0.5, 0.5]]
    # global logits: head(x) = (x1, x2 + 0.5, -x1 - x2)
    logits = [[0.0, 0.5, 0.0], [2.0, 1.5, -3.0]]
    soft = [[e(v) / sum(e(u) for u in row) for v in row] for row in logits]
    want = torch.tensor([[lam * a + (1 - lam) * b for a, b in zip(ra, rb, strict=True)]
                         for ra, rb in zip(p_knn, soft, strict=True)])
    got = pm.probabilities(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pm(x).exp(), want, rtol=1e-6, atol=1e-7)  # forward = log p
    if lam == 0.0:
        assert torch.equal(got, torch.softmax(pm.model.head(x), 1))
    if lam == 1.0:
        assert torch.equal(got, knn_probabilities(x, KEYS, LABELS, 3, 2, 1.0))
    # the helper is the same mixture
    torch.testing.assert_close(interpolate(torch.tensor(p_knn), torch.tensor(logits), lam), want)


# ---- a real tiny run -----------------------------------------------------------------------------
def _module(**kw):
    g = torch.Generator().manual_seed(0)
    classes, n_train, n_test = 4, 160, 80
    y_train, y_test = torch.arange(n_train) % classes, torch.arange(n_test) % classes
    # overlapping classes, so that kNN, the global model and their mixtures disagree on some samples
    x_train = torch.randn(n_train, 1, 4, 4, generator=g) + 0.5 * y_train.view(-1, 1, 1, 1).float()
    x_test = torch.randn(n_test, 1, 4, 4, generator=g) + 0.5 * y_test.view(-1, 1, 1, 1).float()
    name = register_tensors(x_train, y_train, x_test, y_test, num_classes=classes)
    args = dict(dataset=name, num_clients=4, sample_ratio=1.0, local_epochs=1, batch_size=20,
                partition="dirichlet", alpha=0.5, min_size=5, client_test="align")
    args.update(kw)
    return FederatedDataModule(**args)


def _client_data(dm, client, split):
    if split == "train":
        idx, ds = dm.client_parts[client], dm.plain_train_set
    else:
        idx, ds = dm.client_test_parts[client], dm.test_set
    return torch.stack([ds[int(i)][0] for i in idx]), torch.tensor([int(ds[int(i)][1]) for i in idx])


def _reference_probs(model, x_store, y_store, x_query, k, temperature, distance, lam, num_classes):
    """The definition, one query at a time, in float64."""
    model.eval()
    with torch.no_grad():
        store = model.features(x_store).double()
        feats = model.features(x_query).double()
        logits = model.head(model.features(x_query)).double()
    out = []
    for q, z in zip(feats, logits, strict=True):
        d = [float(((q - s) ** 2).sum()) for s in store]
        if distance == "euclidean":
            d = [math.sqrt(v) for v in d]
        nearest = sorted(range(len(d)), key=lambda i: d[i])[:k]
        w = {i: math.exp(-d[i] / temperature) for i in nearest}
        p_knn = [sum(w[i] for i in nearest if int(y_store[i]) == c) / sum(w.values()) for c in range(num_classes)]
        soft = torch.softmax(z, 0).tolist()
        out.append([lam * a + (1 - lam) * b for a, b in zip(p_knn, soft, strict=True)])
    return torch.tensor(out, dtype=torch.float64)


def test_personal_model_equals_the_definition_and_changes_nothing():
    torch.manual_seed(0)
    dm = _module()
    method = KNNPer(model="mlp", lr=0.1, data_spec=dm.spec, num_neighbors=5, lam=0.4)
    pers = PersonalizationCallback(enabled=True, epochs=[0])
    trainer = fit(method, dm, rounds=2, callbacks=[pers])
    assert method.temperature == method.model.feature_dim == 16  # T defaults to the feature dimension
    global_state, rng = params(method.model), torch.get_rng_state()
    differs_from_global = 0
    for distance, temperature in (("squared", None), ("euclidean", 0.3)):
        method.distance = distance
        method.temperature = temperature or float(method.model.feature_dim)
        for c in range(4):
            pm = method.personal_model(c)
            x_train, y_train = _client_data(dm, c, "train")
            x_test, y_test = _client_data(dm, c, "test")
            assert pm.keys.shape == (len(y_train), 16) and torch.equal(pm.labels, y_train)
            want = _reference_probs(method.model, x_train, y_train, x_test, 5, method.temperature, distance,
                                    0.4, 4)
            got = pm.probabilities(x_test).double()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            assert torch.equal(pm(x_test).argmax(1), want.argmax(1))
            with torch.no_grad():
                differs_from_global += int((want.argmax(1) != method.model(x_test).argmax(1)).sum())
            if distance == "squared":
                # the personalised evaluation reports exactly this model's accuracy per client
                acc = float((want.argmax(1) == y_test).double().mean())
                assert pers.per_client["own"][c] == pytest.approx(acc)
    assert differs_from_global > 0  # the kNN part changes some predictions: the check has teeth
    after = params(method.model)
    assert all(torch.equal(global_state[k], after[k]) for k in global_state)
    assert torch.equal(torch.get_rng_state(), rng)  # building datastores draws nothing from the RNG
    assert dict(method.client_states) == {}  # no datastore is kept on the server or in checkpoints
    # the personal model holds a copy: changing it leaves the global model alone
    with torch.no_grad():
        pm.model.head.weight.add_(1.0)
    assert torch.equal(method.model.head.weight, global_state["head.weight"])
    assert trainer.current_epoch == 2


def test_lambda_grid_picks_the_best_heldout_accuracy():
    torch.manual_seed(0)
    dm = _module()
    grid = [0.0, 0.5, 1.0, 0.25]
    method = KNNPer(model="mlp", lr=0.1, data_spec=dm.spec, num_neighbors=3, temperature=0.5, lam_grid=grid,
                    lam_holdout=0.3, lam_seed=7)
    fit(method, dm, rounds=1)
    dm.setup()
    any_contest = False
    for c in range(4):
        x, y = _client_data(dm, c, "train")
        kept, held = holdout_split(len(y), 0.3, 7, c)
        assert len(held) == round(0.3 * len(y)) and not set(kept) & set(held)
        assert sorted([*kept, *held]) == list(range(len(y)))
        accs = []
        for lam in grid:
            p = _reference_probs(method.model, x[kept], y[kept], x[held], 3, 0.5, "squared", lam, 4)
            accs.append(int((p.argmax(1) == y[held]).sum()))
        any_contest |= len(set(accs)) > 1
        pm = method.personal_model(c)
        assert pm.lam == grid[accs.index(max(accs))]  # first best in grid order
        assert len(pm.labels) == len(y)  # the final datastore holds all training samples
    assert any_contest  # some client's accuracies differ across the grid


def test_client_with_fewer_samples_than_k_uses_all_of_them():
    x, y = toy_data(n=13, channels=1, size=4, num_classes=3)
    dm = fixed_parts_module(x, y, [[0, 1, 2], list(range(3, 12)), [12]], batch_size=4)
    torch.manual_seed(0)
    method = KNNPer(model="mlp", lr=0.1, data_spec=dm.spec, num_neighbors=10, temperature=2.0, lam=0.7,
                    lam_grid=[0.2, 0.9])
    fit(method, dm, rounds=1)
    small = method.personal_model(0)
    assert small.keys.shape[0] == 3
    want = _reference_probs(method.model, x[:3], y[:3], x[3:8], 10, 2.0, "squared", small.lam, 3)
    torch.testing.assert_close(small.probabilities(x[3:8]).double(), want, rtol=1e-4, atol=1e-6)
    assert small.lam in (0.2, 0.9)
    # one training sample: nothing to hold out, so the fixed lam; p_kNN is that sample's one-hot label
    single = method.personal_model(2)
    assert single.lam == 0.7 and single.keys.shape[0] == 1
    with torch.no_grad():
        soft = torch.softmax(method.model(x[:5]), 1)
    want = 0.7 * torch.nn.functional.one_hot(y[12].expand(5), 3).float() + 0.3 * soft
    torch.testing.assert_close(single.probabilities(x[:5]), want)


def _record_uploads(method):
    seen = []
    real = method.server_step

    def spy(uploads):
        seen.extend((sorted(u.weights), sorted(u.stats)) for u in uploads)
        return real(uploads)

    method.server_step = spy
    return seen


def test_training_is_fedavg_bit_for_bit_and_uploads_the_same():
    results = []
    for cls in (FedAvg, KNNPer):
        torch.manual_seed(0)
        dm = _module()
        method = cls(model="mlp", lr=0.1, data_spec=dm.spec)
        uploads = _record_uploads(method)
        fit(method, dm, rounds=2)
        results.append((params(method.model), uploads, dict(method.client_states)))
    (fedavg, up_fedavg, st_fedavg), (knn, up_knn, st_knn) = results
    assert fedavg.keys() == knn.keys() and all(torch.equal(fedavg[k], knn[k]) for k in fedavg)
    assert len(up_knn) == 8 and up_knn == up_fedavg  # 4 clients x 2 rounds, same key sets
    assert st_fedavg == st_knn == {}


def test_bad_options_fail_with_one_line():
    dm = _module()
    for bad in (dict(num_neighbors=0), dict(lam=1.5), dict(lam=-0.1), dict(lam_grid=[]), dict(lam_grid=[0.5, 2.0]),
                dict(distance="cosine"), dict(temperature=0.0), dict(lam_holdout=1.0), dict(lam_holdout=0.0)):
        with pytest.raises(FLUserError) as err:
            KNNPer(model="mlp", data_spec=dm.spec, **bad)
        assert "\n" not in str(err.value)


def test_holdout_split_is_seeded_per_client():
    a = holdout_split(20, 0.25, 0, 1)
    assert all(np.array_equal(u, v) for u, v in zip(a, holdout_split(20, 0.25, 0, 1), strict=True))
    assert not np.array_equal(a[1], holdout_split(20, 0.25, 0, 2)[1])
    assert len(a[1]) == 5 and len(holdout_split(2, 0.01, 0, 0)[1]) == 1 and len(holdout_split(2, 0.99, 0, 0)[0]) == 1
