"""Frozen-classifier methods: the shared machinery.

FedBABU, SphereFed, FedETF, FedGELA, dot-regression and FedDr+ all keep the classifier fixed for
the whole run, so every client aligns its features to one common classifier. This file holds what
they share:

- `simplex_etf(d, C, seed)`: V = sqrt(C/(C-1)) B (I - 11^T/C) with B the reduced QR of a random
  d x C matrix, returned as C rows v_c (unit vectors, pairwise cosine -1/(C-1));
  `orthonormal_classifier(d, C, seed)`: C orthonormal rows (SphereFed).
- `FixedClassifier`: logits = f @ V^T, or cosines normalise(f) @ V^T. V is a parameter with
  requires_grad False, so it is in the state dict (checkpoints, every client) but never in the
  optimizer (base `local_parameters()` skips it) and receives no weight decay.
- `FrozenClassifierMethod`: never uploads the frozen tensors (the server step keeps them as they were),
  so they stay bit-identical (an average of identical float tensors need not be); optional
  per-round analyses of the paper (feature-classifier alignment and local-vs-global feature
  distance/angle, on each client's observed and unobserved classes).

V is drawn from a torch.Generator seeded with `classifier_seed`, so the server, every client and
every process build the same V without communicating it.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning import compat
from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import as_model_input, model_dtype
from fl_lightning.methods.base import LossContext, abstract_base
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.models import FLModel, build_model
from fl_lightning.uploads import ClientUpload


def _orthonormal_columns(d: int, num_classes: int, seed: int) -> torch.Tensor:
    if d < num_classes:
        raise FLUserError(f"a fixed ETF/orthonormal classifier needs feature dim >= classes, got "
                          f"{d} < {num_classes}; use a model with wider features")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, num_classes, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(a, mode="reduced")  # d x C, orthonormal columns
    return q


def simplex_etf(d: int, num_classes: int, seed: int = 0) -> torch.Tensor:
    """Rows v_1..v_C of a simplex ETF in R^d: unit norm, cos(v_i, v_j) = -1/(C-1)."""
    b = _orthonormal_columns(d, num_classes, seed)
    ones = torch.full((num_classes, num_classes), 1.0 / num_classes, dtype=torch.float64)
    center = torch.eye(num_classes, dtype=torch.float64) - ones
    v = math.sqrt(num_classes / (num_classes - 1)) * b @ center  # d x C
    return v.T.contiguous()  # float64; FixedClassifier keeps it exact in a float64 run


def orthonormal_classifier(d: int, num_classes: int, seed: int = 0) -> torch.Tensor:
    """C orthonormal rows in R^d (SphereFed's fixed classifier), in float64."""
    return _orthonormal_columns(d, num_classes, seed).T.contiguous()


class FixedClassifier(nn.Module):
    """A bias-free linear classifier with fixed weight V (C x d); `cosine` normalises features.

    The weight is a parameter in the default dtype (float32), built from `weight`'s exact values,
    which are kept: converted to float64 (`--trainer.precision 64-true`), the module takes them
    again instead of widening the float32 rounding, so an ETF's unit norms and -1/(C-1) cosines
    hold to float64 precision there too (they held to ~1e-7)."""

    def __init__(self, weight: torch.Tensor, cosine: bool):
        super().__init__()
        self._exact = weight.detach().to(torch.float64, copy=True)  # not state: rebuilt from the seed
        self.weight = nn.Parameter(weight.detach().to(torch.get_default_dtype(), copy=True), requires_grad=False)
        self.cosine = cosine

    @compat.overrides_module_internal  # every dtype conversion goes through it
    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self.weight.dtype == torch.float64:
            with torch.no_grad():
                self.weight.copy_(self._exact.to(self.weight.device))
        return self

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.cosine:
            features = F.normalize(features, dim=1)
        return features @ self.weight.T


def make_fixed_head(model: FLModel, kind: Literal["etf", "orthonormal"], cosine: bool,
                    seed: int) -> FixedClassifier:
    num_classes = model.head.out_features
    build = simplex_etf if kind == "etf" else orthonormal_classifier
    return FixedClassifier(build(model.feature_dim, num_classes, seed), cosine)


def dot_regression_loss(features: torch.Tensor, y: torch.Tensor, classifier: torch.Tensor) -> torch.Tensor:
    """L_DR = mean_b 0.5 (cos(f(x_b), v_{y_b}) - 1)^2 (Yang et al., 2022)."""
    cos = F.cosine_similarity(features, classifier[y], dim=1)
    return 0.5 * ((cos - 1.0) ** 2).mean()


def feature_distillation_loss(features: torch.Tensor, teacher_features: torch.Tensor) -> torch.Tensor:
    """L_FD = mean_b (1/d) ||f(x_b) - f_g(x_b)||^2 on raw (unnormalised) features."""
    return ((features - teacher_features) ** 2).sum(dim=1).mean() / features.shape[1]


@abstract_base
class FrozenClassifierMethod(SharedModelMethod):
    """Base of the frozen-classifier family. Subclasses choose the head in `build_network` and their
    local objective in `loss(model, batch, context)` (the one loss hook, also used by personalised
    fine-tuning with the method's own loss, e.g. FedDr+FT; `context.teacher` is the frozen model
    training started from, `context.class_counts` the client's class counts).

    Args:
        classifier_seed: seed of the fixed classifier V (the same V on the server and all clients).
        analysis: log per round, for the sampled local models on a fixed subset of the global test
            set, cos(f(x), v_y) and the distance/angle (degrees) between local and round-start
            global features, separately for each client's observed and unobserved classes.
        analysis_samples: size of that test subset.
    """

    # (kind, cosine logits) of the fixed classifier that replaces the model's head; subclasses with
    # another head (FedBABU's random linear head, FedETF's projected ETF) override build_network.
    fixed_head: tuple[Literal["etf", "orthonormal"], bool] | None = None

    def __init__(self, classifier_seed: int = 0, analysis: bool = False, analysis_samples: int = 1000,
                 **kwargs):
        self._classifier_seed = classifier_seed  # build_network runs inside super().__init__
        super().__init__(**kwargs)
        self.save_hyperparameters()
        if analysis:
            self.needs_global_model = True  # the analysis compares against the round-start model
        self.client_counts: torch.Tensor | None = None
        self._analysis_loader = None

    def build_network(self, name: str, spec) -> FLModel:
        model = build_model(name, spec)
        if self.fixed_head is not None:
            kind, cosine = self.fixed_head
            model.head = make_fixed_head(model, kind, cosine=cosine, seed=self._classifier_seed)
        return model

    # ---- frozen tensors -----------------------------------------------------------------------
    def frozen_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if not p.requires_grad]

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        dm = getattr(compat.attached_trainer(self), "datamodule", None)
        if dm is not None and hasattr(dm, "client_class_counts"):
            self.client_counts = torch.as_tensor(dm.client_class_counts(client), dtype=torch.float32,
                                                 device=self.device)

    def client_end(self) -> ClientUpload:
        upload = super().client_end()
        for name in self.frozen_names():  # never communicated: every party already holds V
            upload.weights.pop(name, None)
        if self.hparams.analysis:
            upload.stats.update(self.alignment_stats())
        return upload

    # ---- objective ----------------------------------------------------------------------------
    def loss_context(self) -> LossContext:
        """Also the client's class counts (FedGELA's and FedETF's locally adapted losses)."""
        return LossContext(teacher=self.global_model if self.needs_global_model else None,
                           class_counts=self.client_counts)

    # ---- analyses -----------------------------------------------------------------------------
    def classifier_vectors(self) -> torch.Tensor:
        """The class vectors v_c the features should align with (rows of the head's weight)."""
        return self.model.head.weight

    @torch.no_grad()
    def alignment_stats(self) -> dict[str, float]:
        if self._analysis_loader is None:
            dm = self.trainer.datamodule
            self._analysis_loader = dm.global_test_subset_loader(self.hparams.analysis_samples)
        observed = (self.client_counts > 0) if self.client_counts is not None else None
        was_training = self.model.training
        self.model.eval()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        v = self.classifier_vectors().detach()
        for x, y in self._analysis_loader:
            x, y = as_model_input(x, self.device, model_dtype(self.model)), y.to(self.device)
            f, fg = self.model.features(x).float(), self.global_model.features(x).float()
            align = F.cosine_similarity(f, v[y].float(), dim=1)
            dist = (f - fg).norm(dim=1)
            angle = torch.rad2deg(torch.arccos(F.cosine_similarity(f, fg, dim=1).clamp(-1.0, 1.0)))
            seen = observed[y] if observed is not None else torch.ones_like(y, dtype=torch.bool)
            for tag, mask in (("observed", seen), ("unobserved", ~seen)):
                for name, values in (("align", align), ("feat_dist", dist), ("feat_angle", angle)):
                    key = f"{name}_{tag}"
                    sums[key] = sums.get(key, 0.0) + float(values[mask].sum())
                    counts[key] = counts.get(key, 0) + int(mask.sum())
        self.model.train(was_training)
        return {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
