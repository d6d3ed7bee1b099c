"""How far a round's clients drift from the global model and from each other (FedSOL Fig. 6),
how each model does per class (FedSOL Fig. 7), and how the data is split (the partition).

All pure functions of tensors; the callback feeds them the round's accepted uploads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fl_lightning.evaluation import Tally

# Columns of the updates taken at once by `update_gram`: 10 clients x 16,384 float64 columns is
# 1.3 MB, which stays in the cache between the subtraction and the product; one float64 block per
# parameter tensor (the FedAvg CNN's 1.6M-weight layer: 128 MB for 10 clients) would not.
GRAM_COLUMNS = 1 << 14


def update_gram(uploads: Sequence[Mapping[str, torch.Tensor]], global_params: Mapping[str, torch.Tensor],
                ) -> torch.Tensor | None:
    """The Gram matrix G_ij = <w_i - w_g, w_j - w_g> (float64) of the clients' updates over the
    parameters every upload carries, or None when the uploads hold no model parameters (e.g.
    prototypes). Summed over blocks of GRAM_COLUMNS parameters: the clients' whole flattened
    updates in float64 would take clients x parameters x 8 bytes at once (880 MB for 10 ResNet-18
    clients), and a block that fits in the cache is several times faster."""
    names = [n for n in global_params if all(n in u for u in uploads)]
    if not uploads or not names:
        return None
    # summed on the uploads' device, moved to the CPU once
    gram = torch.zeros(len(uploads), len(uploads), dtype=torch.float64, device=uploads[0][names[0]].device)
    for n in names:
        g = global_params[n].detach().reshape(-1)
        if g.numel() <= GRAM_COLUMNS:  # one block: the same rows without slicing each upload
            rows = torch.stack([u[n].detach() for u in uploads]).reshape(len(uploads), -1).double() - g.double()
            gram += rows @ rows.T
            continue
        flat = [u[n].detach().reshape(-1) for u in uploads]
        for start in range(0, g.numel(), GRAM_COLUMNS):
            end = start + GRAM_COLUMNS
            rows = torch.stack([f[start:end] for f in flat]).double() - g[start:end].double()
            gram += rows @ rows.T
    return gram.cpu()


def divergence_stats(gram: torch.Tensor) -> dict[str, float]:
    """||w_k - w_g|| summary over clients, and the mean over client pairs of ||w_i - w_j|| and of
    cos(w_i - w_g, w_j - w_g), from the Gram matrix of the updates (`update_gram`)."""
    sq = gram.diagonal()
    dist = sq.clamp_min(0).sqrt()
    out = {"client_global_dist_mean": float(dist.mean()), "client_global_dist_std": float(dist.std(unbiased=False)),
           "client_global_dist_min": float(dist.min()), "client_global_dist_max": float(dist.max())}
    k = len(gram)
    if k >= 2:
        i, j = torch.triu_indices(k, k, offset=1)
        pair_dist = (sq[i] + sq[j] - 2 * gram[i, j]).clamp_min(0).sqrt()
        cos = gram[i, j] / (dist[i] * dist[j]).clamp_min(1e-30)
        out["client_pair_dist_mean"] = float(pair_dist.mean())
        out["update_cosine_mean"] = float(cos.mean())
    return out


@torch.no_grad()
def classwise_accuracy(scores: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Accuracy per true class (NaN for a class absent from y), on the CPU."""
    metrics = Tally(num_classes, per_class=True)
    metrics.update(scores, y)
    return metrics.result().class_accuracy.cpu()


def partition_counts(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Samples per (client, class): the clients x classes matrix of the partition."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=num_classes) for p in parts])
