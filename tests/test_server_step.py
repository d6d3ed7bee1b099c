"""The method contract's server side: `server_step(uploads)` returns a `ServerUpdate`
and changes nothing itself, for every method; the round callback applies it. The server
optimizers added on that contract (FedAvgM, FedAdam, FedYogi, FedAdagrad) against their papers'
update written out by hand, and FedBN's BatchNorm layers staying with their clients."""

from __future__ import annotations

import inspect
import math

import lightning as L
import pytest
import torch
from fl_test_utils import fit, fixed_parts_module, one_client_module, params, server_round, toy_data

from fl_lightning import methods
from fl_lightning.errors import FLUserError
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAdagrad, FedAdam, FedAvgM, FedBN, FedYogi
from fl_lightning.methods.base import FederatedMethod
from fl_lightning.uploads import ClientUpload, ServerUpdate

CONCRETE = sorted(n for n in methods.__all__ if inspect.isclass(c := getattr(methods, n))
                  and issubclass(c, FederatedMethod) and not inspect.isabstract(c))


def _kwargs(name: str) -> dict:
    if issubclass(getattr(methods, name), methods.HeteroMethod):
        kw = {"model": "mlp,mlp", "feature_dim": 8}
        if name in ("FML", "FedKD"):
            kw["shared_model"] = "mlp"
        return kw
    kw = {"model": "mlp_bn" if name == "FedBN" else "mlp"}
    if name == "FedRep":
        kw.update(head_epochs=1, body_epochs=1)
    return kw


class StepSpy(FederatedCallback):
    """The round callback, checking around every server step that the step changed nothing: the
    module's state_dict and every client's stored state are the same before and after it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        real = pl_module.server_step

        def checked(uploads):
            before = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            clients = {c: {k: v.clone() for k, v in pl_module.client_states[c].items()}
                       for c in pl_module.client_states}
            update = real(uploads)
            assert isinstance(update, ServerUpdate)
            after = pl_module.state_dict()
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            assert not changed, f"{type(pl_module).__name__}.server_step changed {changed[:3]}"
            for c, state in clients.items():
                assert all(torch.equal(v, pl_module.client_states[c][k]) for k, v in state.items())
            self.steps += 1
            return update

        pl_module.server_step = checked
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            del pl_module.server_step


@pytest.mark.parametrize("name", CONCRETE)
def test_every_methods_server_step_returns_its_result_and_changes_nothing(name):
    torch.manual_seed(0)
    x, y = toy_data(n=48, size=4, num_classes=3)
    kw = {"local_epochs": 2} if name == "FedRep" else {}
    dm = one_client_module(x, y, num_clients=4, sample_ratio=0.5, batch_size=6, client_test_fraction=0.25, **kw)
    method = getattr(methods, name)(data_spec=dm.spec, lr=0.05, **_kwargs(name))
    spy = StepSpy(eval_local_models=False)
    spy.steps = 0
    trainer = L.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, callbacks=[spy])
    trainer.fit(method, dm)
    assert spy.steps == 2 and spy.record.outcome.value == "finished"


# ---- server optimizers: hand-computed steps ------------------------------------------------------
def _two_uploads(method, shifts=(0.5, -0.25), sizes=(10, 30)):
    """Two clients whose models are the global model shifted by a constant (their uploads)."""
    g = method.global_weights
    return [ClientUpload(c, n, {"weights": {k: v + s if torch.is_floating_point(v) else v for k, v in g.items()}})
            for c, (s, n) in enumerate(zip(shifts, sizes, strict=True))]


def _setup(cls, **kw):
    x, y = toy_data(n=8, size=4)
    dm = one_client_module(x, y)
    method = cls(model="mlp", data_spec=dm.spec, **kw)
    method.round_start(0, [0, 1])
    return method


def test_fedavgm_is_server_momentum_on_the_average_update():
    method = _setup(FedAvgM, server_momentum=0.9, server_lr=1.0)
    w0 = params(method.model)
    delta = 0.25 * 0.5 + 0.75 * -0.25  # sample-weighted average shift: -0.0625
    server_round(method, _two_uploads(method))
    u1 = delta  # u_0 = beta * 0 + delta
    for k, v in method.model.state_dict().items():
        torch.testing.assert_close(v, w0[k] + u1)
    method.round_start(1, [0, 1])
    server_round(method, _two_uploads(method))
    u2 = 0.9 * u1 + delta
    for k, v in method.model.state_dict().items():
        torch.testing.assert_close(v, w0[k] + u1 + u2)  # momentum carried between rounds
    assert all(torch.allclose(m, torch.full_like(m, u2)) for m in method.server["momentum"].values())


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
def test_adaptive_server_step_follows_algorithm_2(cls):
    """Two rounds of Reddi et al.'s Algorithm 2 written out per coordinate (every coordinate sees
    the same update here, so scalars suffice): m, v and the step, with v_{-1} = tau^2."""
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    kw = dict(server_lr=eta, beta2=b2, tau=tau) | ({} if cls is FedAdagrad else dict(beta1=b1))
    method = _setup(cls, **kw)
    b1 = method.hparams.beta1  # FedAdagrad: 0, no momentum
    w = params(method.model)
    m, v = 0.0, tau**2
    for round_idx, shift in enumerate((0.5, -0.25)):
        method.round_start(round_idx, [0, 1])
        uploads = _two_uploads(method, shifts=(shift, shift))
        delta = shift
        m = b1 * m + (1 - b1) * delta
        if cls is FedAdam:
            v = b2 * v + (1 - b2) * delta**2
        elif cls is FedYogi:
            v = v - (1 - b2) * delta**2 * math.copysign(1.0, v - delta**2)
        else:
            v = v + delta**2
        step = eta * m / (math.sqrt(v) + tau)
        server_round(method, uploads)
        got = method.model.state_dict()
        for name, _ in method.model.named_parameters():
            w[name] = w[name] + step
            torch.testing.assert_close(got[name], w[name], rtol=1e-5, atol=1e-6)
        for name in method.server["v"]:
            torch.testing.assert_close(method.server["v"][name], torch.full_like(w[name], v), rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(method.server["m"][name], torch.full_like(w[name], m), rtol=1e-5, atol=1e-9)


def test_yogi_moves_v_by_a_step_that_does_not_grow_with_v():
    """Where v is far above Delta^2, Adam shrinks it by (1 - beta2) v, Yogi only by (1 - beta2) Delta^2."""
    adam, yogi = _setup(FedAdam, tau=1.0), _setup(FedYogi, tau=1.0)
    v, d2 = torch.tensor(100.0), torch.tensor(1.0)
    assert float(adam.second_moment(v, d2)) == pytest.approx(0.99 * 100 + 0.01)
    assert float(yogi.second_moment(v, d2)) == pytest.approx(100 - 0.01)


def test_bad_server_optimizer_options_are_refused():
    with pytest.raises(FLUserError, match="beta1"):
        _setup(FedAdam, beta1=1.0)
    with pytest.raises(FLUserError, match="tau"):
        _setup(FedYogi, tau=0.0)
    with pytest.raises(FLUserError, match="server_momentum"):
        _setup(FedAvgM, server_momentum=1.5)


# ---- FedBN ---------------------------------------------------------------------------------------
BN = {"body.2.weight", "body.2.bias", "body.2.running_mean", "body.2.running_var", "body.2.num_batches_tracked"}


def test_fedbn_keeps_batchnorm_local_and_averages_the_rest():
    """Two clients, one round: the global model's BatchNorm entries are the initial ones, every
    other entry is the sample-weighted average of the clients' (FedAvg), and each client keeps
    exactly its own BatchNorm layer, which it starts from in its next round."""
    torch.manual_seed(0)
    x, y = toy_data(n=24, size=4, num_classes=3)
    x[12:] += 2.0  # the clients' feature distributions differ (FedBN's setting)
    dm = fixed_parts_module(x, y, [list(range(12)), list(range(12, 24))], batch_size=6)
    method = FedBN(model="mlp_bn", lr=0.1, data_spec=dm.spec)
    assert set(method.personal) == BN
    w0 = params(method.model)
    uploads = []
    step = method.server_step
    method.server_step = lambda ups: (uploads.extend(ups), step(ups))[1]
    fit(method, dm, rounds=1)
    assert all(set(u.weights).isdisjoint(BN) for u in uploads)  # BatchNorm never leaves a client
    kept = {u.client: method.client_state(u.client, "model.") for u in uploads}
    assert set(kept[0]) == BN and not torch.equal(kept[0]["body.2.running_mean"], kept[1]["body.2.running_mean"])
    got = params(method.model)
    for k in BN:
        assert torch.equal(got[k], w0[k])  # the server never changes the global BatchNorm
    n = {u.client: u.num_samples for u in uploads}
    for k in set(got) - BN:
        avg = sum(n[u.client] * u.weights[k] for u in uploads) / sum(n.values())
        torch.testing.assert_close(got[k], avg)
    # next round, a client starts from the global shared layers and its own BatchNorm
    method.round_start(1, [0, 1])
    method.client_start(1, 12)
    for k in BN:
        assert torch.equal(method.model.state_dict()[k], kept[1][k])
    personal = method.personal_model(0).state_dict()
    assert all(torch.equal(personal[k], kept[0][k]) for k in BN)


def test_fedbn_refuses_a_model_without_batchnorm():
    x, y = toy_data(n=8, size=4)
    dm = one_client_module(x, y)
    with pytest.raises(FLUserError, match="FedBN keeps BatchNorm layers local, but model 'mlp' has none"):
        FedBN(model="mlp", data_spec=dm.spec)


def test_a_new_method_is_found_without_any_edit_to_the_package():
    """Methods are found by walking the package: every method here is exported by name."""
    for name in ("FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedBN"):
        assert name in methods.__all__ and getattr(methods, name).__name__ == name


def test_server_state_is_one_container_in_the_state_dict():
    """Every entry of the container is in the module's state_dict, so it moves and converts with
    the module (here: to float64, as Lightning's 64-true precision does) and is checkpointed."""
    x, y = toy_data(n=8, size=4)
    method = FedAdam(model="mlp", data_spec=one_client_module(x, y).spec)
    keys = [k for k in method.state_dict() if k.startswith("server.")]
    assert {k.split(".")[1] for k in keys} == {"m", "v"}
    method.double()
    assert all(t.dtype == torch.float64 for t in method.server["v"].values())
    fresh = FedAdam(model="mlp", data_spec=one_client_module(x, y).spec).double()
    fresh.load_state_dict(method.state_dict())  # strict: the same entries
    assert all(torch.equal(fresh.server["v"][k], method.server["v"][k]) for k in method.server["v"])

