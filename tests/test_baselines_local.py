"""Baselines whose difference from FedAvg is the local step: FedProx, FedNTD, MOON, FedSAM and
FedASAM. Each is run through a real one-client fit (batch = all data, so a round is an exact
number of local steps) and compared to the step written out from the paper's formula."""

import math

import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, params, reference_sgd, tiny_spec, toy_data
from torch.func import functional_call

from fl_lightning.methods import MOON, FedASAM, FedNTD, FedProx, FedSAM
from fl_lightning.methods.baselines.fedntd import not_true_logits, ntd_loss
from fl_lightning.methods.baselines.fedsam import sam_perturbation
from fl_lightning.methods.baselines.moon import moon_contrastive_loss

LR, MOM, WD = 0.1, 0.9, 1e-3


def setup(method_cls, steps=2, n=12, **kw):
    torch.manual_seed(0)
    x, y = toy_data(n=n, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=steps)
    method = method_cls(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, data_spec=dm.spec, **kw)
    w0 = {k: v.detach().clone() for k, v in method.model.named_parameters()}
    return method, dm, x, y, w0


def assert_weights(method, expected):
    got = dict(method.model.named_parameters())
    for k, v in expected.items():
        torch.testing.assert_close(got[k].detach(), v, atol=1e-6, rtol=1e-5)


def ce_grad(model, x, y, extra=None):
    """grad_fn for reference_sgd: CE (+ extra(w, logits)) at the leaf weights w."""
    def grad_fn(w):
        logits = functional_call(model, w, (x,))
        loss = F.cross_entropy(logits, y) + (extra(w, logits) if extra else 0)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    return grad_fn


# ---- FedProx ----------------------------------------------------------------------------------
def test_fedprox_gradient_is_ce_plus_mu_times_distance():
    mu = 0.7
    method, dm, x, y, w0 = setup(FedProx, steps=3, mu=mu)

    def grad_fn(w):  # the gradient of (mu/2)||w - w_g||^2 is mu (w - w_g), written out, not autograd
        g = ce_grad(method.model, x, y)(w)
        return {k: g[k] + mu * (w[k].detach() - w0[k]) for k in w}

    expected = reference_sgd(w0, grad_fn, 3, LR, MOM, WD)
    plain = reference_sgd(w0, ce_grad(method.model, x, y), 3, LR, MOM, WD)
    assert max(float((expected[k] - plain[k]).abs().max()) for k in w0) > 1e-5  # the term matters
    fit(method, dm)
    assert_weights(method, expected)


# ---- FedNTD -----------------------------------------------------------------------------------
def test_ntd_loss_matches_hand_computation():
    z = torch.tensor([[1.0, 2.0, 3.0]])
    zg = torch.tensor([[0.0, 1.0, 5.0]])
    y = torch.tensor([0])
    tau = 2.0
    p = [math.exp(2 / tau), math.exp(3 / tau)]  # student without class 0
    q = [math.exp(1 / tau), math.exp(5 / tau)]  # teacher without class 0
    p = [v / sum(p) for v in p]
    q = [v / sum(q) for v in q]
    expected = tau**2 * sum(qi * math.log(qi / pi) for pi, qi in zip(p, q, strict=True))
    assert math.isclose(float(ntd_loss(z, zg, y, tau)), expected, rel_tol=1e-6)
    dropped = not_true_logits(torch.tensor([[1.0, 2, 3], [4, 5, 6]]), torch.tensor([2, 0]))
    assert dropped.tolist() == [[1, 2], [5, 6]]


def test_ntd_ignores_the_true_class_of_the_teacher():
    torch.manual_seed(0)
    z = torch.randn(6, 4, requires_grad=True)
    zg = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 3, 1, 2])
    moved = zg.clone()
    moved[torch.arange(6), y] += torch.randn(6) * 10  # change only the teacher's true-class logits
    base = ntd_loss(z, zg, y, 1.0)
    assert float(base) == float(ntd_loss(z, moved, y, 1.0))
    (grad,) = torch.autograd.grad(base, z)
    assert float(grad[torch.arange(6), y].abs().max()) == 0.0  # nor does it train the true logit
    other = zg.clone()
    other[torch.arange(6), (y + 1) % 4] += 1.0  # a not-true logit does matter
    assert abs(float(ntd_loss(z, other, y, 1.0)) - float(base)) > 1e-4


def test_fedntd_two_steps_match_reference():
    beta, tau = 1.0, 2.0
    method, dm, x, y, w0 = setup(FedNTD, steps=2, beta=beta, tau=tau)
    with torch.no_grad():
        zg = functional_call(method.model, w0, (x,))

    def extra(w, logits):
        keep = F.one_hot(y, 3) == 0
        z_nt, g_nt = logits[keep].view(len(y), 2), zg[keep].view(len(y), 2)
        q = F.softmax(g_nt / tau, 1)
        return beta * tau**2 * (q * (q.log() - F.log_softmax(z_nt / tau, 1))).sum(1).mean()

    expected = reference_sgd(w0, ce_grad(method.model, x, y, extra), 2, LR, MOM, WD)
    fit(method, dm)
    assert_weights(method, expected)


# ---- MOON -------------------------------------------------------------------------------------
def test_moon_contrastive_loss_matches_hand_computation():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    zg = torch.tensor([[1.0, 1.0], [2.0, 2.0]])  # cosines 1/sqrt2 and 1
    zp = torch.tensor([[0.0, 1.0], [-1.0, 1.0]])  # cosines 0 and 0
    tau = 0.5
    pos, neg = [1 / math.sqrt(2), 1.0], [0.0, 0.0]
    expected = sum(-math.log(math.exp(a / tau) / (math.exp(a / tau) + math.exp(b / tau)))
                   for a, b in zip(pos, neg, strict=True)) / 2
    assert math.isclose(float(moon_contrastive_loss(z, zg, zp, tau)), expected, rel_tol=1e-6)


def features(model, w, x):
    """The MLP's features (its body) at weights w."""
    return functional_call(model.body, {k[5:]: v for k, v in w.items() if k.startswith("body.")}, (x,))


def test_moon_step_matches_reference_with_a_previous_model():
    mu, tau = 0.5, 0.5
    method, dm, x, y, w0 = setup(MOON, steps=2, mu=mu, tau=tau)
    torch.manual_seed(1)
    prev = {k: v + 0.3 * torch.randn_like(v) for k, v in w0.items()}
    method.client_states[0] = {f"previous.{k}": v for k, v in prev.items()}  # this client's previous local model
    with torch.no_grad():
        zg, zp = features(method.model, w0, x), features(method.model, prev, x)

    def grad_fn(w):
        z = features(method.model, w, x)
        logits = F.linear(z, w["head.weight"], w["head.bias"])
        pos, neg = F.cosine_similarity(z, zg, dim=1), F.cosine_similarity(z, zp, dim=1)
        con = (-(pos / tau) + torch.logsumexp(torch.stack([pos, neg], 1) / tau, 1)).mean()
        loss = F.cross_entropy(logits, y) + mu * con
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))

    expected = reference_sgd(w0, grad_fn, 2, LR, MOM, WD)
    plain = reference_sgd(w0, ce_grad(method.model, x, y), 2, LR, MOM, WD)
    assert max(float((expected[k] - plain[k]).abs().max()) for k in w0) > 1e-5
    fit(method, dm)
    assert_weights(method, expected)
    # the client's previous model is now its upload, kept on CPU
    for k, v in method.model.state_dict().items():
        assert method.client_states[0][f"previous.{k}"].device.type == "cpu"
        assert torch.equal(method.client_state(0, "previous.")[k], v.cpu())


class RecordingMOON(MOON):
    def client_start(self, client, num_samples):
        super().client_start(client, num_samples)
        self.seen.append((client, params(self.prev_model)))

    def server_step(self, uploads):
        self.uploads.append({u.client: {k: v.cpu().clone() for k, v in u.weights.items()} for u in uploads})
        return super().server_step(uploads)


def test_moon_previous_model_starts_as_initial_global_model():
    torch.manual_seed(0)
    x, y = toy_data(n=16, size=4, num_classes=3)
    dm = one_client_module(x, y, num_clients=4, sample_ratio=0.5, batch_size=4)
    method = RecordingMOON(model="mlp", data_spec=dm.spec)
    method.seen, method.uploads = [], []
    initial = params(method.model)
    fit(method, dm, rounds=3)
    last: dict[int, dict] = {}
    returning = 0
    for r in range(3):
        starts = method.seen[2 * r: 2 * r + 2]
        for client, prev in starts:
            returning += client in last
            expected = last.get(client, initial)
            assert all(torch.equal(prev[k], expected[k]) for k in expected)
        last.update(method.uploads[r])
        assert sorted(method.uploads[r]) == sorted(c for c, _ in starts)
    assert returning > 0 and len(method.seen) - returning > 2  # both cases were exercised
    assert set(method.client_states) == set(last)  # state only for clients that took part


# ---- FedSAM / FedASAM -------------------------------------------------------------------------
def test_asam_perturbation_is_elementwise():
    w = [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])]
    g = [torch.tensor([3.0, 1.0]), torch.tensor([[4.0]])]
    rho = 0.3
    # |w| (.) g = [3, 2], [2]: norm sqrt(17); eps = rho w^2 g / sqrt(17)
    eps = sam_perturbation(w, g, rho, adaptive=True)
    torch.testing.assert_close(eps[0], rho * torch.tensor([3.0, 4.0]) / math.sqrt(17))
    torch.testing.assert_close(eps[1], rho * torch.tensor([[1.0]]) / math.sqrt(17))
    # the defining property: the perturbation has length rho in the |w|-rescaled space
    scaled = torch.cat([(e / wi.abs()).flatten() for e, wi in zip(eps, w, strict=True)])
    assert math.isclose(float(scaled.norm()), rho, rel_tol=1e-6)
    eps = sam_perturbation(w, g, rho, adaptive=False)
    torch.testing.assert_close(eps[0], rho * torch.tensor([3.0, 1.0]) / math.sqrt(26))


@pytest.mark.parametrize("method_cls,rho", [(FedSAM, 0.2), (FedASAM, 1.0)])
def test_sam_steps_match_reference(method_cls, rho):
    method, dm, x, y, w0 = setup(method_cls, steps=2, rho=rho)
    adaptive = method_cls is FedASAM

    def grad_fn(w):
        g = ce_grad(method.model, x, y)(w)
        if adaptive:
            norm = math.sqrt(sum(float(((w[k].detach().abs() * g[k]) ** 2).sum()) for k in w))
            eps = {k: rho * w[k].detach() ** 2 * g[k] / norm for k in w}
        else:
            norm = math.sqrt(sum(float((g[k] ** 2).sum()) for k in w))
            eps = {k: rho * g[k] / norm for k in w}
        shifted = {k: (w[k].detach() + eps[k]).requires_grad_(True) for k in w}
        return ce_grad(method.model, x, y)(shifted)

    expected = reference_sgd(w0, grad_fn, 2, LR, MOM, WD)
    plain = reference_sgd(w0, ce_grad(method.model, x, y), 2, LR, MOM, WD)
    assert max(float((expected[k] - plain[k]).abs().max()) for k in w0) > 1e-5
    fit(method, dm)
    assert_weights(method, expected)


def test_defaults_are_the_papers():
    spec = tiny_spec(toy_data()[0], 3)
    assert FedProx(model="mlp", data_spec=spec).hparams.mu == 1.0
    assert FedSAM(model="mlp", data_spec=spec).hparams.rho == 0.1
    assert FedASAM(model="mlp", data_spec=spec).hparams.rho == 1.0
    moon, ntd = MOON(model="mlp", data_spec=spec).hparams, FedNTD(model="mlp", data_spec=spec).hparams
    assert (moon.mu, moon.tau, ntd.beta, ntd.tau) == (0.1, 0.5, 1.0, 1.0)


@pytest.mark.parametrize("name", ["FedProx", "SCAFFOLD", "FedNova", "FedDyn", "MOON", "FedNTD", "FedSAM",
                                  "FedASAM", "FedExP"])
def test_every_step_goes_through_the_optimizer_hooks(name):
    """Options that act after backward or after every optimizer step (FedCONST's projection) must
    see every local step of every method, once, in order."""
    import fl_lightning.methods as methods

    class Counting(getattr(methods, name)):
        def after_backward(self):
            super().after_backward()
            self.calls.append("backward")

        def after_optimizer_step(self):
            super().after_optimizer_step()
            self.calls.append("step")

    method, dm, *_ = setup(Counting, steps=3)
    method.calls = []
    fit(method, dm)
    assert method.calls == ["backward", "step"] * 3
