"""Loss surfaces: L(w + a d1 + b d2) on a grid, and 1-D slices L(w + a d).

Directions:
- "hessian": the top-2 Hessian eigenvectors (unit norm), as in FedSOL's Fig. 8: the axes along
  which the loss curves most, so the picture shows the sharpness the eigenvalues quantify.
- "random": filter-normalised Gaussian directions (Li et al., "Visualizing the Loss Landscape of
  Neural Nets", 2018): each filter (output row of a weight tensor) of the direction is rescaled to
  the norm of the same filter of the weights, so that scale-invariant networks compare across
  models; tensors with one dimension (biases, BatchNorm) get a zero direction, as in that paper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fl_lightning.analysis.objective import Params, SubsetObjective

DIRECTION_KINDS = ("hessian", "random")


def filter_normalized_direction(weights: Params, generator: torch.Generator) -> Params:
    """A random direction with ||d_i|| = ||w_i|| for every filter i of every weight tensor."""
    out = {}
    for name, w in weights.items():
        if w.dim() <= 1:
            out[name] = torch.zeros_like(w)
            continue
        d = torch.randn(w.shape, generator=generator, dtype=torch.float64).to(w)
        w_norm = w.reshape(len(w), -1).norm(dim=1)
        d_norm = d.reshape(len(d), -1).norm(dim=1).clamp_min(1e-12)
        out[name] = d * (w_norm / d_norm).view(-1, *([1] * (w.dim() - 1)))
    return out


def grid(radius: float, points: int) -> torch.Tensor:
    """`points` evenly spaced values in [-radius, radius]; odd counts put 0 at the centre."""
    if points < 2:
        raise ValueError(f"a surface needs at least 2 points per axis, got {points}")
    return torch.linspace(-radius, radius, points, dtype=torch.float64)


@dataclass
class Surface:
    alphas: list[float]
    betas: list[float]
    loss: list[list[float]]  # loss[i][j] at (alphas[i], betas[j])
    acc: list[list[float]]
    kind: str

    def rows(self) -> list[tuple[float, float, float, float]]:
        """(alpha, beta, loss, acc) for every grid point, the rows of the W&B table."""
        return [(a, b, self.loss[i][j], self.acc[i][j]) for i, a in enumerate(self.alphas)
                for j, b in enumerate(self.betas)]


def surface_2d(objective: SubsetObjective, d1: Params, d2: Params, radius: float = 1.0, points: int = 11,
               kind: str = "hessian", advance: Callable[[int], None] | None = None) -> Surface:
    """The loss and accuracy on a points x points grid; `advance(1)` after each point (progress)."""
    axis = grid(radius, points)
    loss = [[0.0] * points for _ in range(points)]
    acc = [[0.0] * points for _ in range(points)]
    for i, a in enumerate(axis.tolist()):
        for j, b in enumerate(axis.tolist()):
            loss[i][j], acc[i][j] = objective.loss_and_accuracy(objective.shifted((a, d1), (b, d2)))
            if advance is not None:
                advance(1)
    return Surface(axis.tolist(), axis.tolist(), loss, acc, kind)


def slice_1d(objective: SubsetObjective, d: Params, radius: float = 1.0, points: int = 11,
             ) -> tuple[list[float], list[float], list[float]]:
    """(alphas, loss, acc) along w + a d."""
    axis = grid(radius, points).tolist()
    values = [objective.loss_and_accuracy(objective.shifted((a, d))) for a in axis]
    return axis, [v[0] for v in values], [v[1] for v in values]
