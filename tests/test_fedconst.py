"""FedCONST as an option of any method: the projection against hand computations and the normal
equations, the constraints per channel after real local training (momentum, weight decay) and
after aggregation, the sequential variant's drift, composition with FedSOL, and the models."""

import pytest
import torch
from fl_test_utils import fit, one_client_module, toy_data

from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
from fl_lightning.fedconst import (
    constrained_names,
    constraint_residuals,
    orthogonal_direction,
    project_joint,
    project_sequential,
    rows,
    unit_rows,
)
from fl_lightning.methods import FedAvg, FedSOL
from fl_lightning.models import build_model

TOL = 1e-6


def test_joint_projection_hand_computed():
    # w_g = (1, 0, 0), Delta = (1, 2, 3): centred Delta = (-1, 0, 1); e2 = (2, -1, -1)/sqrt(6);
    # (-1, 0, 1) . e2 = -3/sqrt(6), so P Delta = (-1, 0, 1) + (3/6) (2, -1, -1) = (0, -0.5, 0.5).
    wg = torch.tensor([[1.0, 0.0, 0.0]])
    delta = torch.tensor([[1.0, 2.0, 3.0]])
    out = project_joint(delta, orthogonal_direction(wg))
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.5, 0.5]]))
    # what was removed lies in span{1, w_g}: (1, 2.5, 2.5) = 2.5 * 1 - 1.5 * w_g
    torch.testing.assert_close(delta - out, 2.5 * torch.ones(1, 3) - 1.5 * wg)


def test_sequential_projection_hand_computed_and_drift():
    # centre: (-1, 0, 1); remove the component along p = (1, 0, 0): (0, 0, 1).
    # Orthogonal to w_g, but the sum is 1, not 0: Algorithm 1's order does not keep the centering.
    wg = torch.tensor([[1.0, 0.0, 0.0]])
    out = project_sequential(torch.tensor([[1.0, 2.0, 3.0]]), unit_rows(wg))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0]]))
    assert float((out * wg).sum()) == 0.0 and float(out.sum()) == 1.0


def test_joint_projection_equals_normal_equations():
    """Per row, P = I - A (A^T A)^-1 A^T with A = [1, w_g,c]: the orthogonal projector, computed
    independently of the Gram-Schmidt implementation, in float64."""
    g = torch.Generator().manual_seed(0)
    wg = torch.randn(5, 7, generator=g, dtype=torch.float64)
    delta = torch.randn(5, 7, generator=g, dtype=torch.float64)
    out = project_joint(delta, orthogonal_direction(wg))
    for c in range(5):
        a = torch.stack([torch.ones(7, dtype=torch.float64), wg[c]], dim=1)
        proj = torch.eye(7, dtype=torch.float64) - a @ torch.linalg.solve(a.T @ a, a.T)
        torch.testing.assert_close(out[c], proj @ delta[c])
    # idempotent
    torch.testing.assert_close(project_joint(out, orthogonal_direction(wg)), out)


def test_degenerate_channels():
    """w_g,c = 0 or parallel to 1: only the centering exists (it implies the orthogonality); no NaN.
    A channel with one input: span{1} is everything, Delta must be 0."""
    wg = torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [1.0, -1.0, 3.0]])
    delta = torch.tensor([[1.0, 2.0, 6.0], [1.0, 2.0, 6.0], [1.0, 2.0, 6.0]])
    out = project_joint(delta, orthogonal_direction(wg))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], torch.tensor([-2.0, -1.0, 3.0]))
    torch.testing.assert_close(out[1], torch.tensor([-2.0, -1.0, 3.0]))
    assert abs(float(out[2].sum())) < 1e-6 and abs(float(out[2] @ wg[2])) < 1e-5
    one = project_joint(torch.tensor([[0.3], [-2.0]]), orthogonal_direction(torch.tensor([[1.0], [0.0]])))
    assert float(one.abs().max()) == 0.0
    assert torch.isfinite(project_sequential(delta, unit_rows(wg))).all()


def _capture_uploads(method):
    uploads = []
    client_end = method.client_end

    def wrapped():
        upload = client_end()
        uploads.append(upload)
        return upload

    method.client_end = wrapped
    return uploads


def _images(n=24, seed=0):
    return toy_data(n=n, channels=1, size=16, num_classes=3, seed=seed)


def _run(method_cls, constraint, clients=3, **kw):
    """One round, `clients` clients, batch 4 over 8 samples each for 3 local epochs (6 local steps
    per client) with momentum 0.9 and weight decay. Returns (method, w_g, uploads)."""
    x, y = _images()
    torch.manual_seed(0)
    dm = one_client_module(x, y, num_classes=3, num_clients=clients, batch_size=4, local_epochs=3)
    method = method_cls(model="lenet5_nobias", lr=0.05, momentum=0.9, weight_decay=1e-3,
                        constraint=constraint, data_spec=dm.spec, **kw)
    w_g = {k: v.detach().clone() for k, v in method.model.state_dict().items()}
    uploads = _capture_uploads(method)
    fit(method, dm)
    assert len(uploads) == clients and all(method.local_step == 6 for _ in uploads)
    return method, w_g, uploads


def _max_residuals(weights, w_g, names):
    res = constraint_residuals(weights, w_g, names)
    return max(r[0] for r in res.values()), max(r[1] for r in res.values())


def test_fedavg_joint_constraints_hold_per_channel_and_after_aggregation():
    method, w_g, uploads = _run(FedAvg, "joint")
    names = constrained_names(method.model)
    assert len(names) == 5  # 2 convs + 2 FC + head: every weight of the bias-free LeNet-5
    for u in uploads:
        s, o = _max_residuals(u.weights, w_g, names)
        assert s < TOL and o < TOL, (s, o)
        assert max(float((u.weights[n] - w_g[n]).abs().max()) for n in names) > 1e-3  # it did train
    s, o = _max_residuals(method.model.state_dict(), w_g, names)  # the aggregated global model
    assert s < TOL and o < TOL, (s, o)


def test_without_constraint_the_residuals_are_large():
    """Guards the test above: unconstrained local training violates both constraints."""
    method, w_g, uploads = _run(FedAvg, "none")
    s, o = _max_residuals(uploads[0].weights, w_g, constrained_names(method.model))
    assert s > 1e-3 and o > 1e-3


def test_sequential_keeps_orthogonality_but_sum_drifts():
    method, w_g, uploads = _run(FedAvg, "sequential")
    names = constrained_names(method.model)
    for u in uploads:
        s, o = _max_residuals(u.weights, w_g, names)
        assert o < TOL, o
        # Algorithm 1 (centre, then project on w_g's complement) leaves 1^T Delta != 0
        assert s > 1e-4, s


def test_composes_with_fedsol():
    method, w_g, uploads = _run(FedSOL, "joint", perturb="all", adaptive="none", rho=0.5)
    names = constrained_names(method.model)
    for u in uploads + [type("G", (), {"weights": method.model.state_dict()})]:
        s, o = _max_residuals(u.weights, w_g, names)
        assert s < TOL and o < TOL, (s, o)


def test_biases_stay_unconstrained():
    x, y = _images()
    torch.manual_seed(0)
    dm = one_client_module(x, y, num_classes=3, batch_size=4, local_epochs=2)
    method = FedAvg(model="lenet5", constraint="joint", data_spec=dm.spec)
    w_g = {k: v.detach().clone() for k, v in method.model.state_dict().items()}
    fit(method, dm)
    names = constrained_names(method.model)
    assert not any(n.endswith("bias") for n in names)
    bias = method.model.body[0].bias.detach() - w_g["body.0.bias"]
    assert abs(float(bias.sum())) > 1e-4  # a bias vector is free to move its sum (no centering)
    s, o = _max_residuals(method.model.state_dict(), w_g, names)
    assert s < TOL and o < TOL


def test_override_without_super_fails_loudly():
    class Forgetful(FedAvg):
        def after_optimizer_step(self):  # forgets super(): would silently drop the constraint
            pass

    x, y = _images(n=8)
    dm = one_client_module(x, y, num_classes=3)
    with pytest.raises(RuntimeError, match="super\\(\\).after_optimizer_step"):
        fit(Forgetful(model="lenet5_nobias", constraint="joint", data_spec=dm.spec), dm)
    fit(Forgetful(model="lenet5_nobias", data_spec=dm.spec), dm)  # no constraint: nothing to lose


def test_bad_constraint_is_a_user_error():
    with pytest.raises(FLUserError):
        FedAvg(model="mlp", constraint="both", data_spec=DataSpec(3, 1, 8))


@pytest.mark.parametrize("name,size", [("lenet5_nobias", 32), ("resnet18_nobn_nobias", 32)])
def test_fedconst_models_have_no_bias_and_no_norm(name, size):
    model = build_model(name, DataSpec(10, 3, size))
    assert all(p.dim() >= 2 for p in model.parameters())  # no biases, no norm scales
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert len(constrained_names(model)) == len(list(model.parameters()))
    out = model(torch.randn(2, 3, size, size))
    assert out.shape == (2, 10)
    assert model.features(torch.randn(1, 3, size, size)).shape[1] == model.feature_dim


def _cosines(delta: torch.Tensor, wg: torch.Tensor) -> tuple[float, float]:
    """max over channels of |cos(1, Delta_c)| and |cos(w_g,c, Delta_c)|."""
    ones = torch.ones_like(wg)
    cos_1 = (delta * ones).sum(1).abs() / (delta.norm(dim=1) * ones.norm(dim=1))
    cos_w = (delta * wg).sum(1).abs() / (delta.norm(dim=1) * wg.norm(dim=1))
    return float(cos_1.max()), float(cos_w.max())


@pytest.mark.parametrize("mode", ["joint", "sequential"])
def test_float64_weights_are_constrained_in_float64(mode):
    """A float64 model keeps both invariants to ~1e-15 in cosine over many steps (a float32
    projection leaves ~1e-7), and the projection loses nothing to float32 rounding: after every
    step the weights equal w_g + P(w - w_g) computed independently in float64 (normal equations)."""
    from fl_lightning.fedconst import ChannelConstraint

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(37, 6, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(6, 37, generator=g, dtype=torch.float64) + 0.3)
    wg = model.weight.detach().clone()
    constraint = ChannelConstraint(mode, {"weight": wg}, ["weight"])
    for _ in range(20):  # 20 "optimizer steps": a random move, then the constraint
        with torch.no_grad():
            before = model.weight.detach().clone() + 1e-2 * torch.randn(6, 37, generator=g, dtype=torch.float64)
            model.weight.copy_(before)
        constraint.apply(model)
        assert model.weight.dtype == torch.float64
        delta = model.weight.detach() - wg
        expected = torch.empty_like(delta)
        for c in range(6):
            if mode == "joint":
                a = torch.stack([torch.ones(37, dtype=torch.float64), wg[c]], dim=1)
                proj = torch.eye(37, dtype=torch.float64) - a @ torch.linalg.solve(a.T @ a, a.T)
                expected[c] = proj @ (before[c] - wg[c])
            else:  # centre, then remove the component along w_g,c / ||w_g,c||
                d = (before[c] - wg[c]) - (before[c] - wg[c]).mean()
                p = wg[c] / wg[c].norm()
                expected[c] = d - (d @ p) * p
        assert float((delta - expected).abs().max()) < 1e-12 * float(expected.abs().max())
        cos_1, cos_w = _cosines(delta, wg)
        assert cos_w < 1e-12, cos_w
        if mode == "joint":
            assert cos_1 < 1e-12, cos_1


def test_float64_training_keeps_the_constraints_to_1e_12():
    """Real local training (momentum, weight decay, 3 clients, aggregation) with a float64 model
    (`precision="64-true"`): per-channel residuals relative to the channel norms stay below 1e-12."""
    x, y = _images()
    torch.manual_seed(0)
    dm = one_client_module(x, y, num_classes=3, num_clients=3, batch_size=4, local_epochs=3)
    method = FedAvg(model="lenet5_nobias", lr=0.05, momentum=0.9, weight_decay=1e-3,
                    constraint="joint", data_spec=dm.spec)
    w_g = {k: v.detach().double().clone() for k, v in method.model.state_dict().items()}
    uploads = _capture_uploads(method)
    fit(method, dm, precision="64-true")
    names = constrained_names(method.model)
    assert method.model.body[0].weight.dtype == torch.float64
    for weights in [u.weights for u in uploads] + [method.model.state_dict()]:
        for n in names:
            wg, delta = rows(w_g[n]), rows(weights[n]) - rows(w_g[n])
            assert weights[n].dtype == torch.float64
            # Every channel, relative to ||w_g,c||: float64 rounding of w_c itself (~1e-16).
            scale = wg.norm(dim=1)
            assert float(((delta.sum(1) / wg.shape[1] ** 0.5) / scale).abs().max()) < 1e-13
            assert float(((delta * wg).sum(1) / scale**2).abs().max()) < 1e-13
            # In cosine, over channels that moved: a channel behind a dead ReLU only sees weight
            # decay, whose move along w_g,c is projected away, so its Delta_c is rounding noise.
            moved = delta.norm(dim=1) > 1e-3 * scale
            assert int(moved.sum()) >= 1
            cos_1, cos_w = _cosines(delta[moved], wg[moved])
            assert cos_1 < 1e-12 and cos_w < 1e-12, (n, cos_1, cos_w)
