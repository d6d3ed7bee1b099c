"""The training loss on a fixed sample subset as a pure function of the weights.

Every analysis (Hessian spectrum, trace, loss surfaces) evaluates the same function,
L(w) = mean_i loss(f(x_i; w), y_i) over a fixed subset, with the module in eval mode (BatchNorm
uses its running statistics, dropout is off), through `torch.func.functional_call` on detached
copies of the weights. So an analysis never writes a weight, a `.grad`, a BatchNorm buffer or the
global RNG of the run it looks at: training cannot tell whether it ran.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fl_lightning.evaluation import correct_predictions, eval_mode

Params = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In at least float32 (bfloat16 logits are widened; a float64 run's analyses stay float64)."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y, reduction="sum")


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Gradients on, also inside Lightning's validation, which runs under torch.inference_mode."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _outside_inference(t: torch.Tensor) -> torch.Tensor:
    """A tensor made under inference mode cannot be saved for backward: a normal copy of it."""
    return t.clone() if t.is_inference() else t


def flatten(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


def unflatten(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> Params:
    out, start = {}, 0
    for name, t in like.items():
        out[name] = flat[start : start + t.numel()].view_as(t)
        start += t.numel()
    return out


HVP_MODES = ("graph", "auto", "forward", "double")


@dataclass
class _GradientGraph:
    leaves: Params  # the weights as leaves of the graph
    grad: dict[str, torch.Tensor | None]  # dL/dw, built with create_graph=True (None: w unused)


class SubsetObjective:
    """L(w) over a fixed subset (x, y), differentiable in the named parameters `names`
    (default: every parameter that requires grad); the other parameters and all buffers are
    constants. Sums are taken in chunks of `chunk_size` samples to bound memory.

    Args:
        module: the model; called as `module(x)`, must return one row of scores per sample.
        x, y: the subset (already on the module's device).
        names: the parameters the function depends on (e.g. one layer's for a layer-wise spectrum).
        loss_fn: loss summed over a chunk (default cross-entropy); the objective divides by N.
        hvp_mode: how H v is computed (the same numbers up to float rounding, at different costs):
            "graph" (default): the first-order gradient of the whole subset is built once with
            `create_graph=True` and kept; every product is then one backward pass through it
            (v . grad L)' = H v. The forward pass and first backward are not repeated, which
            makes a product about 1.5x cheaper than recomputing it (benchmarks/analysis_cost.py),
            at the price of holding the subset's double-backward graph in memory (a few times
            the activations of one training batch per 100 samples; use the others if it does
            not fit). "forward": forward-over-reverse with torch.func (jvp of grad), recomputed
            per product and chunk (memory of one chunk). "double": double backward, recomputed
            per product and chunk. "auto": forward, falling back to double backward for modules
            with an op that has no forward-mode derivative.
    """

    def __init__(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, names: list[str] | None = None,
                 loss_fn: LossFn = cross_entropy_sum, chunk_size: int = 500,
                 hvp_mode: Literal["graph", "auto", "forward", "double"] = "graph"):
        if len(x) == 0:
            raise ValueError("the analysis subset is empty")
        self.module, self.loss_fn = module, loss_fn
        named = dict(module.named_parameters())
        chosen = [n for n, p in named.items() if p.requires_grad] if names is None else list(names)
        unknown = [n for n in chosen if n not in named]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown}")
        with torch.inference_mode(False):  # `analyze` runs in Lightning's validation (inference mode):
            # tensors made there cannot enter autograd, so the weights and the subset are copied out
            self.params: Params = {n: named[n].detach().clone() for n in chosen}
            x, y = (t.clone() if t.is_inference() else t for t in (x, y))
        self.constants: Params = {n: p.detach() for n, p in named.items() if n not in self.params}
        self.constants.update({n: b.detach() for n, b in module.named_buffers()})
        self.chunks = [(x[i : i + chunk_size], y[i : i + chunk_size]) for i in range(0, len(x), chunk_size)]
        self.num_samples = len(x)
        if hvp_mode not in HVP_MODES:
            raise ValueError(f"hvp_mode must be one of {HVP_MODES}, got {hvp_mode!r}")
        self.hvp_mode = hvp_mode
        self.num_hvps = 0
        self._graph: _GradientGraph | None = None  # "graph" mode, built at the first product
        self._graph_owner: SubsetObjective = self  # restricted() blocks share their parent's graph

    def restricted(self, names: list[str]) -> SubsetObjective:
        """The same function of `names` only, the other parameters held at their current values
        (its Hessian is the diagonal block of those parameters)."""
        block = copy.copy(self)
        block.params = {n: self.params[n] for n in names}
        block.constants = {**self.constants, **{n: t for n, t in self.params.items() if n not in block.params}}
        block.num_hvps = 0
        # H_block v = the block of H (v with zeros elsewhere): the parent's gradient graph serves
        block._graph_owner = self._graph_owner
        return block

    @property
    def dim(self) -> int:
        return sum(t.numel() for t in self.params.values())

    def _scores(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with eval_mode(self.module):
            return functional_call(self.module, {**self.constants, **params}, (x,), strict=True)

    def _chunk_loss(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self._scores(params, x), y) / self.num_samples

    # ---- values -------------------------------------------------------------------------------
    @torch.no_grad()
    def loss_and_accuracy(self, params: Mapping[str, torch.Tensor] | None = None) -> tuple[float, float]:
        """(mean loss, accuracy) at `params` (default: the weights the objective was built at)."""
        params = self.params if params is None else params
        loss, correct = 0.0, 0
        for x, y in self.chunks:
            scores = self._scores(params, x)
            loss += float(self.loss_fn(scores, y))
            if scores.dim() == 2:
                correct += int(correct_predictions(scores, y).sum())
        return loss / self.num_samples, correct / self.num_samples

    def shifted(self, *steps: tuple[float, Mapping[str, torch.Tensor]]) -> Params:
        """w + sum_i a_i d_i for (a_i, d_i) in `steps` (directions may cover a subset of names)."""
        out = dict(self.params)
        for a, d in steps:
            for n, t in d.items():
                out[n] = out[n] + a * t.to(out[n].dtype)
        return out

    # ---- Hessian-vector products --------------------------------------------------------------
    def hvp(self, v: Mapping[str, torch.Tensor]) -> Params:
        """H v with H the Hessian of L at the objective's weights (w.r.t. `names`)."""
        self.num_hvps += 1
        if self.hvp_mode == "graph":
            return self._hvp_through_gradient_graph(v)
        if self.hvp_mode in ("auto", "forward"):
            try:
                return self._hvp_forward_over_reverse(v)
            except (RuntimeError, NotImplementedError):
                if self.hvp_mode == "forward":
                    raise
                self.hvp_mode = "double"  # an op without a forward-mode derivative: fall back for good
        return self._hvp_double_backward(v)

    def _hvp_forward_over_reverse(self, v: Mapping[str, torch.Tensor]) -> Params:
        out = {n: torch.zeros_like(t) for n, t in self.params.items()}
        tangent = {n: v[n].to(t.dtype) for n, t in self.params.items()}
        for x, y in self.chunks:
            grad_fn = torch.func.grad(lambda p, x=x, y=y: self._chunk_loss(p, x, y))
            _, hv = torch.func.jvp(grad_fn, (self.params,), (tangent,))
            for n in out:
                out[n] += hv[n]
        return out

    def _hvp_double_backward(self, v: Mapping[str, torch.Tensor]) -> Params:
        out = {n: torch.zeros_like(t) for n, t in self.params.items()}
        for x, y in self.chunks:
            with autograd_enabled():
                leaves = {n: t.detach().requires_grad_(True) for n, t in self.params.items()}
                grads = torch.autograd.grad(self._chunk_loss(leaves, x, y), list(leaves.values()),
                                            create_graph=True, allow_unused=True)
                dot = sum((g * _outside_inference(v[n]).to(g.dtype)).sum()
                          for n, g in zip(leaves, grads, strict=True) if g is not None)
                if not isinstance(dot, torch.Tensor) or not dot.requires_grad:
                    continue  # L is linear in these parameters on this chunk: H v = 0
                hv = torch.autograd.grad(dot, list(leaves.values()), allow_unused=True)
            for n, h in zip(leaves, hv, strict=True):
                if h is not None:
                    out[n] += h.detach()
        return out

    def gradient_graph(self) -> _GradientGraph:
        """The first-order gradient of L at the weights, differentiable (built once, kept)."""
        owner = self._graph_owner
        if owner._graph is None:
            leaves = {n: t.detach().requires_grad_(True) for n, t in owner.params.items()}
            total: list[torch.Tensor | None] = [None] * len(leaves)
            with autograd_enabled():
                for x, y in owner.chunks:
                    grads = torch.autograd.grad(owner._chunk_loss(leaves, x, y), list(leaves.values()),
                                                create_graph=True, allow_unused=True)
                    total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads, strict=True)]
            owner._graph = _GradientGraph(leaves, dict(zip(leaves, total, strict=True)))
        return owner._graph

    def release_graph(self) -> None:
        """Frees the kept gradient graph (the next product in "graph" mode builds it again)."""
        self._graph_owner._graph = None

    def _hvp_through_gradient_graph(self, v: Mapping[str, torch.Tensor]) -> Params:
        graph = self.gradient_graph()
        names = list(self.params)
        with autograd_enabled():
            terms = [(graph.grad[n] * _outside_inference(v[n]).to(graph.grad[n].dtype)).sum() for n in names
                     if graph.grad[n] is not None and graph.grad[n].requires_grad]
            if not terms:  # L is at most linear in these parameters: H v = 0
                return {n: torch.zeros_like(self.params[n]) for n in names}
            hv = torch.autograd.grad(sum(terms), [graph.leaves[n] for n in names],
                                     retain_graph=True, allow_unused=True)
        return {n: torch.zeros_like(self.params[n]) if h is None else h.detach()
                for n, h in zip(names, hv, strict=True)}

    def hvp_flat(self, v: torch.Tensor) -> torch.Tensor:
        return flatten(self.hvp(unflatten(v, self.params)))
