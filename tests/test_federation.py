"""Aggregation and the round mechanics."""

import math

import lightning as L
import numpy as np
import pytest
import torch
from fl_test_utils import fit, four_clients, register_tensors, server_round, toy_data

from fl_lightning.data.datamodule import FederatedDataModule, sample_clients
from fl_lightning.federation import federation_of
from fl_lightning.methods import FedAvg
from fl_lightning.uploads import ClientUpload, RoundUploads


def test_weighted_average_equals_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, -2.0]), "n": torch.tensor(7)}
    # the uploads arrive in any order; integer buffers come from the lowest-numbered client
    ups = RoundUploads([ClientUpload(5, 30, {"weights": b}), ClientUpload(2, 10, {"weights": a})])
    out = ups.weighted_average(lambda u: u.weights)
    torch.testing.assert_close(out["w"], torch.tensor([0.25 * 1 + 0.75 * 4, 0.25 * 2 - 0.75 * 2]))
    assert out["w"].dtype == torch.float32 and list(out) == ["w", "n"]
    assert int(out["n"]) == 3  # integer buffers are not averaged


def test_the_weighted_sum_is_the_sum_of_scaled_float64_copies_to_the_bit():
    """The average adds w * v for a float32 v and an integer weight w in one pass (its product is
    exact in float64); other weights (and float64 values) scale a float64 copy first. Either way
    the sum is the one of scaled float64 copies, in client order, to the bit."""
    g = torch.Generator().manual_seed(11)
    for weights, dtype in (([57, 1_000_003, 3, 2**28 + 1], torch.float32), ([0.1, 1 / 3, 7.0, 2.5e-3], torch.float32),
                           ([57, 3, 11, 5], torch.float64), ([9, 4, 2**30 + 3, 6], torch.float32)):
        values = [torch.randn(4099, generator=g, dtype=dtype) * 10.0 ** torch.randint(-20, 20, (4099,), generator=g)
                  for _ in weights]
        ups = RoundUploads([ClientUpload(c, w, {"weights": {"v": v}})
                            for c, (w, v) in enumerate(zip(weights, values, strict=True))])
        out = ups.weighted_average(lambda u: u.weights, weight=lambda u: u.num_samples)
        expected = torch.zeros(4099, dtype=torch.float64)
        for w, v in zip(weights, values, strict=True):
            expected += v.to(torch.float64) * float(w)
        # (the total weight is summed as the weights' float32 tensors were: torch.as_tensor of a float)
        total = sum(torch.tensor(float(w), dtype=torch.float32).double() for w in weights)
        expected = (expected / float(total)).to(dtype)
        assert torch.equal(out["v"], expected), (weights, dtype)


def test_fedavg_aggregate_weights_by_sample_count():
    x, y = toy_data(n=6, size=4)
    name = register_tensors(x, y)
    dm = FederatedDataModule(dataset=name, num_clients=1, partition="iid", min_size=1)
    method = FedAvg(model="mlp", data_spec=dm.spec, server_lr=1.0)
    method.round_start(0, [0, 1])
    ups = []
    for client, n, shift in [(0, 10, 1.0), (1, 30, -3.0)]:
        ups.append(ClientUpload(client, n, {"weights": {k: v + shift for k, v in method.global_weights.items()}}))
    server_round(method, RoundUploads(ups))
    for k, v in method.model.state_dict().items():
        torch.testing.assert_close(v, method.global_weights[k] + (0.25 * 1.0 + 0.75 * -3.0))


def test_server_lr_scales_the_averaged_update():
    x, y = toy_data(n=6, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=1, partition="iid", min_size=1)
    method = FedAvg(model="mlp", data_spec=dm.spec, server_lr=0.5)
    method.round_start(0, [0])
    server_round(method, [ClientUpload(0, 5, {"weights": {k: v + 2.0 for k, v in method.global_weights.items()}})])
    for k, v in method.model.state_dict().items():
        torch.testing.assert_close(v, method.global_weights[k] + 1.0)


def test_client_sampling_is_seeded_sized_and_without_replacement():
    for n, ratio, expected in [(100, 0.1, 10), (50, 0.2, 10), (7, 0.1, 1), (10, 1.0, 10)]:
        s = sample_clients(n, ratio, seed=3, round_idx=5)
        assert len(s) == expected == len(set(s))
        assert s == sample_clients(n, ratio, seed=3, round_idx=5)
    assert sample_clients(100, 0.1, 3, 5) != sample_clients(100, 0.1, 3, 6)


def test_round_plan_covers_local_epochs_and_batches():
    x, y = toy_data(n=40, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=4, sample_ratio=0.5, local_epochs=3,
                             batch_size=4, partition="iid", min_size=1)
    dm.setup()
    plan = dm.plan_round(2)
    assert [c.client for c in plan.clients] == sample_clients(4, 0.5, 0, 2)
    assert all(c.num_steps == 3 * int(np.ceil(c.num_samples / 4)) for c in plan.clients)
    for work in plan.clients:
        batches = work.batches
        assert all(1 <= len(b) <= 4 for b in batches)
        # every local epoch is one full pass over the client's own data, in a seeded order
        per_epoch = len(batches) // 3
        for e in range(3):
            seen = np.concatenate(batches[e * per_epoch : (e + 1) * per_epoch])
            assert sorted(seen.tolist()) == dm.client_parts[work.client].tolist()
            expected = np.random.default_rng([0, 2, work.client, e]).permutation(dm.client_parts[work.client])
            assert seen.tolist() == expected.tolist()


def test_one_trainer_batch_is_one_client_with_its_minibatches_sliced_on_the_device():
    """The round's dataloader has one item per sampled client, and the client's mini-batches are
    exactly the samples its seeded order names."""
    x, y = toy_data(n=40, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=4, sample_ratio=0.5, local_epochs=2,
                             batch_size=3, partition="iid", min_size=1)
    method = FedAvg(model="mlp", data_spec=dm.spec)
    trainer = fit(method, dm, rounds=1)
    assert trainer.num_training_batches == 2  # clients, not local steps
    plan = dm.round_plan
    for work in plan.clients:
        got = list(dm.minibatches(work))
        assert len(got) == len(work.batches)
        for (xb, yb), idx in zip(got, work.batches, strict=True):
            assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx])


@pytest.mark.parametrize("model", ["mlp", "mlp_bn"])
def test_fit_runs_every_sampled_client_and_resets_momentum(monkeypatch, model):
    """Each sampled client starts from the round's global weights (batch-norm statistics too)
    with empty optimizer state."""
    x, y = toy_data(n=24, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=3, sample_ratio=1.0, local_epochs=1,
                             batch_size=8, partition="iid", min_size=1)
    method = FedAvg(model=model, data_spec=dm.spec)
    starts = []
    original = FedAvg.client_start

    def spy(self, client, n):
        original(self, client, n)
        starts.append((client, len(self.optimizers().optimizer.state),
                       all(torch.equal(v, self.global_weights[k]) for k, v in self.model.state_dict().items())))

    monkeypatch.setattr(FedAvg, "client_start", spy)
    fit(method, dm, rounds=2)
    assert [s[0] for s in starts] == [0, 1, 2, 0, 1, 2]
    assert all(n_state == 0 and fresh for _, n_state, fresh in starts)


def test_each_clients_train_loss_is_the_batch_weighted_mean_of_its_own_steps(monkeypatch):
    """clients.csv's train_loss: each client's own local steps (tail batches weigh less), in
    every round, though the means are taken when the round ends."""
    x, y = toy_data(n=30, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=3, sample_ratio=1.0, local_epochs=2,
                             batch_size=4, partition="iid", min_size=1)  # 10 samples a client: 4, 4, 2
    method = FedAvg(model="mlp", data_spec=dm.spec)
    steps = []
    original = FedAvg.minibatch_step

    def spy(self, batch):
        loss = original(self, batch)
        steps.append((self.round_idx, self.current_client, float(loss), len(batch[1])))
        return loss

    class Rows(L.Callback):
        rows = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.rows += [(pl_module.round_idx, r) for r in federation_of(trainer).round_report.clients]

    monkeypatch.setattr(FedAvg, "minibatch_step", spy)
    fit(method, dm, rounds=2, eval_local_models=True, callbacks=[Rows()])
    assert len(Rows.rows) == 6 and {len([s for s in steps if s[:2] == (r, c)]) for r in (0, 1) for c in range(3)} == {6}
    for round_idx, row in Rows.rows:
        own = [(loss, n) for r, c, loss, n in steps if (r, c) == (round_idx, row["client"])]
        assert sorted(n for _, n in own) == [2, 2, 4, 4, 4, 4]
        assert row["train_loss"] == pytest.approx(sum(v * n for v, n in own) / sum(n for _, n in own), rel=1e-12)


def test_a_client_starts_from_and_drifts_from_the_round_start_in_the_tensors_the_model_has_now():
    """A conversion that gives the module new tensors (here its batch-norm buffers, through
    .double().float()) after the round started must not leave clients loading into, or measuring,
    the old ones."""
    x, y = toy_data(n=24, size=4)
    dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=2, sample_ratio=1.0, local_epochs=1,
                             batch_size=8, partition="iid", min_size=1)
    method = FedAvg(model="mlp_bn", data_spec=dm.spec)
    fit(method, dm, rounds=1)
    method.round_start(1, [0, 1])
    buffer = next(k for k in method.global_weights if k.endswith("running_mean"))
    old = method.model.state_dict()[buffer]
    method.double().float()
    now = method.model.state_dict()[buffer]
    assert now.data_ptr() != old.data_ptr()
    now.add_(5.0)
    method.client_start(0, 12)
    assert torch.equal(method.model.state_dict()[buffer], method.global_weights[buffer])
    with torch.no_grad():
        for i, p in enumerate(method.model.parameters()):
            p.add_(0.01 * (i + 1))
    moved = {n: p.detach() - method.global_weights[n] for n, p in method.model.named_parameters()}
    expected = math.sqrt(sum(float((d.double() ** 2).sum()) for d in moved.values()))
    assert method.client_end().stats["drift"] == pytest.approx(expected, rel=1e-6)


def test_method_and_data_options_of_the_same_name_are_both_logged():
    """FedDyn's alpha and the Dirichlet alpha: Lightning used to stop the run ("Error while merging
    hparams") whenever a logger was on; now the data's options are logged under `data`."""
    from lightning.pytorch.loggers import Logger

    from fl_lightning.methods import FedDyn

    class Recorder(Logger):
        name, version, logged = "recorder", 0, []

        def log_hyperparams(self, params, *args, **kwargs):
            self.logged.append(dict(params))

        def log_metrics(self, metrics, step=None):
            pass

    x, y = toy_data(n=40, size=4, num_classes=3)
    name = register_tensors(x, y, num_classes=3)
    dm = FederatedDataModule(dataset=name, num_clients=2, partition="dirichlet", alpha=0.3, min_size=1,
                             batch_size=10, local_epochs=1)
    method = FedDyn(model="mlp", alpha=0.05, data_spec=dm.spec)
    recorder = Recorder()
    fit(method, dm, logger=recorder)
    (params,) = recorder.logged
    assert params["alpha"] == 0.05 and params["data"]["alpha"] == 0.3
    assert params["data"]["partition"] == "dirichlet"


def test_direct_steps_equal_lightning_wrapped_steps_and_count_every_step():
    """Without per-step listeners the local step bypasses Lightning's backward/step wrappers; a
    callback that listens to a per-step hook gets the wrapped path, called on every local step.
    Both give the same weights and the same global_step (= all local steps taken)."""
    import lightning as L

    class CountsBackward(L.Callback):
        def __init__(self):
            self.calls = 0

        def on_after_backward(self, trainer, pl_module):
            self.calls += 1

    results = []
    for listener in (None, CountsBackward()):
        x, y = toy_data(n=30, size=4)
        dm = FederatedDataModule(dataset=register_tensors(x, y), num_clients=3, sample_ratio=1.0, local_epochs=2,
                                 batch_size=4, partition="iid", min_size=1)
        torch.manual_seed(0)
        method = FedAvg(model="mlp", data_spec=dm.spec)
        trainer = fit(method, dm, rounds=2, callbacks=[listener] if listener else [])
        steps = sum(w.num_steps for r in range(2) for w in dm.plan_round(r).clients)
        assert method.steps.direct is (listener is None)
        assert trainer.global_step == steps
        if listener is not None:
            assert listener.calls == steps
        results.append({k: v.clone() for k, v in method.model.state_dict().items()})
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_average_is_a_reducible_weighted_sum_plus_a_finishing_step():
    """Partial float64 sums, as different processes hold them, add up to the average: a fake
    two-process collective hands each share the other share's sums and metadata."""
    g = torch.Generator().manual_seed(0)
    ups = [ClientUpload(i, n, {"weights": {"w": torch.randn(5, generator=g), "n": torch.tensor(10 + i)}})
           for i, n in enumerate([3, 1, 2, 4])]
    coef = [u.num_samples / 10 for u in ups]
    expected = sum(c * u.weights["w"].double() for c, u in zip(coef, ups, strict=True)).float()

    class Pair:  # what Collective does across two processes, for the share `mine`
        distributed, world_size = True, 2

        def __init__(self, other_share):
            self.other = RoundUploads(other_share)

        def gather(self, obj):
            if isinstance(obj, dict) and "dtypes" in obj:  # weighted_average's metadata
                u = min(self.other, key=lambda u: u.client)
                theirs = {"dtypes": {k: v.dtype for k, v in u.weights.items()},
                          "ints": (u.client, {"n": u.weights["n"]})}
            else:  # sum's schema
                theirs = obj
            return [obj, theirs]

        def sum(self, tensors):
            w = lambda u: {"\0weight": float(u.num_samples),  # noqa: E731
                           "w": u.weights["w"].double() * u.num_samples}
            other = RoundUploads(self.other).sum(w)
            return {k: v + other[k] for k, v in tensors.items()}

    for mine, theirs in ((ups[2:], ups[:2]), (ups[:2], ups[2:])):
        out = RoundUploads(mine, collective=Pair(theirs)).weighted_average(lambda u: u.weights)
        torch.testing.assert_close(out["w"], expected)
        assert int(out["n"]) == 10  # client 0's, wherever it trained
    torch.testing.assert_close(RoundUploads(ups).weighted_average(lambda u: u.weights)["w"], expected)


def test_every_group_of_an_upload_and_its_kept_state_is_checked_for_finiteness():
    from fl_lightning.uploads import all_finite

    ok = ClientUpload(0, 1, {"weights": {"w": torch.ones(2)}, "control_delta": {"w": torch.zeros(2)},
                             "prototypes": {"3": torch.ones(4)}, "local_steps": {"tau": torch.tensor(2)}},
                      kept={"c.w": torch.ones(2)})
    assert all_finite(ok)
    for group, value in [("control_delta", {"w": torch.tensor([float("nan"), 0.0])}),
                         ("prototypes", {"1": torch.tensor([float("inf")])}),
                         ("any_new_kind", {"n": torch.tensor([float("nan")])})]:
        bad = ClientUpload(0, 1, {"weights": {"w": torch.ones(2)}})
        bad.set_group(group, value)
        assert not all_finite(bad), group
    assert not all_finite(ClientUpload(0, 1, {"weights": {"w": torch.ones(2)}},
                                       kept={"c.w": torch.tensor([float("nan")])}))
    with pytest.raises(TypeError, match="tensor names must be strings"):
        ClientUpload(0, 1, {"prototypes": {3: torch.ones(4)}})
    # finite values whose sum overflows are finite; a NaN beside them, or an inf, is not
    huge = torch.tensor([3e38, 3e38, -1.0])
    assert all_finite({"w": huge}) and all_finite({"w": huge.to(torch.bfloat16)})
    assert not all_finite({"w": torch.cat([huge, torch.tensor([float("nan")])])})
    assert not all_finite({"w": torch.tensor([float("inf"), -float("inf")])})  # a sum of NaN
    # the same across tensors: finite sums whose total overflows; an inf and a -inf in two tensors
    assert all_finite({"a": torch.tensor([3e38]), "b": torch.tensor([3e38]), "c": torch.ones(2, dtype=torch.float64)})
    assert not all_finite({"a": torch.tensor([float("inf")]), "b": torch.tensor([-float("inf")])})
    assert not all_finite({"a": torch.tensor([3e38]), "b": torch.tensor([3e38, float("nan")])})
    half = torch.tensor([60000.0, 5000.0], dtype=torch.float16)  # finite; their total overflows float16
    assert all_finite({"a": half, "b": half}) and not all_finite({"a": half, "b": torch.tensor([float("nan")]).half()})


class TallyingFedAvg(FedAvg):
    """FedAvg with an upload kind of its own, defined here and nowhere else: every client also
    sends a group "tally" (its sample count, as a float tensor) that the server sums over the
    round's clients. Client 1's tally is NaN; its weights are finite."""

    def client_end(self):
        upload = super().client_end()
        n = float("nan") if upload.client == 1 else float(upload.num_samples)
        upload.set_group("tally", {"samples": torch.tensor(n), "ones": torch.ones(3)})
        self.sent.append((upload.client, upload.num_samples))
        return upload

    def server_step(self, uploads):
        sums = uploads.sum("tally")
        self.summed.append(([u.client for u in uploads], sums))
        return super().server_step(uploads)


def test_a_new_upload_group_is_summed_and_checked_for_finiteness_without_touching_the_core():
    torch.manual_seed(0)
    dm = four_clients()
    method = TallyingFedAvg(model="mlp", data_spec=dm.spec)
    method.sent, method.summed = [], []
    trainer = fit(method, dm, rounds=4, on_divergence="skip_client")
    sampled = [method.sent[2 * r: 2 * r + 2] for r in range(4)]
    assert any(c == 1 for s in sampled for c, _ in s) and any(all(c != 1 for c, _ in s) for s in sampled)
    assert len(method.summed) == 4
    for sent, (clients, sums) in zip(sampled, method.summed, strict=True):
        accepted = [(c, n) for c, n in sent if c != 1]  # the NaN tally left client 1 out of the round
        assert clients == [c for c, _ in accepted]
        assert sums["samples"].dtype == torch.float64
        assert float(sums["samples"]) == sum(n for _, n in accepted)
        assert torch.equal(sums["ones"], torch.full((3,), float(len(accepted)), dtype=torch.float64))
    assert all(torch.isfinite(p).all() for p in method.model.parameters())
    assert float(trainer.callback_metrics["clients/skipped"]) in (0.0, 1.0)
