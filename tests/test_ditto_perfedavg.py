"""Ditto and Per-FedAvg against hand-written references: Ditto's personal models follow CE +
lambda/2 prox steps from the round-start global model, stay on the client and survive resume, and
its global model is FedAvg's; a Per-FedAvg step is the first-order (or Hessian-free) MAML step on
the two halves of a batch, and its personal model is one alpha-step from the global model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import (
    assert_same_run,
    assert_same_tensors,
    fit,
    fixed_parts_module,
    four_clients,
    learnable_shard_module,
    one_client_module,
    params,
    reference_sgd,
    straight_and_resumed,
    toy_data,
)
from torch.func import functional_call

from fl_lightning.errors import FLUserError
from fl_lightning.methods import Ditto, FedAvg, PerFedAvg
from fl_lightning.personalization import PersonalizationCallback

OPT = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)


def assert_close_tensors(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), atol=atol, rtol=1e-5, msg=k)


def ce_grad(model, w: dict, x, y) -> dict:
    """grad of CE at weights w (leaf tensors) of a copy of `model`."""
    loss = F.cross_entropy(functional_call(model, w, (x,)), y)
    return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))


class RecordingDitto(Ditto):
    """Ditto that records every client's local batches and uploads."""

    def minibatch_step(self, batch):
        self.seen.setdefault(self.current_client, []).append((batch[0].clone(), batch[1].clone()))
        return super().minibatch_step(batch)

    def client_end(self):
        upload = super().client_end()
        self.sent.append(upload)
        return upload


def two_clients():
    x, y = toy_data(n=16, size=4, num_classes=3)
    # two clients of 8 samples, batch 4: two local steps each
    return fixed_parts_module(x, y, [list(range(8)), list(range(8, 16))], batch_size=4)


def ditto_round(lam=0.5):
    torch.manual_seed(0)
    dm = two_clients()
    method = RecordingDitto(model="mlp", lam=lam, data_spec=dm.spec, **OPT)
    method.seen, method.sent = {}, []
    w0 = params(method.model)
    fit(method, dm, rounds=1)
    return method, dm, w0


# ---- Ditto ----------------------------------------------------------------------------------------
def test_ditto_personal_model_is_ce_plus_prox_sgd_from_the_global_model_and_global_is_fedavg():
    lam = 0.5
    method, dm, w0 = ditto_round(lam)
    ref_model = copy.deepcopy(method.model)
    assert sorted(method.seen) == [0, 1] and all(len(b) == 2 for b in method.seen.values())
    for client, batches in method.seen.items():
        it = iter(batches)

        def grad_fn(w, it=it):
            x, y = next(it)
            loss = F.cross_entropy(functional_call(ref_model, w, (x,)), y)
            loss = loss + 0.5 * lam * sum(((w[n] - w0[n]) ** 2).sum() for n in w)
            return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))

        expected = reference_sgd(w0, grad_fn, steps=2, **OPT)
        assert_close_tensors(method.client_state(client, "personal."), expected)
        # the prox term matters: without it v_k would be the client's FedAvg model
        assert not torch.allclose(method.client_state(client, "personal.")["head.weight"],
                                  method.sent[client].weights["head.weight"], atol=1e-6)

    torch.manual_seed(0)
    dm = two_clients()
    fedavg = FedAvg(model="mlp", data_spec=dm.spec, **OPT)
    assert_same_tensors(params(fedavg.model), w0)
    fit(fedavg, dm, rounds=1)
    assert_same_tensors(params(method.model), params(fedavg.model))


def test_ditto_with_lambda_zero_personal_model_is_the_local_fedavg_model():
    """lam = 0: v_k takes the same steps from the same start as the global track."""
    method, _, _ = ditto_round(lam=0.0)
    for u in method.sent:
        assert_close_tensors(method.client_state(u.client, "personal."), u.weights, atol=1e-7)


def test_ditto_uploads_only_the_global_track_model():
    method, _, _ = ditto_round()
    model_keys = set(method.model.state_dict())
    assert len(method.sent) == 2
    for u in method.sent:
        assert set(u.weights) == model_keys  # exactly the model, no personal tensors
        assert u.stats["personal_distance"] > 0
    # what stays on the client: v_k, on CPU
    assert set(method.client_states) == {0, 1}
    assert all(t.device.type == "cpu" for s in method.client_states.values() for t in s.values())


def test_ditto_personal_model_is_v_k_and_leaves_the_global_model_alone():
    method, _, _ = ditto_round()
    global_before = params(method.model)
    states_before = {c: dict(s) for c, s in method.client_states.items()}
    for client in (0, 1):
        pm = method.personal_model(client)
        assert pm is not method.model
        assert_same_tensors(params(pm), method.client_state(client, "personal."))
        with torch.no_grad():  # a change to the returned model must not reach the method
            pm.head.weight.add_(1.0)
    assert_same_tensors(params(method.model), global_before)
    for c, s in states_before.items():
        assert_same_tensors(method.client_states[c], s)
    # a client that never took part: a copy of the current global model
    method.client_states.pop(1)
    assert_same_tensors(params(method.personal_model(1)), global_before)


def build(method_cls, seed=0, **kw):
    torch.manual_seed(seed)
    dm = four_clients()
    return method_cls(model="mlp", data_spec=dm.spec, **kw), dm


@pytest.mark.parametrize("method_cls", [Ditto, PerFedAvg])
def test_resume_equals_uninterrupted(method_cls, tmp_path):
    straight, first, resumed = straight_and_resumed(lambda seed: build(method_cls, seed), tmp_path)
    assert_same_run(straight, resumed)
    if method_cls is Ditto:
        # personal models of clients trained before the interruption came back from the checkpoint
        assert set(first.client_states) <= set(straight.client_states)
        assert len(first.client_states) >= 2


def test_bad_options_fail_fast():
    x, y = toy_data(n=4, size=4)
    dm = one_client_module(x, y)
    with pytest.raises(FLUserError):
        Ditto(model="mlp", lam=-1.0, data_spec=dm.spec)
    with pytest.raises(FLUserError):
        PerFedAvg(model="mlp", variant="so", data_spec=dm.spec)
    with pytest.raises(FLUserError):
        PerFedAvg(model="mlp", alpha=-0.1, data_spec=dm.spec)


# ---- Per-FedAvg -----------------------------------------------------------------------------------
class RecordingPerFedAvg(PerFedAvg):
    def minibatch_step(self, batch):
        self.seen.append((batch[0].clone(), batch[1].clone()))
        return super().minibatch_step(batch)


def perfedavg_one_step(variant, alpha, n=7):
    """One client, one batch of n samples: one round is one local step."""
    torch.manual_seed(0)
    x, y = toy_data(n=n, size=4, num_classes=3)
    dm = one_client_module(x, y)
    method = RecordingPerFedAvg(model="mlp", alpha=alpha, variant=variant, data_spec=dm.spec, **OPT)
    method.seen = []
    w0 = params(method.model)
    fit(method, dm, rounds=1)
    assert len(method.seen) == 1 and len(method.seen[0][1]) == n
    return method, w0, copy.deepcopy(method.model), method.seen[0]


def first_order_direction(model, w, batch, alpha):
    x, y = batch
    n1 = (len(y) + 1) // 2  # D1 = first ceil(n/2) samples, D2 = the rest
    g1 = ce_grad(model, w, x[:n1], y[:n1])
    temp = {k: (w[k] - alpha * g1[k]).detach().requires_grad_(True) for k in w}
    return ce_grad(model, temp, x[n1:], y[n1:]), (x[:n1], y[:n1])


def test_perfedavg_fo_step_is_the_gradient_at_the_inner_step_applied_to_w():
    alpha = 0.3
    method, w0, model, batch = perfedavg_one_step("fo", alpha)

    def grad_fn(w):
        return first_order_direction(model, w, batch, alpha)[0]

    assert_close_tensors(params(method.model), reference_sgd(w0, grad_fn, steps=1, **OPT))
    # not plain SGD on the whole batch: the inner step matters
    plain = reference_sgd(w0, lambda w: ce_grad(model, w, *batch), steps=1, **OPT)
    assert not torch.allclose(params(method.model)["head.weight"], plain["head.weight"], atol=1e-5)


def test_perfedavg_hf_step_adds_the_hessian_correction():
    """HF = FO direction - alpha * H(w; D1) g2; the reference takes H g2 by exact double backprop."""
    alpha = 0.5
    method, w0, model, batch = perfedavg_one_step("hf", alpha)

    def grad_fn(w):
        g2, (x1, y1) = first_order_direction(model, w, batch, alpha)
        g1 = ce_grad_graph(model, w, x1, y1)
        dot = sum((g1[k] * g2[k].detach()).sum() for k in w)
        hv = dict(zip(w, torch.autograd.grad(dot, list(w.values())), strict=True))
        return {k: g2[k] - alpha * hv[k] for k in w}

    expected = reference_sgd(w0, grad_fn, steps=1, **OPT)
    assert_close_tensors(params(method.model), expected, atol=2e-5)
    fo = reference_sgd(w0, lambda w: first_order_direction(model, w, batch, alpha)[0], steps=1, **OPT)
    gap = max(float((fo[k] - expected[k]).abs().max()) for k in fo)
    assert gap > 1e-3  # the correction is far larger than the tolerance: the test can tell HF from FO


def ce_grad_graph(model, w, x, y):
    loss = F.cross_entropy(functional_call(model, w, (x,)), y)
    return dict(zip(w, torch.autograd.grad(loss, list(w.values()), create_graph=True), strict=True))


def _shard_module():
    return learnable_shard_module(n_train=80, n_test=40, batch_size=10)


@pytest.mark.parametrize("adapt_steps", [1, 2])
def test_perfedavg_personal_model_is_alpha_steps_on_the_clients_training_batches(adapt_steps):
    torch.manual_seed(0)
    dm = _shard_module()
    method = PerFedAvg(model="mlp", alpha=0.2, adapt_steps=adapt_steps, adapt_seed=7, data_spec=dm.spec, **OPT)
    fit(method, dm, rounds=1)
    global_before = params(method.model)
    rng_before = torch.random.get_rng_state()
    client = 2
    pm = method.personal_model(client)

    # reference: plain SGD steps of size alpha from the global model on the seeded client batches
    w = {k: v.clone() for k, v in global_before.items()}
    batches = iter(dm.client_loader(client, "train", shuffle=True, seed=7))
    for _ in range(adapt_steps):
        x, y = next(batches)
        leaves = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        g = ce_grad(method.model, leaves, x, y)
        w = {k: w[k] - 0.2 * g[k] for k in w}
    assert_close_tensors(params(pm), w)
    assert not torch.allclose(params(pm)["head.weight"], global_before["head.weight"])

    # the global model and the RNG are untouched
    assert_same_tensors(params(method.model), global_before)
    assert torch.equal(torch.random.get_rng_state(), rng_before)


def test_perfedavg_personal_models_in_evaluation_change_no_training():
    """Runs with and without per-round personalised evaluation (which builds every client's personal
    model) end in the same global model; the own models are reported."""
    finals = []
    for enabled in (False, True):
        torch.manual_seed(0)
        dm = _shard_module()
        method = PerFedAvg(model="mlp", alpha=0.2, data_spec=dm.spec, **OPT)
        cb = PersonalizationCallback(enabled=enabled, epochs=[0], every_n_rounds=1, at_end=False)
        fit(method, dm, rounds=2, callbacks=[cb])
        finals.append(params(method.model))
    assert_same_tensors(finals[0], finals[1])
    assert len(cb.per_client["own"]) == 4
