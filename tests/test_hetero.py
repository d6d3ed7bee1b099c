"""Model-heterogeneous clients: group assignment and the common feature size K, a short HMG3 run
on offline data with per-client evaluation, resume bringing every client's own model back, and the
incomplete last batch (BatchNorm on 1x1 maps) being dropped."""

import copy

import lightning as L
import pytest
import torch
import torchvision.models as tvm
from fl_test_utils import register_tensors

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.data.datasets import DataSpec, load_dataset
from fl_lightning.errors import FLUserError
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedORGP, FedProto
from fl_lightning.models.hetero import MODEL_GROUPS, build_client_models, client_architecture

EXPECTED_TYPES = {
    "googlenet": tvm.GoogLeNet,
    "mobilenet_v2": tvm.MobileNetV2,
    "densenet121": tvm.DenseNet,
    "efficientnet_b0": tvm.EfficientNet,
}
RESNET_BLOCKS = {
    "resnet18": [2, 2, 2, 2],
    "resnet34": [3, 4, 6, 3],
    "resnet50": [3, 4, 6, 3],
    "resnet101": [3, 4, 23, 3],
    "resnet152": [3, 8, 36, 3],
}


def test_group_assignment_is_client_mod_group_size():
    assert MODEL_GROUPS["HMG8"] == MODEL_GROUPS["HMG3"] + MODEL_GROUPS["HMG5"]
    assert MODEL_GROUPS["HMG10"] == MODEL_GROUPS["HMG8"] + ("densenet121", "efficientnet_b0")
    for group, members in MODEL_GROUPS.items():
        for client in range(23):
            assert client_architecture(group, client) == members[client % len(members)]
    with pytest.raises(FLUserError, match="unknown model group"):
        client_architecture("HMG4", 0)


def test_every_hmg10_model_has_the_common_feature_size():
    torch.manual_seed(0)
    spec, k = DataSpec(10, 3, 32), 64
    models = build_client_models("HMG10", spec, k, 10)
    x = torch.randn(2, 3, 32, 32)
    for client, model in enumerate(models):
        name = MODEL_GROUPS["HMG10"][client]
        if name in EXPECTED_TYPES:
            assert isinstance(model.body, EXPECTED_TYPES[name]), name
        elif name in RESNET_BLOCKS:
            assert isinstance(model.body, tvm.ResNet), name
            assert [
                len(model.body.layer1),
                len(model.body.layer2),
                len(model.body.layer3),
                len(model.body.layer4),
            ] == RESNET_BLOCKS[name]
        model.eval()
        with torch.no_grad():
            feats = model.features(x)
            logits = model(x)
        assert feats.shape == (2, k), name
        assert logits.shape == (2, 10), name
        assert model.head.in_features == k and model.head.out_features == 10


def _digits_hmg3(num_clients=3, samples=240):
    """The first `samples` of scikit-learn's 8x8 digits (offline), upsampled to 3x32x32 by the data module."""
    train, _ = load_dataset("digits", seed=0)
    xs, ys = zip(*(train[i] for i in range(samples)), strict=True)
    name = register_tensors(torch.stack(xs), torch.tensor(ys), num_classes=10)
    return FederatedDataModule(
        dataset=name,
        num_clients=num_clients,
        sample_ratio=1.0,
        local_epochs=1,
        batch_size=32,
        partition="pathological",
        classes_per_client=4,
        client_test_fraction=0.25,
        resize=32,
        to_rgb=True,
    )


def _trainer(rounds, **kw):
    return L.Trainer(
        max_epochs=rounds,
        reload_dataloaders_every_n_epochs=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[FederatedCallback()],
        **kw,
    )


def test_two_rounds_hmg3_on_upsampled_digits():
    torch.manual_seed(0)
    dm = _digits_hmg3()
    method = FedORGP(model="HMG3", feature_dim=64, data_spec=dm.spec)
    trainer = _trainer(2, enable_checkpointing=False)
    trainer.fit(method, dm)
    assert [type(m.body).__name__ for m in method.client_models] == [
        "_FeaturesOf",
        "GoogLeNet",
        "MobileNetV2",
    ]
    assert all(p.device.type == "cpu" for m in method.client_models for p in m.parameters())
    m = trainer.callback_metrics
    acc = float(m["clients/test_acc"])
    # accuracy is total correct / total over the clients' own test splits
    test_sizes = [len(p) for p in dm.client_test_parts]
    assert 0.0 <= acc <= 1.0 and abs(acc * sum(test_sizes) - round(acc * sum(test_sizes))) < 1e-6
    assert float(m["clients/best_test_acc"]) >= acc
    # published with the round's other values, as the shared-model methods publish theirs, not
    # through Lightning's per-step logging (a path of its own)
    assert "clients/test_acc" not in trainer.logged_metrics and "global/test_acc" not in m
    assert 0 < float(m["protos/inter_abs_cos"]) < 1 and -1 < float(m["protos/intra_cos"]) <= 1 + 1e-6
    assert bool(method.has_proto.all())


def test_resume_restores_every_client_model(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, 32, 32, generator=g)
    y = torch.arange(48) % 4
    name = register_tensors(x, y, num_classes=4)

    def datamodule():
        return FederatedDataModule(
            dataset=name,
            num_clients=3,
            sample_ratio=1.0,
            local_epochs=1,
            batch_size=8,
            partition="iid",
            client_test_fraction=0.25,
        )

    def method(dm):
        torch.manual_seed(0)
        return FedORGP(model="HMG3", feature_dim=32, lambda_c=1.0, data_spec=dm.spec)

    dm = datamodule()
    full = method(dm)
    _trainer(2, enable_checkpointing=False).fit(full, dm)

    dm = datamodule()
    first = method(dm)
    trainer = _trainer(1, enable_checkpointing=False)
    trainer.fit(first, dm)
    ckpt = tmp_path / "round1.ckpt"
    trainer.save_checkpoint(ckpt)

    dm = datamodule()
    resumed = method(dm)
    torch.manual_seed(123)  # a different RNG state must not matter
    resumed.build_client_models(3)  # fresh weights, to be overwritten by the checkpoint
    resumed.on_load_checkpoint(torch.load(ckpt, weights_only=True))
    for a, b in zip(first.client_models, resumed.client_models, strict=True):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb), ka

    dm = datamodule()
    resumed = method(dm)
    _trainer(2, enable_checkpointing=False).fit(resumed, dm, ckpt_path=ckpt)
    for a, b in zip(full.client_models, resumed.client_models, strict=True):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb), ka
    torch.testing.assert_close(full.global_protos, resumed.global_protos, rtol=0, atol=0)


def test_resize_and_to_rgb_reshape_offline_images():
    dm = FederatedDataModule(
        dataset="digits", num_clients=4, partition="iid", client_test_fraction=0.25, resize=32, to_rgb=True
    )
    assert (dm.spec.in_channels, dm.spec.image_size) == (3, 32)
    dm.setup()
    x, y = dm.train_set[0]
    assert x.shape == (3, 32, 32) and torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    raw, _ = load_dataset("digits", seed=0)
    up = torch.nn.functional.interpolate(
        raw[0][0][None], size=(32, 32), mode="bilinear", align_corners=False
    )[0, 0]
    torch.testing.assert_close(x[0], up)
    xb, _ = next(iter(dm.client_loader(0, "test")))
    assert xb.shape[1:] == (3, 32, 32)
    with pytest.raises(FLUserError, match="resize"):
        FederatedDataModule(dataset="digits", resize=0)


@pytest.mark.parametrize("d", [1.0, 0.1, 1e-3, 0.0])
def test_train_mode_batchnorm_over_two_values(d):
    """Why a 2-sample batch breaks MobileNetV2 on 32x32 (1x1 maps): BatchNorm over the two values
    m +- d outputs +-d / sqrt(d^2 + eps), i.e. +-1 whatever the input once d >> sqrt(eps), so the
    true gradient is 0; autograd returns the eps term, (g1 - g2) eps / (2 (d^2 + eps)^1.5), which
    is 1 / (2 sqrt(eps)) ~ 158 per unit of g when the two values (nearly) coincide (a dead ReLU)."""
    eps = 1e-5
    bn = torch.nn.BatchNorm1d(1, eps=eps, affine=False).double().train()
    x = torch.tensor([[0.7 + d], [0.7 - d]], dtype=torch.float64, requires_grad=True)
    out = bn(x)
    expected = d / (d * d + eps) ** 0.5
    torch.testing.assert_close(out.detach(), torch.tensor([[expected], [-expected]], dtype=torch.float64))
    g = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, x, g)
    slope = eps / (d * d + eps) ** 1.5  # d out_1 / d d
    torch.testing.assert_close(grad, torch.tensor([[slope], [-slope]], dtype=torch.float64))
    if d <= 1e-3:
        assert float(grad[0]) > 100.0  # x 100 per BatchNorm layer: ~50 of them in MobileNetV2
    if d >= 0.1:
        assert float(grad[0]) < 1e-2


def test_incomplete_last_batch_is_dropped():
    """The HMG3 demo's MobileNetV2 client once hit NaN on a batch of 2: a client with 34 training
    samples and batch 32 trains exactly one step, on the first full batch of its seeded order, as
    HtFLlib's drop_last=True does; the 2-sample tail, whose gradient is ~1e4 times larger, is not
    trained on."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(45) % 2
    x = torch.randn(45, 3, 32, 32, generator=g) + y.view(-1, 1, 1, 1)
    name = register_tensors(x, y, num_classes=2)
    dm = FederatedDataModule(dataset=name, num_clients=1, sample_ratio=1.0, local_epochs=1, batch_size=32,
                             partition="iid", min_size=1, client_test_fraction=0.25)
    dm.setup()
    assert len(dm.client_parts[0]) == 34
    torch.manual_seed(0)
    method = FedProto(model="mobilenet_v2", feature_dim=64, lr=0.01, data_spec=dm.spec)
    method.build_client_models(1)
    start = copy.deepcopy(method.client_models[0]).train()
    _trainer(1, enable_checkpointing=False).fit(method, dm)

    full, tail = dm.plan_round(0).clients[0].batches
    assert (len(full), len(tail)) == (32, 2)

    def step(model, idx):
        xb, yb = torch.stack([dm.train_set[i][0] for i in idx]), torch.tensor([dm.train_set[i][1] for i in idx])
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()  # round 1: no prototypes yet
        norm = sum(float(p.grad.norm()) ** 2 for p in model.parameters()) ** 0.5
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        return norm

    reference = copy.deepcopy(start)
    full_norm = step(reference, full)
    trained = method.client_models[0].state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # guard: the dropped batch is the one that blows up
    assert step(copy.deepcopy(reference), tail) > 1e3 * full_norm
