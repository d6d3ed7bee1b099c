"""On-device data: the batched crop + flip equals torchvision's per-sample transforms for the same
draws, the draws depend only on (seed, round, client), and an augmented client's mini-batches are
the reference transforms of exactly its samples, whichever clients ran before it."""

import numpy as np
import torch
import torchvision.transforms.functional as TF

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.data.datasets import DataSpec, LabelledDataset, register_dataset
from fl_lightning.data.tensors import TensorImages, client_generator, crop_flip, draw_crop_flip

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


def reference_sample(image: torch.Tensor, top: int, left: int, flip: bool, padding: int = 4) -> torch.Tensor:
    """torchvision's RandomCrop(32, padding=4) then RandomHorizontalFlip with given parameters,
    on one uint8 image, then ToTensor's /255 and Normalize."""
    h, w = image.shape[-2:]
    out = TF.crop(TF.pad(image, [padding]), top, left, h, w)
    if flip:
        out = TF.hflip(out)
    return TF.normalize(out.float().div(255), MEAN, STD)


def test_batched_crop_flip_equals_per_sample_reference():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for seed in (0, 7):
        offsets, flips = draw_crop_flip(64, 4, client_generator(seed, 3, 11), "cpu")
        got = TensorImages(images, torch.zeros(64, dtype=torch.long), MEAN, STD).finish(
            crop_flip(images, offsets, flips, 4))
        for i in range(64):
            top, left = int(offsets[i, 0]), int(offsets[i, 1])
            assert torch.equal(got[i], reference_sample(images[i], top, left, bool(flips[i]))), i


def test_draws_depend_only_on_seed_round_and_client_and_cover_every_crop():
    def draws(seed, round_idx, client):
        return draw_crop_flip(4096, 4, client_generator(seed, round_idx, client), "cpu")

    a = draws(0, 1, 2)
    torch.randint(0, 10, (100,))  # global RNG use in between changes nothing
    b = draws(0, 1, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for other in [(1, 1, 2), (0, 2, 2), (0, 1, 3)]:
        assert not torch.equal(draws(*other)[0], a[0])
    offsets, flips = a
    assert set(offsets.flatten().tolist()) == set(range(9))  # every shift of padding 4
    assert 0.45 < flips.float().mean() < 0.55


def test_augmented_client_batches_are_the_reference_transforms_of_its_own_samples():
    n = 40
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    labels = np.arange(n) % 10

    def build(request):
        train = TensorImages(images, torch.as_tensor(labels), MEAN, STD, augment=True)
        test = TensorImages(images, torch.as_tensor(labels), MEAN, STD)
        return (LabelledDataset(None, labels, lambda: train), LabelledDataset(None, labels, lambda: test))

    register_dataset("augmented_toy", DataSpec(10, 3, 32), build)
    dm = FederatedDataModule(dataset="augmented_toy", num_clients=4, sample_ratio=1.0, local_epochs=2,
                             batch_size=4, partition="iid", min_size=1, seed=5)
    dm.setup()
    plan = dm.plan_round(3)
    forward = {w.client: list(dm.minibatches(w)) for w in plan.clients}
    backward = {w.client: list(dm.minibatches(w)) for w in reversed(plan.clients)}
    for work in plan.clients:
        generator = client_generator(5, 3, work.client)
        for (x, y), (x2, _), idx in zip(forward[work.client], backward[work.client], work.batches, strict=True):
            assert torch.equal(x, x2)  # independent of the order clients run in
            offsets, flips = draw_crop_flip(len(idx), 4, generator, "cpu")
            expected = torch.stack([reference_sample(images[i], int(o[0]), int(o[1]), bool(f))
                                    for i, o, f in zip(idx, offsets, flips, strict=True)])
            assert torch.equal(x, expected) and torch.equal(y, torch.as_tensor(labels[idx]))


def test_a_clients_batches_are_its_epochs_own_samples_whether_gathered_at_once_or_per_epoch(monkeypatch):
    """One gather for all local epochs (GATHER_ONCE_BYTES) gives the same mini-batches as one per
    epoch: each epoch's last, smaller batch stays in its epoch (7 samples in batches of 3: 3, 3, 1
    per epoch, never a batch across two epochs)."""
    import fl_lightning.data.datamodule as datamodule

    n = 14
    images = torch.arange(n * 4, dtype=torch.float32).view(n, 1, 2, 2)
    labels = np.arange(n) % 10

    def build(request):
        tensors = TensorImages(images, torch.as_tensor(labels))
        return (LabelledDataset(None, labels, lambda: tensors), LabelledDataset(None, labels, lambda: tensors))

    register_dataset("float_toy", DataSpec(10, 1, 2), build)
    dm = FederatedDataModule(dataset="float_toy", num_clients=2, sample_ratio=1.0, local_epochs=3,
                             batch_size=3, partition="iid", min_size=1, seed=1)
    dm.setup()
    work = dm.plan_round(0).clients[0]
    assert work.num_samples == 7 and work.num_steps == 9
    gathers = []
    take = TensorImages.take
    monkeypatch.setattr(TensorImages, "take", lambda self, idx: gathers.append(len(idx)) or take(self, idx))
    at_once = list(dm.minibatches(work))
    monkeypatch.setattr(datamodule, "GATHER_ONCE_BYTES", 7 * 3 * 16 - 1)  # one byte short of 3 epochs
    per_epoch = list(dm.minibatches(work))
    assert gathers == [21, 7, 7, 7]
    for batches in (at_once, per_epoch):
        assert [len(y) for _, y in batches] == [3, 3, 1] * 3
        for (x, y), idx in zip(batches, work.batches, strict=True):
            assert torch.equal(x, images[idx]) and torch.equal(y, torch.as_tensor(labels[idx]))
