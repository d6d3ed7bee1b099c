"""One loss hook, `loss(model, batch, context)`, serves local training and personalised fine-tuning
(`objective: method`): a method that overrides only `loss` changes both, and fine-tuning passes
the start model as the teacher, the client's class counts and `finetuning=True`."""

import copy

import torch
import torch.nn.functional as F
from fl_test_utils import fit, learnable_shard_module, one_client_module, reference_sgd, toy_data
from torch.func import functional_call

from fl_lightning.methods import FedAvg, FedNTD, FedProto, FedProx
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.baselines.fedntd import ntd_loss
from fl_lightning.personalization import PersonalizationCallback

SMOOTHING = 0.3


class SmoothedFedAvg(FedAvg):
    """FedAvg whose local objective is label-smoothed CE: it overrides `loss` and nothing else."""

    def loss(self, model, batch, context):
        x, y = batch
        return F.cross_entropy(model(x), y, label_smoothing=SMOOTHING)


def smoothed_grad(model, x, y):
    def grad_fn(w):
        loss = F.cross_entropy(functional_call(model, w, (x,)), y, label_smoothing=SMOOTHING)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    return grad_fn


def finetuned_model(cb, method, dm, client=0, epochs=1):
    """Runs the callback's fine-tuning of `client` and returns the model it evaluated last."""
    seen = []
    real = PersonalizationCallback.accuracy
    cb.accuracy = lambda model, loader, device: (seen.append(copy.deepcopy(model)), real(model, loader, device))[1]
    start = method.finetune_start(client)
    cb.train_and_test(method, start, start.state_dict(), dm, client, dm.client_loader(client, "test"), [epochs])
    return seen[-1]


def hand_finetuned(cb, start, dm, client, loss_fn, epochs=1):
    """The fine-tuning written out: SGD on a copy, the callback's seeded batches, `loss_fn`."""
    model = copy.deepcopy(start).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cb.lr, momentum=cb.momentum,
                          weight_decay=cb.weight_decay)
    for epoch in range(epochs):
        for x, y in dm.client_loader(client, "train", shuffle=True, seed=cb.seed * 100003 + epoch):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    return model


def assert_same_params(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5, msg=n)


def test_local_training_steps_on_the_overridden_loss():
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=2)
    method = SmoothedFedAvg(model="mlp", lr=0.1, momentum=0.9, weight_decay=1e-3, data_spec=dm.spec)
    w0 = {k: v.detach().clone() for k, v in method.model.named_parameters()}
    expected = reference_sgd(w0, smoothed_grad(method.model, x, y), 2, 0.1, 0.9, 1e-3)
    fit(method, dm)
    for k, v in method.model.named_parameters():
        torch.testing.assert_close(v.detach(), expected[k], atol=1e-6, rtol=1e-5)


def test_finetuning_with_objective_method_uses_the_same_hook():
    torch.manual_seed(0)
    dm = learnable_shard_module()
    method = SmoothedFedAvg(model="mlp", lr=0.1, data_spec=dm.spec)
    fit(method, dm, rounds=1)
    cb = PersonalizationCallback(enabled=True, epochs=[1], objective="method", lr=0.05)
    got = finetuned_model(cb, method, dm, client=1)
    smoothed = hand_finetuned(cb, method.model, dm, 1,
                              lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=SMOOTHING))
    assert_same_params(got, smoothed)
    plain = hand_finetuned(cb, method.model, dm, 1, lambda m, x, y: F.cross_entropy(m(x), y))
    assert max(float((p - q).abs().max()) for p, q in zip(got.parameters(), plain.parameters(), strict=True)) > 1e-5
    # objective "ce" ignores the method's loss
    cb_ce = PersonalizationCallback(enabled=True, epochs=[1], objective="ce", lr=0.05)
    assert_same_params(finetuned_model(cb_ce, method, dm, client=1), plain)


def test_finetuning_distils_from_the_start_model_as_teacher():
    """FedNTD's loss reads its teacher from the context: in fine-tuning that is the start model."""
    torch.manual_seed(0)
    dm = learnable_shard_module()
    method = FedNTD(model="mlp", lr=0.1, beta=2.0, data_spec=dm.spec)
    fit(method, dm, rounds=1)
    cb = PersonalizationCallback(enabled=True, epochs=[1], objective="method", lr=0.05)
    got = finetuned_model(cb, method, dm, client=2)
    teacher = copy.deepcopy(method.model).eval()

    def ntd(m, x, y):
        logits = m(x)
        with torch.no_grad():
            t = teacher(x)
        return F.cross_entropy(logits, y) + 2.0 * ntd_loss(logits, t, y, 1.0)

    assert_same_params(got, hand_finetuned(cb, method.model, dm, 2, ntd))
    assert not method.local_logs  # fine-tuning does not log into the next round's local means


def test_terms_on_federated_state_are_left_out_of_finetuning():
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = one_client_module(x, y)
    method = FedProx(model="mlp", mu=5.0, data_spec=dm.spec)
    fit(method, dm)
    method.round_start(1, [0])
    with torch.no_grad():
        for p in method.model.parameters():
            p.add_(0.1)  # away from the round-start weights: the proximal term is > 0
    ce = F.cross_entropy(method.model(x), y)
    local = method.loss(method.model, (x, y), method.loss_context())
    assert float(local - ce) > 1e-3
    torch.testing.assert_close(method.loss(method.model, (x, y), LossContext(finetuning=True)), ce)


def test_heterogeneous_methods_finetune_with_objective_method():
    """Model-heterogeneous methods answer the same hook (their own model, no server prototypes)."""
    torch.manual_seed(0)
    dm = learnable_shard_module(client_test="split", client_test_fraction=0.25)
    method = FedProto(model="mlp", feature_dim=16, lam=5.0, data_spec=dm.spec)
    fit(method, dm, rounds=2)
    assert bool(method.has_proto.any())
    cb = PersonalizationCallback(enabled=True, epochs=[1], objective="method", lr=0.05)
    got = finetuned_model(cb, method, dm, client=3)
    start = method.finetune_start(3)
    assert_same_params(got, hand_finetuned(cb, start, dm, 3, lambda m, x, y: F.cross_entropy(m(x), y)))
