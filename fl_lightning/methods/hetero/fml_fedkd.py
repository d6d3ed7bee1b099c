"""Heterogeneous FL through a small shared model trained by mutual distillation: FML and FedKD.

Each client keeps its own (heterogeneous) model and, during its local steps, trains it together
with a copy of a small shared model (default the 4-layer CNN with the same K); only the shared
model crosses the network and the server averages it by sample count. Clients are evaluated with
their own model.

    FML (Shen et al., 2020)   L_local  = a CE(z, y)   + (1 - a) KL(softmax(z_g) || softmax(z))
                              L_shared = b CE(z_g, y) + (1 - b) KL(softmax(z) || softmax(z_g))
                              (the other model's outputs are detached), a = b = 0.5
    FedKD (Wu et al., 2022)   with L = CE(z, y) + CE(z_g, y) (not detached), and a per-client
                              W_h: Linear(K, K) that stays on the client,
                              L_local  = CE(z, y)   + KL(z || z_g) / L + MSE(f, W_h f_g) / L
                              L_shared = CE(z_g, y) + KL(z_g || z) / L + MSE(f, W_h f_g) / L
                              and the shared model travels SVD-compressed both ways: each matrix
                              keeps the smallest rank whose singular values hold a fraction T of
                              its energy (sum of squares), T rising linearly from 0.95 to 0.98
                              over the run.

Both losses are summed into one backward pass (the authors step two SGD optimizers with the same
learning rate on the two losses' gradients, which is the same update).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext, abstract_base
from fl_lightning.methods.hetero.base import HeteroMethod
from fl_lightning.models.hetero import build_group_model
from fl_lightning.uploads import RoundUploads, ServerUpdate

SHARED = "shared"  # the upload group: the client's copy of the shared model, by its state_dict names


def kl_to(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)), batch mean; the target is detached."""
    return F.kl_div(F.log_softmax(logits, 1), F.softmax(target_logits.detach(), 1), reduction="batchmean")


@abstract_base
class MutualLearningMethod(HeteroMethod):
    """Keeps the server's shared model and the installed client's working copy of it.

    Args:
        shared_model: architecture of the small shared model (built with the same K).
    """

    def __init__(self, shared_model: str = "cnn4", **kwargs):
        super().__init__(**kwargs)
        h = self.hparams
        self.server.module("global_shared", build_group_model(shared_model, h.data_spec, h.feature_dim))
        self.shared = copy.deepcopy(self.server["global_shared"])  # trained by the current client
        self.shared_architecture = shared_model

    def architectures(self) -> tuple[str, ...]:
        return (*super().architectures(), self.shared_architecture)

    def receive(self, client: int) -> None:
        self.shared.load_state_dict(self.server["global_shared"].state_dict())
        self.shared.train()

    def extra_local_parameters(self):
        return list(self.shared.parameters())

    def upload(self) -> dict:
        return {SHARED: {k: v.detach().clone() for k, v in self.shared.state_dict().items()}}

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        return ServerUpdate(server_state={"global_shared": uploads.weighted_average(SHARED)})


class FML(MutualLearningMethod):
    """Federated Mutual Learning (Shen et al.): each client's model and the shared model teach each other.

    Args:
        alpha: weight of CE in the client model's loss (1 - alpha: KL to the shared model).
        beta: weight of CE in the shared model's loss (1 - beta: KL to the client model).
    """

    def __init__(self, alpha: float = 0.5, beta: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        if not (0 <= alpha <= 1 and 0 <= beta <= 1):
            raise FLUserError(f"alpha and beta must be in [0, 1], got {alpha} and {beta}")
        self.save_hyperparameters()

    def loss(self, model, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        if context.finetuning:  # mutual learning needs the shared model this round trains alongside
            return F.cross_entropy(model(x), y)
        z, zg = model(x), self.shared(x)
        a, b = self.hparams.alpha, self.hparams.beta
        local = a * F.cross_entropy(z, y) + (1 - a) * kl_to(z, zg)
        shared = b * F.cross_entropy(zg, y) + (1 - b) * kl_to(zg, z)
        return local + shared


def svd_compress(t: torch.Tensor, energy: float) -> tuple[torch.Tensor, ...]:
    """(U_r, S_r, V_r) of t reshaped to (shape[0], -1), r = smallest rank holding `energy` of
    sum(S^2); vectors and scalars travel as they are."""
    # LAPACK has no 16-bit SVD: those widen to float32; float32 and float64 (64-true) stay as they are
    matrix = t.reshape(t.shape[0], -1).to(torch.promote_types(t.dtype, torch.float32)) if t.ndim >= 2 else t
    if t.ndim < 2 or not bool(torch.isfinite(matrix).all()):
        # A non-finite matrix has no SVD (LAPACK fails to converge): it travels as it is, so the
        # federation's divergence policy sees the NaN instead of a crash inside the upload.
        return (t,)
    try:
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError:  # an ill-conditioned finite matrix: float64 converges
        u, s, vh = (part.to(matrix.dtype) for part in torch.linalg.svd(matrix.double(), full_matrices=False))
    kept = torch.cumsum(s**2, 0) / (s**2).sum().clamp_min(1e-30)
    r = min(int((kept < energy).sum()) + 1, len(s))
    return u[:, :r].contiguous(), s[:r].contiguous(), vh[:r].contiguous()


def svd_decompress(parts: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    u, s, vh = parts
    return ((u * s) @ vh).reshape(shape)


def compress_state(state: dict[str, torch.Tensor], energy: float, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        parts = svd_compress(v.detach(), energy)
        if len(parts) == 1:
            out[f"{prefix}{k}"] = parts[0].clone()
        else:
            out.update({f"{prefix}{k}.U": parts[0], f"{prefix}{k}.S": parts[1], f"{prefix}{k}.V": parts[2]})
    return out


def decompress_state(tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor], prefix: str) -> dict:
    out = {}
    for k, ref in like.items():
        if f"{prefix}{k}" in tensors:
            out[k] = tensors[f"{prefix}{k}"]
        else:
            parts = tuple(tensors[f"{prefix}{k}.{p}"] for p in "USV")
            out[k] = svd_decompress(parts, ref.shape).to(ref.dtype)
    return out


class FedKD(MutualLearningMethod):
    """FedKD: adaptive mutual distillation with hidden-state alignment and SVD-compressed exchange.

    Args:
        energy_start: the SVD energy threshold T in the first round (T is linear over the rounds).
        energy_end: the SVD energy threshold T in the last round.
    """

    def __init__(self, energy_start: float = 0.95, energy_end: float = 0.98, **kwargs):
        super().__init__(**kwargs)
        if not (0 < energy_start <= 1 and 0 < energy_end <= 1):
            raise FLUserError(f"energy thresholds must be in (0, 1], got {energy_start} and {energy_end}")
        self.save_hyperparameters()
        k = self.hparams.feature_dim
        self.W_h = nn.Linear(k, k)  # the installed client's own projection (kept in client_states)

    def energy(self) -> float:
        h = self.hparams
        rounds = max(int(self.trainer.max_epochs or 1), 1)
        return h.energy_start + (h.energy_end - h.energy_start) * min((self.round_idx + 1) / rounds, 1.0)

    def receive(self, client: int) -> None:
        super().receive(client)
        state = self.client_state(client, "W_h.")
        if state is None:
            self.W_h.reset_parameters()
        else:
            self.W_h.load_state_dict(state)

    def kept_extras(self) -> dict[str, torch.Tensor]:
        return self.prefixed("W_h.", {k: v.clone() for k, v in self.W_h.state_dict().items()})

    def extra_local_parameters(self):
        return list(self.shared.parameters()) + list(self.W_h.parameters())

    def loss(self, model, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        if context.finetuning:  # distillation needs the shared model and the client's W_h
            return F.cross_entropy(model(x), y)
        f, fg = model.features(x), self.shared.features(x)
        z, zg = model.head(f), self.shared.head(fg)
        ce, ce_g = F.cross_entropy(z, y), F.cross_entropy(zg, y)
        task = ce + ce_g
        hidden = F.mse_loss(f, self.W_h(fg)) / task
        local = ce + kl_to(z, zg) / task + hidden
        shared = ce_g + kl_to(zg, z) / task + hidden
        return local + shared

    def upload(self) -> dict:
        return {SHARED: compress_state(self.shared.state_dict(), self.energy(), "")}

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        like = self.server["global_shared"].state_dict()
        avg = uploads.weighted_average(lambda u: decompress_state(u.group(SHARED), like, ""))
        # the server sends the average back compressed too; clients receive the reconstruction
        sent = compress_state(avg, self.energy(), "")
        return ServerUpdate(server_state={"global_shared": decompress_state(sent, like, "")})
