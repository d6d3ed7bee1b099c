"""FedSOL (Lee et al., "FedSOL: Stabilized Orthogonal Learning with Proximal Restrictions in
Federated Learning") and its ablations.

Each local step takes the gradient of the local loss at weights perturbed along the gradient of a
proximal loss, so the update keeps little component along the proximal gradient (it becomes
orthogonal to it as rho grows):

    g_p = grad_w L_p(w; w_g)                       L_p = KL(softmax(z_g/T) || softmax(z/T)), T = 3,
                                                         or FedProx's (mu/2)||w - w_g||^2
    eps = rho * Lambda (.) g_p / ||g_p||_2         Lambda = 1 (fixed) or |w - w_g| / ||w - w_g||_2 per layer
    w  <- SGD step with grad_w L_CE(f(w + eps))     (only the perturbed tensors move by eps)

The perturbed forward pass uses `torch.func.functional_call` with w + eps as *new* tensors, so the
model's weights are never modified and need no restoring: they are bit-for-bit what they were
(the exactness that "restore by copy, not by subtraction" asks for), and the gradient w.r.t. w
equals the gradient at w + eps because eps is a constant. With head-only perturbation the body's
features are computed once and reused by both passes.

Also here, because they share the proximal losses:
- `strategy` A0..A6, the perturbation ablation of the paper (Table 12 / Table 6 of the two
  versions; their prose lists describe A2 and A3 identically, the table formulas are the
  definition used). eps_p is the perturbation above, eps_c the same built from the combined
  gradient g_l + beta * g_p:
      A0  L_local(w)                                        FedAvg
      A1  L_local(w + eps_p)                                FedSOL (default)
      A2  L_local(w) + beta * L_p(w + eps_p)
      A3  L_local(w + eps_p) + beta * L_p(w + eps_p)
      A4  L_local(w + eps_c) + beta * L_p(w + eps_c)        SAM on the combined loss
      A5  L_local(w) + beta * L_p(w)                        proximal restriction (table: beta = 1)
      A6  L_local(w + eps_p) + beta * L_p(w)
- `ProximalProjection`, the direct gradient projection of paper eq. 3 (Table 1).

Proximal losses plug in by overriding `ProximalMethod.proximal_loss` (and
`proximal_vanishes_at_global` if their gradient is not zero at w == w_g); MOON, FedDyn, SCAFFOLD
and FedNova terms ("Combined", paper Table 4) are meant to arrive that way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

from fl_lightning import compat, loss_scaling
from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import PADDED_LABEL, abstract_base
from fl_lightning.methods.shared_model import SharedModelMethod

Scope = Literal["head", "body", "all"]


@dataclass(frozen=True)
class Strategy:
    """One row of the perturbation ablation (module docstring): where the local loss and L_p are
    evaluated, and what sets the perturbation.

    Attributes:
        perturbs: whether the step is perturbed at all (A0 and A5 are not).
        direction: "prox" (eps_p, from g_p) or "combined" (eps_c, from g_l + beta * g_p).
        local_at: the local loss at "w" or at the perturbed "w+eps".
        prox_at: the beta * L_p term at "w", at "w+eps", or None (no such term).
    """

    perturbs: bool
    direction: Literal["prox", "combined"]
    local_at: Literal["w", "w+eps"]
    prox_at: Literal["w", "w+eps"] | None


STRATEGIES = {
    "A0": Strategy(False, "prox", "w", None),  # FedAvg
    "A1": Strategy(True, "prox", "w+eps", None),  # FedSOL
    "A2": Strategy(True, "prox", "w", "w+eps"),
    "A3": Strategy(True, "prox", "w+eps", "w+eps"),
    "A4": Strategy(True, "combined", "w+eps", "w+eps"),  # SAM on the combined loss
    "A5": Strategy(False, "prox", "w", "w"),  # proximal restriction
    "A6": Strategy(True, "prox", "w+eps", "w"),
}


def kl_proximal_loss(logits: torch.Tensor, global_logits: torch.Tensor, temperature: float,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(z_g/T) || softmax(z/T)), batch mean over all classes, no T^2 factor. With `valid`
    (which of the batch's samples are real: the vectorised engine pads batches to one size), the
    mean over the valid samples only."""
    log_p, q = F.log_softmax(logits / temperature, dim=1), F.softmax(global_logits / temperature, dim=1)
    if valid is None:
        return F.kl_div(log_p, q, reduction="batchmean")
    weights = valid.to(log_p.dtype)
    return (F.kl_div(log_p, q, reduction="none").sum(dim=1) * weights).sum() / weights.sum()


def l2_proximal_loss(params: Mapping[str, torch.Tensor], global_params: Mapping[str, torch.Tensor],
                     mu: float) -> torch.Tensor:
    """FedProx: (mu/2) * sum over tensors of ||w - w_g||^2."""
    return 0.5 * mu * sum(((p - global_params[n]) ** 2).sum() for n, p in params.items())


def sol_perturbation(
    params: list[torch.Tensor],
    prox_grads: list[torch.Tensor],
    global_params: list[torch.Tensor],
    rho: float,
    adaptive: Literal["layer", "dim0", "none"],
    min_grad_norm: float = 1e-8,
) -> list[torch.Tensor]:
    """eps = rho * Lambda (.) g_p / (||g_p||_2 + 1e-12), zero when ||g_p|| < min_grad_norm.

    The guard matters for the fixed radius: at the first local step w == w_g, so g_p is zero up
    to rounding and normalising it would blow noise up to length rho. Adaptive Lambda is zero
    there anyway (w - w_g = 0), which the clamp below keeps from becoming 0/0.
    """
    grad_norm = torch.sqrt(sum((_wide(g) ** 2).sum() for g in prox_grads))
    scale = rho / (grad_norm + 1e-12) * (grad_norm >= min_grad_norm)
    eps = []
    for w, g, wg in zip(params, prox_grads, global_params, strict=True):
        if adaptive == "none":
            lam = 1.0
        else:
            diff = (w.detach() - wg).abs()
            if adaptive == "layer":  # paper eq. 7: normalised within the layer
                lam = diff / diff.norm().clamp_min(1e-30)
            else:  # "dim0", the official code: F.normalize(|w - w_g|, dim=0)
                lam = F.normalize(diff, dim=0)
        eps.append((scale * lam * g).to(w.dtype))
    return eps


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in at least float32 for norms and inner products (bfloat16 -> float32; float64 stays)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def project_out_conflict(grads: list[torch.Tensor], prox_grads: list[torch.Tensor],
                         min_grad_norm: float = 1e-8) -> tuple[list[torch.Tensor], bool]:
    """Paper eq. 3: g_l - (g_l^T g_p / g_p^T g_p) g_p if g_l^T g_p < 0, else g_l unchanged.
    Inner products are over all the given tensors as one vector. Returns (gradients, projected?),
    projected a 0-dim bool tensor: the choice stays on the device (no host sync every local step;
    where nothing is projected the coefficient is 0 and g_l comes back exactly)."""
    dot = sum((_wide(g) * _wide(p)).sum() for g, p in zip(grads, prox_grads, strict=True))
    sq = sum((_wide(p) ** 2).sum() for p in prox_grads)
    projected = (sq >= min_grad_norm**2) & (dot < 0)
    coef = torch.where(projected, dot / sq.clamp_min(torch.finfo(sq.dtype).tiny), torch.zeros_like(dot))
    return [g - (coef * p).to(g.dtype) for g, p in zip(grads, prox_grads, strict=True)], projected


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """cos between two vectors given as lists of tensors (float32 sums)."""
    dot = sum((u.float() * g.float()).sum() for u, g in zip(a, b, strict=True))
    na = torch.sqrt(sum((u.float() ** 2).sum() for u in a))
    nb = torch.sqrt(sum((g.float() ** 2).sum() for g in b))
    return dot / (na * nb).clamp_min(1e-12)


class _FeaturesAndLogits(nn.Module):
    """Lets one functional_call return both the features and the logits of a model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.model.features(x)
        return features, self.model.head(features)


@abstract_base
class ProximalMethod(SharedModelMethod):
    """Shared by FedSOL and the projection baseline: the proximal loss L_p(w; w_g).

    Args:
        proximal: "kl" (KL to the global model's tempered softmax) or "l2" (FedProx).
        temperature: softmax temperature of the KL proximal loss.
        mu: weight of the L2 proximal loss (only its direction matters to FedSOL's perturbation
            and to the projection; it matters to the combined-loss strategies A2..A6).
    """

    needs_global_model = True

    def __init__(self, proximal: Literal["kl", "l2"] = "kl", temperature: float = 3.0, mu: float = 1.0,
                 **kwargs):
        super().__init__(**kwargs)
        if proximal not in ("kl", "l2"):
            raise FLUserError(f"proximal must be kl or l2, got '{proximal}'")
        if temperature <= 0 or mu < 0:
            raise FLUserError(f"temperature must be > 0 and mu >= 0, got {temperature} and {mu}")
        self.save_hyperparameters()
        self._step_cache: dict[str, object] = {}

    # ---- the pluggable proximal loss ----------------------------------------------------------
    def proximal_loss(self, x: torch.Tensor, features: torch.Tensor, logits: torch.Tensor,
                      params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """L_p of the model evaluated at `params` (every trainable tensor by name, perturbed ones
        replaced), whose forward on `x` gave `features` and `logits`. Gradients must flow from the
        result to `params`. Override to plug in another proximal term; per-step values shared by
        several evaluations (e.g. the global model's outputs) go through `step_cached`."""
        if self.hparams.proximal == "l2":
            g = self.global_params()
            return l2_proximal_loss(params, g, self.hparams.mu)
        global_logits = self.step_cached("global_logits", lambda: self.global_model(x))
        return kl_proximal_loss(logits, global_logits, self.hparams.temperature, self._step_cache.get("valid"))

    @property
    def proximal_vanishes_at_global(self) -> bool:
        """True when grad L_p is exactly zero at w == w_g (KL and L2: both are minimal there), so a
        client's first step can take it as zero instead of computing rounding noise. Override
        with False for terms with a non-zero gradient there (e.g. FedDyn's linear term)."""
        return True

    def step_cached(self, key: str, compute: Callable[[], object]):
        if key not in self._step_cache:
            with torch.no_grad():
                self._step_cache[key] = compute()
        return self._step_cache[key]

    # ---- helpers ------------------------------------------------------------------------------
    def trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def scoped_names(self, scope: Scope) -> list[str]:
        head = self.model.head_parameter_names()
        names = list(self.trainable())
        if scope == "head":
            return [n for n in names if n in head]
        if scope == "body":
            return [n for n in names if n not in head]
        return names

    def forward_at(self, x: torch.Tensor, params: Mapping[str, torch.Tensor] | None = None,
                   features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) at the model's own weights (params None) or at `params`. Pass the
        unperturbed `features` when only head tensors differ: the body's pass is then reused."""
        if params is None:
            features = self.model.features(x)
            return features, self.model.head(features)
        if features is not None:
            head = {n.removeprefix("head."): t for n, t in params.items() if n.startswith("head.")}
            return features, functional_call(self.model.head, head, (features,), strict=False)
        prefixed = {f"model.{n}": t for n, t in params.items()}
        return functional_call(_FeaturesAndLogits(self.model), prefixed, (x,), strict=False)

    def _plain_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        self.sgd_step(loss)
        self.log_local({"train/loss": loss}, len(y))
        return loss.detach()

    def _grads(self, loss: torch.Tensor, params: list[torch.Tensor], retain_graph: bool,
               ) -> list[torch.Tensor]:
        """d loss / d params (zeros where the loss does not depend on a tensor), averaged over devices."""
        # through 16-mixed's loss scaler: a small L_p's float16 gradients would underflow to zero
        scaler = loss_scaling.scaler_of(compat.attached_trainer(self))
        grads = loss_scaling.grad(loss, params, scaler, retain_graph=retain_graph, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]
        return self.mean_across_devices(grads)


class FedSOL(ProximalMethod):
    """FedSOL with a pluggable proximal loss and the A0..A6 perturbation ablation.

    Args:
        rho: perturbation radius (paper best 2.0; the official configs use 1.0).
        adaptive: "layer" (paper eq. 7), "dim0" (official code) or "none" (fixed radius).
        perturb: which tensors are perturbed: "head" (partial, paper default), "body" or "all".
        strategy: "A1" = FedSOL; A0 and A2..A6 are the paper's ablations (module docstring).
        beta: weight of L_p in the combined-loss strategies A2..A6.
        min_grad_norm: below this ||g_p|| the step is unperturbed (first-step guard).
        cosine_scope: the tensors `fedsol/cos_update_prox`, cos(g_u, g_p) with
            g_u = grad L_local(w + eps_p) and g_p = grad L_p(w; w_g), is taken over. "perturbed"
            (default): the perturbed tensors, on which g_p is computed for the perturbation anyway,
            so a step costs what the paper says (its Appendix I: two backward passes, FedSOL(head)
            33% over FedAvg). "all": every trainable tensor, the whole-model vectors the paper's
            Fig. 3 plots and its Prop. 1 is about; with head perturbation that is one more
            backward of L_p through the body a step (on the FedAvg CNN a round takes 1.19x a plain
            FedSOL(head) round's, against 1.01x with "perturbed": benchmarks/core_overhead.py
            --only ii). The training is the same with either.
        proximal, temperature, mu: the proximal loss (`ProximalMethod`).
    """

    def __init__(
        self,
        rho: float = 2.0,
        adaptive: Literal["layer", "dim0", "none"] = "layer",
        perturb: Scope = "head",
        strategy: Literal["A0", "A1", "A2", "A3", "A4", "A5", "A6"] = "A1",
        beta: float = 1.0,
        min_grad_norm: float = 1e-8,
        cosine_scope: Literal["all", "perturbed"] = "perturbed",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if cosine_scope not in ("all", "perturbed"):
            raise FLUserError(f"cosine_scope must be all or perturbed, got '{cosine_scope}'")
        if rho < 0:
            raise FLUserError(f"rho must be >= 0, got {rho}")
        if beta < 0 or min_grad_norm < 0:
            raise FLUserError(f"beta and min_grad_norm must be >= 0, got {beta} and {min_grad_norm}")
        if strategy not in STRATEGIES:
            raise FLUserError(f"strategy must be one of {', '.join(STRATEGIES)}, got '{strategy}'")
        self.save_hyperparameters()

    vectorized = True  # strategies A0 and A1 (`vectorized_loss`)

    def perturbed_names(self) -> list[str]:
        return self.scoped_names(self.hparams.perturb)

    # ---- the vectorised engine (vectorized.py) ------------------------------------------------
    @property
    def vectorized_padding(self) -> bool:
        """The engine may pad batches (`FederatedMethod.vectorized_padding`): the cross-entropy
        ignores padded labels, the KL term leaves the padded samples out (`vectorized_loss` marks
        them) and the L2 term is free of the batch. A subclass's own proximal term may not."""
        return type(self).proximal_loss is FedSOL.proximal_loss

    def vectorized_refusal(self) -> str | None:
        if self.hparams.strategy not in ("A0", "A1"):
            return f"strategy {self.hparams.strategy} (A0 and A1 run vectorised)"
        return None

    def vectorized_loss(self, model, batch, step: int):
        """`minibatch_step`'s A1 (and A0) in torch.func's terms: the same forward passes, proximal
        loss and `sol_perturbation`, with g_p taken by `torch.func.grad` and detached (eps is a
        constant, as `torch.autograd.grad` makes it); the CE at w + eps is what the engine
        differentiates. g_p rides along in the logs for the logged cosine (`vectorized_logs`)."""
        x, y = batch
        h = self.hparams
        self._step_cache = {"valid": y != PADDED_LABEL}  # the samples of a batch the engine padded to size
        if h.strategy == "A0" or (step == 0 and self.proximal_vanishes_at_global):  # `minibatch_step`'s plain step
            loss = F.cross_entropy(model(x), y)
            return loss, {"train/loss": loss}
        named = self.trainable()
        names = self.perturbed_names()
        # g_p on the unperturbed tensors too when the logged cosine is over all of them
        grad_names = names + ([n for n in named if n not in names] if h.cosine_scope == "all" else [])
        features, logits = self.forward_at(x)
        reuse = all(n.startswith("head.") for n in grad_names)  # g_p needs no pass through the body

        def prox_at(part: dict[str, torch.Tensor]) -> torch.Tensor:
            params = {**named, **part}
            f, z = self.forward_at(x, params, features.detach() if reuse else None)
            return self.proximal_loss(x, f, z, params)

        direction, prox = grad_and_value(prox_at)({n: named[n].detach() for n in grad_names})
        direction = {n: g.detach() for n, g in direction.items()}
        global_params = self.global_params()
        eps = sol_perturbation([named[n].detach() for n in names], [direction[n] for n in names],
                               [global_params[n] for n in names], h.rho, h.adaptive, h.min_grad_norm)
        perturbed = dict(named)
        perturbed.update({n: named[n] + e for n, e in zip(names, eps, strict=True)})
        head_only = all(n.startswith("head.") for n in names)
        _, logits_p = self.forward_at(x, perturbed, features if head_only else None)
        loss = F.cross_entropy(logits_p, y)
        self._step_cache = {}  # nothing of a vectorised step outlives it
        return loss, {"train/loss": loss, "fedsol/prox_loss": prox.detach(), "g_p": direction}

    def vectorized_logs(self, logs, grads):
        """`_log`'s cosines, from the engine's gradients (g_u) and the step's g_p."""
        direction = logs.pop("g_p", None)
        if direction is None:
            return logs
        names = list(direction)
        update, prox_grads = [grads[n] for n in names], [direction[n] for n in names]
        logs["fedsol/cos_update_prox"] = _cosine(update, prox_grads)
        perturbed = len(self.perturbed_names())
        if perturbed < len(names):
            logs["fedsol/cos_update_prox_perturbed"] = _cosine(update[:perturbed], prox_grads[:perturbed])
        return logs

    def minibatch_step(self, batch):
        x, y = batch
        h = self.hparams
        strategy = STRATEGIES[h.strategy]
        self._step_cache = {}
        # w == w_g on a client's first step: the KL and L2 proximal gradients are exactly zero
        # there, so eps_p = 0 and every L_p term has zero gradient: the step is plain SGD.
        # Computing it numerically would give rounding noise of ~1e-8 that the fixed radius
        # would blow up to length rho. Only A4's perturbation (from g_l) is non-zero there.
        prox_is_zero = self.local_step == 0 and self.proximal_vanishes_at_global
        if (not strategy.perturbs and strategy.prox_at is None) or (prox_is_zero and strategy.direction == "prox"):
            return self._plain_step(x, y)
        named = self.trainable()
        features, logits = self.forward_at(x)
        prox = None if prox_is_zero else self.proximal_loss(x, features, logits, named)
        if not strategy.perturbs:  # A5: L_local(w) + beta * L_p(w)
            loss = F.cross_entropy(logits, y) + h.beta * prox
            self.sgd_step(loss)
            self._log(loss, prox, len(y))
            return loss.detach()
        return self._perturbed_step(strategy, x, y, named, features, logits, prox, prox_is_zero)

    def _perturbed_step(self, strategy: Strategy, x, y, named, features, logits, prox, prox_is_zero: bool):
        h = self.hparams
        names = self.perturbed_names()
        params = [named[n] for n in names]
        head_only = all(n.startswith("head.") for n in names)
        # the graph at w is needed again to reuse the body's features, or for a term at w
        keep_graph = head_only or strategy.local_at == "w" or strategy.prox_at == "w"
        # g_p on the tensors that are not perturbed, only for the logged cosine (not for training)
        logs_cosine = strategy.direction == "prox"
        unperturbed = [n for n in named if n not in names] if h.cosine_scope == "all" and logs_cosine else []
        direction = self._grads(self._direction_loss(strategy, logits, y, prox), params,
                                retain_graph=keep_graph or bool(unperturbed))
        rest = self._grads(prox, [named[n] for n in unperturbed], retain_graph=keep_graph) if unperturbed else []
        global_params = self.global_params()
        eps = sol_perturbation(params, direction, [global_params[n] for n in names], h.rho, h.adaptive,
                               h.min_grad_norm)
        perturbed = dict(named)
        perturbed.update({n: p + e for n, p, e in zip(names, params, eps, strict=True)})
        features_p, logits_p = self.forward_at(x, perturbed, features if head_only else None)
        # A4's first step has a perturbation from g_l alone and no L_p yet
        no_prox_yet = prox_is_zero and not any(bool(e.any()) for e in eps)
        loss = self._strategy_loss(strategy, x, y, logits, prox, features_p, logits_p, perturbed, no_prox_yet)
        self.sgd_step(loss)
        cos_params = params + [named[n] for n in unperturbed]
        self._log(loss, prox, len(y), cos_params, direction + rest if logs_cosine else None, len(params))
        return loss.detach()

    def _direction_loss(self, strategy: Strategy, logits, y, prox):
        """What the perturbation follows: L_p (eps_p), or L_local + beta * L_p (eps_c, A4)."""
        if strategy.direction == "prox":
            return prox
        return F.cross_entropy(logits, y) + (0.0 if prox is None else self.hparams.beta * prox)

    def _strategy_loss(self, strategy: Strategy, x, y, logits, prox, features_p, logits_p, perturbed,
                       no_prox_yet: bool):
        """The strategy's row: L_local at w or w + eps, plus beta * L_p at w or w + eps (or none)."""
        loss = F.cross_entropy(logits_p if strategy.local_at == "w+eps" else logits, y)
        if strategy.prox_at == "w":
            return loss + self.hparams.beta * prox
        if strategy.prox_at == "w+eps" and not no_prox_yet:
            return loss + self.hparams.beta * self.proximal_loss(x, features_p, logits_p, perturbed)
        return loss

    @torch.no_grad()
    def _log(self, loss, prox, batch_size: int, params=None, prox_grads=None, num_perturbed: int = 0) -> None:
        """Mean proximal loss and cos(g_u, g_p) per step, averaged over the round's steps: g_u =
        grad L_local(w + eps_p) (p.grad after the step: the optimizer adds momentum and weight
        decay out of place), g_p = grad L_p at the unperturbed w, over `params` (`cosine_scope`),
        whose first `num_perturbed` are the perturbed tensors. The paper's Fig. 3 shows it moving
        towards 0 as rho grows. With scope "all" and tensors left unperturbed, the perturbed
        tensors' own cosine is logged too (`fedsol/cos_update_prox_perturbed`)."""
        metrics = {"train/loss": loss.detach()}
        if prox is not None:
            metrics["fedsol/prox_loss"] = prox.detach()
        if prox_grads is not None:
            update = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            metrics["fedsol/cos_update_prox"] = _cosine(update, prox_grads)
            if num_perturbed < len(params):
                metrics["fedsol/cos_update_prox_perturbed"] = _cosine(update[:num_perturbed],
                                                                      prox_grads[:num_perturbed])
        self.log_local(metrics, batch_size)


class ProximalProjection(ProximalMethod):
    """Direct proximal gradient projection (FedSOL paper eq. 3, "Projection" in Table 1): the
    local gradient g_l = grad CE(w) loses its component along g_p = grad L_p(w; w_g) when the two
    conflict (g_l^T g_p < 0); otherwise g_l is used as is. The paper reports it *below* FedAvg;
    it is here as the baseline FedSOL's implicit orthogonality is compared with.

    Args:
        scope: the tensors g_l and g_p are taken on for the projection ("all": the paper's whole
            gradient vector); the other tensors step with their plain g_l.
        min_grad_norm: below this ||g_p|| nothing is projected (first step: g_p = 0 exactly).
        proximal, temperature, mu: the proximal loss (`ProximalMethod`).
    """

    def __init__(self, scope: Scope = "all", min_grad_norm: float = 1e-8, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self._prox_grads: list[torch.Tensor] | None = None  # this step's g_p, set before sgd_step
        self._projection_params: list[torch.Tensor] = []
        self._projected = False

    def minibatch_step(self, batch):
        x, y = batch
        self._step_cache = {}
        self._prox_grads = None
        if self.local_step == 0 and self.proximal_vanishes_at_global:
            return self._plain_step(x, y)  # g_p = 0 at w == w_g: nothing to project
        named = self.trainable()
        params = [named[n] for n in self.scoped_names(self.hparams.scope)]
        features, logits = self.forward_at(x)
        prox = self.proximal_loss(x, features, logits, named)
        self._prox_grads = self._grads(prox, params, retain_graph=True)
        self._projection_params = params
        loss = F.cross_entropy(logits, y)
        self.sgd_step(loss)  # after_backward projects p.grad before the optimizer sees it
        projected = torch.as_tensor(self._projected, dtype=torch.float32, device=loss.device)  # no sync
        self.log_local({"train/loss": loss, "projection/prox_loss": prox, "projection/projected": projected},
                       len(y))
        return loss.detach()

    @torch.no_grad()
    def after_backward(self) -> None:
        super().after_backward()
        self._projected = False
        if self._prox_grads is None:
            return
        params = self._projection_params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        new, self._projected = project_out_conflict(grads, self._prox_grads, self.hparams.min_grad_norm)
        for p, g in zip(params, new, strict=True):  # unchanged where nothing was projected
            p.grad = g
