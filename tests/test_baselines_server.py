"""Baselines with client or server state: SCAFFOLD, FedNova, FedDyn, FedExP. Clients of known data
take exact numbers of local steps (batch = the client's data); their local runs and the server's
update are written out from the papers' formulas and compared with a real fit."""

import math

import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, fixed_parts_module, reference_sgd, toy_data
from torch.func import functional_call

from fl_lightning.data.datamodule import sample_clients
from fl_lightning.errors import FLUserError
from fl_lightning.methods import SCAFFOLD, FedDyn, FedExP, FedNova
from fl_lightning.methods.baselines.fedexp import fedexp_step_size
from fl_lightning.methods.baselines.local_steps import effective_steps

LR, MOM, WD = 0.1, 0.9, 1e-3
# 3 clients of different sizes, 2 sampled per round: N (all clients) differs from |S| (sampled)
PARTS = [list(range(0, 4)), list(range(0, 12)), list(range(4, 12))]


def three_clients(method_cls, local_epochs=2, **kw):
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = fixed_parts_module(x, y, PARTS, sample_ratio=2 / 3, local_epochs=local_epochs, batch_size=12)
    method = method_cls(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, data_spec=dm.spec, **kw)
    w0 = {k: v.detach().clone() for k, v in method.model.named_parameters()}
    sampled = sample_clients(3, 2 / 3, 0, 0)
    assert len(sampled) == 2
    return method, dm, x, y, w0, sampled


def ce_grad(model, x, y, extra=None):
    def grad_fn(w):
        loss = F.cross_entropy(functional_call(model, w, (x,)), y) + (extra(w) if extra else 0)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    return grad_fn


def hand_effective_steps(steps, m):
    """Weight of every gradient in the final displacement of heavy-ball SGD, summed term by term."""
    return sum(sum(m**j for j in range(steps - k)) for k in range(steps))


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_effective_steps_is_the_momentum_displacement():
    for steps in (1, 2, 5, 13):
        assert math.isclose(effective_steps(steps, 0.9), hand_effective_steps(steps, 0.9), rel_tol=1e-12)
        assert effective_steps(steps, 0.0) == steps
    # K momentum steps with a constant gradient move lr * K_eff * g
    w, g, lr = torch.zeros(1, requires_grad=True), torch.ones(1), 0.1
    opt = torch.optim.SGD([w], lr=lr, momentum=0.9)
    for _ in range(5):
        w.grad = g.clone()
        opt.step()
    assert math.isclose(-float(w), lr * effective_steps(5, 0.9), rel_tol=1e-6)


# ---- SCAFFOLD ---------------------------------------------------------------------------------
@pytest.mark.parametrize("momentum_correction", [True, False])
def test_scaffold_corrected_gradient_and_control_variates(momentum_correction):
    method, dm, x, y, w0, sampled = three_clients(SCAFFOLD, momentum_correction=momentum_correction)
    torch.manual_seed(1)
    c = {k: 0.1 * torch.randn_like(v) for k, v in w0.items()}
    ci = {k: {n: 0.1 * torch.randn_like(v) for n, v in w0.items()} for k in range(3)}
    method.server.assign({"c": c})  # SCAFFOLD's server state
    first = sampled[0]
    method.client_states[first] = {f"c.{k}": v.clone() for k, v in ci[first].items()}  # the other starts at 0
    ci[sampled[1]] = {k: torch.zeros_like(v) for k, v in w0.items()}

    local, new_ci = {}, {}
    k_eff = hand_effective_steps(2, MOM) if momentum_correction else 2
    for k in sampled:
        xk, yk = x[PARTS[k]], y[PARTS[k]]
        base = ce_grad(method.model, xk, yk)

        def grad_fn(w, base=base, k=k):
            g = base(w)
            return {n: g[n] - ci[k][n] + c[n] for n in w}

        local[k] = reference_sgd(w0, grad_fn, 2, LR, MOM, WD)
        new_ci[k] = {n: ci[k][n] - c[n] + (w0[n] - local[k][n]) / (k_eff * LR) for n in w0}
    sizes = {k: len(PARTS[k]) for k in sampled}
    total = sum(sizes.values())
    expected_w = {n: sum(sizes[k] / total * local[k][n] for k in sampled) for n in w0}
    expected_c = {n: c[n] + sum(new_ci[k][n] - ci[k][n] for k in sampled) / 3 for n in w0}

    fit(method, dm)
    got = dict(method.model.named_parameters())
    for n in w0:
        close(got[n].detach(), expected_w[n])
        close(method.server["c"][n], expected_c[n])
        for k in sampled:
            close(method.client_state(k, "c.")[n], new_ci[k][n])
            assert method.client_states[k][f"c.{n}"].device.type == "cpu"
    assert set(method.client_states) == set(sampled)  # no state for the client that did not take part


# ---- FedNova ----------------------------------------------------------------------------------
class RecordingFedNova(FedNova):
    def server_step(self, uploads):
        sent = [(u.client, u.num_samples, {k: v.clone() for k, v in u.weights.items()},
                 int(u.group("local_steps")["tau"]))
                for u in uploads]
        self.recorded = ({k: v.clone() for k, v in self.global_params().items()}, sent)
        return super().server_step(uploads)


def test_fednova_normalised_averaging():
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    # sizes 4 and 8 with batch 4 and 2 local epochs: 2 and 4 local steps
    dm = fixed_parts_module(x, y, [list(range(4)), list(range(4, 12))], local_epochs=2, batch_size=4)
    method = RecordingFedNova(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, data_spec=dm.spec)
    fit(method, dm)
    wg, uploads = method.recorded
    a = {0: hand_effective_steps(2, MOM), 1: hand_effective_steps(4, MOM)}  # 2.9 and 9.049
    assert math.isclose(a[0], 2.9) and math.isclose(a[1], 9.049)
    assert {c: tau for c, _, _, tau in uploads} == {0: 2, 1: 4}
    p = {0: 4 / 12, 1: 8 / 12}
    tau_eff = p[0] * a[0] + p[1] * a[1]
    got = dict(method.model.named_parameters())
    fedavg_gap = 0.0
    for n, g in wg.items():
        d = sum(p[c] * (g - t[n]) / a[c] for c, _, t, _ in uploads)
        close(got[n].detach(), g - tau_eff * d)
        fedavg = sum(p[c] * t[n] for c, _, t, _ in uploads)
        fedavg_gap = max(fedavg_gap, float((got[n].detach() - fedavg).abs().max()))
    assert fedavg_gap > 1e-5  # different step counts: not plain FedAvg


# ---- FedDyn -----------------------------------------------------------------------------------
def test_feddyn_client_and_server_state():
    alpha = 0.5
    method, dm, x, y, w0, sampled = three_clients(FedDyn, alpha=alpha)
    torch.manual_seed(1)
    h = {n: 0.1 * torch.randn_like(v) for n, v in w0.items()}
    gi = {k: {n: 0.1 * torch.randn_like(v) for n, v in w0.items()} for k in sampled}
    method.server.assign({"h": h})  # FedDyn's server state
    for k in sampled:
        method.client_states[k] = {f"g.{n}": v.clone() for n, v in gi[k].items()}
    local = {}
    for k in sampled:
        base = ce_grad(method.model, x[PARTS[k]], y[PARTS[k]])

        def grad_fn(w, base=base, k=k):  # grad of CE - <g_i, w> + alpha/2 ||w - w_g||^2, by hand
            g = base(w)
            return {n: g[n] - gi[k][n] + alpha * (w[n].detach() - w0[n]) for n in w}

        local[k] = reference_sgd(w0, grad_fn, 2, LR, MOM, WD)
    new_h = {n: h[n] - alpha / 3 * sum(local[k][n] - w0[n] for k in sampled) for n in w0}
    expected = {n: sum(local[k][n] for k in sampled) / 2 - new_h[n] / alpha for n in w0}  # unweighted mean

    fit(method, dm)
    got = dict(method.model.named_parameters())
    for n in w0:
        close(got[n].detach(), expected[n])
        close(method.server["h"][n], new_h[n])
        for k in sampled:
            close(method.client_state(k, "g.")[n], gi[k][n] - alpha * (local[k][n] - w0[n]))
    assert set(method.client_states) == set(sampled)


# ---- FedExP -----------------------------------------------------------------------------------
def test_fedexp_step_size_formula_and_floor():
    same = [{"w": torch.tensor([1.0, 2.0])}] * 3
    assert fedexp_step_size(same, [1, 2, 3], 1e-3) == 1.0  # agreeing clients: no extrapolation
    opposed = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([-1.0, 0.0])}]
    # 0.5 * (0.5 * 1 + 0.5 * 1) / (0 + 2 * 1e-3) = 250
    assert math.isclose(fedexp_step_size(opposed, [5, 5], 1e-3), 250.0)
    torch.manual_seed(0)
    for _ in range(20):
        deltas = [{"a": torch.randn(3, 2), "b": torch.randn(4)} for _ in range(4)]
        weights = torch.randint(1, 10, (4,)).tolist()
        flat = [torch.cat([d["a"].flatten(), d["b"]]).double() for d in deltas]
        p = [w / sum(weights) for w in weights]
        mean = sum(pi * f for pi, f in zip(p, flat, strict=True))
        spread = sum(pi * float(f @ f) for pi, f in zip(p, flat, strict=True))
        formula = 0.5 * spread / (float(mean @ mean) + 4 * 1e-3)
        eta = fedexp_step_size(deltas, weights, 1e-3)
        assert eta >= 1.0
        assert math.isclose(eta, max(1.0, formula), rel_tol=1e-9)


class RecordingFedExP(FedExP):
    def round_start(self, round_idx, clients):
        super().round_start(round_idx, clients)
        self.starts.append({k: v.clone() for k, v in self.global_weights.items()})

    def server_step(self, uploads):
        self.recorded = [(u.num_samples, {k: v.clone() for k, v in u.weights.items()}) for u in uploads]
        return super().server_step(uploads)

    def apply_server_update(self, update):
        super().apply_server_update(update)
        self.reported.append({k: v.clone() for k, v in self.model.state_dict().items()})


def test_fedexp_server_step_and_reported_average():
    method, dm, x, y, w0, sampled = three_clients(RecordingFedExP, local_epochs=3)
    method.starts, method.reported = [], []
    fit(method, dm, rounds=2)
    # round 1: the reported model is (w_1 + w_0)/2 and round 2 starts from w_1 itself
    w_start, w1 = method.starts[0], method.starts[1]
    for k in w0:
        close(method.reported[0][k], (w1[k] + w_start[k]) / 2)
    # round 2's step, from its recorded uploads
    sizes = [n for n, _ in method.recorded]
    deltas = [{k: t[k] - w1[k] for k in w0} for _, t in method.recorded]
    eta = fedexp_step_size(deltas, sizes, 1e-3)
    assert eta >= 1.0
    p = [n / sum(sizes) for n in sizes]
    for k in w0:
        w2 = w1[k] + eta * sum(pi * d[k] for pi, d in zip(p, deltas, strict=True))
        close(method.server["iterate"][k], w2)
        close(dict(method.model.named_parameters())[k].detach(), (w2 + w1[k]) / 2)


def test_fedexp_rejects_a_server_lr():
    with pytest.raises(FLUserError, match="server step"):
        FedExP(model="mlp", server_lr=2.0, data_spec=fixed_parts_module(*toy_data(), [[0, 1]]).spec)
