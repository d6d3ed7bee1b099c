"""kNN-Per (Marfoq, Neglia, Vidal, Kameni: "Personalized Federated Learning through Local
Memorization", ICML 2022): train one global model with FedAvg, then personalise it at inference
time with a k-nearest-neighbours model over each client's own training data.

Training is exactly FedAvg (same hooks, same uploads, same global model). Personalisation:

    datastore of client m:  {(phi(x_i), y_i)} over its training samples, phi = the global model's
                            `features` in eval mode (no augmentation)
    p_kNN(y | x)          = sum_{i in N_k(x), y_i = y} exp(-d(phi(x), phi(x_i)) / T)
                            / sum_{i in N_k(x)} exp(-d(phi(x), phi(x_i)) / T)
    p_m(y | x)            = lam_m * p_kNN(y | x) + (1 - lam_m) * softmax(global logits)(y)

N_k(x) = the k stored entries nearest to phi(x) in Euclidean distance; a client with fewer than k
training samples uses all of them. `personal_model(client)` builds the datastore on the client
(nothing leaves it: the upload is FedAvg's) and returns a `KNNPerModel` whose forward gives
log p_m(y | x), so its argmax is the prediction and it can be fed to NLL as log-probabilities
(with lam = 1 a class no neighbour has gets log 0 = -inf).

Defaults, and where they come from (the FedSOL and FedDr+ papers give no kNN-Per hyperparameters):
- num_neighbors = 10. The kNN-Per paper's experiments are recalled as using k = 10 (not verified); its official
  code takes k as a required argument and its scripts sweep k in {1, 3, 5, 7, 10} (7 for the
  heterogeneity study). FL-bench's re-implementation uses 5. UNSURE: an option.
- distance = "squared": the official code searches a FAISS IndexFlatL2, which returns SQUARED
  Euclidean distances, and puts those into the kernel. "euclidean" (plain distance) is an option.
- temperature = None, meaning the feature dimension D: the official code's kernel is
  exp(-d^2 / (D * scale)) with the length scale left at 1.0 (MobileNet: D = 1024 here). A number
  sets T directly.
- lam = 0.5 (FL-bench's default weight): a fixed interpolation weight for every client. The paper
  instead tunes lam per client on held-out data (its code evaluates a 0.01-step grid on [0, 1]).
  `lam_grid` does that: each client holds out `lam_holdout` (default 0.2, our choice: the paper's
  exact validation protocol is not reproduced here) of its training samples (a seeded split,
  `lam_seed`), builds a datastore from the rest, and picks the grid value with the highest
  held-out accuracy (ties: the first in grid order). The final datastore then holds ALL its
  training samples (so it is larger than the one lambda was chosen with). A client with fewer than
  2 samples cannot hold one out and uses `lam`.
- The interpolation is of probabilities, as in the paper. (The official evaluation script's
  `--interpolate_logits` flag has `default="store_true"` without `action`, which makes it truthy,
  so that script mixes kNN probabilities with raw logits; we follow the paper, not that slip.)
- The datastore holds every training sample (the paper's "capacity" study, which subsamples the
  datastore, is left out).

Left out: the FedSOL appendix table reports kNN-Per "after e epochs of fine-tuning", i.e. the kNN
step on top of a fine-tuned model; here the base model is the global model as trained (the
fine-tuning numbers of PersonalizationCallback are FedAvg-FT's).
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import numpy as np
import torch
from torch import nn

from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import as_model_input, correct_predictions, model_dtype
from fl_lightning.methods.baselines.fedavg import FedAvg
from fl_lightning.models import FLModel

DISTANCES = ("squared", "euclidean")


def knn_probabilities(queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, num_classes: int,
                      k: int, temperature: float, distance: str = "squared") -> torch.Tensor:
    """p_kNN(. | x) for each row of `queries` (B, D) from the datastore (`keys` (N, D), `labels`
    (N,)): the k nearest keys (all N if N < k), each weighted by exp(-d / T), normalised."""
    # exact pairwise differences (no |a|^2 + |b|^2 - 2ab shortcut, which loses digits)
    dtype = torch.promote_types(keys.dtype, torch.float32)  # cdist has no bfloat16 kernel on CPU (bf16-true)
    dist = torch.cdist(queries.to(dtype), keys.to(dtype), compute_mode="donot_use_mm_for_euclid_dist")
    if distance == "squared":
        dist = dist.square()
    near_dist, near_idx = dist.topk(min(k, keys.shape[0]), dim=1, largest=False)
    # the normalised kernel weights are a softmax over the neighbours' -d / T: same values, and no
    # 0 / 0 when every exp(-d / T) underflows
    weights = torch.softmax(-near_dist / temperature, dim=1)
    probs = torch.zeros(queries.shape[0], num_classes, dtype=weights.dtype, device=weights.device)
    return probs.scatter_add_(1, labels[near_idx], weights)


def interpolate(p_knn: torch.Tensor, logits: torch.Tensor, lam: float) -> torch.Tensor:
    """lam * p_kNN + (1 - lam) * softmax(logits)."""
    return lam * p_knn + (1 - lam) * torch.softmax(logits, dim=1)


class KNNPerModel(nn.Module):
    """One client's kNN-Per model: a frozen copy of the global model, the client's datastore
    (`keys` = features, `labels`, as buffers) and the hyperparameters. forward(x) = log p(y | x)."""

    def __init__(self, model: FLModel, keys: torch.Tensor, labels: torch.Tensor, num_classes: int, k: int,
                 temperature: float, lam: float, distance: str = "squared"):
        super().__init__()
        self.model = model.requires_grad_(False).eval()
        self.register_buffer("keys", keys)
        self.register_buffer("labels", labels)
        self.num_classes, self.k, self.temperature, self.lam, self.distance = (
            num_classes, k, temperature, lam, distance)

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()  # features are always the eval-mode ones the datastore was built with
        return self

    @torch.no_grad()
    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.model.features(x)
        p_knn = knn_probabilities(feats, self.keys, self.labels, self.num_classes, self.k, self.temperature,
                                  self.distance)
        return interpolate(p_knn, self.model.head(feats), self.lam)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.probabilities(x))


def holdout_split(n: int, fraction: float, seed: int, client: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (kept, held out) of a client's n training samples for choosing lam: a seeded
    permutation, round(fraction * n) held out, at least one on each side (n >= 2)."""
    order = np.random.default_rng([seed, client]).permutation(n)
    n_hold = min(max(int(round(fraction * n)), 1), n - 1)
    return np.sort(order[n_hold:]), np.sort(order[:n_hold])


class KNNPer(FedAvg):
    """FedAvg training; `personal_model(client)` = the global model interpolated with a kNN model
    over the client's training features (see the module docstring for every default's source).

    Args:
        num_neighbors: k, the neighbours retrieved (all samples when a client has fewer).
        temperature: T of the kernel exp(-d / T); None = the feature dimension (official code).
        distance: "squared" (squared Euclidean, official code) or "euclidean".
        lam: the fixed weight of p_kNN in the mixture, in [0, 1] (used when `lam_grid` is None).
        lam_grid: candidate weights; each client picks the one with the best accuracy on a held-out
            `lam_holdout` fraction of its training data (split seeded by `lam_seed` and the client).
        lam_holdout: the fraction of a client's training data held out to pick lam from lam_grid.
        lam_seed: seed of that held-out split.
    """

    def __init__(self, num_neighbors: int = 10, temperature: float | None = None,
                 distance: Literal["squared", "euclidean"] = "squared", lam: float = 0.5,
                 lam_grid: list[float] | None = None, lam_holdout: float = 0.2, lam_seed: int = 0, **kwargs):
        if num_neighbors < 1:
            raise FLUserError(f"num_neighbors must be >= 1, got {num_neighbors}")
        if temperature is not None and not temperature > 0:
            raise FLUserError(f"temperature must be > 0 (or null for the feature dimension), got {temperature}")
        if distance not in DISTANCES:
            raise FLUserError(f"distance must be one of {', '.join(DISTANCES)}, got '{distance}'")
        if not 0 <= lam <= 1:
            raise FLUserError(f"lam must be in [0, 1], got {lam}")
        if lam_grid is not None and (len(lam_grid) == 0 or not all(0 <= v <= 1 for v in lam_grid)):
            raise FLUserError(f"lam_grid must be a non-empty list of values in [0, 1], got {lam_grid}")
        if not 0 < lam_holdout < 1:
            raise FLUserError(f"lam_holdout must be in (0, 1), got {lam_holdout}")
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.num_neighbors, self.distance = num_neighbors, distance
        self.temperature = float(temperature) if temperature is not None else float(self.model.feature_dim)
        self.lam = float(lam)
        self.lam_grid = None if lam_grid is None else [float(v) for v in lam_grid]
        self.lam_holdout, self.lam_seed = lam_holdout, lam_seed

    def personal_model(self, client: int) -> KNNPerModel:
        if self.current_client is not None:
            raise RuntimeError("personal_model needs the global model: call it between rounds")
        dm = self.trainer.datamodule
        model = copy.deepcopy(self.model).to(self.device).requires_grad_(False).eval()
        # Iterating a DataLoader draws a seed from torch's global RNG: fork it, so that building
        # the datastore cannot change the draws of the training that follows.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            feats, labels = [], []
            for x, y in dm.client_loader(client, "train", shuffle=False, augment=False):
                feats.append(model.features(as_model_input(x, self.device, model_dtype(model))))
                labels.append(y.to(self.device))
        keys, labels = torch.cat(feats), torch.cat(labels)
        lam = self.lam if self.lam_grid is None else self.select_lambda(model, keys, labels, client)
        return KNNPerModel(model, keys, labels, self.hparams.data_spec.num_classes, self.num_neighbors,
                           self.temperature, lam, self.distance)

    @torch.no_grad()
    def select_lambda(self, model: FLModel, keys: torch.Tensor, labels: torch.Tensor, client: int) -> float:
        """The grid value with the best accuracy on a held-out part of the client's training data,
        the datastore built from the rest (ties: the first in grid order; `lam` if n < 2)."""
        n = keys.shape[0]
        if n < 2:
            return self.lam
        kept, held = (torch.as_tensor(p, device=keys.device) for p in
                      holdout_split(n, self.lam_holdout, self.lam_seed, client))
        p_knn = knn_probabilities(keys[held], keys[kept], labels[kept], self.hparams.data_spec.num_classes,
                                  self.num_neighbors, self.temperature, self.distance)
        logits = model.head(keys[held])
        best, best_correct = self.lam_grid[0], -math.inf
        for lam in self.lam_grid:
            correct = int(correct_predictions(interpolate(p_knn, logits, lam), labels[held]).sum())
            if correct > best_correct:
                best, best_correct = lam, correct
        return best
