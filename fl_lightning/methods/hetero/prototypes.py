"""Prototype-based heterogeneous FL: FedProto, FedTGP and FedORGP.

Clients upload only per-class prototypes, P_k^c = mean of f_k(x) over client k's class-c training
samples, computed after local training with the model in eval mode; the server turns them into
global prototypes P^c that regularise the next round's local features. The three methods differ
in the server and in the local regulariser:

    FedProto  P^c = unweighted mean over clients of P_k^c;        local CE + lam * MSE(f, P^y)
    FedTGP    P^c = TrainablePrototypes(c), trained 100 epochs on  local CE + lam * MSE(f, P^y)
              CE(-(||P_k^c - P^c'|| + margin * [c' = c])), margin = min(max_gap, 100)
    FedORGP   P^c = TrainablePrototypes(c), trained 1 epoch on     local CE + lam_c * mean(1 - cos(f, P^y))
              L_OR = lam_s (1 - mean cos(P_k^c, P^c)) + lam_d mean_{c'!=c} |cos(P_k^c, P^c')|
              ("w/o OR" ablation, `orthogonality=False`: P^c = mean of P_k^c)

Round 1 has no global prototypes, so its local loss is plain CE. Prediction is by the head
(FedORGP) or by the nearest global prototype (FedProto, FedTGP), configurable with `predict`.
After every round the separation of the global prototypes is logged: `protos/intra_cos` (mean
cosine between client prototypes and their class's global prototype) and `protos/inter_abs_cos`
(mean |cosine| between different classes' global prototypes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning import compat
from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext, abstract_base
from fl_lightning.methods.hetero.base import HeteroMethod
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate


# ---- shared pieces ------------------------------------------------------------------------------
@torch.no_grad()
def class_prototypes(model: nn.Module, loader, device) -> dict[int, torch.Tensor]:
    """Per-class mean of `model.features` over a loader, with the model in eval mode (Eq. 2)."""
    was_training = model.training
    model.eval()
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    dtype = next(model.parameters()).dtype  # inputs as the model's (float64 under 64-true)
    for x, y in loader:
        feats = model.features(x.to(device=device, dtype=dtype))
        feats = feats.to(torch.promote_types(feats.dtype, torch.float32))  # sums in >= float32
        for c in torch.unique(y).tolist():
            mask = (y == c).to(device)
            sums[c] = sums.get(c, 0) + feats[mask].sum(0)
            counts[c] = counts.get(c, 0) + int(mask.sum())
    model.train(was_training)
    return {c: sums[c] / counts[c] for c in sorted(sums)}


PROTOTYPES = "prototypes"  # the upload group: class (as str(c)) -> the client's prototype


def prototype_upload(protos: dict[int, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The upload of a client that sends only its class prototypes."""
    return {PROTOTYPES: {str(c): p.detach() for c, p in protos.items()}}


def client_prototypes(upload: ClientUpload) -> dict[int, torch.Tensor]:
    """An upload's prototypes by class."""
    return {int(c): p for c, p in upload.group(PROTOTYPES).items()}


def uploaded_pairs(uploads: list[ClientUpload], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every received (client prototype, class) pair as a (M, K) matrix and (M,) labels."""
    protos, labels = [], []
    for u in uploads:
        for c, p in client_prototypes(u).items():
            protos.append(p.to(device))
            labels.append(int(c))
    return torch.stack(protos), torch.tensor(labels, device=device)


def mean_prototypes(
    protos: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted mean over clients per class; (C, K) prototypes and a (C,) mask of classes seen."""
    out = torch.zeros(num_classes, protos.shape[1], device=protos.device, dtype=protos.dtype)
    counts = torch.zeros(num_classes, device=protos.device, dtype=protos.dtype)
    out.index_add_(0, labels, protos)
    counts.index_add_(0, labels, torch.ones_like(labels, dtype=protos.dtype))
    seen = counts > 0
    out[seen] /= counts[seen, None]
    return out, seen


def orthogonality_loss(
    client_protos: torch.Tensor,
    labels: torch.Tensor,
    global_protos: torch.Tensor,
    lambda_s: float,
    lambda_d: float,
) -> torch.Tensor:
    """FedORGP's L_OR (Eq. 3-5): lam_s * (1 - s) + lam_d * d with
    s = mean_b cos(P_b, P^{y_b}) and d = mean_b sum_{c != y_b} |cos(P_b, P^c)| / (C - 1)."""
    dtype = torch.promote_types(client_protos.dtype, global_protos.dtype)  # e.g. float32 uploads, bf16 server
    cos = F.normalize(client_protos.to(dtype), dim=1) @ F.normalize(global_protos.to(dtype), dim=1).T
    own = F.one_hot(labels, global_protos.shape[0]).bool()
    s = cos[own].mean()
    d = (cos.abs().masked_fill(own, 0.0).sum(1) / (global_protos.shape[0] - 1)).mean()
    return lambda_s * (1 - s) + lambda_d * d


def margin_contrastive_loss(
    client_protos: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor, margin: float
) -> torch.Tensor:
    """FedTGP's server loss: CE over negative Euclidean distances, the own class's distance
    enlarged by the adaptive margin."""
    dtype = torch.promote_types(global_protos.dtype, torch.float32)  # cdist has no bfloat16 kernel on CPU
    dist = torch.cdist(client_protos.to(dtype), global_protos.to(dtype))
    dist = dist + margin * F.one_hot(labels, global_protos.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


class TrainablePrototypes(nn.Module):
    """P^c = Linear(ReLU(Linear(Embedding(c)))): FedTGP's and FedORGP's server-side prototypes."""

    def __init__(self, num_classes: int, feature_dim: int, hidden_dim: int | None = None):
        super().__init__()
        hidden_dim = hidden_dim or feature_dim
        self.embedding = nn.Embedding(num_classes, feature_dim)
        self.middle = nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.ReLU())
        self.fc = nn.Linear(hidden_dim, feature_dim)

    def forward(self, class_ids: torch.Tensor | None = None) -> torch.Tensor:
        if class_ids is None:
            class_ids = torch.arange(self.embedding.num_embeddings, device=self.embedding.weight.device)
        return self.fc(self.middle(self.embedding(class_ids)))


def train_on_pairs(
    module: nn.Module,
    protos: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
) -> float:
    """Server SGD on the received (prototype, class) pairs, shuffled, in batches: one step of
    loss_fn(module, batch prototypes, batch labels) per batch. Returns the last batch's loss."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    # the pairs in the module's dtype (uploads are >= float32; the server's module is bfloat16 under bf16-true)
    protos = protos.to(next(module.parameters()).dtype)
    gen = torch.Generator().manual_seed(seed)
    last = float("nan")
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(len(labels), generator=gen).to(labels.device)
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                loss = loss_fn(module, protos[idx], labels[idx])
                compat.release_gradients(opt)
                loss.backward()
                compat.step_optimizer(opt)
                last = float(loss.detach())
    return last


def separation(
    client_protos: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor, seen: torch.Tensor
) -> dict[str, float]:
    """Mean cos(client prototype, its global prototype) and mean |cos| between different
    classes' global prototypes (over classes that have one)."""
    g = F.normalize(global_protos[seen], dim=1)
    intra = (F.normalize(client_protos, dim=1) * F.normalize(global_protos[labels], dim=1)).sum(1).mean()
    out = {"protos/intra_cos": float(intra)}
    if len(g) > 1:
        cos = (g @ g.T).abs()
        off = ~torch.eye(len(g), dtype=torch.bool, device=g.device)
        out["protos/inter_abs_cos"] = float(cos[off].mean())
    return out


# ---- the methods ---------------------------------------------------------------------------------
@abstract_base
class PrototypeMethod(HeteroMethod):
    """Clients upload class prototypes; the server holds global prototypes (server state).

    Args:
        lam: weight of the local prototype regulariser.
        predict: "head" (argmax of the client's head) or "proto" (nearest global prototype).
    """

    def __init__(self, lam: float = 1.0, predict: Literal["head", "proto"] = "proto", **kwargs):
        super().__init__(**kwargs)
        if predict not in ("head", "proto"):
            raise FLUserError(f"predict must be 'head' or 'proto', got '{predict}'")
        if lam < 0:
            raise FLUserError(f"lam must be >= 0, got {lam}")
        self.save_hyperparameters()
        c, k = self.hparams.data_spec.num_classes, self.hparams.feature_dim
        self.server.tensor("global_protos", torch.zeros(c, k))
        self.server.tensor("has_proto", torch.zeros(c, dtype=torch.bool))

    @property
    def global_protos(self) -> torch.Tensor:
        return self.server["global_protos"]

    @property
    def has_proto(self) -> torch.Tensor:
        return self.server["has_proto"]

    # client
    def proto_weight(self) -> float:
        return float(self.hparams.lam)

    # Whether the server has prototypes yet: read when a client starts and when the server state
    # changes, not in every local step's loss (a device sync on a GPU).
    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        self._have_prototypes = bool(self.has_proto.any())

    def apply_server_update(self, update: ServerUpdate) -> None:
        super().apply_server_update(update)
        self._have_prototypes = bool(self.has_proto.any())

    def proto_regularizer(self, feats: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, model, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        feats = model.features(x)
        loss = F.cross_entropy(model.head(feats), y)
        # the server's prototypes regularise federated local training only
        if not context.finetuning and getattr(self, "_have_prototypes", False) and self.proto_weight() > 0:
            loss = loss + self.proto_weight() * self.proto_regularizer(feats, y)
        return loss

    def upload(self) -> dict:
        return prototype_upload(
            class_prototypes(self.model, self.client_train_loader(self.current_client), self.device)
        )

    # server
    def server_prototypes(self, protos: torch.Tensor, labels: torch.Tensor) -> ServerUpdate:
        """The new global prototypes ("global_protos", "has_proto") from the round's (client
        prototype, class) pairs, and whatever else the rule changes and reports."""
        raise NotImplementedError

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        protos, labels = uploaded_pairs(uploads.gathered(), self.device)  # pooled per class: not a sum
        update = self.server_prototypes(protos, labels)
        new, seen = update.server_state["global_protos"], update.server_state["has_proto"]
        update.metrics.update(separation(protos, labels, new, seen))
        return update

    def trained_prototypes(self, protos: torch.Tensor, labels: torch.Tensor,
                           loss_fn) -> tuple[torch.Tensor, dict, float]:
        """Trains a copy of the server's trainable prototypes on the pairs with `loss_fn(module,
        prototypes, labels)`: (its output, its new state_dict, the last batch's loss)."""
        h = self.hparams
        module = copy.deepcopy(self.server["prototypes"])
        loss = train_on_pairs(module, protos, labels, loss_fn, h.server_epochs, h.proto_lr, h.server_batch_size,
                              self.server_seed())
        with torch.no_grad():
            out = module()
        return out, module.state_dict(), loss

    # evaluation
    def predict_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.predict == "head" or not bool(self.has_proto.any()):
            return self.model(x)
        feats = self.model.features(x)
        dtype = torch.promote_types(feats.dtype, torch.float32)  # cdist has no 16-bit CPU kernel; float64 stays
        # nearest global prototype by squared Euclidean distance; classes without one never win (a
        # large finite score, not -inf: the evaluation's loss stays finite, see evaluation.py)
        dist = torch.cdist(feats.to(dtype), self.global_protos.to(dtype)) ** 2
        return (-dist).masked_fill(~self.has_proto, -1e30)


def _mse_to_prototypes(
    feats: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, has: torch.Tensor
) -> torch.Tensor:
    """nn.MSELoss(f, P^y) over the batch, as FedProto's code computes it: a sample whose class
    has no global prototype is its own target (contributes zero but counts in the mean)."""
    target = torch.where(has[y][:, None], protos[y], feats.detach())
    return F.mse_loss(feats, target)


class FedProto(PrototypeMethod):
    """FedProto (Tan et al., AAAI 2022): unweighted per-class mean of client prototypes;
    local CE + lam * MSE(f(x), P^y); prediction by the nearest global prototype."""

    def __init__(self, lam: float = 1.0, predict: Literal["head", "proto"] = "proto", **kwargs):
        super().__init__(lam=lam, predict=predict, **kwargs)
        self.save_hyperparameters()

    def proto_regularizer(self, feats, y):
        return _mse_to_prototypes(feats, y, self.global_protos, self.has_proto)

    def server_prototypes(self, protos, labels):
        new, seen = mean_prototypes(protos, labels, self.hparams.data_spec.num_classes)
        return ServerUpdate(server_state={"global_protos": new, "has_proto": seen})


class FedTGP(PrototypeMethod):
    """FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with an adaptive margin.

    Args:
        server_epochs: epochs of the server's training on the prototype pairs (paper: 100).
        proto_lr: SGD learning rate of that training.
        server_batch_size: prototype pairs per server step.
        margin_threshold: the margin is min(max_c gap_c, threshold), gap_c = distance from class
            c's mean client prototype to the nearest other class's.
    """

    def __init__(
        self,
        lam: float = 1.0,
        predict: Literal["head", "proto"] = "proto",
        server_epochs: int = 100,
        proto_lr: float = 0.01,
        server_batch_size: int = 32,
        margin_threshold: float = 100.0,
        **kwargs,
    ):
        super().__init__(lam=lam, predict=predict, **kwargs)
        if server_epochs < 1 or server_batch_size < 1 or proto_lr <= 0:
            raise FLUserError("server_epochs and server_batch_size must be >= 1 and proto_lr > 0")
        self.save_hyperparameters()
        self.server.module("prototypes", TrainablePrototypes(self.hparams.data_spec.num_classes,
                                                             self.hparams.feature_dim))

    def proto_regularizer(self, feats, y):
        return _mse_to_prototypes(feats, y, self.global_protos, self.has_proto)

    def adaptive_margin(self, protos: torch.Tensor, labels: torch.Tensor) -> float:
        means, seen = mean_prototypes(protos, labels, self.hparams.data_spec.num_classes)
        m = means[seen]
        if len(m) < 2:
            return 0.0
        dist = torch.cdist(m, m) + torch.diag(torch.full((len(m),), float("inf"), device=m.device))
        gap = dist.min(1).values  # classes nobody uploaded would take the minimum gap: no effect on max
        return min(float(gap.max()), self.hparams.margin_threshold)

    def server_prototypes(self, protos, labels):
        margin = self.adaptive_margin(protos, labels)
        out, state, loss = self.trained_prototypes(protos, labels,
                                                   lambda m, p, y: margin_contrastive_loss(p, y, m(), margin))
        seen = torch.ones(len(out), dtype=torch.bool, device=out.device)
        return ServerUpdate(server_state={"global_protos": out, "has_proto": seen, "prototypes": state},
                            metrics={"server/loss": loss, "server/margin": margin})


class FedORGP(PrototypeMethod):
    """FedORGP (Guo et al.): orthogonality regularisation on trainable global prototypes.

    Args:
        lambda_c: weight of the local cosine alignment (paper best 100; the authors' scripts use 10).
        lambda_s: weight of the intra-class similarity term of L_OR.
        lambda_d: weight of the inter-class orthogonality term of L_OR.
        orthogonality: False gives the "w/o OR" ablation (global prototypes = mean of client ones).
        server_epochs: epochs of the server's training of the prototypes (paper: 1).
        proto_lr: SGD learning rate of that training (paper: 0.01).
        server_batch_size: prototype pairs per server step (paper: 32).
        predict: "head" (paper) or "proto".
    """

    def __init__(
        self,
        lambda_c: float = 100.0,
        lambda_s: float = 1.0,
        lambda_d: float = 10.0,
        orthogonality: bool = True,
        server_epochs: int = 1,
        proto_lr: float = 0.01,
        server_batch_size: int = 32,
        predict: Literal["head", "proto"] = "head",
        **kwargs,
    ):
        if kwargs.pop("lam", None) is not None:
            raise FLUserError("FedORGP weighs its prototype loss with lambda_c, not lam")
        super().__init__(lam=lambda_c, predict=predict, **kwargs)
        if server_epochs < 1 or server_batch_size < 1 or proto_lr <= 0:
            raise FLUserError("server_epochs and server_batch_size must be >= 1 and proto_lr > 0")
        self.save_hyperparameters()
        self.server.module("prototypes", TrainablePrototypes(self.hparams.data_spec.num_classes,
                                                             self.hparams.feature_dim))

    def proto_weight(self) -> float:
        return float(self.hparams.lambda_c)

    def proto_regularizer(self, feats, y):
        """mean_b (1 - cos(f(x_b), P^{y_b})) over samples whose class has a global prototype."""
        has = self.has_proto[y]
        cos = F.cosine_similarity(feats, self.global_protos[y].to(feats.dtype), dim=1)
        return ((1 - cos) * has).sum() / has.sum().clamp_min(1)

    def server_prototypes(self, protos, labels):
        h = self.hparams
        if not h.orthogonality:
            new, seen = mean_prototypes(protos, labels, h.data_spec.num_classes)
            return ServerUpdate(server_state={"global_protos": new, "has_proto": seen})
        out, state, loss = self.trained_prototypes(
            protos, labels, lambda m, p, y: orthogonality_loss(p, y, m(), h.lambda_s, h.lambda_d))
        seen = torch.ones(len(out), dtype=torch.bool, device=out.device)
        return ServerUpdate(server_state={"global_protos": out, "has_proto": seen, "prototypes": state},
                            metrics={"server/loss": loss})
