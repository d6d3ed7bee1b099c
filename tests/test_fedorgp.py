"""FedORGP: the server's orthogonality loss and the client's loss equal the paper's formulas, one
server epoch separates the global prototypes, and a client uploads its class prototypes and
nothing else."""

import copy
import math

import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, toy_data

from fl_lightning.methods import FedORGP
from fl_lightning.methods.hetero.prototypes import (
    TrainablePrototypes,
    client_prototypes,
    orthogonality_loss,
    separation,
    train_on_pairs,
)


def test_orthogonality_loss_on_hand_made_prototypes():
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # global prototypes of classes 0, 1, 2
    p = torch.tensor([[2.0, 0.0], [1.0, 1.0]])  # client prototypes of classes 0 and 1
    y = torch.tensor([0, 1])
    r = 1 / math.sqrt(2)
    s = (1.0 + r) / 2  # cos(P_0, G_0) = 1, cos(P_1, G_1) = 1/sqrt(2)
    # |cos| with the other classes, divided by C - 1 = 2: P_0 -> {G_1: 0, G_2: r}; P_1 -> {G_0: r, G_2: 1}
    d = ((0 + r) / 2 + (r + 1) / 2) / 2
    for lam_s, lam_d in [(1.0, 10.0), (3.0, 0.5)]:
        got = orthogonality_loss(p, y, g, lam_s, lam_d)
        assert math.isclose(float(got), lam_s * (1 - s) + lam_d * d, rel_tol=1e-6)


def test_one_server_epoch_lowers_inter_class_cosine():
    torch.manual_seed(0)
    c, k = 5, 16
    centers = torch.randn(c, k)
    y = torch.arange(c).repeat(20)  # 100 (prototype, class) pairs: 4 batches of 32
    protos = centers[y] + 0.3 * torch.randn(len(y), k)
    server = TrainablePrototypes(c, k)
    seen = torch.ones(c, dtype=torch.bool)
    before = separation(protos, y, server().detach(), seen)
    train_on_pairs(
        server,
        protos,
        y,
        lambda m, p, yy: orthogonality_loss(p, yy, m(), 1.0, 10.0),
        epochs=1,
        lr=0.01,
        batch_size=32,
        seed=0,
    )
    after = separation(protos, y, server().detach(), seen)
    assert after["protos/inter_abs_cos"] < before["protos/inter_abs_cos"] - 1e-3
    assert after["protos/intra_cos"] > before["protos/intra_cos"]


def _one_client_fedorgp(lr=0.1, lambda_c=5.0):
    torch.manual_seed(0)
    x, y = toy_data(n=16, channels=1, size=4, num_classes=3)
    dm = one_client_module(x, y, num_classes=3, client_test_fraction=0.25)
    dm.setup()
    method = FedORGP(model="mlp", feature_dim=16, lr=lr, lambda_c=lambda_c, data_spec=dm.spec)
    method.build_client_models(1)
    idx = torch.as_tensor(dm.client_parts[0])
    return method, dm, x[idx], y[idx]


def test_client_loss_and_step_match_the_formula():
    method, dm, x, y = _one_client_fedorgp()
    dm.hparams.batch_size = len(y)  # the whole train split in one batch: one local step
    g = torch.randn(3, 16)
    method.server.assign({"global_protos": g, "has_proto": torch.ones(len(g), dtype=torch.bool)})
    model0 = copy.deepcopy(method.client_models[0])

    feats = model0.features(x)
    expected_loss = (
        F.cross_entropy(model0.head(feats), y) + 5.0 * (1 - F.cosine_similarity(feats, g[y], dim=1)).mean()
    )
    grads = torch.autograd.grad(expected_loss, list(model0.parameters()))
    expected = {n: p.detach() - 0.1 * gr for (n, p), gr in zip(model0.named_parameters(), grads, strict=True)}

    trainer = fit(method, dm, rounds=1)
    assert math.isclose(float(trainer.callback_metrics["train/loss"]), float(expected_loss), rel_tol=1e-5)
    got = dict(method.client_models[0].named_parameters())
    for n, v in expected.items():
        torch.testing.assert_close(got[n].detach(), v, atol=1e-6, rtol=1e-5)


def test_first_round_is_plain_cross_entropy():
    method, dm, x, y = _one_client_fedorgp()
    dm.hparams.batch_size = len(y)
    model0 = copy.deepcopy(method.client_models[0])
    trainer = fit(method, dm, rounds=1)
    assert math.isclose(
        float(trainer.callback_metrics["train/loss"]), float(F.cross_entropy(model0(x), y)), rel_tol=1e-5
    )


def test_upload_is_the_class_prototypes_and_nothing_else():
    method, dm, x, y = _one_client_fedorgp()
    uploads = []
    step = method.server_step
    method.server_step = lambda ups: (uploads.extend(ups), step(ups))[1]
    fit(method, dm, rounds=1)
    (upload,) = uploads
    assert set(upload.groups) == {"prototypes"}
    assert set(client_prototypes(upload)) == set(torch.unique(y).tolist())
    model = method.client_models[0].eval()
    with torch.no_grad():
        feats = model.features(x)
    for c in torch.unique(y).tolist():
        torch.testing.assert_close(
            client_prototypes(upload)[c], feats[y == c].mean(0), atol=1e-6, rtol=1e-5
        )
    # the server's global prototypes are the trainable module's outputs, for every class
    torch.testing.assert_close(method.global_protos, method.server["prototypes"]().detach())


def test_without_or_the_global_prototypes_are_the_plain_mean():
    torch.manual_seed(0)
    x, y = toy_data(n=24, channels=1, size=4, num_classes=3)
    dm = one_client_module(x, y, num_classes=3, num_clients=2, client_test_fraction=0.25)
    method = FedORGP(model="mlp", feature_dim=16, orthogonality=False, data_spec=dm.spec)
    uploads = []
    step = method.server_step
    method.server_step = lambda ups: (uploads.extend(ups), step(ups))[1]
    fit(method, dm, rounds=1)
    for c in range(3):
        ps = [client_prototypes(u)[c] for u in uploads if c in client_prototypes(u)]
        torch.testing.assert_close(method.global_protos[c], torch.stack(ps).mean(0))
