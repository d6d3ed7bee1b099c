"""The method contract: what a federated method is, and which of its hooks to override.

A method is a manual-optimization LightningModule that states, in one place, what a client
receives, how it takes its local steps, what it uploads and how the server combines the uploads.
The round driver (the federated callback, federation.py) calls its hooks and knows no method by
name; a method never imports the driver. To write one, subclass `SharedModelMethod` (one global
model; every hook's default is FedAvg's) or `hetero.base.HeteroMethod` (a model per client), and
override the first tier that does what the method needs:

Tier 1, the local objective: `loss(model, batch, context)`. Most methods change only what a
    client minimises. The default local step steps on it, and personalised fine-tuning with
    `objective: method` uses the same hook; `LossContext` says what else a loss may use (the
    frozen round-start model as `context.teacher` when the class sets `needs_global_model`).
    Example: FedProx (baselines/fedprox.py), CE + (mu / 2) ||w - w_g||^2; also FedNTD and the
    frozen-classifier methods (frozen/).
Tier 2, the local step: `minibatch_step(batch)`, for a step that is not one backward of one
    loss: two passes (a perturbed gradient), a second model trained alongside. It calls
    `sgd_step(loss)` to step and `log_local(values, batch_size)` for its per-step values, and
    returns the step's loss. Inside `sgd_step`, `after_backward()` corrects the gradients before
    the optimizer sees them and `after_optimizer_step()` projects the weights after it (call
    super(): the base enforces the FedCONST constraint).
    Example: FedSAM (baselines/fedsam.py), a clean pass for the perturbation and a perturbed
    pass to step on; also FedSOL (fedsol/), Ditto and Per-FedAvg (personalized/).
Tier 3, state across rounds: `client_start(client, num_samples)`, `client_end()` and
    `server_step(uploads)`, for methods that keep state on the clients or the server. Each calls
    super() and adds its own: after `client_start` has loaded the global state and reset the
    optimizer, the method loads the client's state (`client_state(client, prefix)`);
    `client_end` returns FedAvg's `ClientUpload`, to which the method adds its upload groups
    (`upload.set_group(name, tensors)`, read by name on the server) and,
    in `upload.kept` under a prefix of its own (`prefixed`), what the client keeps; `server_step`
    returns a `ServerUpdate`, to which it adds new values of the server state it declared in
    `__init__` (`self.server.tensors(...)`).
    Example: SCAFFOLD (baselines/scaffold.py): c_i loaded in `client_start`, c - c_i added in
    `after_backward`, delta c_i uploaded and c_i+ kept in `client_end`, c updated in
    `server_step`; also FedDyn, MOON and FedNova (baselines/).

`FederatedMethod`'s sections follow the tiers, then: hooks a family or an unusual method
overrides; helpers a method calls and does not override; hooks for the round driver and
Lightning only, which no method overrides (family bases extend the checkpoint hooks).

The round driver calls the hooks in this order:

    round_start(round, clients)      server: snapshot the global state every client starts from
    client_start(client, n)          client: load the global state (+ its own persistent state,
                                     `client_states[client]`), fresh optimizer state
    training_step(work)              client: its whole local training, calling
                                     minibatch_step(batch) once per local mini-batch, which by
                                     default steps on loss(self.model, batch, loss_context())
    client_end() -> ClientUpload     client: what it sends, and in `upload.kept` the state it
                                     keeps for itself (stored by the callback once accepted)
    local_model_stats(test_loader)   client: measures of its trained model (local/* means)
    server_step(uploads)             server: the accepted uploads -> a `ServerUpdate` (the new
                                     global state, new server-state values, the step's metrics);
                                     it changes nothing itself: the callback checks the update
                                     for NaN/inf and applies it (`apply_server_update`)
    round_end()                      server: per-round lr decay

State has one home per kind: the global model is `self.model` (shared-model methods); everything
else the server keeps between rounds is declared in `self.server` (`state.ServerState`, a
submodule: moved with the device and checkpointed in the state_dict for every method); every
client's own state is `self.client_states[client]` (`client_store.ClientStateStore`, one dict
of tensors per client, under a prefix per kind: "model." for the client's own part of the model,
"c." for SCAFFOLD's c_i, ...), written only from `upload.kept`; models a client uses for a while
(a frozen teacher, a previous or personal model) are `self.copies` (`state.WorkingCopies`), never
saved. What the callbacks read of a method without knowing its family: `accuracy_key` (the metric
that is the run's accuracy) and `analysis_models()` (the models the analyses look at).

How a local step is taken (through Lightning's wrappers or past them, clipping, the FedCONST
constraint) is local_step.py's; per-step values wait in local_logs.py for the round's end.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning import compat
from fl_lightning.client_store import ClientStateStore
from fl_lightning.data.datamodule import ClientWork
from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
from fl_lightning.fedconst import CONSTRAINT_MODES
from fl_lightning.methods.local_logs import LocalLogs
from fl_lightning.methods.local_step import LocalSteps
from fl_lightning.models import FLModel, check_memory_format, memory_format_for
from fl_lightning.parallel import clients_in_parallel
from fl_lightning.round_metrics import log_round_metrics
from fl_lightning.state import ServerState, State, WorkingCopies
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate


def abstract_base(cls: type) -> type:
    """Marks a base class that is not a method of its own (FederatedMethod, HeteroMethod, ...): it
    cannot be instantiated, and the CLI's `--help` and unknown-method list, which skip abstract
    classes, do not offer it. Unlike ABCMeta's flag, this one is not inherited: subclasses are
    concrete methods unless marked too."""
    cls.__abstractmethods__ = frozenset({"(a base class, not a method)"})
    return cls


# the label of a sample the vectorised engine pads a batch with: F.cross_entropy's default ignore_index
PADDED_LABEL = -100


@dataclass(frozen=True)
class LossContext:
    """What a method's `loss(model, batch, context)` may use besides the model and the batch.

    Attributes:
        teacher: a frozen model the training started from: in local training the round-start
            global model, for methods that set `needs_global_model`; in personalised fine-tuning
            the model the fine-tuning started from. None when there is none.
        class_counts: the client's training class counts (float, on the device), or None.
        finetuning: True in personalised fine-tuning of a copy. The method's federated state
            (this round's global weights, the client's stored state, the server's shared models,
            prototypes or generator) then does not belong to `model`, so loss terms built on it
            are left out: fine-tuning uses the method's objective as far as it is defined on one
            model, its teacher and the class counts.
    """

    teacher: nn.Module | None = None
    class_counts: torch.Tensor | None = None
    finetuning: bool = False


NO_CONTEXT = LossContext()  # a loss that uses nothing else (frozen, so one instance serves every step)


def seed_rngs(seed: int, device: torch.device) -> None:
    """Seeds the global generators a client's training draws from: the CPU's, and the one of
    `device` if it is an accelerator (dropout, augmentation and a method's draws on the GPU).
    `torch.manual_seed` would also queue a lazy seed for every accelerator type torch knows but
    this process does not use (CUDA, XPU, MTIA), formatting a stack trace for each, per client."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.get_device_module(device.type).manual_seed(seed)


@abstract_base
class FederatedMethod(L.LightningModule):
    """Options of the method and of its clients' local training.

    The common base of both method families: the local optimizer and step (manual
    optimization through `sgd_step`), one Trainer batch = one client (`training_step` calls
    `minibatch_step` per local mini-batch), per-step logs, per-client state, and the round's
    hooks the federated callback calls. `SharedModelMethod` (one global model) and
    `hetero.base.HeteroMethod` (a model per client) are its two siblings. Which hooks a method
    overrides: the module docstring's three tiers.

    Args:
        model: architecture name (see `fl_lightning.models.MODELS`), or a model group for
            model-heterogeneous methods.
        lr: learning rate of the local SGD (its state is reset for every client, every round).
        momentum: momentum of the local SGD.
        weight_decay: weight decay of the local SGD.
        lr_decay: local lr multiplied by this after every round (FedSOL: 0.99).
        lr_milestones: if set, multi-step decay instead: lr x `lr_milestone_gamma` at these rounds.
        lr_milestone_gamma: the factor of that multi-step decay.
        data_spec: classes / channels / image size; the CLI links it from the data module.
        constraint: FedCONST's per-channel convex constraints on the local update (see
            fedconst.py): "none", "joint" (exact projection) or "sequential" (the paper's
            Algorithm 1 order). Applied in `after_optimizer_step`, so every method that steps
            through `sgd_step` gets it ("+ CONST").
        memory_format: the memory layout of the convolutional models' weights and of the
            batches: "channels_last", "contiguous" (torch's default), or "auto": channels-last
            where it is the faster layout (on CUDA, and on a CPU for the architectures of
            `fl_lightning.models.CHANNELS_LAST_ON_CPU`). Results differ only by float rounding;
            checkpoints and client-state files are written in the default layout either way.
    """

    def __init__(
        self,
        model: str = "fedavg_cnn",
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 1e-5,
        lr_decay: float = 0.99,
        lr_milestones: list[int] | None = None,
        lr_milestone_gamma: float = 0.1,
        data_spec: DataSpec | None = None,
        constraint: Literal["none", "joint", "sequential"] = "none",
        memory_format: Literal["auto", "channels_last", "contiguous"] = "auto",
    ):
        super().__init__()
        if data_spec is None:
            raise FLUserError("the method needs data_spec (the CLI links it from --data.dataset)")
        if lr <= 0:
            raise FLUserError(f"lr must be > 0, got {lr}")
        if momentum < 0 or weight_decay < 0:
            raise FLUserError(f"momentum and weight_decay must be >= 0, got {momentum} and {weight_decay}")
        if lr_decay <= 0 or lr_milestone_gamma <= 0:
            raise FLUserError(f"lr_decay and lr_milestone_gamma must be > 0 (1 = no decay), got {lr_decay} and "
                              f"{lr_milestone_gamma}")
        if lr_milestones and any(m < 1 for m in lr_milestones):
            raise FLUserError(f"lr_milestones are rounds >= 1, e.g. [160, 240], got {lr_milestones}")
        if constraint not in CONSTRAINT_MODES:
            raise FLUserError(f"constraint must be one of {', '.join(CONSTRAINT_MODES)}, got '{constraint}'")
        check_memory_format(memory_format)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.round_idx = -1
        self.current_client: int | None = None
        self.current_num_samples = 0
        self.steps = LocalSteps()  # how local steps are taken, and the current client's count
        self.local_logs = LocalLogs()  # what `log_local` recorded this round
        # the three homes of state (module docstring): the server's, every client's, working copies
        self.server = ServerState()
        self.client_states = ClientStateStore()
        self.copies = WorkingCopies()
        self.constraint = constraint  # the FedCONST mode; the round's constraint set is steps.constraint
        self.memory_format = torch.contiguous_format  # `memory_format` resolved in configure_model

    # ---- tier 1: the local objective -------------------------------------------------------------
    def loss(self, model: nn.Module, batch, context: LossContext) -> torch.Tensor:
        """The method's local objective on `model` for one mini-batch (x, y): the one loss hook of
        both local training (`minibatch_step`: `loss(self.model, batch, self.loss_context())`)
        and personalised fine-tuning with `objective: method` (a copy of the start model, context
        with `finetuning=True`, `personalization.py`). Plain CE here; methods whose local loss
        differs override this, computing on `model`, never on `self.model`."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def loss_context(self) -> LossContext:
        """What `loss` may use in the current client's local training (see LossContext)."""
        return NO_CONTEXT

    # ---- the vectorised engine (vectorized.py) ---------------------------------------------------
    # True in a method whose local step the vectorised engine (`--federation.engine vectorized`)
    # can take: a loss on the shared model, no per-client state. Subclasses inherit it only as long
    # as they keep the hooks the engine bypasses (vectorized.BYPASSED_HOOKS).
    vectorized: bool = False
    # True when the vectorised loss of a batch padded with ignored samples (zero images, label
    # PADDED_LABEL: F.cross_entropy's ignore_index) is the loss of the batch: a mean cross-entropy
    # plus terms free of the batch, or terms that leave the padded samples out. Clients whose
    # batches differ in size then still step in one call.
    vectorized_padding: bool = False
    # True when the method's loss reads nothing of a parameter but its value (no `requires_grad`
    # test, no inner gradient): the engine may then differentiate the sum of the clients' vmapped
    # losses in one backward pass, where `vmap` of `torch.func.grad` wraps every operation twice.
    # Used only while the class that sets it also gives the loss hooks (vectorized.py checks).
    vectorized_one_backward: bool = False

    def vectorized_loss(self, model: nn.Module, batch, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss whose gradient is local step number `step` (0-based) of one client, with the
        step's logged values (`log_local`'s), computed on `model` whose parameters the vectorised
        engine has set to that client's (torch.func: no in-place change of a parameter, no
        `torch.autograd.grad`; an inner gradient is `torch.func.grad`). By default the method's
        `loss`, which is what `minibatch_step` steps on."""
        loss = self.loss(model, batch, self.loss_context())
        return loss, {"train/loss": loss}

    def vectorized_logs(self, logs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's logged values from `vectorized_loss`'s and the step's gradients (by
        parameter name, before weight decay and momentum): for values that need the gradient."""
        return logs

    def vectorized_refusal(self) -> str | None:
        """Why this instance's options cannot run vectorised (e.g. "strategy A4"), or None."""
        return None

    # ---- tier 2: the local step ------------------------------------------------------------------
    def minibatch_step(self, batch) -> torch.Tensor | None:
        """One local step on one mini-batch (x, y); methods with their own step override this."""
        loss = self.loss(self.model, batch, self.loss_context())
        self.sgd_step(loss)
        loss = loss.detach()
        self.log_local({"train/loss": loss}, len(batch[1]))
        return loss

    def after_backward(self) -> None:
        """Hook between backward and step: gradient corrections (SCAFFOLD's c - c_i, FedSOL's
        projection). It sees the gradients as the optimizer will (unscaled by any loss scaler:
        it runs in `on_before_optimizer_step`), so a correction added here is added at its true size."""

    def after_optimizer_step(self) -> None:
        """Hook after every local step: projections that must hold after momentum/weight decay.

        The base version enforces the FedCONST constraint (`constraint`). Overrides must call
        `super().after_optimizer_step()`, last if their own changes must also be constrained;
        `sgd_step` raises if an override skips it while a constraint is on.
        """
        self.steps.constrain(self.model)

    # ---- tier 3: state across rounds (each sibling implements these) -----------------------------
    def client_start(self, client: int, num_samples: int) -> None:
        """Client: receive what the server sends (and the client's own state); fresh optimizer."""
        raise NotImplementedError

    def client_end(self) -> ClientUpload:
        """Client: what it sends, and in `kept` what it keeps for itself (see ClientUpload)."""
        raise NotImplementedError

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        """Server: the accepted uploads -> the next round's state, returned, not applied. Sums over
        the round's clients go through `uploads.sum(group)` / `uploads.weighted_average(group)`
        (a group's name, or a function of an upload; they reduce across processes when clients
        train in parallel); a rule that is not a sum takes `uploads.gathered()`."""
        raise NotImplementedError

    # ---- hooks a family or an unusual method overrides -------------------------------------------
    def round_start(self, round_idx: int, clients: list[int]) -> None:
        """Server: take this round's starting state (before any client runs)."""
        self.round_idx = round_idx

    def round_end(self) -> None:
        with warnings.catch_warnings():
            if self.steps.engine is not None:
                # the vectorised engine steps the clients' stacked copies, never the optimizer, so
                # torch would warn that the schedule steps first (the schedule is right as it is)
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.lr_schedulers().step()

    def apply_server_update(self, update: ServerUpdate) -> None:
        """Called by the round callback with `server_step`'s result once it is known finite."""
        self.server.assign(update.server_state)
        self.current_client = None
        self._drop_local_optimizer_state()

    def abandon_round(self) -> None:
        """The round stops the run before its server step (divergence): the module goes back to
        where the round started, so nothing of the round is evaluated or saved."""
        self.current_client = None
        self._drop_local_optimizer_state()

    def local_parameters(self) -> Iterable[nn.Parameter]:
        """What the local optimizer updates; frozen-classifier methods leave the head out."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def predict_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores used for every accuracy; cosine-classifier methods override this."""
        return self.model(x)

    accuracy_key: str = "global/test_acc"  # the logged metric that is the run's accuracy

    def local_model_stats(self, test_loader: Callable[[], Iterable], per_class: bool = False) -> dict[str, float]:
        """Called right after `client_end`: measures of the client's just-trained model for the
        round's `local/*` means (e.g. its accuracy on the global test set, `test_loader()`); with
        `per_class`, also `federation.LOCAL_CLASS_ACC`, its accuracy per class (a list)."""
        return {}

    def analysis_models(self, max_clients: int) -> list[tuple[str, nn.Module]]:
        """The models the analyses (Hessian spectrum, loss surface, divergence) look at, each with
        the prefix of its logged keys: ("", the global model), or for methods without one
        ("client_k/", client k's model) for clients 0 .. max_clients-1."""
        raise NotImplementedError

    def finetune_start(self, client: int) -> FLModel:
        """The model personalised fine-tuning of `client` starts from (it is copied, never
        changed): the global model, or the client's own model."""
        raise NotImplementedError

    def personal_model(self, client: int) -> nn.Module | None:
        """The method's own personalised model of `client`, for methods that train one while
        federating (FedPer, FedRep, Ditto, Per-FedAvg, kNN-Per: the "1-step" pFL methods). It is a
        new module on `self.device` whose forward gives class scores. Building it must not change
        the global model or any client state. None means the method has none, and personalised
        evaluation then reports only fine-tuning from the global model."""
        return None

    def global_test_metrics(self, loader: Callable[[], Iterable]) -> dict[str, float]:
        """Final measures on the global test set `loader()` (personalised evaluation reports them
        as `final/*`); nothing for methods without a global model."""
        return {}

    # ---- helpers a method calls (not to override) ------------------------------------------------
    def sgd_step(self, loss: torch.Tensor) -> None:
        """One local step on `loss`: backward, `after_backward`, gradient clipping
        (`--trainer.gradient_clip_val`), the optimizer's step, `after_optimizer_step`; how it is
        taken (through Lightning's wrappers or past them) is local_step.py's."""
        self.steps.take(self, loss)

    def log_local(self, metrics: dict[str, torch.Tensor | float], batch_size: int) -> None:
        """Per-step values (e.g. {"train/loss": loss}), logged once per round as their
        batch-size-weighted mean over all local steps of the round (local_logs.py)."""
        self.local_logs.add(metrics, batch_size)

    def clip_local_gradients(self, optimizer) -> None:
        """`--trainer.gradient_clip_val` / `--trainer.gradient_clip_algorithm` on every local step,
        through Lightning's `clip_gradients` (its precision plugin). The clipped gradient is the one
        the optimizer steps with: after `after_backward`'s corrections (SCAFFOLD's c - c_i, FedSOL's
        projection), and after any perturbation (FedSAM/FedSOL's perturbed gradient); weight decay
        and momentum come after, inside the optimizer, as with Lightning's automatic clipping."""
        self.steps.clip_gradients(self, optimizer)

    def client_state(self, client: int, prefix: str) -> State | None:
        """The part of `client_states[client]` stored under `prefix` (e.g. "c." for SCAFFOLD's
        c_i), with the prefix removed; None when the client has none."""
        state = self.client_states.get(client)
        if state is None:
            return None
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        return part or None

    @staticmethod
    def prefixed(prefix: str, state: Mapping[str, torch.Tensor]) -> State:
        """`state` with every key under `prefix`, detached (an `upload.kept` part)."""
        return {prefix + k: v.detach() for k, v in state.items()}

    @property
    def local_step(self) -> int:
        """Local steps the current client has taken this round."""
        return self.steps.taken

    def current_lr(self) -> float:
        return float(self.optimizers().optimizer.param_groups[0]["lr"])

    def reset_optimizer_state(self) -> None:
        """Momentum buffers start at zero for every client, every round, and are never uploaded."""
        self.optimizers().optimizer.state.clear()

    def run_seed(self) -> int:
        dm = getattr(compat.attached_trainer(self), "datamodule", None)
        return int(dm.hparams.seed) if dm is not None else 0

    def server_seed(self) -> int:
        """Seeds the server's random draws of this round (shuffles, generator samples)."""
        return self.run_seed() * 1_000_003 + self.round_idx

    def seed_client(self, client: int) -> None:
        """Seeds the global RNG by (seed, round, client) as the client starts: its dropout and any
        draw a method makes during local training are the same whichever process trains it, and
        in a resumed run the same as in an uninterrupted one."""
        seed_rngs(self.run_seed() * 1_000_003 + self.round_idx * 10_007 + client, self.device)

    def mean_across_devices(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients taken with torch.autograd.grad bypass DDP's all-reduce; average them here so
        every rank perturbs identically (a no-op on one device, and when the ranks train different
        clients: `--federation.parallel clients`)."""
        trainer = compat.attached_trainer(self)
        if trainer is None or trainer.world_size == 1 or clients_in_parallel(trainer):
            return tensors
        return [self.trainer.strategy.reduce(t, reduce_op="mean") for t in tensors]

    # ---- for the round driver and Lightning only (not to override) -------------------------------
    def configure_optimizers(self):
        h = self.hparams
        opt = torch.optim.SGD(self.local_parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
        if h.lr_milestones:
            sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(h.lr_milestones),
                                                         gamma=h.lr_milestone_gamma)
        else:
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=h.lr_decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def architectures(self) -> tuple[str, ...]:
        """The names of the architectures this method trains (`fl_lightning.models.MODELS`)."""
        return (self.hparams.model,)

    def configure_model(self) -> None:
        """The `memory_format` option, applied once the device is known (fit, validate, test):
        the module's weights (models, server state) in that layout, and the data module makes its
        batches in it. Copies made later (teachers, personal models) keep it; a state_dict or
        file in either layout loads into it (copied element by element)."""
        trainer = compat.attached_trainer(self)
        device = trainer.strategy.root_device if trainer is not None else self.device
        self.memory_format = memory_format_for(self.hparams.memory_format, self.architectures(), device)
        self.in_memory_format(self)
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "memory_format"):
            datamodule.memory_format = self.memory_format

    def in_memory_format(self, module: nn.Module) -> nn.Module:
        """`module` with its 4-d weights and buffers in the run's layout (in place)."""
        return module.to(memory_format=self.memory_format)

    def on_train_start(self) -> None:
        self.steps.start_training(self, FederatedMethod)

    def training_step(self, work: ClientWork, batch_idx: int) -> None:
        """One Trainer batch is one client: its whole local training, one `minibatch_step` per
        local mini-batch (sliced on the device by the data module). The federated callback has
        started the client before this and ends it after."""
        trainer = self.trainer
        if self.steps.engine is not None:  # the vectorised engine trains the round's clients together
            self.steps.engine.train_client(self, work)
            return
        convert = trainer.precision_plugin.convert_input  # e.g. float64 inputs for 64-true
        for batch in trainer.datamodule.minibatches(work):
            self.minibatch_step(convert(batch))
        self.steps.count_in(trainer)  # the steps taken past Lightning's wrappers (local_step.py)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Lightning calls this right before every local step (the direct path of `sgd_step` calls
        it itself), after a loss scaler (16-mixed's GradScaler) has unscaled the gradients: the
        place for gradient corrections (`after_backward`) and then clipping."""
        self.after_backward()
        self.clip_local_gradients(optimizer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict_logits(x)

    def local_log_position(self) -> dict[str, int]:
        return self.local_logs.position()  # before and after a client: its span of the logs

    def local_log_means(self, since: dict[str, int], until: dict[str, int] | None = None) -> dict[str, float]:
        return self.local_logs.means(since, until)  # one client's means: its row's train_loss

    def flush_local_logs(self) -> dict[str, tuple[float, float]]:
        return self.local_logs.flush()  # this process's part of the round's means

    merge_local_logs = staticmethod(LocalLogs.merge)  # the round's means from every process's part

    def _drop_local_optimizer_state(self) -> None:
        """The round's last client's momentum buffers are of no use: the next client starts from
        zero. Dropped when the round ends, they stay out of the round checkpoint (as many bytes as
        the model's parameters: half of an `mlp` checkpoint) and out of memory between rounds.
        (No local optimizer before fit's training starts.)"""
        if self.steps.optimizer is not None:
            self.reset_optimizer_state()

    def configure_client_stores(self, directory, cache_size: int, rank: int = 0) -> None:
        """Where per-client state files go, how many clients stay in memory and which process
        this is (the federated callback sets this from its options before a checkpoint is loaded)."""
        self.client_states.configure(directory, cache_size, rank)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        from fl_lightning.checkpointing import FORMAT

        checkpoint["fl_format"] = FORMAT
        checkpoint["fl_client_states"] = self.client_states.checkpoint_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # the files a checkpoint names are beside it, wherever this run writes its own
        path = getattr(compat.attached_trainer(self), "ckpt_path", None)
        base = Path(path).parent / "client_states" if path else None
        self.client_states.load_checkpoint_state(checkpoint.get("fl_client_states", {"states": {}}), base=base)

    def publish_evaluation(self, values: dict[str, float | torch.Tensor], progress_key: str) -> None:
        """An evaluation's values, the same on every process: in fit published with the round's
        other values (`log_round_metrics`), in validate and test as Lightning's returned and
        printed results. The one way every family logs its evaluation."""
        trainer = self.trainer
        if trainer.state.fn != "fit":
            # the values are the same on every process already; Lightning's mean over them
            # (sync_dist) changes nothing and keeps its distributed-logging warning quiet
            for key, value in values.items():
                self.log(key, value, on_epoch=True, prog_bar=key == progress_key, sync_dist=True)
        elif not trainer.sanity_checking:
            log_round_metrics(trainer, values, progress_bar=(progress_key,))
