"""FedPer and FedRep: local steps against hand-written SGD (first round and a later round from the
client's own head), a body-only upload with a sample-weighted average and a global head that never
changes, FedRep's phases (frozen part bit-identical, buffers included; steps per phase; fresh
momentum), personal_model = global body + own head without side effects, and resume."""

import numpy as np
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
from torch import nn
from torch.func import functional_call

from fl_lightning.errors import FLUserError
from fl_lightning.methods import FedPer, FedRep
from fl_lightning.models import FLModel, register_model
from fl_lightning.personalization import PersonalizationCallback

LR, MOM, WD = 0.3, 0.9, 1e-3
BODY = {"body.1.weight", "body.1.bias"}  # the mlp's shared part
HEAD = {"head.weight", "head.bias"}


class _BNMLP(FLModel):
    """Flatten - Linear - BatchNorm - Tanh - head: a body with running statistics."""

    def __init__(self, in_features, num_classes, hidden=8):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.Tanh())
        self.head = nn.Linear(hidden, num_classes)
        self.feature_dim = hidden

    def features(self, x):
        return self.body(x)


register_model("test_bn_mlp", lambda spec, **kw: _BNMLP(spec.in_channels * spec.image_size**2, spec.num_classes))


def ce_grad(model, x, y, fixed=None):
    """grad_fn for reference_sgd: CE gradient w.r.t. the leaves w, the other weights held at `fixed`."""
    def grad_fn(w):
        logits = functional_call(model, {**(fixed or {}), **w}, (x,))
        grads = torch.autograd.grad(F.cross_entropy(logits, y), list(w.values()))
        return dict(zip(w, grads, strict=True))
    return grad_fn


def part(state, keys):
    return {k: state[k].detach().clone() for k in keys}


def close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def heads(method) -> dict[int, dict[str, torch.Tensor]]:
    """Every client's own head (its part of the model kept in the client-state store)."""
    return {c: method.client_state(c, "model.") for c in method.client_states}


class Recorder:
    """Mixin: keeps every accepted upload."""

    def server_step(self, uploads):
        self.uploads = getattr(self, "uploads", []) + [list(uploads)]
        return super().server_step(uploads)


class RecFedPer(Recorder, FedPer):
    pass


class RecFedRep(Recorder, FedRep):
    pass


# ---- FedPer: local steps by hand ----------------------------------------------------------------
def test_fedper_steps_by_hand_first_and_later_round():
    """Two clients (4 and 8 samples, one full-batch step per round). Round 1 starts every client
    from the global body + the initial head; round 2 from the averaged body + the client's own head."""
    x, y = toy_data(n=12, size=4, num_classes=3)
    parts = [list(range(4)), list(range(4, 12))]
    results = {}
    for rounds in (1, 2):
        torch.manual_seed(0)
        dm = fixed_parts_module(x, y, parts)
        method = FedPer(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, lr_decay=1.0, data_spec=dm.spec)
        w0 = params(method.model)
        fit(method, dm, rounds=rounds)
        results[rounds] = (w0, params(method.model), heads(method))

    w0, global1, heads1 = results[1]
    local = [reference_sgd(w0, ce_grad(_mlp(x), x[p], y[p]), 1, LR, MOM, WD) for p in parts]
    body1 = {k: (4 * local[0][k] + 8 * local[1][k]) / 12 for k in BODY}  # sample-weighted
    close(part(global1, BODY), body1)
    assert_same_tensors(part(global1, HEAD), part(w0, HEAD))  # the global head is the initial one
    for c in (0, 1):
        close(heads1[c], part(local[c], HEAD))

    w0_again, global2, heads2 = results[2]
    assert_same_tensors(w0_again, w0)
    # round 2: the averaged body + the client's OWN head (not the global head)
    local2 = [reference_sgd({**body1, **part(local[c], HEAD)}, ce_grad(_mlp(x), x[p], y[p]), 1, LR, MOM, WD)
              for c, p in enumerate(parts)]
    close(part(global2, BODY), {k: (4 * local2[0][k] + 8 * local2[1][k]) / 12 for k in BODY})
    for c in (0, 1):
        close(heads2[c], part(local2[c], HEAD))
    # the same step from the global head would give another model: the test sees the difference
    from_global = reference_sgd({**body1, **part(w0, HEAD)}, ce_grad(_mlp(x), x[parts[0]], y[parts[0]]), 1,
                                LR, MOM, WD)
    assert not torch.allclose(from_global["head.weight"], heads2[0]["head.weight"], atol=1e-4)


def _mlp(x, classes=3):
    from fl_lightning.data.datasets import DataSpec
    from fl_lightning.models import build_model
    return build_model("mlp", DataSpec(classes, x.shape[1], x.shape[-1]))


# ---- uploads, global head, per-client heads ------------------------------------------------------
@pytest.mark.parametrize("cls", [RecFedPer, RecFedRep])
def test_upload_is_body_only_global_head_fixed_heads_personal(cls):
    torch.manual_seed(0)
    x, y = toy_data(n=40, size=4, num_classes=4)
    # 14/13/13 samples: weights under which averaging identical float tensors is not exact
    dm = fixed_parts_module(x, y, [range(0, 14), range(14, 27), range(27, 40)], batch_size=7, local_epochs=2)
    kw = {"head_epochs": 1, "body_epochs": 1} if cls is RecFedRep else {}
    method = cls(model="mlp", lr=0.5, data_spec=dm.spec, **kw)
    w0 = params(method.model)
    fit(method, dm, rounds=3)
    assert len(method.uploads) == 3
    for uploads in method.uploads:
        assert [u.client for u in uploads] == [0, 1, 2]
        assert [u.num_samples for u in uploads] == [14, 13, 13]
        for u in uploads:
            assert set(u.weights) == BODY  # the head never leaves the client
    # the last round's global body is the sample-weighted average of the uploaded bodies
    last = method.uploads[-1]
    expected = {k: sum(u.num_samples * u.weights[k] for u in last) / 40 for k in BODY}
    close(part(method.model.state_dict(), BODY), expected)
    assert not torch.equal(method.model.body[1].weight, w0["body.1.weight"])
    assert_same_tensors(part(method.model.state_dict(), HEAD), part(w0, HEAD))  # bit for bit
    assert set(method.client_states) == {0, 1, 2}
    for c in range(3):
        assert set(method.client_states[c]) == {f"model.{k}" for k in HEAD}  # the head, and only it
        assert method.client_states[c]["model.head.weight"].device.type == "cpu"
        assert not torch.equal(method.client_state(c, "model.")["head.weight"], w0["head.weight"])
    assert not torch.allclose(method.client_state(0, "model.")["head.weight"],
                              method.client_state(1, "model.")["head.weight"])


# ---- FedRep's phases -----------------------------------------------------------------------------
class PhaseSpy(FedRep):
    """Records the phase of every step and the model state at every phase boundary."""

    def client_start(self, client, num_samples):
        super().client_start(client, num_samples)
        self.log_ = getattr(self, "log_", [])
        self.log_.append({"client": client, "start": params(self.model), "steps": [], "ends": [],
                          "mid_body_buffers": None})

    def after_optimizer_step(self):
        super().after_optimizer_step()
        rec = self.log_[-1]
        rec["steps"].append(self.phase)
        if self.phase == "head" and rec["mid_body_buffers"] is None:
            rec["mid_body_buffers"] = self.model.body[2].running_mean.detach().clone()

    def end_phase(self):
        phase = self.phase
        super().end_phase()
        self.log_[-1]["ends"].append((phase, params(self.model)))


def test_fedrep_phases_freeze_the_other_part_bit_for_bit_with_configured_step_counts():
    torch.manual_seed(0)
    x, y = toy_data(n=16, size=4, num_classes=3)
    # 10 samples / batch 4 = 3 batches per epoch, 6 samples = 2 batches per epoch
    dm = fixed_parts_module(x, y, [range(10), range(10, 16)], batch_size=4, local_epochs=3)
    method = PhaseSpy(model="test_bn_mlp", lr=0.5, head_epochs=2, body_epochs=1, data_spec=dm.spec)
    fit(method, dm, rounds=2)
    keys = list(method.model.state_dict())
    body = [k for k in keys if k.startswith("body.")]
    assert "body.2.running_mean" in body and "body.2.num_batches_tracked" in body
    head = sorted(HEAD)
    assert len(method.log_) == 4
    for rec in method.log_:
        per_epoch = 3 if rec["client"] == 0 else 2
        assert rec["steps"] == ["head"] * 2 * per_epoch + ["body"] * 1 * per_epoch
        (p1, after_head), (p2, after_body) = rec["ends"]
        assert (p1, p2) == ("head", "body")
        # head phase: the body (parameters AND BN buffers) is the round-start global body
        assert_same_tensors(part(after_head, body), part(rec["start"], body))
        # ... although its forward passes did move the running statistics, which were put back
        assert not torch.equal(rec["mid_body_buffers"], rec["start"]["body.2.running_mean"])
        assert not torch.equal(after_head["head.weight"], rec["start"]["head.weight"])  # head trained
        # body phase: the head is the one the head phase ended with
        assert_same_tensors(part(after_body, head), part(after_head, head))
        assert not torch.equal(after_body["body.1.weight"], after_head["body.1.weight"])  # body trained
    # a client's second round starts from the head its first round ended with
    first, second = method.log_[0], method.log_[2]
    assert first["client"] == second["client"] == 0
    assert_same_tensors(part(second["start"], head), part(first["ends"][1][1], head))
    assert all(p.requires_grad for p in method.model.parameters())  # nothing stays frozen


def test_fedrep_round_by_hand_head_then_body_with_fresh_momentum():
    """One client, full batch: 1 head step from the initial model, then 2 body steps (heavy ball
    from a zero buffer) with the head fixed at its new value."""
    torch.manual_seed(0)
    x, y = toy_data(n=6, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=3)
    method = FedRep(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, head_epochs=1, body_epochs=2,
                    data_spec=dm.spec)
    w0 = params(method.model)
    fit(method, dm, rounds=1)
    model = _mlp(x)
    head1 = reference_sgd(part(w0, HEAD), ce_grad(model, x, y, fixed=part(w0, BODY)), 1, LR, MOM, WD)
    body2 = reference_sgd(part(w0, BODY), ce_grad(model, x, y, fixed=head1), 2, LR, MOM, WD)
    close(method.client_state(0, "model."), head1)
    close(part(method.model.state_dict(), BODY), body2)
    # a body phase that inherited momentum, or ran all three steps, would land elsewhere
    three = reference_sgd(part(w0, BODY), ce_grad(model, x, y, fixed=head1), 3, LR, MOM, WD)
    assert not torch.allclose(three["body.1.weight"], body2["body.1.weight"], atol=1e-4)


# ---- personal_model --------------------------------------------------------------------------------
def _shard_module(**kw):
    args = dict(n_train=120, n_test=60, sample_ratio=0.5, local_epochs=2, batch_size=15)
    args.update(kw)
    return learnable_shard_module(**args)


@pytest.mark.parametrize("cls", [FedPer, FedRep])
def test_personal_model_is_global_body_plus_own_head_and_changes_nothing(cls):
    torch.manual_seed(0)
    dm = _shard_module(sample_ratio=0.25)  # one client per round: some clients never train
    kw = {"head_epochs": 1, "body_epochs": 1} if cls is FedRep else {}
    method = cls(model="mlp", lr=0.1, data_spec=dm.spec, **kw)
    initial_head = part(method.model.state_dict(), HEAD)
    fit(method, dm, rounds=2)
    trained = set(method.client_states)
    assert 0 < len(trained) < 4
    global_before = params(method.model)
    states_before = {c: dict(s) for c, s in method.client_states.items()}
    x, _ = next(iter(dm.client_loader(0, "test")))  # (iterating a DataLoader draws from the RNG)
    rng = torch.get_rng_state()
    for c in range(4):
        own = method.personal_model(c)
        assert own is not method.model
        head = method.client_state(c, "model.") if c in trained else initial_head
        assert_same_tensors(own.state_dict(), {**part(global_before, BODY), **head})
        with torch.no_grad():
            expected = F.linear(method.model.features(x), head["head.weight"], head["head.bias"])
            assert torch.equal(own(x), expected)
            own.head.weight.add_(1.0)  # a new module: changing it changes nothing of the method
    assert_same_tensors(params(method.model), global_before)
    assert method.client_states.keys() == states_before.keys()
    for c in states_before:
        assert_same_tensors(method.client_states[c], states_before[c])
    assert torch.equal(torch.get_rng_state(), rng)


def test_own_personal_models_are_evaluated_and_do_not_change_training():
    finals = []
    for enabled in (False, True):
        torch.manual_seed(0)
        dm = _shard_module()
        method = FedRep(model="mlp", lr=0.1, head_epochs=1, body_epochs=1, data_spec=dm.spec)
        cb = PersonalizationCallback(enabled=enabled, epochs=[0], every_n_rounds=1)
        fit(method, dm, rounds=2, callbacks=[cb])
        finals.append((params(method.model), heads(method)))
    assert_same_tensors(finals[0][0], finals[1][0])
    for c in finals[0][1]:
        assert_same_tensors(finals[0][1][c], finals[1][1][c])
    # own accuracy of client k = accuracy of the global body + head k on k's test set
    dm.setup()
    for c in range(4):
        idx = dm.client_test_parts[c]
        xt = torch.stack([dm.test_set[i][0] for i in idx])
        yt = torch.tensor([dm.test_set[i][1] for i in idx])
        head = method.personal_state(c)
        with torch.no_grad():
            pred = F.linear(method.model.features(xt), head["head.weight"], head["head.bias"]).argmax(1)
        assert cb.per_client["own"][c] == pytest.approx(float((pred == yt).float().mean()))
    assert cb.results["personal/own_acc_mean"] == pytest.approx(np.mean(cb.per_client["own"]))


# ---- resume ----------------------------------------------------------------------------------------
def _build(cls):
    def build(seed):
        torch.manual_seed(seed)
        dm = four_clients()
        kw = {"head_epochs": 1, "body_epochs": 1} if cls is FedRep else {}
        return cls(model="mlp", data_spec=dm.spec, **kw), dm
    return build


@pytest.mark.parametrize("cls", [FedPer, FedRep])
def test_resume_equals_uninterrupted_including_heads(cls, tmp_path):
    # the resumed instance has another init: the global head too must come from the checkpoint
    straight, _, resumed = straight_and_resumed(_build(cls), tmp_path)
    assert len(straight.client_states) >= 3
    assert_same_run(straight, resumed)


# ---- bad input ---------------------------------------------------------------------------------------
def test_bad_options_fail_with_one_line():
    x, y = toy_data(n=6, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=3)
    for kw in ({"head_epochs": -1}, {"body_epochs": 0}, {"personal_layers": ["nope"]},
               {"personal_layers": ["head", "body"]}, {"constraint": "joint"}):
        with pytest.raises(FLUserError) as err:
            FedRep(model="mlp", data_spec=dm.spec, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(FLUserError, match=r"data.local_epochs must be 10 \+ 1 = 11, got 3"):
        fit(FedRep(model="mlp", data_spec=dm.spec), dm)
