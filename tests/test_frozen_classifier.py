"""Frozen-classifier family: the ETF geometry, the frozen head surviving training and aggregation
bit for bit, the DR/FD losses and a FedDr+ two-step run against hand-written formulas, SphereFed's
recalibration against centralised least squares, FedETF/FedGELA local objectives, MobileNet shape,
and the multi-step lr schedule."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, register_tensors, toy_data
from torch.func import functional_call

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.data.datasets import DataSpec
from fl_lightning.methods import DotRegression, FedAvg, FedBABU, FedDrPlus, FedETF, FedGELA, SphereFed
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.frozen.base import (
    dot_regression_loss,
    feature_distillation_loss,
    orthonormal_classifier,
    simplex_etf,
)
from fl_lightning.methods.frozen.fedetf import balanced_softmax_loss
from fl_lightning.methods.frozen.fedgela import locally_adapted_logits
from fl_lightning.methods.frozen.spherefed import feature_label_statistics, least_squares_classifier
from fl_lightning.models import build_model


@pytest.mark.parametrize("d,c", [(16, 3), (32, 10), (1024, 100)])
def test_simplex_etf_geometry(d, c):
    v = simplex_etf(d, c, seed=1).double()
    assert v.shape == (c, d)
    torch.testing.assert_close(v.norm(dim=1), torch.ones(c, dtype=torch.float64), atol=1e-6, rtol=0)
    cos = v @ v.T
    off = cos[~torch.eye(c, dtype=torch.bool)]
    torch.testing.assert_close(off, torch.full_like(off, -1.0 / (c - 1)), atol=1e-6, rtol=0)
    assert torch.equal(simplex_etf(d, c, seed=1), simplex_etf(d, c, seed=1))  # same V everywhere
    assert not torch.equal(simplex_etf(d, c, seed=1), simplex_etf(d, c, seed=2))
    w = orthonormal_classifier(d, c, seed=1).double()
    torch.testing.assert_close(w @ w.T, torch.eye(c, dtype=torch.float64), atol=1e-6, rtol=0)


def _two_client_module(n=40, classes=4, seed=0, **kw):
    x, y = toy_data(n=n, size=4, num_classes=classes, seed=seed)
    name = register_tensors(x, y, num_classes=classes)
    args = dict(dataset=name, num_clients=2, sample_ratio=1.0, local_epochs=2, batch_size=10, partition="iid",
                min_size=1)
    args.update(kw)
    return FederatedDataModule(**args)


@pytest.mark.parametrize("cls", [FedDrPlus, DotRegression, SphereFed, FedETF, FedGELA, FedBABU])
def test_frozen_classifier_bit_identical_after_training_and_aggregation(cls):
    torch.manual_seed(0)
    # three clients of 14, 13 and 13 samples: weights 0.35/0.325/0.325, under which averaging
    # identical float tensors is not exact, so only restoring V keeps it bit-identical
    dm = _two_client_module(num_clients=3)
    kwargs = {"recalibrate": False} if cls is SphereFed else {}
    method = cls(model="mlp", lr=0.5, data_spec=dm.spec, **kwargs)
    frozen = {n: p.detach().clone() for n, p in method.model.named_parameters() if not p.requires_grad}
    body_before = {n: p.detach().clone() for n, p in method.model.named_parameters() if p.requires_grad}
    assert frozen, "the method must freeze its classifier"
    fit(method, dm, rounds=2)
    optimized = {id(p) for g in method.optimizers().optimizer.param_groups for p in g["params"]}
    for name, p in method.model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach(), frozen[name]), name
            assert not p.requires_grad and id(p) not in optimized
    moved = [n for n, p in method.model.named_parameters()
             if n in body_before and not torch.equal(p, body_before[n])]
    assert moved, "the body must have been trained"
    if cls in (FedDrPlus, DotRegression):
        torch.testing.assert_close(method.model.head.weight, simplex_etf(method.model.feature_dim, 4, seed=0).float())


@pytest.mark.parametrize("cls", [FedDrPlus, SphereFed, FedETF])
def test_a_fixed_classifier_is_exact_in_float64(cls):
    """Converted to float64 (--trainer.precision 64-true), the fixed ETF / orthonormal rows are the
    exact float64 ones (unit norm, cosines -1/(C-1) or 0 to 1e-15), not the float32 rounding
    widened (about 1e-7 off); in float32 they are that rounding, as before; the exact copy is not
    part of the state_dict."""
    dm = _two_client_module()
    method = cls(model="mlp", data_spec=dm.spec)
    head = method.model.head.classifier if cls is FedETF else method.model.head
    assert head.weight.dtype == torch.float32
    assert not any(k.endswith("_exact") for k in method.state_dict())
    single = head.weight.detach().clone()
    method.double()
    v = head.weight.detach()
    assert v.dtype == torch.float64 and torch.equal(v.float(), single)
    c = v.shape[0]
    torch.testing.assert_close(v.norm(dim=1), torch.ones(c, dtype=torch.float64), atol=1e-15, rtol=0)
    off = (v @ v.T)[~torch.eye(c, dtype=torch.bool)]
    target = 0.0 if cls is SphereFed else -1.0 / (c - 1)
    torch.testing.assert_close(off, torch.full_like(off, target), atol=1e-15, rtol=0)


def test_dr_and_fd_losses_on_hand_made_features():
    f = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, -2.0]])
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1])
    # cosines to the true class: 3/5, 0, -1
    expected_dr = (0.5 * (0.6 - 1) ** 2 + 0.5 * (0 - 1) ** 2 + 0.5 * (-1 - 1) ** 2) / 3
    assert math.isclose(float(dot_regression_loss(f, y, v)), expected_dr, rel_tol=1e-6)
    g = torch.tensor([[3.0, 2.0], [0.0, 0.0], [1.0, -2.0]])
    # squared distances 4, 1, 1; divided by d = 2, batch mean
    assert math.isclose(float(feature_distillation_loss(f, g)), (4 + 1 + 1) / 2 / 3, rel_tol=1e-6)
    # L_DR only sees directions: scaling the features leaves it unchanged
    assert math.isclose(float(dot_regression_loss(7 * f, y, v)), expected_dr, rel_tol=1e-6)


LR, MOM, WD, BETA = 0.5, 0.9, 1e-3, 0.7


def test_feddr_plus_two_steps_match_hand_computation():
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=2)
    method = FedDrPlus(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, beta=BETA, data_spec=dm.spec)
    model = method.model
    v = model.head.weight.detach().clone()
    w0 = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    assert all(not k.startswith("head.") for k in w0)

    def feats(w):
        return functional_call(model.body, {k.removeprefix("body."): t for k, t in w.items()}, (x,))

    def loss(w):
        f, fg = feats(w), feats(w0)
        cos = (F.normalize(f, dim=1) * v[y]).sum(1)
        dr = 0.5 * ((cos - 1) ** 2).mean()
        fd = ((f - fg) ** 2).sum(1).mean() / f.shape[1]
        return BETA * dr + (1 - BETA) * fd, fd

    w, buf = w0, {}
    fds = []
    for step in range(2):
        wr = {k: t.clone().requires_grad_(True) for k, t in w.items()}
        total, fd = loss(wr)
        fds.append(float(fd))
        grads = dict(zip(wr, torch.autograd.grad(total, list(wr.values())), strict=True))
        new = {}
        for k in w:
            d = grads[k] + WD * w[k]
            buf[k] = d if step == 0 else MOM * buf[k] + d
            new[k] = w[k] - LR * buf[k]
        w = new
    assert fds[0] == 0.0 and fds[1] > 1e-6  # the second step really distills
    fit(method, dm, rounds=1)
    got = dict(method.model.named_parameters())
    for k, t in w.items():
        torch.testing.assert_close(got[k].detach(), t, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["head.weight"].detach(), v, atol=0, rtol=0)


def test_feddr_plus_predicts_with_cosine_logits():
    torch.manual_seed(0)
    spec = DataSpec(3, 1, 4)
    method = FedDrPlus(model="mlp", data_spec=spec)
    x = torch.randn(5, 1, 4, 4)
    f = method.model.features(x)
    expected = F.normalize(f, dim=1) @ method.model.head.weight.T
    torch.testing.assert_close(method.predict_logits(x), expected)


def test_spherefed_recalibration_is_centralised_least_squares():
    torch.manual_seed(0)
    dm = _two_client_module(n=90, classes=3, num_clients=3)
    dm.setup()
    method = SphereFed(model="mlp", data_spec=dm.spec)
    model = method.model
    # centralised: all clients' normalised features and one-hot labels in one matrix
    hs, ys = [], []
    for c in range(3):
        for xb, yb in dm.client_loader(c, "train", augment=False):
            hs.append(F.normalize(model.features(xb).double(), dim=1))
            ys.append(F.one_hot(yb, 3).double())
    h, yy = torch.cat(hs), torch.cat(ys)
    expected = torch.linalg.lstsq(h, yy).solution.T  # C x d
    loaders = [dm.client_loader(c, "train", augment=False) for c in range(3)]
    stats = [feature_label_statistics(model, loader, 3, "cpu") for loader in loaders]
    got = least_squares_classifier([s[0] for s in stats], [s[1] for s in stats], ridge=0.0)
    torch.testing.assert_close(got, expected, atol=1e-8, rtol=1e-6)
    # the method's own recalibration (tiny ridge) writes that classifier into the head
    method.hparams.recalibration_ridge = 0.0
    method.recalibrate(dm)
    torch.testing.assert_close(method.model.head.weight.double(), expected, atol=1e-5, rtol=1e-4)


def test_spherefed_objective_is_mse_to_one_hot_of_cosines():
    torch.manual_seed(0)
    method = SphereFed(model="mlp", data_spec=DataSpec(3, 1, 4))
    x, y = torch.randn(6, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    cos = F.normalize(method.model.features(x), dim=1) @ method.model.head.weight.T
    expected = ((cos - F.one_hot(y, 3)) ** 2).sum(1).mean()
    torch.testing.assert_close(method.loss(method.model, (x, y), LossContext()), expected)


def test_fedetf_and_fedgela_local_objectives():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    counts = torch.tensor([10.0, 30.0, 0.0])
    # balanced softmax: CE on logits + log n_c; an absent class gets no probability mass
    p = torch.tensor([10 * math.e**1.0, 30 * math.e**2.0])
    got = float(balanced_softmax_loss(logits, torch.tensor([0]), counts))
    assert math.isclose(got, -math.log(p[0] / p.sum()), rel_tol=1e-6)
    # FedGELA: logit c scaled by C * pi_c = 3 * (0.25, 0.75, 0)
    torch.testing.assert_close(locally_adapted_logits(logits, counts), torch.tensor([[0.75, 4.5, 0.0]]))
    torch.manual_seed(0)
    method = FedETF(model="mlp", data_spec=DataSpec(3, 1, 4))
    x = torch.randn(4, 1, 4, 4)
    head = method.model.head
    projected = F.normalize(head.projection(method.model.features(x)), dim=1)
    expected = head.temperature * projected @ head.weight.T
    torch.testing.assert_close(method.model(x), expected)
    assert head.temperature.requires_grad and head.projection.weight.requires_grad


def test_mobilenet_features_and_head():
    model = build_model("mobilenet", DataSpec(100, 3, 32))
    x = torch.randn(2, 3, 32, 32)
    f = model.features(x)
    assert f.shape == (2, 1024) and model.feature_dim == 1024
    assert model(x).shape == (2, 100)
    assert model.head.in_features == 1024


class _LrRecorder(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.lrs.append(pl_module.current_lr())


def test_multistep_lr_steps_per_round():
    x, y = toy_data(n=6, size=4, num_classes=3)
    dm = one_client_module(x, y)
    method = FedAvg(model="mlp", lr=0.4, lr_milestones=[2, 4], lr_milestone_gamma=0.1, data_spec=dm.spec)
    rec = _LrRecorder()
    fit(method, dm, rounds=6, callbacks=[rec], limit_val_batches=0)
    expected = [0.4, 0.4, 0.04, 0.04, 0.004, 0.004]
    assert len(rec.lrs) == 6
    for got, want in zip(rec.lrs, expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-9)


class _RecordingFedDr(FedDrPlus):
    def client_end(self):
        upload = super().client_end()
        self.records = getattr(self, "records", [])
        self.records.append((dict(upload.stats), {k: v.clone() for k, v in self.model.state_dict().items()},
                             dict(self.global_weights), self.client_counts.clone()))
        return upload


def test_alignment_and_feature_drift_analyses_match_their_definitions():
    torch.manual_seed(0)
    dm = _two_client_module(n=60, classes=4, partition="shard", shards_per_client=1, num_clients=4,
                            sample_ratio=0.5)
    method = _RecordingFedDr(model="mlp", lr=0.5, analysis=True, analysis_samples=0, data_spec=dm.spec)
    fit(method, dm, rounds=1)
    x = torch.stack([dm.test_set[i][0] for i in range(len(dm.test_set))])
    y = torch.tensor([dm.test_set[i][1] for i in range(len(dm.test_set))])
    local, glob = build_model("mlp", dm.spec), build_model("mlp", dm.spec)
    local.head = glob.head = method.model.head
    for stats, local_state, global_state, counts in method.records:
        local.load_state_dict(local_state)
        glob.load_state_dict(global_state)
        with torch.no_grad():
            f, fg = local.features(x), glob.features(x)
        seen = counts[y] > 0
        assert 0 < int(seen.sum()) < len(y)
        v = method.model.head.weight
        for mask, tag in ((seen, "observed"), (~seen, "unobserved")):
            cos = torch.stack([torch.dot(f[i], v[y[i]]) / f[i].norm() for i in range(len(y))])[mask].mean()
            assert stats[f"align_{tag}"] == pytest.approx(float(cos), rel=1e-4, abs=1e-6)
            dist = float((f - fg).norm(dim=1)[mask].mean())
            assert stats[f"feat_dist_{tag}"] == pytest.approx(dist, rel=1e-4)
            cos_fg = (F.normalize(f, dim=1) * F.normalize(fg, dim=1)).sum(1).clamp(-1, 1)
            ang = torch.rad2deg(torch.arccos(cos_fg))
            assert stats[f"feat_angle_{tag}"] == pytest.approx(float(ang[mask].mean()), rel=1e-3, abs=1e-3)
