"""The federated DataModule: a dataset, its partition over clients, and one round's batches.

One Trainer epoch is one communication round and one Trainer batch is one client: the training
dataloader of epoch r yields one `ClientWork` per client sampled in round r (its id, and the
sample indices of each of its local steps in their seeded order), and the method's
`training_step` runs that client's whole local training. Lightning rebuilds the loader each epoch
(`reload_dataloaders_every_n_epochs=1`), so its per-batch machinery is paid once per client.

Datasets that fit in memory are held as tensors on the training device (data/tensors.py) and
each local mini-batch is sliced there; image folders are decoded in a DataLoader per client.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.data import AttributeDict
from torch.utils.data import DataLoader, Dataset, Subset

from fl_lightning.data import partition as partitioners
from fl_lightning.data.datasets import DataSpec, LabelledDataset, entry_of, load_dataset, spec_of
from fl_lightning.data.tensors import TensorImages, client_generator
from fl_lightning.errors import FLUserError
from fl_lightning.parallel import assign_clients, clients_in_parallel


def clients_per_round(num_clients: int, sample_ratio: float) -> int:
    return max(int(num_clients * sample_ratio), 1)


def sample_clients(num_clients: int, sample_ratio: float, seed: int, round_idx: int) -> list[int]:
    """max(floor(N * ratio), 1) clients without replacement, seeded by (seed, round) so that a
    resumed run samples exactly the clients an uninterrupted one would."""
    k = clients_per_round(num_clients, sample_ratio)
    rng = np.random.default_rng([seed, round_idx])
    return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))


@dataclass(eq=False)  # not frozen: Lightning's precision plugins rebuild batch dataclasses field by field
class ClientWork:
    """One Trainer batch: everything a sampled client needs to run its local training.

    `orders` holds one permutation of the client's sample indices per local epoch, seeded by
    (seed, round, client, epoch); each is cut into mini-batches of `batch_size` (the last one of an
    epoch may be smaller). They are whole batches; on several devices each rank takes its share
    when it loads them.
    """

    round: int
    client: int
    num_samples: int
    orders: tuple[np.ndarray, ...]
    batch_size: int

    @property
    def batches(self) -> list[np.ndarray]:
        """The sample indices of each local step, in order."""
        b = self.batch_size
        return [order[s : s + b] for order in self.orders for s in range(0, len(order), b)]

    @property
    def num_steps(self) -> int:
        return sum(-(-len(order) // self.batch_size) for order in self.orders)


@dataclass(frozen=True)
class RoundPlan:
    round: int
    clients: tuple[ClientWork, ...]

    @property
    def num_steps(self) -> int:
        return sum(c.num_steps for c in self.clients)


def client_orders(indices: np.ndarray, seed: int, round_idx: int, client: int,
                  local_epochs: int) -> tuple[np.ndarray, ...]:
    """Each local epoch reshuffles the client's indices with a seed of (seed, round, client, epoch)."""
    return tuple(np.random.default_rng([seed, round_idx, client, epoch]).permutation(indices)
                 for epoch in range(local_epochs))


def rank_share(batch_size: int, rank: int, world_size: int) -> slice | np.ndarray:
    """The positions of a batch that one rank trains on (data parallelism inside a client)."""
    if world_size == 1:
        return slice(None)
    if batch_size < world_size:
        # A tail batch smaller than the number of ranks: every rank needs a sample, so some repeat
        # one (their gradients are averaged by DDP). Exact equivalence with one device holds when
        # batches divide evenly.
        return np.asarray([rank % batch_size])
    return slice(rank, None, world_size)


# A client's samples for all its local epochs are gathered at once up to this many bytes (an
# mnist5k client's 5 epochs: 1.6 MB), else one epoch at a time: each gather and split made after
# an epoch's steps costs far more in a run, with the caches cold after training, than in a loop
# (benchmarks/core_overhead.py (i) measures the round).
GATHER_ONCE_BYTES = 16 << 20


def _gather_groups(work: ClientWork, sample_bytes: int) -> list[tuple[np.ndarray, ...]]:
    """The client's epochs' orders, grouped by the gathers that make their mini-batches."""
    if sum(len(o) for o in work.orders) * sample_bytes <= GATHER_ONCE_BYTES:
        return [work.orders]
    return [(o,) for o in work.orders]


class _WorkItems:
    """The round's training data: one item (one Trainer batch) per client, in the plan's order.

    Lightning takes any iterable with a length as training data; this one is not a torch
    DataLoader, whose per-item bookkeeping (a profiler annotation, the sampler, the fetch and
    collate calls) every client would pay, for nothing: the batches are sliced on the device
    already (benchmarks/core_overhead.py (i) measures the round). Nothing here is loaded:
    each item is a `ClientWork`, and `minibatches` slices its batches on the device."""

    def __init__(self, plan: RoundPlan):
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan.clients)

    def __iter__(self) -> Iterator[ClientWork]:
        return iter(self.plan.clients)


class _SlicedBatches(Dataset):
    """Evaluation batches pre-sliced from tensors on the device (no per-sample collation)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        return self.batches[i]


def _no_collate(item):
    return item


class _Reshaped(Dataset):
    """Resizes (bilinear) and/or repeats grey channels on the fly, so that offline sets (8x8
    digits, 28x28 MNIST-5k) can feed ImageNet-style architectures (GoogLeNet, MobileNetV2)."""

    def __init__(self, base: Dataset, size: int | None, channels: int | None):
        self.base, self.size, self.channels = base, size, channels

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        if self.size is not None and x.shape[-1] != self.size:
            x = torch.nn.functional.interpolate(x[None], size=(self.size, self.size), mode="bilinear",
                                                align_corners=False)[0]
        if self.channels is not None and x.shape[0] != self.channels:
            x = x.expand(self.channels, -1, -1).contiguous()
        return x, y


def _reshaped(ds: LabelledDataset, size: int | None, channels: int | None) -> LabelledDataset:
    def in_memory() -> TensorImages | None:
        base = ds.tensors()
        if base is None or base.augment:  # crop and flip come before resizing: keep the DataLoader path
            return None
        chunks = []
        for start in range(0, len(base), 1024):
            x = base.finish(base.images[start : start + 1024])
            if size is not None and x.shape[-1] != size:
                x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            if channels is not None and x.shape[1] != channels:
                x = x.expand(-1, channels, -1, -1)
            chunks.append(x.contiguous())
        return TensorImages(torch.cat(chunks), base.labels)

    return LabelledDataset(_Reshaped(ds, size, channels), ds.labels, in_memory)


def _check_at_least(low: int, **options: int) -> None:
    """Refuses, in one line, the first of the data module's `options` below `low`."""
    for name, value in options.items():
        if value < low:
            raise FLUserError(f"--data.{name} must be >= {low}, got {value}")


class FederatedDataModule(L.LightningDataModule):
    """Dataset, partition and client sampling of a federated run.

    `seed` draws client sampling and local shuffling; by default (null) it is the run's
    seed_everything, so runs with different seeds sample and shuffle differently, as in FL-bench
    (the FedSOL authors' code also shuffles by the run seed, but samples clients by the round
    alone: an explicit `seed` keeps the sampling fixed across run seeds). `partition_seed` draws
    the partition (and the offline sets' test split) and stays fixed across run seeds, as both
    codebases fix the partition: methods and seeds are compared on one partition.

    Per-client test sets (personalised evaluation), `client_test`:
      "split": each client's train data split by `client_test_fraction` (the auto choice when it is > 0);
      "partition": the global test set split over clients with the training partition's class
        assignment: per class, its test samples are divided in proportion to the clients' train
        counts of that class, disjointly (for sharding: the same shards of test data);
      "align": per client, test samples drawn from the global test set to follow the client's
        train label distribution (FedSOL's "test_align"); clients may share test samples.

    `resize` / `to_rgb` reshape every image (e.g. MNIST-5k to 3x32x32 for the heterogeneous
    model groups).

    Args:
        dataset: mnist5k, digits (offline), mnist, cifar10, cifar100, svhn, cinic10, pathmnist or tissuemnist.
        root: directory of the downloaded data files (default ./data or $FL_LIGHTNING_DATA).
        download: download missing files when the machine has network.
        augment: random crop + flip on CIFAR-10/100 and CINIC-10 training images.
        num_clients: N, the number of clients the training data is partitioned over.
        sample_ratio: fraction of clients sampled per round: max(floor(N * ratio), 1) clients.
        local_epochs: passes of each sampled client over its own data per round.
        batch_size: local mini-batch size (also of per-client evaluation and fine-tuning).
        eval_batch_size: batch size of the global test set's evaluation (and of the local models'
            and the analyses' class-wise accuracies). On a CPU a small CNN's forward pass per sample
            is about a fifth cheaper in batches of 100-200 than of 500; on a GPU, and for models
            whose evaluation costs less than its per-batch bookkeeping, fewer batches are faster.
        partition: how the training data is split: iid, dirichlet, shard or pathological.
        alpha: Dirichlet concentration of the "dirichlet" partition (smaller = more skewed).
        min_size: the "dirichlet" partition redraws until every client has at least this many samples.
        shards_per_client: shards per client of the "shard" partition (shards are sorted by label).
        classes_per_client: classes per client of the "pathological" partition.
        client_test_fraction: fraction of each client's data split off as its own test set (0 = none).
        client_test: per-client test sets: auto, split, partition or align (see above).
        partition_seed: seed of the partition (and of the offline sets' test split).
        seed: seed of client sampling and local shuffling; null follows the CLI's seed_everything
            (constructed directly, null is 0).
        num_workers: DataLoader worker processes (0 = load in the training process).
        resize: resize every image to this size (bilinear), e.g. 32; null keeps the dataset's size.
        to_rgb: repeat a grey channel three times (for 3-channel architectures).
    """

    def __init__(
        self,
        dataset: str = "mnist5k",
        root: str | None = None,
        download: bool = True,
        augment: bool = True,
        num_clients: int = 50,
        sample_ratio: float = 0.2,
        local_epochs: int = 5,
        batch_size: int = 50,
        eval_batch_size: int = 500,
        partition: Literal["iid", "dirichlet", "shard", "pathological"] = "dirichlet",
        alpha: float = 0.1,
        min_size: int = 10,
        shards_per_client: int = 2,
        classes_per_client: int = 2,
        client_test_fraction: float = 0.0,
        client_test: Literal["auto", "split", "partition", "align"] = "auto",
        partition_seed: int = 0,
        seed: int | None = None,
        num_workers: int = 0,
        resize: int | None = None,
        to_rgb: bool = False,
    ):
        super().__init__()
        self.spec: DataSpec = spec_of(dataset)  # fails fast on an unknown name, before any loading
        # every line names the option as the CLI's user types it
        if resize is not None and resize < 1:
            raise FLUserError(f"--data.resize must be a positive image size, got {resize}")
        if to_rgb and self.spec.in_channels not in (1, 3):
            raise FLUserError(f"--data.to_rgb repeats a grey channel; {dataset} has {self.spec.in_channels} "
                              f"channels")
        self.spec = replace(self.spec, image_size=resize or self.spec.image_size,
                            in_channels=3 if to_rgb else self.spec.in_channels)
        if partition not in partitioners.PARTITIONERS:
            raise FLUserError(
                f"unknown partition '{partition}'; choose one of: {', '.join(partitioners.PARTITIONERS)}"
            )
        if not 0 < sample_ratio <= 1:
            raise FLUserError(f"--data.sample_ratio must be in (0, 1], got {sample_ratio}")
        _check_at_least(1, num_clients=num_clients, local_epochs=local_epochs, batch_size=batch_size,
                        eval_batch_size=eval_batch_size)
        _check_at_least(0, num_workers=num_workers, min_size=min_size)
        if client_test == "split" and client_test_fraction <= 0:
            raise FLUserError("--data.client_test split needs --data.client_test_fraction in (0, 1)")
        if client_test in ("partition", "align") and client_test_fraction > 0:
            raise FLUserError(f"--data.client_test {client_test} takes test data from the global test set; "
                              f"set --data.client_test_fraction 0 (or use --data.client_test split)")
        if seed is None:  # constructed outside the CLI (which fills in seed_everything)
            seed = 0
        for name, value in (("seed", seed), ("partition_seed", partition_seed)):
            if not 0 <= value < 2**32:  # numpy's and torch's generators take seeds in [0, 2^32)
                raise FLUserError(f"--data.{name} must be in 0 .. 2^32 - 1 (a generator seed), got {value}")
        self.save_hyperparameters()
        self.train_set = self.test_set = None
        self._plain_train_set = None
        self.client_parts: list[np.ndarray] = []
        self.client_test_parts: list[np.ndarray] = []
        self.round_plan: RoundPlan | None = None
        self.rank_plan: RoundPlan | None = None  # this rank's clients of round_plan
        self._device_cache: dict[int, TensorImages] = {}
        # the layout of the images in every batch made here: the method's (its `memory_format`
        # option, set in its configure_model), so that a batch is laid out once, where it is made
        self.memory_format = torch.contiguous_format

    @property
    def hparams_initial(self) -> AttributeDict:
        """What loggers get, under `data`: Lightning merges the method's and the data's
        hyperparameters into one flat dict and stops the run when a name is in both with different
        values (FML's, FedDyn's and PerFedAvg's `alpha` against the Dirichlet `alpha`)."""
        return AttributeDict({"data": dict(super().hparams_initial)})

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        h = self.hparams
        self.train_set, self.test_set = load_dataset(
            h.dataset, h.root, download=h.download, seed=h.partition_seed, augment=h.augment
        )
        self._plain_train_set = self.train_set
        if h.augment and entry_of(h.dataset).augmented:
            self._plain_train_set, _ = load_dataset(h.dataset, h.root, download=False, seed=h.partition_seed,
                                                  augment=False)
        if h.resize is not None or h.to_rgb:
            size, channels = h.resize, 3 if h.to_rgb else None
            self.train_set, self.test_set, self._plain_train_set = (
                _reshaped(d, size, channels) for d in (self.train_set, self.test_set, self._plain_train_set))
        parts = partitioners.partition(
            self.train_set.labels, h.num_clients, h.partition, h.partition_seed, alpha=h.alpha,
            min_size=h.min_size, shards_per_client=h.shards_per_client, classes_per_client=h.classes_per_client,
        )
        if h.client_test_fraction > 0:
            parts, self.client_test_parts = partitioners.split_train_test(
                parts, h.client_test_fraction, h.partition_seed
            )
        empty = [c for c, p in enumerate(parts) if len(p) == 0]
        if empty:
            raise FLUserError(f"partition left {len(empty)} clients without data (e.g. client {empty[0]})")
        self.client_parts = parts
        if h.client_test in ("partition", "align"):
            train_labels, test_labels = self.train_set.labels, self.test_set.labels
            num_classes = self.spec.num_classes
            counts = np.stack([np.bincount(train_labels[p], minlength=num_classes) for p in parts])
            if h.client_test == "partition":
                self.client_test_parts = partitioners.test_like_train(counts, test_labels, h.partition_seed)
            else:
                self.client_test_parts = partitioners.test_aligned(counts, test_labels, h.partition_seed)

    @property
    def client_test_mode(self) -> str:
        h = self.hparams
        if h.client_test == "auto":
            return "split" if h.client_test_fraction > 0 else "none"
        return h.client_test

    def client_class_counts(self, client: int) -> np.ndarray:
        """Samples per class in the client's training data (balanced softmax, FedGELA, analyses)."""
        return np.bincount(self.train_set.labels[self.client_parts[client]], minlength=self.spec.num_classes)

    @property
    def plain_train_set(self):
        """The training set without augmentation (and with the same resize/to_rgb), for evaluating
        on training samples: per-client test splits, prototypes, statistics from training data."""
        return self._plain_train_set

    @property
    def num_clients(self) -> int:
        return self.hparams.num_clients

    def plan_round(self, round_idx: int) -> RoundPlan:
        h = self.hparams
        work = tuple(
            ClientWork(round_idx, c, len(self.client_parts[c]),
                       client_orders(self.client_parts[c], h.seed, round_idx, c, h.local_epochs), h.batch_size)
            for c in sample_clients(h.num_clients, h.sample_ratio, h.seed, round_idx)
        )
        return RoundPlan(round_idx, work)

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        if isinstance(batch, ClientWork):  # indices only; its mini-batches are made on the device
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> _WorkItems:
        """One item per sampled client; `training_step` runs the client's local training. When
        the round's clients train in parallel (parallel.py), each rank gets its share, balanced
        by local steps; `round_plan` stays the whole round."""
        round_idx = self.trainer.current_epoch if self.trainer is not None else 0
        self.round_plan = self.plan_round(round_idx)
        mine = self.round_plan
        if clients_in_parallel(self.trainer):
            shares = assign_clients([c.num_steps for c in mine.clients], self.trainer.world_size)
            mine = RoundPlan(round_idx, tuple(mine.clients[i] for i in shares[self.trainer.global_rank]))
        self.rank_plan = mine
        return _WorkItems(mine)

    # ---- data on the device -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")

    def _on_device(self, dataset) -> TensorImages | None:
        """The dataset as tensors on the training device, or None for the DataLoader path."""
        tensors_of = getattr(dataset, "tensors", None)
        tensors = tensors_of() if tensors_of is not None else None
        if tensors is None:
            return None
        device = self.device
        cached = self._device_cache.get(id(dataset))
        if cached is None or cached.images.device != device or cached.memory_format != self.memory_format:
            cached = replace(tensors.to(device), memory_format=self.memory_format)
            self._device_cache[id(dataset)] = cached
        return cached

    @property
    def samples_from_indices(self) -> bool:
        """Whether `samples` makes training batches: the training set is held as tensors and not
        augmented (augmented batches draw their crops per client and batch; image folders are
        decoded by a DataLoader)."""
        tensors = self._on_device(self.train_set)
        return tensors is not None and not tensors.augment

    def samples(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The training samples `indices` as the model sees them, gathered and converted at once:
        what `minibatches` makes of the same indices (see `samples_from_indices`)."""
        tensors = self._on_device(self.train_set)
        images, labels = tensors.take(torch.from_numpy(indices).to(tensors.images.device))
        return tensors.finish(images), labels

    def minibatches(self, work: ClientWork) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A client's local mini-batches, in order, on the training device (this rank's share)."""
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        if clients_in_parallel(self.trainer):  # a whole client per rank: no batch to share
            rank, world = 0, 1
        tensors = self._on_device(self.train_set)
        if tensors is None:  # image folders: decode and collate in a DataLoader
            shares = [b[rank_share(len(b), rank, world)].tolist() for b in work.batches]
            loader = DataLoader(self.train_set, batch_sampler=shares, num_workers=self.hparams.num_workers)
            device = self.device
            for x, y in loader:
                yield x.to(device).contiguous(memory_format=self.memory_format), y.to(device)
            return
        generator = None
        if tensors.augment:
            generator = client_generator(self.hparams.seed, work.round, work.client, tensors.images.device)
        device = tensors.images.device
        for orders in _gather_groups(work, tensors.images[:1].nbytes):
            # one gather for the client's local epochs (or one per epoch when they would take much
            # memory); its mini-batches are then views, not copies (split makes them in one call,
            # a few microseconds a step less than slicing them one by one)
            order = np.concatenate(orders) if len(orders) > 1 else orders[0]
            images, labels = tensors.take(torch.from_numpy(order).to(device))
            sizes = [min(work.batch_size, len(o) - s) for o in orders for s in range(0, len(o), work.batch_size)]
            for x, y in zip(images.split(sizes), labels.split(sizes), strict=True):
                if world > 1:
                    share = rank_share(len(y), rank, world)
                    share = share if isinstance(share, slice) else torch.as_tensor(share, device=device)
                    yield tensors.finish(x, generator, share), y[share]
                else:
                    yield tensors.finish(x, generator), y

    def _eval_loader(self, dataset, indices: np.ndarray | None = None) -> DataLoader:
        tensors = self._on_device(dataset) if self.trainer is not None else None
        if tensors is not None:
            idx = None if indices is None else torch.as_tensor(indices, device=tensors.images.device)
            batches = tensors.without_augmentation().sequential_batches(self.hparams.eval_batch_size, idx)
            return DataLoader(_SlicedBatches(batches), batch_size=None, collate_fn=_no_collate)
        if indices is not None:
            dataset = Subset(dataset, indices.tolist())
        return DataLoader(dataset, batch_size=self.hparams.eval_batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> Iterable:
        # The papers evaluate the global model on the full test set every round; there is no
        # separate validation split in their protocol. Every process evaluates the whole test set
        # (with clients in parallel they all hold the same global model): the logged values are
        # then exactly the one-process run's.
        return self._global_test_batches()

    def test_dataloader(self) -> Iterable:
        return self._global_test_batches()

    def _global_test_batches(self) -> Iterable:
        """The test set's batches for Lightning's validation and test loops: when already sliced
        on the device, as they are (Lightning takes any iterable with a length; a DataLoader would
        make its iterator anew every round and fetch batches that exist already), else a
        DataLoader."""
        loader = self._eval_loader(self.test_set)
        return loader.dataset if isinstance(loader.dataset, _SlicedBatches) else loader

    @staticmethod
    def batches_of(loader: DataLoader) -> Iterable:
        """What to iterate for `loader`'s batches: the list itself when they are already sliced on
        the device (a DataLoader's iterator, made anew for every pass, costs about as much as a
        small model's forward pass over 300 samples, and the round evaluates every client's model
        on the same subset), else the loader."""
        return loader.dataset.batches if isinstance(loader.dataset, _SlicedBatches) else loader

    def global_test_subset_loader(self, max_samples: int) -> DataLoader:
        """A fixed, seeded subset of the global test set for evaluating every local model."""
        n = len(self.test_set)
        if max_samples and max_samples < n:
            idx = np.sort(np.random.default_rng(self.hparams.partition_seed).choice(n, max_samples, replace=False))
            return self._eval_loader(self.test_set, idx)
        return self._eval_loader(self.test_set)

    def client_loader(self, client: int, split: Literal["train", "test"] = "train", shuffle: bool = False,
                      seed: int = 0, augment: bool = True) -> DataLoader:
        """One client's own data, for fine-tuning, prototypes and personalised evaluation.
        Test data is never augmented; `augment=False` also reads training samples without it."""
        if split == "test":
            if not self.client_test_parts:
                raise FLUserError("per-client test sets need data.client_test_fraction > 0 or "
                                  "data.client_test partition/align")
            mode = self.client_test_mode
            dataset = self.plain_train_set if mode == "split" else self.test_set
            idx = self.client_test_parts[client]
        else:
            dataset = self.train_set if augment else self.plain_train_set
            idx = self.client_parts[client]
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(Subset(dataset, idx.tolist()), batch_size=self.hparams.batch_size, shuffle=shuffle,
                          generator=generator, num_workers=self.hparams.num_workers)
