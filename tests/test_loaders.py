"""Loaders read small files written in each library's own on-disk format; missing files fail with
one line naming what to place where. Nothing is downloaded."""

import hashlib
import pickle
import struct

import numpy as np
import pytest
import torch

from fl_lightning.data.datasets import NORMALIZATION, load_dataset
from fl_lightning.errors import FLUserError

RNG = np.random.default_rng(0)


def assert_tensors_equal_samples(ds):
    """The in-memory form (sliced on the device in training) is bit-identical to the per-sample
    transform pipeline (ToTensor + Normalize) of the same dataset."""
    tensors = ds.tensors()
    assert tensors is not None and not tensors.augment
    x, y = tensors.batch(torch.arange(len(ds)))
    for i in range(len(ds)):
        xi, yi = ds[i]
        assert torch.equal(x[i], xi) and int(y[i]) == yi


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def expected_pixel(value, name, channel=0):
    mean, std = NORMALIZATION[name]
    return (value / 255.0 - mean[channel]) / std[channel]


def test_mnist_idx_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 6), ("t10k", 4)):
        images = RNG.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())
        if prefix == "train":
            first_pixel = images[0, 0, 0]
    train, test = load_dataset("mnist", tmp_path, download=False)
    assert len(train) == 6 and len(test) == 4
    assert list(train.labels) == [0, 1, 2, 3, 4, 5]
    x, y = train[0]
    assert x.shape == (1, 28, 28) and y == 0
    assert float(x[0, 0, 0]) == pytest.approx(expected_pixel(first_pixel, "mnist"), abs=1e-5)
    assert_tensors_equal_samples(train)
    assert_tensors_equal_samples(test)


def _cifar_batch(path, n, labels_key="labels"):
    data = RNG.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    with open(path, "wb") as f:
        pickle.dump({"data": data, labels_key: list(np.arange(n) % 10)}, f)
    return data


def write_cifar10(root, monkeypatch, per_batch: int, test_size: int):
    """Five train batches, a test batch and the meta file, registered with our files' MD5 sums
    because torchvision verifies the official ones. Returns the first train batch's raw bytes."""
    from torchvision.datasets import CIFAR10

    base = root / "cifar-10-batches-py"
    base.mkdir()
    batches = [_cifar_batch(base / f"data_batch_{i}", per_batch) for i in range(1, 6)]
    _cifar_batch(base / "test_batch", test_size)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    monkeypatch.setattr(CIFAR10, "train_list",
                        [[f"data_batch_{i}", md5(base / f"data_batch_{i}")] for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5(base / "test_batch")]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names",
                                          "md5": md5(base / "batches.meta")})
    return batches[0]


def test_cifar10_pickled_batches(tmp_path, monkeypatch):
    first = write_cifar10(tmp_path, monkeypatch, per_batch=2, test_size=3)
    train, test = load_dataset("cifar10", tmp_path, download=False, augment=False)
    assert len(train) == 10 and len(test) == 3
    x, y = train[0]
    assert x.shape == (3, 32, 32) and y == 0
    # CIFAR rows are channel-major: the first 1024 bytes are the red plane
    assert float(x[0, 0, 0]) == pytest.approx(expected_pixel(first[0, 0], "cifar10"), abs=1e-5)
    assert float(x[1, 0, 0]) == pytest.approx(expected_pixel(first[0, 1024], "cifar10", 1), abs=1e-5)
    assert_tensors_equal_samples(train)
    assert_tensors_equal_samples(test)


def test_cifar10_augmentation_keeps_shape(tmp_path, monkeypatch):
    write_cifar10(tmp_path, monkeypatch, per_batch=1, test_size=1)
    train, test = load_dataset("cifar10", tmp_path, download=False, augment=True)
    torch.manual_seed(0)
    crops = {tuple(train[0][0].flatten()[:50].tolist()) for _ in range(8)}
    assert len(crops) > 1  # random crop / flip on train
    assert len({tuple(test[0][0].flatten()[:50].tolist()) for _ in range(3)}) == 1  # none on test
    assert train.tensors().augment and not test.tensors().augment  # on-device crop + flip (test_tensors.py)


def test_svhn_mat_files(tmp_path, monkeypatch):
    from scipy.io import savemat
    from torchvision.datasets import SVHN

    split_list = {}
    for split, n in (("train", 5), ("test", 2)):
        x = RNG.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        y = np.array([[10], [1], [2], [3], [4]][:n], dtype=np.uint8)  # SVHN stores digit 0 as label 10
        path = tmp_path / f"{split}_32x32.mat"
        savemat(path, {"X": x, "y": y})
        split_list[split] = ["unused-url", path.name, md5(path)]
    monkeypatch.setattr(SVHN, "split_list", split_list)
    train, test = load_dataset("svhn", tmp_path, download=False)
    assert len(train) == 5 and list(train.labels) == [0, 1, 2, 3, 4]
    assert train[0][0].shape == (3, 32, 32)
    assert_tensors_equal_samples(train)


def test_medmnist_npz(tmp_path):
    n = {"train": 5, "val": 2, "test": 3}
    arrays = {}
    for split, k in n.items():
        arrays[f"{split}_images"] = RNG.integers(0, 256, size=(k, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(k) % 9).reshape(-1, 1).astype(np.uint8)  # medmnist: shape (N, 1)
    np.savez(tmp_path / "pathmnist.npz", **arrays)
    train, test = load_dataset("pathmnist", tmp_path, download=False)
    assert len(train) == 5 and len(test) == 3
    x, y = train[1]
    assert x.shape == (3, 28, 28) and isinstance(y, int) and y == 1
    assert float(x[0, 0, 0]) == pytest.approx((arrays["train_images"][1, 0, 0, 0] / 255 - 0.5) / 0.5, abs=1e-5)
    assert_tensors_equal_samples(train)
    # grey-scale TissueMNIST is stored without a channel axis
    grey = {k: (v[..., 0] if k.endswith("images") else v) for k, v in arrays.items()}
    np.savez(tmp_path / "tissuemnist.npz", **grey)
    train, _ = load_dataset("tissuemnist", tmp_path, download=False)
    assert train[0][0].shape == (1, 28, 28)
    assert_tensors_equal_samples(train)


def test_cinic10_image_folder(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("airplane", "bird"):
            d = tmp_path / "cinic10" / split / cls
            d.mkdir(parents=True)
            Image.fromarray(RNG.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)).save(d / "0.png")
    train, test = load_dataset("cinic10", tmp_path, download=False, augment=False)
    assert len(train) == 2 and sorted(train.labels.tolist()) == [0, 1]
    assert train[0][0].shape == (3, 32, 32)
    assert train.tensors() is None  # image folders are decoded in a DataLoader, not held in memory


@pytest.mark.parametrize("name, needle", [("cifar10", "cifar-10-batches-py"), ("svhn", "train_32x32.mat"),
                                          ("pathmnist", "pathmnist.npz"), ("cinic10", "cinic10/"),
                                          ("mnist", "MNIST/raw")])
def test_missing_files_name_what_to_place_where(tmp_path, name, needle):
    with pytest.raises(FLUserError) as err:
        load_dataset(name, tmp_path, download=False)
    message = str(err.value)
    assert needle in message and str(tmp_path) in message and "\n" not in message


def test_offline_sets():
    train, test = load_dataset("mnist5k", seed=0)
    assert len(train) == 4000 and len(test) == 1000
    counts = np.bincount(test.labels, minlength=10)
    assert counts.min() >= 90 and counts.max() <= 115  # stratified: ~10% of each digit
    assert train[0][0].shape == (1, 28, 28)
    train, test = load_dataset("digits", seed=0)
    assert len(train) + len(test) == 1797 and train[0][0].shape == (1, 8, 8)
