"""Hessian spectrum of the training loss from Hessian-vector products only.

- `lanczos`: the Lanczos iteration with full reorthogonalisation. After m products it has the
  m x m tridiagonal T = Q^T H Q of the Krylov space; T's extreme eigenvalues (Ritz values)
  converge to H's extreme ones first, the top few in some tens of products on networks, where
  deflated power iteration needs tens per eigenvalue and stalls on close pairs. Full
  reorthogonalisation (twice, against every stored vector) keeps Q orthonormal in float32, which
  plain three-term Lanczos does not (it then reports copies of the top eigenvalue).
  It stops when the top-k Ritz residuals |beta_m s_{m,i}| (the exact ||H y_i - theta_i y_i|| of
  the Ritz pair) fall below `tol * |theta_i|`, or after `max_iter` products. From one start
  vector it sees each distinct eigenvalue once: an exactly repeated one (e.g. from a symmetry of
  the architecture) is reported once, followed by the next distinct value.
- `hutchinson_trace`: tr(H) = E[z^T H z] for Rademacher z, with its standard error.
- `hessian_spectrum(layerwise=True)`: lambda_1 of each layer's diagonal Hessian block (the other weights
  fixed), as FedSOL/SAM-style layer-wise sharpness plots show it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fl_lightning.analysis.objective import SubsetObjective, unflatten

MatVec = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LanczosResult:
    eigenvalues: torch.Tensor  # every Ritz value, descending (float64)
    eigenvectors: torch.Tensor  # the top `k` Ritz vectors as rows (unit norm)
    residuals: torch.Tensor  # residual bound of every Ritz value, same order as eigenvalues
    num_matvecs: int

    @property
    def minimum(self) -> float:
        """The smallest Ritz value: an upper bound on lambda_min, exact once it has converged."""
        return float(self.eigenvalues[-1])


def lanczos(matvec: MatVec, dim: int, k: int = 5, max_iter: int = 40, tol: float = 1e-4,
            generator: torch.Generator | None = None, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> LanczosResult:
    """Top-k eigenpairs (and all Ritz values) of a symmetric operator given by `matvec`.

    Args:
        matvec: v -> H v on flat vectors of length `dim`.
        k: eigenpairs wanted; the iteration stops when the top k have converged to `tol`.
        max_iter: at most this many products (capped at `dim`: the Krylov space is then all of R^dim).
        generator: draws the start vector (seeded: the same operator gives the same numbers).
    """
    if not 1 <= k <= dim:
        raise ValueError(f"k must be in [1, {dim}] (the number of parameters), got {k}")
    m = min(max(max_iter, k), dim)
    basis = torch.zeros(m, dim, dtype=dtype, device=device)
    q = torch.randn(dim, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    q /= q.norm()
    alphas: list[float] = []
    betas: list[float] = []
    evals = evecs = None
    for j in range(m):
        basis[j] = q
        w = matvec(q).to(dtype)
        alpha = float(torch.dot(w.double(), q.double()))
        w = w - alpha * q - (betas[-1] * basis[j - 1] if j > 0 else 0.0)
        for _ in range(2):  # full reorthogonalisation, twice is enough in floating point
            w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta = float(w.double().norm())
        alphas.append(alpha)
        evals, evecs = _tridiagonal_eigh(alphas, betas)
        residual = (beta * evecs[-1, :]).abs()
        top = torch.arange(len(alphas) - 1, max(len(alphas) - 1 - k, -1), -1)
        converged = len(alphas) >= k and bool((residual[top] <= tol * evals[top].abs().clamp_min(1e-12)).all())
        if converged or beta <= 1e-10 * max(abs(alpha), 1.0) or j == m - 1:
            break
        betas.append(beta)
        q = w / beta
    n = len(alphas)
    order = torch.arange(n - 1, -1, -1)
    evals, evecs, residual = evals[order], evecs[:, order], residual[order]
    # the tridiagonal problem is solved on the CPU, the Krylov basis lives on the model's device
    vectors = evecs[:, : min(k, n)].T.to(device=basis.device, dtype=dtype) @ basis[:n]
    vectors = vectors / vectors.norm(dim=1, keepdim=True)
    return LanczosResult(evals, vectors, residual, n)


def _tridiagonal_eigh(alphas: list[float], betas: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(alphas)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if n > 1:
        off = torch.tensor(betas[: n - 1], dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    return torch.linalg.eigh(t)  # ascending


def hutchinson_trace(matvec: MatVec, dim: int, probes: int = 20, generator: torch.Generator | None = None,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     ) -> tuple[float, float]:
    """(estimate, standard error) of tr(H) from `probes` Rademacher probes z: mean of z^T H z.
    Its variance per probe is 2 * sum_{i != j} H_ij^2, so the error shrinks as 1/sqrt(probes)."""
    if probes < 1:
        raise ValueError(f"probes must be >= 1, got {probes}")
    samples = []
    for _ in range(probes):
        z = (torch.randint(0, 2, (dim,), generator=generator) * 2 - 1).to(device=device, dtype=dtype)
        samples.append(float(torch.dot(matvec(z).double(), z.double())))
    values = torch.tensor(samples, dtype=torch.float64)
    stderr = float(values.std(unbiased=True) / probes**0.5) if probes > 1 else float("nan")
    return float(values.mean()), stderr


@dataclass
class Spectrum:
    top: list[float]  # lambda_1 >= ... >= lambda_k
    minimum: float
    trace: float | None
    trace_stderr: float | None
    layer_top: dict[str, float]
    num_hvps: int  # every product: Lanczos, trace probes, layer blocks
    lanczos_hvps: int
    top_residuals: list[float]  # ||H y_i - lambda_i y_i|| bound of each top Ritz pair (converged: small)
    top_vectors: list[dict[str, torch.Tensor]]  # eigenvectors of the top eigenvalues, by parameter name

    def scalars(self) -> dict[str, float]:
        out = {f"lambda_{i + 1}": v for i, v in enumerate(self.top)}
        if len(self.top) >= 2 and self.top[-1] != 0:
            out[f"lambda_1_over_lambda_{len(self.top)}"] = self.top[0] / self.top[-1]
        out["lambda_min"] = self.minimum
        if self.trace is not None:
            out["trace"], out["trace_stderr"] = self.trace, self.trace_stderr
        out.update({f"layer_lambda_1/{name}": v for name, v in self.layer_top.items()})
        out["hvps"], out["lanczos_hvps"] = float(self.num_hvps), float(self.lanczos_hvps)
        out["lambda_1_rel_residual"] = self.top_residuals[0] / max(abs(self.top[0]), 1e-30)
        return out


def layer_groups(objective: SubsetObjective) -> dict[str, list[str]]:
    """Parameters grouped by the module that owns them ("fc.0" holds fc.0.weight and fc.0.bias)."""
    groups: dict[str, list[str]] = {}
    for name in objective.params:
        groups.setdefault(name.rpartition(".")[0] or name, []).append(name)
    return groups


def hessian_spectrum(objective: SubsetObjective, k: int = 5, max_iter: int = 40, tol: float = 1e-4,
                     trace_probes: int = 0, layerwise: bool = False, layer_iter: int = 20,
                     seed: int = 0, progress=None) -> Spectrum:
    """Top-k and minimum eigenvalues (Lanczos), optionally the Hutchinson trace and each layer's
    lambda_1, all from one seeded generator so the same weights give the same numbers.

    `progress` (a `progress.StageBars`, or None) is told of each stage and each Hessian-vector
    product: on a large model and subset each product takes seconds and a stage minutes."""
    dim = objective.dim
    if not 1 <= k <= dim:
        raise ValueError(f"k = {k} but the model has {dim} parameters")
    device = next(iter(objective.params.values())).device
    generator = torch.Generator().manual_seed(seed)
    start = objective.num_hvps
    dtype = next(iter(objective.params.values())).dtype
    with _stage(progress, f"Hessian top-{k} eigenvalues", min(max(max_iter, k), dim), bound=True) as advance:
        result = lanczos(_counted(objective.hvp_flat, advance), dim, k, max_iter, tol, generator, device, dtype)
    top = [float(v) for v in result.eigenvalues[:k]]
    trace = stderr = None
    if trace_probes:
        with _stage(progress, "Hessian trace", trace_probes) as advance:
            trace, stderr = hutchinson_trace(_counted(objective.hvp_flat, advance), dim, trace_probes, generator,
                                             device, dtype)
    layer_top = {}
    if layerwise:
        blocks = {layer: objective.restricted(names) for layer, names in layer_groups(objective).items()}
        budget = sum(min(layer_iter, block.dim) for block in blocks.values())
        with _stage(progress, f"Hessian lambda_1 of {len(blocks)} layers", budget, bound=True) as advance:
            for layer, block in blocks.items():
                r = lanczos(_counted(block.hvp_flat, advance), block.dim, 1, layer_iter, tol, generator, device,
                            dtype)
                layer_top[layer] = float(r.eigenvalues[0])
                objective.num_hvps += block.num_hvps
    vectors = [unflatten(v, objective.params) for v in result.eigenvectors]
    residuals = [float(r) for r in result.residuals[:k]]
    return Spectrum(top, result.minimum, trace, stderr, layer_top, objective.num_hvps - start,
                    result.num_matvecs, residuals, vectors)



def _stage(progress, name: str, total: int, bound: bool = False):
    """A stage of `progress` counted in Hessian-vector products (nothing to tell without one)."""
    return contextlib.nullcontext(None) if progress is None else progress.stage(name, total, "hvp", bound)


def _counted(matvec: MatVec, advance) -> MatVec:
    if advance is None:
        return matvec

    def counted(v: torch.Tensor) -> torch.Tensor:
        out = matvec(v)
        advance(1)
        return out

    return counted
