"""FedSOL + MOON / FedDyn / SCAFFOLD ("Combined", FedSOL paper Table 4): the method's regulariser
sets the perturbation, the update is CE at the perturbed weights, and the method's own state and
server rule are kept. Two local steps are compared with a hand-written reference."""

import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, params, reference_sgd, toy_data
from torch.func import functional_call

from fl_lightning.methods import FedSOLFedDyn, FedSOLMOON, FedSOLSCAFFOLD

LR, MOM, WD, RHO = 0.1, 0.9, 1e-3, 0.3


def sol_grad(model, x, y, prox_grad_fn):
    """grad_w CE(f(w + eps)) with eps = rho * g_p / ||g_p|| (fixed radius, whole model)."""
    def grad_fn(w):
        gp = prox_grad_fn(w)
        norm = torch.sqrt(sum((g ** 2).sum() for g in gp.values()))
        wp = {k: w[k] + RHO * gp[k] / norm for k in w}
        loss = F.cross_entropy(functional_call(model, wp, (x,)), y)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    return grad_fn


def local_model_after_round(method, dm):
    uploads = []
    original = method.client_end
    method.client_end = lambda: (uploads.append(params(method.model)), original())[1]
    fit(method, dm)
    return uploads[0]


def setup(cls, **kw):
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=2)
    method = cls(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, rho=RHO, adaptive="none", data_spec=dm.spec,
                 **kw)
    w0 = {k: v.detach().clone() for k, v in method.model.named_parameters()}
    return x, y, dm, method, w0


def assert_matches(got, expected):
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v.detach(), atol=1e-6, rtol=1e-5)


def test_fedsol_feddyn_perturbs_along_the_dynamic_regulariser():
    x, y, dm, method, w0 = setup(FedSOLFedDyn, alpha=0.5)
    g_i = {k: torch.randn_like(v) for k, v in w0.items()}
    method.client_states[0] = {f"g.{k}": v for k, v in g_i.items()}

    def prox_grad(w):  # d/dw [-<g_i, w> + alpha/2 ||w - w_g||^2]
        return {k: -g_i[k] + 0.5 * (w[k].detach() - w0[k]) for k in w}

    expected = reference_sgd(w0, sol_grad(method.model, x, y, prox_grad), 2, LR, MOM, WD)
    assert_matches(local_model_after_round(method, dm), expected)


def test_fedsol_scaffold_perturbs_along_the_correction_and_does_not_add_it():
    x, y, dm, method, w0 = setup(FedSOLSCAFFOLD)
    c = {k: torch.randn_like(v) for k, v in w0.items()}
    c_i = {k: torch.randn_like(v) for k, v in w0.items()}
    method.server.assign({"c": c})
    method.client_states[0] = {f"c.{k}": v for k, v in c_i.items()}
    expected = reference_sgd(w0, sol_grad(method.model, x, y, lambda w: {k: c[k] - c_i[k] for k in w}),
                             2, LR, MOM, WD)
    assert_matches(local_model_after_round(method, dm), expected)


def test_fedsol_moon_perturbs_along_the_contrastive_loss():
    x, y, dm, method, w0 = setup(FedSOLMOON, mu=0.1, tau=0.5)
    prev = {k: v + 0.3 * torch.randn_like(v) for k, v in method.model.state_dict().items()}
    method.client_states[0] = {f"previous.{k}": v for k, v in prev.items()}
    model = method.model
    body = {k: v for k, v in w0.items() if not k.startswith("head.")}

    def features(w):
        return functional_call(model.body, {k.removeprefix("body."): v for k, v in w.items()}, (x,))

    with torch.no_grad():
        z_global = features(body)
        z_prev = features({k: prev[k] for k in body})

    def prox_grad(w):
        z = features({k: w[k] for k in body})
        pos = F.cosine_similarity(z, z_global, dim=1) / 0.5
        neg = F.cosine_similarity(z, z_prev, dim=1) / 0.5
        con = (-pos + torch.logsumexp(torch.stack([pos, neg], 1), 1)).mean()
        grads = torch.autograd.grad(0.1 * con, list(w.values()), allow_unused=True, retain_graph=True)
        return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(w.items(), grads, strict=True)}

    expected = reference_sgd(w0, sol_grad(model, x, y, prox_grad), 2, LR, MOM, WD)
    assert_matches(local_model_after_round(method, dm), expected)
