"""FedCONST's convex constraints (Kim et al., "Federated Learning for Feature Generalization with
Convex Constraints"), as an option of every method rather than a method of its own.

Per output channel c of every weight matrix (a conv weight read as [out, in*k*k], a linear one as
[out, in]), with Delta_c = w_c - w_g,c and w_g the round-start global weights, local training keeps

    1^T Delta_c = 0          (centering: the channel's total update is zero)
    w_g,c^T Delta_c = 0      (orthogonality: no update along the channel's own global weights)

Both constraints are linear and identical for every client of a round, so the aggregated update
sum_k p_k Delta_k satisfies them too (paper eqs. 16 and 20).

Modes (applied to Delta after every optimizer step, so they hold whatever the optimizer did:
momentum, weight decay, SAM, control variates):
- "joint" (default): Delta_c <- its exact orthogonal projection onto span{1, w_g,c}^perp. The basis
  is Gram-Schmidt of the two vectors: e1 = 1/sqrt(n), e2 = centred w_g,c normalised. When w_g,c is
  zero or parallel to 1, e2 does not exist and only the centering applies (it then implies the
  orthogonality).
- "sequential": the paper's Algorithm 1 order, S = P_p o C: centre, then remove the component along
  p = w_g,c/||w_g,c||. Orthogonality to w_g,c holds exactly, but the second step adds back
  -(Delta_c . p) p whose sum is generally non-zero: the centering drifts. Kept to reproduce the
  paper's procedure. Like "joint" it is applied to the accumulated Delta after every step (so
  weight decay cannot break the orthogonality); S is not a projection (C and P_p do not commute),
  so this is not bit-identical to Algorithm 1's sum of S(g_t) even for plain SGD. Both keep
  orthogonality and neither keeps the sum at zero.

Algorithm 1 projects each *gradient*; projecting the accumulated Delta after each step is the
same for plain SGD and stays exact with momentum and weight decay, whose own terms (the raw
weights, stale momentum) are not in the constraint set. Paper eq. 8 writes the centering as
1^T w_c = 0; the algorithm (centred gradients) only keeps the sum of each channel at its round-start
value, which is what "1^T Delta_c = 0" states. Biases, norm scales and other tensors with fewer than
2 dimensions are left unconstrained (the paper removes biases and BN from its models).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import nn

from fl_lightning.errors import FLUserError

ConstraintMode = Literal["none", "joint", "sequential"]
CONSTRAINT_MODES = ("none", "joint", "sequential")

# A centred w_g,c shorter than this fraction of ||w_g,c|| is rounding noise of a vector parallel to 1.
_PARALLEL_RTOL = 1e-6


def rows(t: torch.Tensor) -> torch.Tensor:
    """[out, ...] -> [out, fan_in]: one row per output channel."""
    return t.reshape(t.shape[0], -1)


def constrained_names(model: nn.Module) -> list[str]:
    """Trainable weight matrices and conv kernels (dim >= 2)."""
    return [n for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]


def orthogonal_direction(wg: torch.Tensor) -> torch.Tensor:
    """Rows e2_c = (w_g,c - mean(w_g,c)) / norm, the second Gram-Schmidt vector after 1/sqrt(n);
    zero rows where w_g,c is zero or parallel to 1."""
    centred = wg - wg.mean(dim=1, keepdim=True)
    norm = centred.norm(dim=1, keepdim=True)
    ok = norm > _PARALLEL_RTOL * wg.norm(dim=1, keepdim=True)
    return torch.where(ok, centred / norm.clamp_min(torch.finfo(wg.dtype).tiny), torch.zeros_like(centred))


def unit_rows(wg: torch.Tensor) -> torch.Tensor:
    """p_c = w_g,c / ||w_g,c|| (zero rows for zero channels)."""
    norm = wg.norm(dim=1, keepdim=True)
    return torch.where(norm > 0, wg / norm.clamp_min(torch.finfo(wg.dtype).tiny), torch.zeros_like(wg))


def _centre_then_remove_(delta: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """In place (this runs after every local step on every weight matrix): each row minus its
    mean, then minus its component along the unit row of `direction`."""
    delta.sub_(delta.mean(dim=1, keepdim=True))
    coef = torch.linalg.vecdot(delta, direction, dim=1).unsqueeze(1)
    return delta.addcmul_(coef, direction, value=-1.0)


def project_joint(delta: torch.Tensor, e2: torch.Tensor) -> torch.Tensor:
    """Projection of each row onto span{1, w_g,c}^perp, given e2 = orthogonal_direction(w_g).
    e2 is orthogonal to 1, so removing the mean and then the e2 component is the exact projection."""
    return _centre_then_remove_(delta.clone(), e2)


def project_sequential(delta: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Algorithm 1: centre each row, then remove its component along p = unit_rows(w_g)."""
    return _centre_then_remove_(delta.clone(), p)


class ChannelConstraint:
    """The constraint set of one round: built from the round-start global weights, applied to the
    local model after every optimizer step."""

    def __init__(self, mode: ConstraintMode, global_weights: Mapping[str, torch.Tensor],
                 names: Iterable[str]):
        if mode not in ("joint", "sequential"):
            raise FLUserError(f"constraint mode must be joint or sequential, got {mode!r}")
        self.mode = mode
        self.global_rows: dict[str, torch.Tensor] = {}
        self.directions: dict[str, torch.Tensor] = {}
        for n in names:
            w = global_weights[n].detach()
            # In the weights' own precision (float64 stays float64, so the invariants hold to
            # ~1e-15); only half-precision weights are computed in float32.
            wg = rows(w).to(torch.promote_types(w.dtype, torch.float32))
            self.global_rows[n] = wg
            self.directions[n] = orthogonal_direction(wg) if mode == "joint" else unit_rows(wg)

    @torch.no_grad()
    def apply(self, model: nn.Module) -> None:
        """w_c <- w_g,c + P(w_c - w_g,c) for every constrained tensor, in place."""
        named = dict(model.named_parameters())
        for n, wg in self.global_rows.items():
            p = named[n]
            delta = _centre_then_remove_(rows(p).to(wg.dtype) - wg, self.directions[n])
            if p.dtype == wg.dtype and p.is_contiguous():
                torch.add(wg, delta, out=p.view(wg.shape))  # writes the weights in place
            else:
                p.copy_((wg + delta).view(p.shape))


@torch.no_grad()
def constraint_residuals(weights: Mapping[str, torch.Tensor], global_weights: Mapping[str, torch.Tensor],
                         names: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Per tensor, max over channels of |1^T Delta_c| and |w_g,c^T Delta_c| (float64): how far a
    model is from the constraint set of `global_weights`. For tests and diagnostics."""
    out = {}
    for n in names:
        wg = rows(global_weights[n]).double()
        delta = rows(weights[n]).double() - wg
        out[n] = (float(delta.sum(dim=1).abs().max()), float((delta * wg).sum(dim=1).abs().max()))
    return out
