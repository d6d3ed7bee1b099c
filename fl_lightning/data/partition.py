"""Partitioners: pure, seeded functions from labels to per-client index arrays.

Every partitioner returns a list of sorted int64 arrays, one per client, that are disjoint and
together cover every sample (or, for `shard`, every sample that fits in whole shards). Impossible
requests raise `FLUserError` instead of looping or silently returning empty clients.
"""

from __future__ import annotations

import numpy as np

from fl_lightning.errors import FLUserError

PARTITIONERS = ("iid", "dirichlet", "shard", "pathological")


def _check_clients(labels: np.ndarray, num_clients: int) -> None:
    if num_clients < 1:
        raise FLUserError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise FLUserError(
            f"cannot split {len(labels)} samples over {num_clients} clients; use at most {len(labels)} clients"
        )


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    _check_clients(labels, num_clients)
    order = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """LDA partition as in the FedSOL/FedNTD code: per class, proportions ~ Dir(alpha) over clients,
    clients already holding >= N/num_clients samples get none of the class; redraw until the
    smallest client has `min_size` samples. The redraw loop is bounded, since for tiny alpha or many
    clients it may never succeed."""
    _check_clients(labels, num_clients)
    if not alpha > 0:
        raise FLUserError(f"dirichlet alpha must be > 0, got {alpha}")
    if min_size * num_clients > len(labels):
        raise FLUserError(
            f"dirichlet min_size {min_size} x {num_clients} clients exceeds {len(labels)} samples; "
            f"lower min_size or num_clients"
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    cap = len(labels) / num_clients
    smallest = 0
    for _ in range(max_retries):
        # a draw only counts each client's samples; the index lists are built for the draw that is
        # kept (most draws of a small alpha are redrawn)
        sizes = np.zeros(num_clients, dtype=np.int64)
        drawn = []
        for members in by_class:
            idx = members.copy()
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = p * (sizes < cap)
            if p.sum() == 0:  # every client is full: spread the class uniformly instead of dropping it
                p = np.ones(num_clients)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            sizes += np.diff(cuts, prepend=0, append=len(idx))
            drawn.append((idx, cuts))
        smallest = int(sizes.min())
        if smallest >= min_size:
            parts = [np.split(idx, cuts) for idx, cuts in drawn]
            return [np.sort(np.concatenate([p[k] for p in parts]).astype(np.int64)) for k in range(num_clients)]
    raise FLUserError(
        f"dirichlet(alpha={alpha}) found no split of {len(labels)} samples over {num_clients} clients with "
        f"min_size={min_size} in {max_retries} draws (smallest client had {smallest}); "
        f"raise alpha, lower min_size or use fewer clients"
    )


def shard(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """Sort by label, cut each class into equal contiguous shards (s * num_clients / C per class),
    give each client s random shards. Every client gets the same number of samples; samples beyond
    the equal shard size of their class are left out."""
    _check_clients(labels, num_clients)
    classes = np.unique(labels)
    total_shards = shards_per_client * num_clients
    if shards_per_client < 1 or total_shards % len(classes) != 0:
        raise FLUserError(
            f"shard partition needs shards_per_client * num_clients ({total_shards}) to be a positive "
            f"multiple of the {len(classes)} classes"
        )
    per_class = total_shards // len(classes)
    counts = np.array([(labels == c).sum() for c in classes])
    shard_size = int(counts.min()) // per_class
    if shard_size < 1:
        raise FLUserError(
            f"shard partition: the smallest class has {counts.min()} samples, fewer than its "
            f"{per_class} shards; use fewer clients or shards"
        )
    rng = np.random.default_rng(seed)
    shards = []
    for c in classes:
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        shards.extend(idx[k * shard_size : (k + 1) * shard_size] for k in range(per_class))
    order = rng.permutation(total_shards)
    return [
        np.sort(np.concatenate([shards[j] for j in order[i::num_clients]])) for i in range(num_clients)
    ]


def pathological(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Each client sees exactly `classes_per_client` classes (assigned round-robin so every class is
    used), and each class is split over its clients in random, unbalanced proportions, as in the
    heterogeneous-model papers' pathological setting."""
    _check_clients(labels, num_clients)
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(classes):
        raise FLUserError(
            f"classes_per_client must be between 1 and {len(classes)}, got {classes_per_client}"
        )
    rng = np.random.default_rng(seed)
    owners: dict[int, list[int]] = {int(c): [] for c in classes}
    for client in range(num_clients):
        for j in range(classes_per_client):
            owners[int(classes[(client * classes_per_client + j) % len(classes)])].append(client)
    buckets: list[list[int]] = [[] for _ in range(num_clients)]
    for c, clients in owners.items():
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        if not clients:
            # A class no client was assigned (num_clients * classes_per_client < C) is dropped by design.
            continue
        if len(idx) < len(clients) * min_size:
            raise FLUserError(
                f"pathological: class {c} has {len(idx)} samples for {len(clients)} clients; use fewer clients"
            )
        # Unbalanced sizes: random proportions, but at least min_size samples per owner.
        p = rng.uniform(0.1, 1.0, size=len(clients))
        extra = len(idx) - min_size * len(clients)
        sizes = min_size + np.floor(p / p.sum() * extra).astype(int)
        sizes[-1] += len(idx) - sizes.sum()
        for client, part in zip(clients, np.split(idx, np.cumsum(sizes)[:-1]), strict=True):
            buckets[client].extend(part.tolist())
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in buckets]


def split_train_test(
    parts: list[np.ndarray], test_fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split every client's indices into its own train and test set (e.g. 75/25)."""
    if not 0 < test_fraction < 1:
        raise FLUserError(f"client_test_fraction must be in (0, 1) (the FedORGP papers use 0.25), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for client, idx in enumerate(parts):
        if len(idx) < 2:
            raise FLUserError(f"client {client} has {len(idx)} samples; a train/test split needs at least 2")
        shuffled = rng.permutation(idx)
        n_test = min(max(1, int(round(len(idx) * test_fraction))), len(idx) - 1)
        test.append(np.sort(shuffled[:n_test]))
        train.append(np.sort(shuffled[n_test:]))
    return train, test


def test_like_train(train_counts: np.ndarray, test_labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """Disjoint per-client test sets with the training partition's class assignment: each class's
    test samples are split over clients in proportion to their train counts of that class
    (largest-remainder rounding). With sharding this gives every client the test shards of its
    train shards' classes; clients without a class get none of its test samples."""
    test_labels = np.asarray(test_labels)
    rng = np.random.default_rng(seed)
    buckets: list[list[int]] = [[] for _ in range(len(train_counts))]
    for c in range(train_counts.shape[1]):
        idx = rng.permutation(np.flatnonzero(test_labels == c))
        owners = train_counts[:, c]
        if owners.sum() == 0 or len(idx) == 0:
            continue
        exact = owners / owners.sum() * len(idx)
        sizes = np.floor(exact).astype(int)
        for i in np.argsort(-(exact - sizes), kind="stable")[: len(idx) - sizes.sum()]:
            sizes[i] += 1
        for client, part in enumerate(np.split(idx, np.cumsum(sizes)[:-1])):
            buckets[client].extend(part.tolist())
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in buckets]


def test_aligned(train_counts: np.ndarray, test_labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """Per client, test samples drawn from the global test set with the client's train label
    distribution ("test_align"): n_i = round(|train_i| * |test| / |train|) samples in total,
    class c getting round(n_i * p_ic), capped at the class's test size; drawn without replacement
    within a client, independently across clients (clients may share test samples)."""
    test_labels = np.asarray(test_labels)
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(test_labels == c) for c in range(train_counts.shape[1])]
    ratio = len(test_labels) / max(int(train_counts.sum()), 1)
    out = []
    for counts in train_counts:
        n = max(int(round(counts.sum() * ratio)), 1)
        chosen = []
        for c, k in enumerate(np.round(counts / counts.sum() * n).astype(int)):
            k = min(k, len(by_class[c]))
            if k > 0:
                chosen.extend(rng.choice(by_class[c], size=k, replace=False).tolist())
        if not chosen:  # a tiny client whose rounded counts are all zero: one sample of its main class
            chosen = [int(rng.choice(by_class[int(np.argmax(counts))]))]
        out.append(np.sort(np.asarray(chosen, dtype=np.int64)))
    return out


def partition(
    labels: np.ndarray,
    num_clients: int,
    method: str,
    seed: int,
    alpha: float = 0.1,
    min_size: int = 10,
    shards_per_client: int = 2,
    classes_per_client: int = 2,
) -> list[np.ndarray]:
    labels = np.asarray(labels)
    if method == "iid":
        return iid(labels, num_clients, seed)
    if method == "dirichlet":
        return dirichlet(labels, num_clients, alpha, seed, min_size=min_size)
    if method == "shard":
        return shard(labels, num_clients, shards_per_client, seed)
    if method == "pathological":
        return pathological(labels, num_clients, classes_per_client, seed)
    raise FLUserError(f"unknown partition '{method}'; choose one of: {', '.join(PARTITIONERS)}")
