"""Shared body, personal head: FedPer and FedRep, two of the "1-step" personalised-FL baselines of
the FedDr+ paper's Table 5.

Both split the model into a shared part (the body, `model.features`) and a personal part (by
default the linear `head`). The server averages only the body, sample-weighted (FedAvg); every
client keeps its own head, which never leaves it:

    FedPer (Arivazhagan et al., 2019, "Federated Learning with Personalization Layers"): each local
        step trains the whole local model (global body + the client's own head) with CE.
    FedRep (Collins et al., ICML 2021, "Exploiting Shared Representations for Personalized FL"):
        each round the client first trains only its head (body frozen) for `head_epochs` passes
        over its data, then only the body (head frozen) for `body_epochs` passes; it uploads the
        body.

The personal part is the base's `personal_keys` mechanism (methods/base.py): client k's head is
what it keeps (`client_states[k]`, under "model."). A client that has never trained starts from the
initial global head: the server never changes the global model's head, so it is always the
initial one, also after resuming. A client's new head is kept only if the server accepts its
upload (the federation drops non-finite uploads), so a diverged client keeps its previous head.
`personal_model(k)` = the global body + client k's head; it is what
`personal/own_acc_*` reports. The global model itself (body + initial head) is what the global
accuracy and the fine-tuning baselines see; for these methods only the personalised numbers are
meaningful, as in the FedDr+ table.

Defaults and where they come from (neither the FedDr+ nor the FedSOL paper gives them):
- personal part = the last linear layer (`personal_layers: [head]`). FedPer's paper keeps the
  last K_P layers personal and varies K_P (1 or 2 for its ResNet/MobileNet); the FedBABU/FedDr+
  line of work uses the classifier only, and every model here has a single linear head. Which one
  the FedDr+ authors used is not stated; other choices are an option (state-dict prefixes).
- FedRep: 10 head epochs then 1 body epoch. The FedRep paper (Sec. 5): "FedRep executes ten local
  epochs of SGD with momentum to train the local head, followed by one or five epochs for the
  representation" (one for CIFAR; five for some other datasets). Note the official code
  (lgcollins/FedRep; read in forks of it) counts differently: `local_ep` is the total and the head
  gets `local_ep - local_rep_ep` epochs; with `local_ep = 10, local_rep_ep = 1` that is 9 + 1.
  That code uses SGD with momentum 0.5 and weight decay 1e-4; here the framework's local SGD
  (momentum, weight_decay options) is used, as for every other method of the table.
  Both phases use the same optimizer settings and lr (the paper's Algorithm 1 uses one step size
  alpha for both), here the framework's local SGD.

FedRep's schedule inside this framework. A client's number of local batches is fixed by the data
module: `local_epochs * ceil(n_k / batch_size)`. FedRep therefore requires
`data.local_epochs == head_epochs + body_epochs` (checked at fit start, FLUserError otherwise) and
switches from the head phase to the body phase after `head_epochs * ceil(n_k / batch_size)` local
steps (counted by `self.local_step`). Every batch belongs to exactly one phase; each phase sees its
epochs' own shuffles.

What "frozen" means in FedRep's phases:
- the frozen part has requires_grad False, so it gets no gradient, no momentum and no weight decay
  (torch's SGD skips parameters without a gradient);
- its buffers are put back at the end of its phase: BN layers still normalise with batch
  statistics in train mode (as in the official code), but the running statistics the frozen part
  collected during the other part's phase are undone, so the frozen part is bit-identical after
  the phase (parameters and buffers);
- the optimizer's state (momentum buffers) is cleared at the switch, so nothing of the head phase
  leaks into the body phase: the body phase starts heavy-ball from a zero buffer, as every client
  does at the start of a round. (With torch's SGD and gradients set to None, a frozen part's
  buffer could not act anyway; the reset makes it explicit. The official code keeps one optimizer
  over both phases and, under PyTorch 1.x's `zero_grad()` that zeroed rather than removed
  gradients, probably let momentum and weight decay keep moving the "frozen" head during the body
  phase; we do not reproduce that.)

FedCONST's `constraint` is refused: its constraint sets are built from the global model, and a
personal head is not meant to stay near the global one.
"""

from __future__ import annotations

import torch

from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import abstract_base
from fl_lightning.methods.shared_model import SharedModelMethod
from fl_lightning.uploads import ClientUpload


@abstract_base
class PersonalHeadMethod(SharedModelMethod):
    """Shared body averaged by the server, personal head kept by each client (FedPer, FedRep).

    Args:
        personal_layers: state-dict prefixes (module names) of the personal part; default ["head"],
            the model's linear classifier. Everything else is the shared body.
    """

    def __init__(self, personal_layers: list[str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        if self.constraint != "none":
            raise FLUserError(f"{type(self).__name__} keeps personal heads; it does not support "
                              f"constraint '{self.constraint}' (use constraint none)")
        prefixes = list(personal_layers) if personal_layers is not None else ["head"]
        keys = list(self.model.state_dict())
        unknown = [p for p in prefixes if not any(self._under(k, p) for k in keys)]
        if not prefixes or unknown:
            raise FLUserError(f"personal_layers must name modules of the model, got {prefixes}; "
                              f"e.g. [head]")
        self.personal_prefixes = prefixes
        if all(k in self.personal for k, _ in self.model.named_parameters()):
            raise FLUserError(f"personal_layers {prefixes} cover the whole model; nothing would be shared")

    def personal_keys(self, model: torch.nn.Module) -> list[str]:
        return [k for k in model.state_dict() if any(self._under(k, p) for p in self.personal_prefixes)]

    @staticmethod
    def _under(key: str, prefix: str) -> bool:
        return key == prefix or key.startswith(prefix + ".")

    @property
    def shared_keys(self) -> list[str]:
        return [k for k in self.model.state_dict() if k not in self.personal]

    def _model_state(self, keys: list[str]) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {k: state[k].detach().clone() for k in keys}

    def client_end(self) -> ClientUpload:
        self.model.requires_grad_(True)  # FedRep froze one part in its phases
        return super().client_end()


class FedPer(PersonalHeadMethod):
    """FedPer (Arivazhagan et al., 2019): local CE steps on the whole model (global body + own
    head); the server averages the bodies; the heads stay on the clients."""


class FedRep(PersonalHeadMethod):
    """FedRep (Collins et al., ICML 2021): per round, `head_epochs` passes training only the head,
    then `body_epochs` passes training only the body; the server averages the bodies.

    Args:
        head_epochs: passes over the client's data with the body frozen (paper: 10).
        body_epochs: passes with the head frozen (paper: 1 on CIFAR). `data.local_epochs` must
            equal head_epochs + body_epochs (see the module docstring).
    """

    def __init__(self, head_epochs: int = 10, body_epochs: int = 1, **kwargs):
        super().__init__(**kwargs)
        if head_epochs < 0 or body_epochs < 1:
            raise FLUserError(f"FedRep needs head_epochs >= 0 and body_epochs >= 1, got {head_epochs} "
                              f"and {body_epochs}")
        self.save_hyperparameters()
        self.phase: str | None = None  # "head" or "body" while a client trains
        self.head_steps = 0  # local steps of the current client's head phase
        self._frozen_state: dict[str, torch.Tensor] = {}

    def on_fit_start(self) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        local_epochs = getattr(getattr(dm, "hparams", None), "local_epochs", None)
        h = self.hparams
        if local_epochs is not None and local_epochs != h.head_epochs + h.body_epochs:
            raise FLUserError(f"FedRep trains the head for head_epochs and then the body for body_epochs, so "
                              f"data.local_epochs must be {h.head_epochs} + {h.body_epochs} = "
                              f"{h.head_epochs + h.body_epochs}, got {local_epochs}")

    def client_start(self, client: int, num_samples: int) -> None:
        super().client_start(client, num_samples)
        batches_per_epoch = -(-num_samples // self.trainer.datamodule.hparams.batch_size)
        self.head_steps = self.hparams.head_epochs * batches_per_epoch
        self.start_phase("head" if self.head_steps > 0 else "body")

    def start_phase(self, phase: str) -> None:
        """Freeze the other part, remember its state to restore its buffers, fresh momentum."""
        self.phase = phase
        trained, frozen = ((self.personal, self.shared_keys) if phase == "head"
                           else (self.shared_keys, self.personal))
        for name, p in self.model.named_parameters():
            p.requires_grad_(name in trained)
        self._frozen_state = self._model_state(frozen)
        self.reset_optimizer_state()

    def end_phase(self) -> None:
        # parameters without gradient are untouched already; this undoes the BN running statistics
        # the frozen part collected in forward passes of the other part's phase
        self.load_model_part(self._frozen_state)
        self._frozen_state = {}

    def minibatch_step(self, batch):
        if self.phase == "head" and self.local_step == self.head_steps:
            self.end_phase()
            self.start_phase("body")
        return super().minibatch_step(batch)

    def client_end(self) -> ClientUpload:
        self.end_phase()
        self.phase = None
        return super().client_end()
