"""FedGen (Zhu, Hong & Zhou, ICML 2021) for model-heterogeneous clients, as FedORGP compares with it.

The server learns a conditional generator G(y, eps) of *features*: K-dimensional vectors in the
input space of the shared head Linear(K, C). It is trained so that the ensemble of the clients'
heads classifies G(y, eps) as y. Clients then also train their head on generated features, which
carries knowledge about every class, including classes a client has never seen, without data
leaving any client.

    client  loss = CE(h_k(f_k(x)), y) + gen_weight * CE(h_k(G(y', eps)), y'),
            y' ~ p(y), eps ~ U[0, 1)^noise_dim, G in eval mode and not trained by the client;
            plain CE until the server has trained G once.
            Upload: its head (group "head", as LG-FedAvg) and its label counts (group
            "label_counts").
    server  1. Train G for server_steps Adam steps (a fresh Adam every round, as HtFLlib) on
               CE(sum_k w_k(y') h_k(G(y', eps)), y') + diversity_weight * L_div,
               with y' drawn from the label distribution of this round's uploads, and
               w_k(y) = n_k / sum_j n_j ("samples", HtFLlib) or n_k^y / sum_j n_j^y ("label_counts",
               the FedGen paper's per-label ensemble).
            2. Average the heads by samples (as LG-FedAvg) and write the result into every client.
    p(y)    Label distribution of the training data of every client the server has heard from.
            With all clients participating, which is the paper setting, it is that of all data.

The generator is Linear(noise_dim + C, hidden_dim) -> BatchNorm1d -> ReLU -> Linear(hidden_dim, K).
Its noise is uniform in [0, 1), as in both the FedGen and the HtFLlib code. L_div is the FedGen
code's diversity loss, exp(-mean_ij d2(eps_i, eps_j) * d1(G_i, G_j)), where d2 is the mean squared
difference and d1 the mean absolute difference. It is off by default, as in HtFLlib.

Where this deliberately departs from the authors' code:
- HtFLlib's FedGen, the code behind FedORGP's tables, trains the generator every round but never
  stores it back: `train_generator` loads it, trains it, and drops it. This holds from the January
  2024 load/save refactor to the current version (checked at e959261, April 2026). Its clients
  therefore always augment with the untrained initial generator. Here clients receive the trained
  generator.
- The original FedGen also has a KL term between the prediction on x and the head's prediction
  on G(y), with weights decaying from 10. HtFLlib and FedORGP's comparison use only the CE term
  above, with weight 1. That is what this file implements.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning import compat
from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.hetero.lgfedavg_fedgh import HEAD, LGFedAvg
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate

LABEL_COUNTS = "label_counts"  # the upload group holding the client's samples per class ("counts")


def label_counts(upload: ClientUpload) -> torch.Tensor:
    """The (C,) samples per class a client uploaded."""
    return upload.group(LABEL_COUNTS)["counts"]


class FeatureGenerator(nn.Module):
    """G(y, eps) = Linear(ReLU(BN(Linear([eps, onehot(y)])))): a K-dimensional feature for class y."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int):
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.hidden = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU()
        )
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.out(self.hidden(torch.cat([noise, onehot], dim=1)))


def diversity_loss(noise: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """FedGen's L_div = exp(-mean_ij mean_d (eps_i - eps_j)^2 * mean_d |G_i - G_j|): small when
    different noise gives different features, so the generator does not collapse to one per class."""
    noise_dist = (noise[:, None, :] - noise[None, :, :]).pow(2).mean(2)
    feat_dist = (feats[:, None, :] - feats[None, :, :]).abs().mean(2)
    return torch.exp(-(noise_dist * feat_dist).mean())


def ensemble_logits(
    feats: torch.Tensor, labels: torch.Tensor, heads: list[tuple[torch.Tensor, torch.Tensor]],
    weights: torch.Tensor,
) -> torch.Tensor:
    """sum_k w_k(y_b) * h_k(feats_b): the clients' heads (weight, bias), weights (M, C) per label."""
    out = 0
    for (w, b), wk in zip(heads, weights, strict=True):
        out = out + wk[labels, None] * F.linear(feats, w, b)
    return out


class FedGen(LGFedAvg):
    """FedGen: a server-trained feature generator augments the clients' shared head.

    Args:
        gen_weight: weight of the clients' CE on generated features (HtFLlib: 1).
        noise_dim: size of the generator's noise input (HtFLlib: 512).
        hidden_dim: width of the generator's hidden layer (HtFLlib: 512).
        generator_lr: Adam learning rate of the generator (HtFLlib: 0.005).
        server_steps: generator steps per round (HtFLlib's `server_epochs`, 100).
        server_batch_size: generated samples per server step (HtFLlib: the client batch size, 32 in
            FedORGP's setting); clients generate as many as their real batch holds.
        teacher_weighting: "samples" (HtFLlib) or "label_counts" (FedGen paper).
        diversity_weight: weight of L_div in the generator's loss (FedGen code: 1; HtFLlib: none).
    """

    def __init__(
        self,
        gen_weight: float = 1.0,
        noise_dim: int = 512,
        hidden_dim: int = 512,
        generator_lr: float = 0.005,
        server_steps: int = 100,
        server_batch_size: int = 32,
        teacher_weighting: Literal["samples", "label_counts"] = "samples",
        diversity_weight: float = 0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if teacher_weighting not in ("samples", "label_counts"):
            raise FLUserError(f"teacher_weighting must be 'samples' or 'label_counts', got '{teacher_weighting}'")
        if min(noise_dim, hidden_dim, server_steps, server_batch_size) < 1 or generator_lr <= 0:
            raise FLUserError(
                "noise_dim, hidden_dim, server_steps and server_batch_size must be >= 1 and generator_lr > 0"
            )
        if gen_weight < 0 or diversity_weight < 0:
            raise FLUserError("gen_weight and diversity_weight must be >= 0")
        self.save_hyperparameters()
        c = self.hparams.data_spec.num_classes
        self.server.module("generator", FeatureGenerator(noise_dim, c, hidden_dim, self.hparams.feature_dim))
        self.server.tensor("generator_trained", torch.tensor(False))
        # Label counts of every client the server has heard from (rows of the others stay zero);
        # sized once the number of clients is known, before a checkpoint is loaded into it.
        self.server.tensor("client_label_counts", torch.zeros(0, c))

    @property
    def generator(self) -> FeatureGenerator:
        return self.server["generator"]

    def on_client_models_built(self) -> None:
        super().on_client_models_built()
        num_clients, c = self._num_clients, self.hparams.data_spec.num_classes
        self.server.assign({"client_label_counts": torch.zeros(num_clients, c)})

    # ---- client -------------------------------------------------------------------------------
    def label_distribution(self) -> torch.Tensor:
        return self.server["client_label_counts"].sum(0)

    # Whether the server's generator has been trained: read when a client starts and when the
    # server state changes, not in every local step's loss (a device sync on a GPU).
    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        self._generator_ready = bool(self.server["generator_trained"])

    def apply_server_update(self, update: ServerUpdate) -> None:
        super().apply_server_update(update)
        self._generator_ready = bool(self.server["generator_trained"])

    def loss(self, model, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        # the server's generator regularises federated local training only
        if not context.finetuning and getattr(self, "_generator_ready", False) and self.hparams.gen_weight > 0:
            # Drawn from the global RNG, which client_start seeds per (seed, round, client).
            labels = torch.multinomial(self.label_distribution(), len(y), replacement=True)
            noise = torch.rand(len(y), self.hparams.noise_dim, device=y.device).to(model.head.weight.dtype)
            self.generator.eval()  # the client uses G; BatchNorm's running statistics, no update
            with torch.no_grad():
                generated = self.generator(labels, noise)
            loss = loss + self.hparams.gen_weight * F.cross_entropy(model.head(generated), labels)
        return loss

    def upload(self) -> dict:
        counts = self.trainer.datamodule.client_class_counts(self.current_client)
        return {**super().upload(), LABEL_COUNTS: {"counts": torch.as_tensor(counts, dtype=torch.float32)}}

    # ---- server -------------------------------------------------------------------------------
    def teacher_weights(self, uploads: list[ClientUpload], counts: torch.Tensor) -> torch.Tensor:
        """(M, C): how much client m's head counts when the generated label is c."""
        if self.hparams.teacher_weighting == "label_counts":
            return counts / counts.sum(0).clamp_min(1)
        n = torch.tensor([float(u.num_samples) for u in uploads], device=counts.device)
        return (n / n.sum())[:, None].expand_as(counts)

    def train_generator(self, uploads: list[ClientUpload]) -> tuple[dict, float]:
        """Trains a copy of the generator on the uploads' heads: (its new state_dict, the last loss)."""
        h, dev = self.hparams, self.device
        generator = copy.deepcopy(self.generator)
        dtype = next(generator.parameters()).dtype  # the run's precision (float32, float64 for 64-true)
        counts = torch.stack([label_counts(u).to(dev) for u in uploads])
        weights = self.teacher_weights(uploads, counts).to(torch.promote_types(dtype, torch.float32))
        heads = [
            (u.group(HEAD)["weight"].to(dev, dtype), u.group(HEAD)["bias"].to(dev, dtype)) for u in uploads
        ]
        label_dist = counts.sum(0)
        rng = torch.Generator(device=dev).manual_seed(self.server_seed())
        opt = torch.optim.Adam(generator.parameters(), lr=h.generator_lr)
        generator.train()
        with torch.enable_grad():
            for _ in range(h.server_steps):
                labels = torch.multinomial(label_dist, h.server_batch_size, replacement=True, generator=rng)
                noise = torch.rand(h.server_batch_size, h.noise_dim, device=dev, generator=rng).to(dtype)
                feats = generator(labels, noise)
                loss = F.cross_entropy(ensemble_logits(feats, labels, heads, weights), labels)
                if h.diversity_weight > 0:
                    loss = loss + h.diversity_weight * diversity_loss(noise, feats)
                compat.release_gradients(opt)
                loss.backward()
                compat.step_optimizer(opt)
        generator.eval()
        return generator.state_dict(), float(loss.detach())

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        # G learns from every head the round's clients trained (gathered from every process),
        # before they are averaged away; every process trains the same G from the same draws.
        everyone = uploads.gathered()
        counts = self.server["client_label_counts"].clone()
        for u in everyone:
            counts[u.client] = label_counts(u).to(counts)
        generator, loss = self.train_generator(everyone)
        update = super().server_step(uploads)
        update.server_state.update(generator=generator, generator_trained=torch.tensor(True),
                                   client_label_counts=counts)
        update.metrics["server/generator_loss"] = loss
        return update
