"""FedGen: the upload, the generator's server objective, the clients' augmented loss, and resume."""

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from fl_test_utils import fit, fixed_parts_module, toy_data
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.methods import FedGen
from fl_lightning.methods.hetero.fedgen import diversity_loss, label_counts
from fl_lightning.uploads import ClientUpload

NOISE_DIM = 8


def _datamodule():
    x, y = toy_data(n=24, channels=1, size=4, num_classes=3)  # y = 0, 1, 2, 0, 1, 2, ...
    idx = np.arange(24)
    # client 0 holds classes 0 and 1 (16 samples), client 1 class 2 and two samples of class 1
    parts = [idx[y.numpy() != 2], np.concatenate([idx[y.numpy() == 2], idx[y.numpy() == 1][:2]])]
    return fixed_parts_module(x, y, parts, num_classes=3, client_test_fraction=0.25), x, y


def _fedgen(dm, **kw):
    torch.manual_seed(0)
    kw = dict(model="mlp", feature_dim=16, noise_dim=NOISE_DIM, hidden_dim=12, lr=0.1, **kw)
    method = FedGen(data_spec=dm.spec, **kw)
    method.build_client_models(dm.num_clients)
    uploads = []
    step = method.server_step
    method.server_step = lambda ups: (uploads.extend(ups), step(ups))[1]
    return method, uploads


def test_upload_is_the_head_and_label_counts_and_heads_are_averaged_by_samples():
    dm, x, y = _datamodule()
    method, uploads = _fedgen(dm)
    assert not bool(method.server["generator_trained"])
    fit(method, dm, rounds=1)
    assert all(set(u.groups) == {"head", "label_counts"} and set(u.group("head")) == {"weight", "bias"}
               for u in uploads)
    for u in uploads:
        expected = np.bincount(y.numpy()[dm.client_parts[u.client]], minlength=3)
        assert label_counts(u).tolist() == expected.tolist()
        assert method.server["client_label_counts"][u.client].tolist() == expected.tolist()
    n = [u.num_samples for u in uploads]
    for key in ("weight", "bias"):
        expected = sum(u.group("head")[key] * w for u, w in zip(uploads, n, strict=True)) / sum(n)
        for model in method.client_models:
            torch.testing.assert_close(getattr(model.head, key).detach(), expected)
    assert bool(method.server["generator_trained"])


def _hand_made_uploads(num_classes=3, k=16):
    g = torch.Generator().manual_seed(1)
    counts = [torch.tensor([5.0, 3.0, 0.0]), torch.tensor([0.0, 1.0, 6.0])]
    return [
        ClientUpload(c, int(counts[c].sum()), {"head": {
            "weight": torch.randn(num_classes, k, generator=g),
            "bias": torch.randn(num_classes, generator=g),
        }, "label_counts": {"counts": counts[c]}})
        for c in range(2)
    ]


def test_one_generator_step_is_adam_on_the_per_label_weighted_ensemble_ce():
    dm, *_ = _datamodule()
    method, _ = _fedgen(dm, server_steps=1, server_batch_size=10, teacher_weighting="label_counts",
                        generator_lr=0.01)
    method.round_idx = 3
    uploads = _hand_made_uploads()
    reference = copy.deepcopy(method.generator)
    trained, _ = method.train_generator(uploads)  # a trained copy's state: the server step's result
    method.server.assign({"generator": trained})

    # the same draws: labels from the uploads' label distribution, then uniform noise
    rng = torch.Generator().manual_seed(method.server_seed())
    counts = torch.stack([label_counts(u) for u in uploads])
    labels = torch.multinomial(counts.sum(0), 10, replacement=True, generator=rng)
    noise = torch.rand(10, NOISE_DIM, generator=rng)
    reference.train()
    feats = reference(labels, noise)
    logits = []
    for b in range(10):  # teacher k weighs n_k^y / sum_j n_j^y for the sample's label y
        c = int(labels[b])
        row = 0
        for u in uploads:
            w = label_counts(u)[c] / counts[:, c].sum()
            row = row + w * (u.group("head")["weight"] @ feats[b] + u.group("head")["bias"])
        logits.append(row)
    loss = F.cross_entropy(torch.stack(logits), labels)
    opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    loss.backward()
    opt.step()
    for (name, a), b in zip(method.generator.state_dict().items(), reference.state_dict().values(), strict=True):
        if name == "hidden.0.bias":
            # BatchNorm cancels any shift before it, so this gradient is rounding noise, which Adam
            # normalises into a step of up to lr in either direction.
            assert (a - b).abs().max() <= 2 * 0.01 + 1e-6
            continue
        torch.testing.assert_close(a, b, msg=name)
    assert set(labels.tolist()) <= {0, 1, 2}


def test_sample_weighting_gives_every_label_the_clients_sample_shares():
    dm, *_ = _datamodule()
    method, _ = _fedgen(dm)
    uploads = _hand_made_uploads()
    counts = torch.stack([label_counts(u) for u in uploads])
    w = method.teacher_weights(uploads, counts)
    torch.testing.assert_close(w, torch.tensor([[8 / 15] * 3, [7 / 15] * 3]))
    method.hparams.teacher_weighting = "label_counts"
    w = method.teacher_weights(uploads, counts)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.75, 0.0], [0.0, 0.25, 1.0]]))


def test_training_the_generator_makes_the_ensemble_recognise_its_features():
    dm, *_ = _datamodule()
    method, _ = _fedgen(dm, server_steps=150, server_batch_size=32)
    method.round_idx = 0
    uploads = _hand_made_uploads()
    heads = [(u.group("head")["weight"], u.group("head")["bias"]) for u in uploads]
    labels = torch.arange(3).repeat(20)
    noise = torch.rand(60, NOISE_DIM, generator=torch.Generator().manual_seed(5))

    def ensemble_ce():
        method.generator.eval()
        with torch.no_grad():
            feats = method.generator(labels, noise)
            logits = sum(0.5 * F.linear(feats, w, b) for w, b in heads)  # equal sample shares: 8 vs 7
        return float(F.cross_entropy(logits, labels))

    before = ensemble_ce()
    trained, _ = method.train_generator(uploads)
    method.server.assign({"generator": trained})
    after = ensemble_ce()
    assert after < 0.1 < before, (before, after)


def test_diversity_loss_closed_form_on_two_samples():
    noise = torch.tensor([[0.0, 0.0], [1.0, 3.0]])  # mean squared difference 5
    feats = torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 4.0]])  # mean absolute difference 4/3
    # the 2x2 pair matrix has two zero diagonal entries: mean = 2 * 5 * 4/3 / 4
    expected = math.exp(-(2 * 5 * (4 / 3)) / 4)
    assert math.isclose(float(diversity_loss(noise, feats)), expected, rel_tol=1e-6)


def test_local_loss_is_plain_ce_first_then_adds_ce_on_generated_features():
    dm, x, y = _datamodule()
    method, _ = _fedgen(dm, gen_weight=0.7)
    xb, yb = x[:6], y[:6]
    model = method.client_models[1]
    method.model = model
    torch.testing.assert_close(method.loss(model, (xb, yb), method.loss_context()), F.cross_entropy(model(xb), yb))
    method.model = None

    fit(method, dm, rounds=1)
    method.train()  # as Lightning leaves the module during local training
    method.model = model
    torch.manual_seed(11)
    loss = method.loss(model, (xb, yb), method.loss_context())
    torch.manual_seed(11)
    # labels come from all clients' label distribution: client 1 also sees generated class 0
    labels = torch.multinomial(torch.tensor([8.0, 10.0, 8.0]), 6, replacement=True)
    noise = torch.rand(6, NOISE_DIM)
    method.generator.eval()
    with torch.no_grad():
        generated = method.generator(labels, noise)
    expected = F.cross_entropy(model(xb), yb) + 0.7 * F.cross_entropy(model.head(generated), labels)
    torch.testing.assert_close(loss, expected)
    method.model = None


def test_resume_restores_generator_label_counts_and_client_models(tmp_path):
    dm, *_ = _datamodule()
    full, _ = _fedgen(dm, server_steps=5)
    fit(full, dm, rounds=2)

    dm, *_ = _datamodule()
    first, _ = _fedgen(dm, server_steps=5)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_epochs=1)
    fit(first, dm, rounds=1, callbacks=[ckpt])

    dm, *_ = _datamodule()
    resumed = FedGen(model="mlp", feature_dim=16, noise_dim=NOISE_DIM, hidden_dim=12, lr=0.1,
                     server_steps=5, data_spec=dm.spec)  # fresh weights, no client models yet
    fit(resumed, dm, rounds=2, ckpt_path=tmp_path / "last.ckpt")
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(full.server["client_label_counts"], resumed.server["client_label_counts"])
    for a, b in zip(full.client_models, resumed.client_models, strict=True):
        for va, vb in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
            assert torch.equal(va, vb)
