"""FedSOL: a two-step local run equals a hand-computed reference; head-only perturbation runs the
body once forward and, by default, once backward; the toy problem of the paper's Appendix L
reaches its closed-form equilibrium."""

import math

import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, toy_data
from torch.func import functional_call

from fl_lightning.methods import FedSOL
from fl_lightning.methods.fedsol.fedsol import sol_perturbation

LR, MOM, WD, RHO, T = 0.1, 0.9, 1e-3, 0.5, 3.0


def reference_two_steps(model, x, y, adaptive, perturb):
    """Two local SGD(momentum, wd) steps of FedSOL written out from the paper's formulas."""
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    head = {k for k in w0 if k.startswith("head.")}
    scope = [k for k in w0 if (k in head) == (perturb == "head")] if perturb != "all" else list(w0)

    def logits(w):
        return functional_call(model, w, (x,))

    # step 1: w == w_g, so the proximal gradient is exactly zero and the step is plain SGD
    w = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    grads = torch.autograd.grad(F.cross_entropy(logits(w), y), list(w.values()))
    buf = {k: g + WD * w0[k] for k, g in zip(w, grads, strict=True)}
    w1 = {k: w0[k] - LR * buf[k] for k in w0}

    # step 2: perturb along the KL proximal gradient, step with the CE gradient at the perturbed point
    w = {k: v.clone().requires_grad_(True) for k, v in w1.items()}
    with torch.no_grad():
        zg = logits(w0)
    prox = F.kl_div(F.log_softmax(logits(w) / T, 1), F.softmax(zg / T, 1), reduction="batchmean")
    gp = dict(zip(w, torch.autograd.grad(prox, list(w.values())), strict=True))
    gnorm = math.sqrt(sum(float((gp[k] ** 2).sum()) for k in scope))
    eps = {}
    for k in scope:
        d = (w1[k] - w0[k]).abs()
        lam = {"none": torch.ones_like(d), "layer": d / d.norm(), "dim0": F.normalize(d, dim=0)}[adaptive]
        eps[k] = RHO * lam * gp[k] / gnorm
    wp = {k: (w[k] + eps[k]) if k in eps else w[k] for k in w}
    grads = torch.autograd.grad(F.cross_entropy(logits(wp), y), list(w.values()))
    reference_two_steps.gu_gp = (dict(zip(w, grads, strict=True)), gp)  # step 2's g_u and g_p, by name
    w2 = {}
    for k, g in zip(w, grads, strict=True):
        buf[k] = MOM * buf[k] + g + WD * w1[k]
        w2[k] = w1[k] - LR * buf[k]
    return w2, gnorm


@pytest.mark.parametrize("adaptive", ["none", "layer", "dim0"])
@pytest.mark.parametrize("perturb", ["head", "all"])
def test_two_local_steps_match_reference(adaptive, perturb):
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=2)
    method = FedSOL(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, rho=RHO, adaptive=adaptive,
                    perturb=perturb, temperature=T, data_spec=dm.spec)
    expected, gnorm = reference_two_steps(method.model, x, y, adaptive, perturb)
    assert gnorm > 1e-4  # the second step really is perturbed
    fit(method, dm, rounds=1)
    got = dict(method.model.named_parameters())
    for k, v in expected.items():
        torch.testing.assert_close(got[k].detach(), v.detach(), atol=1e-6, rtol=1e-5)


def cosine(a: dict, b: dict, names) -> float:
    dot = sum(float((a[k] * b[k]).sum()) for k in names)
    return dot / math.sqrt(sum(float((a[k] ** 2).sum()) for k in names) * sum(float((b[k] ** 2).sum()) for k in names))


@pytest.mark.parametrize("perturb", ["head", "body", "all"])
def test_logged_cosine_is_the_papers_whole_model_cos_gu_gp(perturb):
    """Fig. 3: cos(g_u, g_p), g_u = grad L_CE(w + eps_p), g_p = grad L_p(w; w_g), both over every
    trainable tensor, at step 2 (step 1 has g_p = 0 and logs no cosine). `cosine_scope perturbed`
    is the same restricted to the perturbed tensors; neither changes the trained weights."""
    x, y = toy_data(n=12, size=4, num_classes=3)
    results = {}
    for scope in ("all", "perturbed"):
        torch.manual_seed(0)
        dm = one_client_module(x, y, local_epochs=2)
        method = FedSOL(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, rho=RHO, adaptive="layer",
                        perturb=perturb, temperature=T, cosine_scope=scope, data_spec=dm.spec)
        reference_two_steps(method.model, x, y, "layer", perturb)
        gu, gp = reference_two_steps.gu_gp
        trainer = fit(method, dm, rounds=1)
        names = list(gp) if scope == "all" else method.perturbed_names()
        logged = float(trainer.callback_metrics["fedsol/cos_update_prox"])
        assert logged == pytest.approx(cosine(gu, gp, names), abs=1e-5)
        if scope == "all" and perturb != "all":  # the perturbed tensors' share, logged alongside
            perturbed = float(trainer.callback_metrics["fedsol/cos_update_prox_perturbed"])
            assert perturbed == pytest.approx(cosine(gu, gp, method.perturbed_names()), abs=1e-5)
        results[scope] = (logged, torch.cat([p.detach().flatten() for p in method.model.parameters()]))
    if perturb != "all":  # the two scopes measure different vectors, and training is the same
        assert abs(results["all"][0] - results["perturbed"][0]) > 1e-3
    assert torch.equal(results["all"][1], results["perturbed"][1])


def test_perturbation_changes_the_step():
    """Guards the reference test against a trivially-equal case: rho = 0 gives a different model."""
    x, y = toy_data(n=12, size=4, num_classes=3)
    results = []
    for rho in (0.0, RHO):
        torch.manual_seed(0)
        dm = one_client_module(x, y, local_epochs=2)
        method = FedSOL(model="mlp", lr=LR, rho=rho, adaptive="none", perturb="all", data_spec=dm.spec)
        fit(method, dm)
        results.append(torch.cat([p.flatten() for p in method.model.parameters()]))
    assert (results[0] - results[1]).abs().max() > 1e-6


def test_head_only_runs_the_body_once_per_step():
    torch.manual_seed(0)
    x, y = toy_data(n=8, size=4)
    dm = one_client_module(x, y, local_epochs=3)
    method = FedSOL(model="mlp", perturb="head", data_spec=dm.spec)
    calls = []
    method.model.body.register_forward_hook(lambda module, inputs, output: calls.append(module))
    fit(method, dm, limit_val_batches=0)  # count training passes only
    local_calls = [m for m in calls if m is method.model.body]
    assert len(local_calls) == 3  # one body pass per local step
    assert len(calls) - len(local_calls) == 2  # the frozen global model's pass on steps 2 and 3


@pytest.mark.parametrize("scope, body_backwards", [("perturbed", 3), ("all", 5)])
def test_head_only_backpropagates_through_the_body_as_the_paper_counts(scope, body_backwards):
    """The paper's cost (Appendix I: two backward passes a step, one of them the proximal loss's,
    through the head alone when only the head is perturbed): by default the body's weights get one
    gradient a local step, the update's. The whole-model cosine (`cosine_scope all`, Fig. 3) adds
    g_p over the body on every step that has one (not the first: g_p = 0 there)."""
    torch.manual_seed(0)
    x, y = toy_data(n=8, size=4)
    dm = one_client_module(x, y, local_epochs=3)
    kwargs = {} if scope == "perturbed" else {"cosine_scope": scope}  # "perturbed" is the default
    method = FedSOL(model="mlp", perturb="head", data_spec=dm.spec, **kwargs)
    body_weight = next(p for n, p in method.model.named_parameters() if n.startswith("body."))
    gradients = []
    body_weight.register_hook(lambda grad: gradients.append(grad))
    fit(method, dm, limit_val_batches=0)
    assert len(gradients) == body_backwards  # 3 local steps


def test_first_step_guard_fixed_radius():
    """At w == w_g a rounding-level proximal gradient must not become a length-rho perturbation."""
    w = [torch.ones(3)]
    tiny = [torch.full((3,), 1e-12)]
    eps = sol_perturbation(w, tiny, [torch.ones(3)], rho=2.0, adaptive="none")
    assert float(eps[0].abs().max()) == 0.0
    eps = sol_perturbation(w, [torch.ones(3)], [torch.ones(3)], rho=2.0, adaptive="none")
    assert math.isclose(float(eps[0].norm()), 2.0, rel_tol=1e-6)
    eps = sol_perturbation(w, [torch.ones(3)], [torch.ones(3)], rho=2.0, adaptive="layer")
    assert float(eps[0].abs().max()) == 0.0  # adaptive: w == w_g gives Lambda = 0, not NaN


def test_toy_problem_equilibrium_appendix_l():
    """L_local = 0.5(u-u_l)^2 + 0.5 delta (v-v_l)^2, L_p = 0.5 mu (u^2+v^2): gradient descent with
    FedSOL's perturbation converges to radius r_l - rho along (u_l, v_l); FedProx's update
    converges to (u_l/(1+mu), delta v_l/(delta+mu))."""
    ul, vl, delta, mu, rho, lr = 1.0, 1.0, 0.1, 0.5, 0.3, 0.1
    target = torch.tensor([ul, vl], dtype=torch.float64)
    curv = torch.tensor([1.0, delta], dtype=torch.float64)
    w = torch.zeros(2, dtype=torch.float64) + 1e-3  # start near the server weights (0, 0)
    prox = w.clone()
    for _ in range(20000):
        gp = mu * w
        eps = sol_perturbation([w], [gp], [torch.zeros(2, dtype=torch.float64)], rho=rho, adaptive="none",
                               min_grad_norm=0.0)[0]
        w = w - lr * curv * (w + eps - target)
        prox = prox - lr * (curv * (prox - target) + mu * prox)
    r_l = math.hypot(ul, vl)
    assert math.isclose(float(w.norm()), r_l - rho, rel_tol=1e-6)
    assert math.isclose(math.atan2(w[1], w[0]), math.atan2(vl, ul), abs_tol=1e-6)
    torch.testing.assert_close(prox, torch.tensor([ul / (1 + mu), delta * vl / (delta + mu)], dtype=torch.float64))
