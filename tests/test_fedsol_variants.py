"""FedSOL's variants against references written out from the papers' formulas: the L2 (FedProx)
proximal loss, the perturbation strategies A0..A6 (Table 12 / Table 6), and the direct proximal
gradient projection of eq. 3 (Table 1)."""

import math

import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, toy_data
from torch.func import functional_call

from fl_lightning.errors import FLUserError
from fl_lightning.methods import FedSOL, ProximalProjection
from fl_lightning.methods.fedsol.fedsol import project_out_conflict

LR, MOM, WD, RHO, T, MU, BETA = 0.1, 0.9, 1e-3, 0.5, 3.0, 0.7, 0.8


def _grad(loss, w):
    return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))


class Reference:
    """Two local SGD(momentum, wd) steps of a proximal method, from the formulas only."""

    def __init__(self, model, x, y, proximal):
        self.model, self.x, self.y, self.proximal = model, x, y, proximal
        self.w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
        with torch.no_grad():
            self.zg = self.logits(self.w0)

    def logits(self, w):
        return functional_call(self.model, w, (self.x,))

    def local(self, w):
        return F.cross_entropy(self.logits(w), self.y)

    def prox(self, w):
        if self.proximal == "l2":
            return 0.5 * MU * sum(((w[k] - self.w0[k]) ** 2).sum() for k in w)
        log_p = F.log_softmax(self.logits(w) / T, 1)
        return F.kl_div(log_p, F.softmax(self.zg / T, 1), reduction="batchmean")

    def leaf(self, w):
        return {k: v.detach().clone().requires_grad_(True) for k, v in w.items()}

    def run(self, step_gradient):
        """step_gradient(w, first) -> gradient dict; two SGD steps with momentum and weight decay."""
        w, buf = dict(self.w0), {}
        for first in (True, False):
            g = step_gradient(w, first)
            for k in w:
                d = g[k] + WD * w[k]
                buf[k] = d if first else MOM * buf[k] + d
            w = {k: (w[k] - LR * buf[k]).detach() for k in w}
        return w


def sol_reference(ref, strategy, scope):
    def step_gradient(w, first):
        wl = ref.leaf(w)
        gl = _grad(ref.local(wl), wl)
        # g_p is analytically zero at w == w_g (the first step)
        gp = {k: torch.zeros_like(v) for k, v in wl.items()} if first else _grad(ref.prox(wl), wl)
        if strategy == "A4":
            d = {k: gl[k] + BETA * gp[k] for k in scope}
        else:
            d = {k: gp[k] for k in scope}
        norm = math.sqrt(sum(float((v**2).sum()) for v in d.values()))
        eps = {k: (RHO * v / norm if norm >= 1e-8 else torch.zeros_like(v)) for k, v in d.items()}
        wp = ref.leaf(w)
        perturbed = {k: wp[k] + eps[k] if k in eps else wp[k] for k in wp}
        if strategy == "A0":
            return gl
        if strategy == "A1":
            return _grad(ref.local(perturbed), wp)
        if strategy == "A2":
            gpp = _grad(ref.prox(perturbed), wp)
            return {k: gl[k] + BETA * gpp[k] for k in wl}
        if strategy in ("A3", "A4"):
            return _grad(ref.local(perturbed) + BETA * ref.prox(perturbed), wp)
        if strategy == "A5":
            return {k: gl[k] + BETA * gp[k] for k in wl}
        gle = _grad(ref.local(perturbed), wp)  # A6
        return {k: gle[k] + BETA * gp[k] for k in wl}

    return step_gradient


def _scope(model, perturb):
    names = [k for k, _ in model.named_parameters()]
    return [k for k in names if k.startswith("head.")] if perturb == "head" else names


def _fit_fedsol(x, y, **kw):
    torch.manual_seed(0)
    dm = one_client_module(x, y, local_epochs=2)
    method = FedSOL(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, rho=RHO, temperature=T, mu=MU,
                    beta=BETA,
                    data_spec=dm.spec, **kw)
    return method, dm


@pytest.mark.parametrize("strategy", ["A0", "A1", "A2", "A3", "A4", "A5", "A6"])
@pytest.mark.parametrize("proximal", ["kl", "l2"])
@pytest.mark.parametrize("perturb", ["head", "all"])
def test_strategy_matches_table_formula(strategy, proximal, perturb):
    x, y = toy_data(n=12, size=4, num_classes=3)
    method, dm = _fit_fedsol(x, y, strategy=strategy, proximal=proximal, perturb=perturb, adaptive="none")
    ref = Reference(method.model, x, y, proximal)
    expected = ref.run(sol_reference(ref, strategy, _scope(method.model, perturb)))
    fit(method, dm)
    for k, v in method.model.named_parameters():
        torch.testing.assert_close(v.detach(), expected[k], atol=1e-6, rtol=1e-5)


def test_strategies_differ():
    """Guards the reference test against trivially-equal cases: the seven rules give seven models."""
    x, y = toy_data(n=12, size=4, num_classes=3)
    results = []
    for s in ["A0", "A1", "A2", "A3", "A4", "A5", "A6"]:
        method, dm = _fit_fedsol(x, y, strategy=s, perturb="all", adaptive="none")
        fit(method, dm)
        results.append(torch.cat([p.detach().flatten() for p in method.model.parameters()]))
    for i in range(len(results)):
        for j in range(i):
            assert (results[i] - results[j]).abs().max() > 1e-6, (i, j)


def test_a4_first_step_is_sam_on_local_loss():
    """A4 perturbs along the combined gradient, which at w == w_g is the local gradient alone: its
    first step is a SAM step on the combined loss (perturbation rho g_l/||g_l||), while A1's first
    step is plain SGD."""
    x, y = toy_data(n=12, size=4, num_classes=3)
    for s in ("A1", "A4"):
        torch.manual_seed(0)
        dm = one_client_module(x, y, local_epochs=1)
        method = FedSOL(model="mlp", lr=LR, momentum=0.0, weight_decay=0.0, rho=RHO, strategy=s,
                        perturb="all",
                        adaptive="none", data_spec=dm.spec)
        w0 = {k: v.detach().clone().requires_grad_(True) for k, v in method.model.named_parameters()}
        model = method.model
        gl = _grad(F.cross_entropy(functional_call(model, w0, (x,)), y), w0)
        norm = math.sqrt(sum(float((g**2).sum()) for g in gl.values()))
        wp = {k: w0[k] + RHO * gl[k] / norm for k in w0}
        with torch.no_grad():
            zg = functional_call(model, w0, (x,))
        zp = functional_call(model, wp, (x,))
        kl = F.kl_div(F.log_softmax(zp / T, 1), F.softmax(zg / T, 1), reduction="batchmean")
        sam = _grad(F.cross_entropy(zp, y) + 1.0 * kl, w0)  # default beta = 1
        fit(method, dm)
        expected = sam if s == "A4" else gl
        for k, v in method.model.named_parameters():
            torch.testing.assert_close(v.detach(), (w0[k] - LR * expected[k]).detach(), atol=1e-6, rtol=1e-5)


def test_l2_perturbation_follows_the_drift():
    """With the L2 proximal loss g_p = mu (w - w_g), so FedSOL's (A1) fixed-radius perturbation is
    rho (w - w_g)/||w - w_g||: mu cancels in the normalisation and cannot change the trajectory."""
    x, y = toy_data(n=12, size=4, num_classes=3)
    results = []
    for mu in (0.01, 10.0):
        torch.manual_seed(0)
        dm = one_client_module(x, y, local_epochs=3)
        method = FedSOL(model="mlp", proximal="l2", mu=mu, rho=RHO, adaptive="none", perturb="all",
                        data_spec=dm.spec)
        fit(method, dm)
        results.append(torch.cat([p.detach().flatten() for p in method.model.parameters()]))
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-5)


def test_projection_hand_computed():
    g_l = [torch.tensor([1.0, 0.0]), torch.tensor([2.0])]
    g_p = [torch.tensor([-1.0, 1.0]), torch.tensor([0.0])]
    # dot = -1 < 0, ||g_p||^2 = 2: g_l + 0.5 g_p
    out, projected = project_out_conflict(g_l, g_p)
    assert projected
    torch.testing.assert_close(out[0], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(out[1], torch.tensor([2.0]))
    assert abs(float((out[0] * g_p[0]).sum() + (out[1] * g_p[1]).sum())) < 1e-7  # orthogonal now
    # no conflict (dot = 1 > 0): unchanged
    out, projected = project_out_conflict(g_l, [torch.tensor([1.0, 1.0]), torch.tensor([0.0])])
    assert not projected and out[0].tolist() == [1.0, 0.0]
    # zero proximal gradient (first step): unchanged
    out, projected = project_out_conflict(g_l, [torch.zeros(2), torch.zeros(1)])
    assert not projected


def projection_reference(ref, scope):
    conflicts = []

    def step_gradient(w, first):
        wl = ref.leaf(w)
        gl = _grad(ref.local(wl), wl)
        if first:
            return gl
        gp = _grad(ref.prox(wl), wl)
        dot = sum(float((gl[k] * gp[k]).sum()) for k in scope)
        sq = sum(float((gp[k] ** 2).sum()) for k in scope)
        conflicts.append(dot < 0)
        if dot >= 0:
            return gl
        return {k: gl[k] - dot / sq * gp[k] if k in scope else gl[k] for k in gl}

    return step_gradient, conflicts


@pytest.mark.parametrize("proximal", ["kl", "l2"])
@pytest.mark.parametrize("scope", ["all", "head"])
def test_projection_two_steps_match_reference(proximal, scope):
    x, y = toy_data(n=12, size=4, num_classes=3)
    torch.manual_seed(0)
    dm = one_client_module(x, y, local_epochs=2)
    method = ProximalProjection(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, proximal=proximal, mu=MU,
                                temperature=T, scope=scope, data_spec=dm.spec)
    ref = Reference(method.model, x, y, proximal)
    step_gradient, conflicts = projection_reference(ref, _scope(method.model, scope))
    expected = ref.run(step_gradient)
    if proximal == "l2":
        # after a plain first SGD step g_p = -mu lr g_l(w_0): the gradients conflict, so step 2 projects
        assert conflicts == [True]
    fit(method, dm)
    for k, v in method.model.named_parameters():
        torch.testing.assert_close(v.detach(), expected[k], atol=1e-6, rtol=1e-5)


def test_bad_options_are_user_errors():
    x, y = toy_data(n=6, size=4)
    dm = one_client_module(x, y)
    with pytest.raises(FLUserError):
        FedSOL(model="mlp", strategy="A7", data_spec=dm.spec)
    with pytest.raises(FLUserError):
        FedSOL(model="mlp", proximal="moon", data_spec=dm.spec)


def test_plugged_in_proximal_loss_drives_the_perturbation():
    """The extension point for the "Combined" variants: a subclass's `proximal_loss` is what
    FedSOL perturbs along, and `proximal_vanishes_at_global = False` makes the first step use it
    (here L_p = <c, w_head>, whose gradient c is not zero at w == w_g)."""

    class LinearProximal(FedSOL):
        proximal_vanishes_at_global = False

        def proximal_loss(self, x, features, logits, params):
            return sum((self.c[n] * params[n]).sum() for n in self.c)

    x, y = toy_data(n=12, size=4, num_classes=3)
    torch.manual_seed(0)
    dm = one_client_module(x, y, local_epochs=1)
    method = LinearProximal(model="mlp", lr=LR, momentum=0.0, weight_decay=0.0, rho=RHO, adaptive="none",
                            perturb="head", data_spec=dm.spec)
    g = torch.Generator().manual_seed(1)
    method.c = {n: torch.randn(p.shape, generator=g) for n, p in method.model.named_parameters()
                if n.startswith("head.")}
    w0 = {k: v.detach().clone().requires_grad_(True) for k, v in method.model.named_parameters()}
    norm = torch.sqrt(sum((c**2).sum() for c in method.c.values()))
    wp = {k: w0[k] + RHO * method.c[k] / norm if k in method.c else w0[k] for k in w0}
    expected = _grad(F.cross_entropy(functional_call(method.model, wp, (x,)), y), w0)
    fit(method, dm)
    for k, v in method.model.named_parameters():
        torch.testing.assert_close(v.detach(), (w0[k] - LR * expected[k]).detach(), atol=1e-6, rtol=1e-5)
