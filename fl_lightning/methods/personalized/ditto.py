"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021): FedAvg for the global model, plus a personal model per client that
is pulled towards the global model and never leaves the client.

Round t, sampled client k, with w_g = the round-start global model:

    global track:  local SGD on CE from w_g, exactly FedAvg; the upload is this model only
    personal v_k:  on the same local batches, SGD on  CE(v_k) + (lambda / 2) * ||v_k - w_g||_2^2
    server:        sample-weighted average of the global-track uploads (FedAvg)

Per local batch the client takes one step on the global-track model (through `sgd_step`, so
FedCONST's constraint and every base hook apply to it) and one step on v_k with its own SGD
optimizer: the same lr (decayed with the round schedule), momentum and weight decay as the local
optimizer, with a momentum buffer that starts at zero every round (as the local optimizer's does).
The proximal term covers the parameters the local optimizer trains and uses the round-start
w_g, not the moving global-track weights.

Defaults and where they come from:
- `lam` = 1.0: the official code (github.com/litian96/ditto) ships its runs with `--lam=1`; the
  paper tunes lambda per data set from a small candidate set (its local "dynamic" selection picks
  from {0.1, 1, 2}). Neither the FedDr+ nor the FedSOL paper states the lambda behind its Ditto
  numbers, so this is a guess for that setting; set `--model.lam`.
- personal steps: Algorithm 1 of the paper leaves the count s of personal iterations free. The
  official code takes one personal step per global local step, on the same batch, with the same
  learning rate; that is what this does (s = E local epochs of batches). There is no separate
  option for s.
- v_k starts as a copy of the global model the client receives the first time it takes part.
  (The official code starts every v_k from the initial model at round 0; for a client sampled
  late that is a worse start, and with lambda > 0 it is pulled towards w_g anyway.)

What stays where: the upload holds exactly the global-track model's state_dict; v_k (full
state_dict including BN buffers) is what the client keeps (`upload.kept`, under "personal."), in
`client_states[k]` once the upload is accepted, so a client whose upload is dropped as non-finite
keeps its previous v_k; while a client trains, v_k is a working copy of the model.

`personal_model(k)` returns v_k. A client that has never taken part has no v_k; it gets a copy of
the current global model (what v_k would start from).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fl_lightning import compat, loss_scaling
from fl_lightning.errors import FLUserError
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.models import FLModel
from fl_lightning.uploads import ClientUpload


class Ditto(SharedModelMethod):
    """Ditto (Li et al., ICML 2021): a FedAvg global model, and per client a personal model v_k
    trained toward it.

    Args:
        lam: weight lambda of the proximal term (lambda / 2) * ||v_k - w_g||^2 of the personal
            objective (official code's runs: 1.0). 0 trains v_k as a purely local model.
    """

    def __init__(self, lam: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        if lam < 0:
            raise FLUserError(f"Ditto lam must be >= 0, got {lam}")
        self.save_hyperparameters()
        self._personal_opt: torch.optim.SGD | None = None

    @property
    def personal_track(self) -> FLModel:
        """The current client's personal model v_k while it trains (a working copy)."""
        return self.copies["personal"]

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        # first participation: v_k = the global model it has just received
        own = self.client_state(client, "personal.") or self.global_weights
        self.copies.get("personal", self.model, own, self.device, trainable=True)
        h = self.hparams
        params = [p for p in self.personal_track.parameters() if p.requires_grad]
        # a new optimizer per client and round: momentum starts at zero, like the local optimizer's
        self._personal_opt = torch.optim.SGD(params, lr=self.current_lr(), momentum=h.momentum,
                                             weight_decay=h.weight_decay)

    def personal_loss(self, batch) -> torch.Tensor:
        """CE(v_k) + (lam / 2) * ||v_k - w_g||^2 over v_k's trainable parameters, w_g = round start."""
        x, y = batch
        g = self.global_params()
        prox = sum(((p - g[n]) ** 2).sum() for n, p in self.personal_track.named_parameters() if p.requires_grad)
        return F.cross_entropy(self.personal_track(x), y) + 0.5 * self.hparams.lam * prox

    def personal_step(self, batch) -> torch.Tensor:
        """One step of v_k with its own optimizer. It runs inside the local training, under the
        precision's autocast, so with 16-mixed on a GPU it goes through the run's GradScaler as
        the global track's step does: scaled backward (float16 gradients do not underflow),
        unscaled before clipping, skipped with the scale lowered when a gradient is inf/NaN (the
        scale is shared with the global track, so it is updated twice per local batch)."""
        loss = self.personal_loss(batch)
        opt = self._personal_opt
        scaler = loss_scaling.scaler_of(compat.attached_trainer(self))
        compat.release_gradients(opt)
        (loss if scaler is None else scaler.scale(loss)).backward()
        params = [p for p in self.personal_track.parameters() if p.grad is not None]
        # averaged before unscaling: every process then finds the same inf/NaN and skips together
        for p, g in zip(params, self.mean_across_devices([p.grad for p in params]), strict=True):
            p.grad = g
        if scaler is None:
            self.clip_local_gradients(opt)  # --trainer.gradient_clip_val, as on the global track
            compat.step_optimizer(opt)
        else:
            scaler.unscale_(opt)
            self.clip_local_gradients(opt)
            scaler.step(opt)  # skipped when the unscaled gradients hold inf/NaN
            scaler.update()
        return loss.detach()

    def minibatch_step(self, batch):
        loss = super().minibatch_step(batch)  # the global track: exactly FedAvg's step
        personal = self.personal_step(batch)
        self.log_local({"ditto/personal_loss": personal}, len(batch[1]))
        return loss

    def client_end(self) -> ClientUpload:
        upload = super().client_end()  # the global-track model only
        g = self.global_params()
        sq = sum(((p.detach() - g[n]) ** 2).sum() for n, p in self.personal_track.named_parameters())
        upload.stats["personal_distance"] = float(torch.sqrt(sq))  # logged, never aggregated
        upload.kept.update(self.prefixed("personal.", self.personal_track.state_dict()))  # v_k
        return upload

    def personal_model(self, client: int) -> FLModel:
        """v_k; a copy of the current global model for a client that never took part."""
        model = copy.deepcopy(self.model)
        own = self.client_state(client, "personal.")
        if own is not None:
            model.load_state_dict(own)
        return model.to(self.device).eval()
