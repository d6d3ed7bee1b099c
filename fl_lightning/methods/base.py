"""The method contract. A method is a manual-optimization LightningModule that states, in one
place, what a client receives, how it takes one local step, what it uploads and how the server
combines the uploads. The federated callback (federation.py) calls these hooks in this order:

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
saved.

Two siblings implement them over the common base `FederatedMethod`: `SharedModelMethod` (one
global model every client starts from; between rounds `self.model` holds it, so Lightning's
validation loop, checkpoints and `validate`/`test` see it with no extra plumbing; state_dict keys
named by `personal_keys(model)` stay with each client) and `hetero.base.HeteroMethod` (each
client its own architecture, evaluated on its own test split). What the callbacks read of a
method without knowing its family: `accuracy_key` (the metric that is the run's accuracy) and
`analysis_models()` (the models the analyses look at). Personalised evaluation starts fine-tuning
from `finetune_start(client)`, whichever the family, and with `objective: method` fine-tunes on the
same `loss(model, batch, context)` hook as local training (one loss hook; `LossContext` says what
else a loss may use).

Every local step should go through `sgd_step(loss)` (backward, `after_backward`, gradient clipping
(`--trainer.gradient_clip_val`), optimizer step, `after_optimizer_step`): the base
`after_optimizer_step` enforces the FedCONST constraint (`constraint` option, fedconst.py), so
overrides must call super().
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from fl_lightning import compat
from fl_lightning.client_store import ClientStateStore
from fl_lightning.data.datamodule import ClientWork
from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import EvalResult, Evaluation, evaluate
from fl_lightning.fedconst import CONSTRAINT_MODES, ChannelConstraint, constrained_names
from fl_lightning.federation import log_round_metrics
from fl_lightning.models import FLModel, build_model
from fl_lightning.parallel import ClientParallelStrategy, clients_in_parallel
from fl_lightning.state import ServerState, State, WorkingCopies, state_loader
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate


def abstract_base(cls: type) -> type:
    """Marks a base class that is not a method of its own (FederatedMethod, HeteroMethod, ...): it
    cannot be instantiated, and the CLI's `--help` and unknown-method list, which skip abstract
    classes, do not offer it. Unlike ABCMeta's flag, this one is not inherited: subclasses are
    concrete methods unless marked too."""
    cls.__abstractmethods__ = frozenset({"(a base class, not a method)"})
    return cls


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


class LocalSteps:
    """The current client's step counters. A plain object, not module attributes: setting an
    attribute of an `nn.Module` checks its parameters, buffers and submodules, which a small
    model's local step would pay several times.

    Attributes:
        taken: local steps the current client has taken this round (`local_step`).
        direct: of these, steps taken without Lightning's optimizer wrapper, which Lightning's
            step counter (`trainer.global_step`) learns of when the client's training ends.
        base_hook_ran: the base `after_optimizer_step` ran in the current step (see sgd_step).
    """

    __slots__ = ("taken", "direct", "base_hook_ran")

    def __init__(self):
        self.taken = self.direct = 0
        self.base_hook_ran = False


def seed_rngs(seed: int, device: torch.device) -> None:
    """Seeds the global generators a client's training draws from: the CPU's, and the one of
    `device` if it is an accelerator (dropout, augmentation and a method's draws on the GPU).
    `torch.manual_seed` would also queue a lazy seed for every accelerator type torch knows but
    this process does not use (CUDA, XPU, MTIA), formatting a stack trace for each: that alone
    cost about as much as 5 local steps of a small model, per client."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.get_device_module(device.type).manual_seed(seed)


def _weighted_sum(values: list, sizes: list[int]) -> tuple[float, float]:
    """(sum of value * size, sum of sizes) in float64, with one device sync for all values."""
    stacked = torch.as_tensor([float(v) for v in values], dtype=torch.float64) if not all(
        isinstance(v, torch.Tensor) for v in values) else torch.stack(values).double().cpu()
    # numpy reads a list of ints faster than torch.as_tensor, and the sizes' sum is exact in
    # Python as in float64 (integers)
    weights = torch.from_numpy(np.asarray(sizes, dtype=np.float64))
    return float((stacked * weights).sum()), float(sum(sizes))


@abstract_base
class FederatedMethod(L.LightningModule):
    """The common base of both method families: the local optimizer and step (manual
    optimization through `sgd_step`), one Trainer batch = one client (`training_step` calls
    `minibatch_step` per local mini-batch), per-step logs, per-client state, and the round's
    hooks the federated callback calls. `SharedModelMethod` (one global model) and
    `hetero.base.HeteroMethod` (a model per client) are its two siblings.

    Args:
        model: architecture name (see `fl_lightning.models.MODELS`), or a model group for
            model-heterogeneous methods.
        lr: learning rate of the local SGD (its state is reset for every client, every round).
        momentum: momentum of the local SGD.
        weight_decay: weight decay of the local SGD.
        lr_decay: local lr multiplied by this after every round (FedSOL: 0.99).
        lr_milestones: if set, multi-step decay instead: lr x `lr_milestone_gamma` at these rounds.
        lr_milestone_gamma: the factor of that multi-step decay.
        server_lr: global step size on the averaged update (1.0 = plain FedAvg).
        data_spec: classes / channels / image size; the CLI links it from the data module.
        constraint: FedCONST's per-channel convex constraints on the local update (see
            fedconst.py): "none", "joint" (exact projection) or "sequential" (the paper's
            Algorithm 1 order). Applied in `after_optimizer_step`, so every method that steps
            through `sgd_step` gets it ("+ CONST").
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
        server_lr: float = 1.0,
        data_spec: DataSpec | None = None,
        constraint: Literal["none", "joint", "sequential"] = "none",
    ):
        super().__init__()
        if data_spec is None:
            raise FLUserError("the method needs data_spec (the CLI links it from --data.dataset)")
        if lr <= 0 or server_lr <= 0:
            raise FLUserError(f"lr and server_lr must be > 0, got {lr} and {server_lr}")
        if momentum < 0 or weight_decay < 0:
            raise FLUserError(f"momentum and weight_decay must be >= 0, got {momentum} and {weight_decay}")
        if lr_decay <= 0 or lr_milestone_gamma <= 0:
            raise FLUserError(f"lr_decay and lr_milestone_gamma must be > 0 (1 = no decay), got {lr_decay} and "
                              f"{lr_milestone_gamma}")
        if lr_milestones and any(m < 1 for m in lr_milestones):
            raise FLUserError(f"lr_milestones are rounds >= 1, e.g. [160, 240], got {lr_milestones}")
        if constraint not in CONSTRAINT_MODES:
            raise FLUserError(f"constraint must be one of {', '.join(CONSTRAINT_MODES)}, got '{constraint}'")
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.round_idx = -1
        self.current_client: int | None = None
        self.current_num_samples = 0
        self.steps = LocalSteps()
        # the three homes of state (module docstring): the server's, every client's, working copies
        self.server = ServerState()
        self.client_states = ClientStateStore()
        self.copies = WorkingCopies()
        self.constraint = constraint
        self._constraint: ChannelConstraint | None = None  # this round's constraint set
        self._local_logs: dict[str, tuple[list, list[int]]] = {}
        self._direct_steps = False  # see sgd_step
        self._local_optimizer: torch.optim.Optimizer | None = None  # the torch optimizer, for direct steps
        self._gradient_clip: tuple[float, str] = (0.0, "norm")  # see clip_local_gradients

    # ---- optimizer ----------------------------------------------------------------------------
    def local_parameters(self) -> Iterable[nn.Parameter]:
        """What the local optimizer updates; frozen-classifier methods leave the head out."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def configure_optimizers(self):
        h = self.hparams
        opt = torch.optim.SGD(self.local_parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
        if h.lr_milestones:
            sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(h.lr_milestones),
                                                         gamma=h.lr_milestone_gamma)
        else:
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=h.lr_decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def current_lr(self) -> float:
        return float(self.optimizers().optimizer.param_groups[0]["lr"])

    def reset_optimizer_state(self) -> None:
        """Momentum buffers start at zero for every client, every round, and are never uploaded."""
        self.optimizers().optimizer.state.clear()

    @property
    def local_step(self) -> int:
        """Local steps the current client has taken this round."""
        return self.steps.taken

    def on_train_start(self) -> None:
        self._direct_steps = self._steps_need_no_lightning_wrappers()
        self._local_optimizer = self.optimizers().optimizer
        # --trainer.gradient_clip_val / _algorithm: Lightning refuses them under manual
        # optimization, so the CLI's Trainer (trainer.py:FLTrainer) keeps them for us
        self._gradient_clip = (float(getattr(self.trainer, "local_gradient_clip_val", 0.0) or 0.0),
                               getattr(self.trainer, "local_gradient_clip_algorithm", "norm"))

    def _steps_need_no_lightning_wrappers(self) -> bool:
        """True on one device per process (one device, or clients in parallel: no DDP wrapper)
        with 32-bit precision when neither a callback nor the module overrides a per-step
        optimization hook: `manual_backward` and `LightningOptimizer.step` then add nothing but
        their cost (a third of a small model's step)."""
        trainer = self.trainer
        one_device = type(trainer.strategy) is SingleDeviceStrategy or type(trainer.strategy) is ClientParallelStrategy
        if not one_device or type(trainer.precision_plugin) is not Precision:
            return False
        hooks = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
        listeners = [(type(cb), L.Callback) for cb in trainer.callbacks] + [(type(self), FederatedMethod)]
        return not any(getattr(cls, h) is not getattr(base, h) for cls, base in listeners for h in hooks)

    # ---- randomness ---------------------------------------------------------------------------
    def run_seed(self) -> int:
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return int(dm.hparams.seed) if dm is not None else 0

    def server_seed(self) -> int:
        """Seeds the server's random draws of this round (shuffles, generator samples)."""
        return self.run_seed() * 1_000_003 + self.round_idx

    def seed_client(self, client: int) -> None:
        """Seeds the global RNG by (seed, round, client) as the client starts: its dropout and any
        draw a method makes during local training are the same whichever process trains it, and
        in a resumed run the same as in an uninterrupted one."""
        seed_rngs(self.run_seed() * 1_000_003 + self.round_idx * 10_007 + client, self.device)

    # ---- the round (each sibling implements these) ---------------------------------------------
    def round_start(self, round_idx: int, clients: list[int]) -> None:
        """Server: take this round's starting state (before any client runs)."""
        self.round_idx = round_idx

    def client_start(self, client: int, num_samples: int) -> None:
        """Client: receive what the server sends (and the client's own state); fresh optimizer."""
        raise NotImplementedError

    def client_end(self) -> ClientUpload:
        """Client: what it sends, and in `kept` what it keeps for itself (see ClientUpload)."""
        raise NotImplementedError

    accuracy_key: str = "global/test_acc"  # the logged metric that is the run's accuracy

    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        """Server: the accepted uploads -> the next round's state, returned, not applied. Sums over
        the round's clients go through `uploads.sum` / `uploads.weighted_average` (they reduce
        across processes when clients train in parallel); a rule that is not a sum takes
        `uploads.gathered()`."""
        raise NotImplementedError

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

    def _drop_local_optimizer_state(self) -> None:
        """The round's last client's momentum buffers are of no use: the next client starts from
        zero. Dropped when the round ends, they stay out of the round checkpoint (as many bytes as
        the model's parameters: half of an `mlp` checkpoint) and out of memory between rounds.
        (No local optimizer before fit's training starts.)"""
        if self._local_optimizer is not None:
            self.reset_optimizer_state()

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

    # ---- the local training ---------------------------------------------------------------------
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

    def training_step(self, work: ClientWork, batch_idx: int) -> None:
        """One Trainer batch is one client: its whole local training, one `minibatch_step` per
        local mini-batch (sliced on the device by the data module). The federated callback has
        started the client before this and ends it after."""
        trainer = self.trainer
        convert = trainer.precision_plugin.convert_input  # e.g. float64 inputs for 64-true
        for batch in trainer.datamodule.minibatches(work):
            self.minibatch_step(convert(batch))
        if self.steps.direct:
            compat.count_manual_optimizer_steps(trainer, self.steps.direct)
            self.steps.direct = 0

    def minibatch_step(self, batch) -> torch.Tensor | None:
        """One local step on one mini-batch (x, y); methods with their own step override this."""
        loss = self.loss(self.model, batch, self.loss_context())
        self.sgd_step(loss)
        loss = loss.detach()
        self.log_local({"train/loss": loss}, len(batch[1]))
        return loss

    def log_local(self, metrics: dict[str, torch.Tensor | float], batch_size: int) -> None:
        """Per-step values, accumulated on the device and logged once per round by the federated
        callback (`flush_local_logs`) as their batch-size-weighted mean over all local steps of the
        round: Lightning's `log` costs far more than a small model's step."""
        for key, value in metrics.items():
            values = self._local_logs.setdefault(key, ([], []))
            values[0].append(value.detach() if isinstance(value, torch.Tensor) else value)
            values[1].append(batch_size)

    def flush_local_logs(self) -> dict[str, tuple[float, float]]:
        """What `log_local` collected this round on this process, as {key: (batch-size-weighted
        sum, total batch size)} (and forgets it); `merge_local_logs` turns such parts into means."""
        sums = {key: _weighted_sum(values, sizes) for key, (values, sizes) in self._local_logs.items()}
        self._local_logs = {}
        return sums

    def local_log_position(self) -> dict[str, int]:
        """Where `log_local`'s records stand now (for `local_log_means` of one client)."""
        return {key: len(values) for key, (values, _) in self._local_logs.items()}

    def local_log_means(self, since: dict[str, int], until: dict[str, int] | None = None) -> dict[str, float]:
        """The batch-size-weighted means of what `log_local` recorded after `since` and up to
        `until` (positions from `local_log_position`; None: up to now), e.g. one client's local
        training: its row in the round's per-client table."""
        out = {}
        for key, (values, sizes) in self._local_logs.items():
            start = since.get(key, 0)
            end = len(values) if until is None else until.get(key, 0)
            if end > start:
                total, weight = _weighted_sum(values[start:end], sizes[start:end])
                out[key] = total / weight
        return out

    @staticmethod
    def merge_local_logs(parts: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
        """The round's means over the parts of every process (in rank order)."""
        merged: dict[str, tuple[float, float]] = {}
        for part in parts:
            for key, (s, w) in part.items():
                s0, w0 = merged.get(key, (0.0, 0.0))
                merged[key] = (s0 + s, w0 + w)
        return {key: s / w for key, (s, w) in merged.items()}

    def sgd_step(self, loss: torch.Tensor) -> None:
        steps = self.steps
        if self._direct_steps:
            # one device, 32-bit, no per-step hook anyone listens to: Lightning's backward and step
            # wrappers would only dispatch empty hooks (and this module's on_before_optimizer_step,
            # called here instead); Lightning's step counter learns of these steps at the client's end
            # (torch's profiler annotations of zero_grad and step, which cost a small model a
            # tenth of its step, are left out unless a profiler records: compat.py)
            opt = self._local_optimizer
            compat.release_gradients(opt)
            loss.backward()
            self.on_before_optimizer_step(opt)
            compat.step_optimizer(opt)
            steps.direct += 1
        else:  # precision plugins (autocast, loss scaling), DDP and per-step callback hooks
            opt = self.optimizers()
            opt.zero_grad(set_to_none=True)
            self.manual_backward(loss)
            opt.step()  # Lightning calls on_before_optimizer_step inside, after unscaling
        steps.base_hook_ran = False
        self.after_optimizer_step()
        if self._constraint is not None and not steps.base_hook_ran:
            raise RuntimeError(f"{type(self).__name__}.after_optimizer_step() must call "
                               f"super().after_optimizer_step(): it enforces the FedCONST constraint")
        steps.taken += 1

    def after_backward(self) -> None:
        """Hook between backward and step: gradient corrections (SCAFFOLD's c - c_i, FedSOL's
        projection). It sees the gradients as the optimizer will (unscaled by any loss scaler:
        it runs in `on_before_optimizer_step`), so a correction added here is added at its true size."""

    def on_before_optimizer_step(self, optimizer) -> None:
        """Lightning calls this right before every local step (`sgd_step` calls it itself on its
        direct path), after a loss scaler (16-mixed's GradScaler) has unscaled the gradients: the
        place for gradient corrections (`after_backward`) and then clipping. Overrides must call
        super()."""
        self.after_backward()
        self.clip_local_gradients(optimizer)

    def clip_local_gradients(self, optimizer) -> None:
        """`--trainer.gradient_clip_val` / `--trainer.gradient_clip_algorithm` on every local step,
        through Lightning's `clip_gradients` (its precision plugin). The clipped gradient is the one
        the optimizer steps with: after `after_backward`'s corrections (SCAFFOLD's c - c_i, FedSOL's
        projection), and after any perturbation (FedSAM/FedSOL's perturbed gradient); weight decay
        and momentum come after, inside the optimizer, as with Lightning's automatic clipping."""
        clip_val, algorithm = self._gradient_clip
        if clip_val > 0:
            self.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)

    def after_optimizer_step(self) -> None:
        """Hook after every local step: projections that must hold after momentum/weight decay.

        The base version enforces the FedCONST constraint (`constraint`). Overrides must call
        `super().after_optimizer_step()`, last if their own changes must also be constrained;
        `sgd_step` raises if an override skips it while a constraint is on.
        """
        if self._constraint is not None:
            self._constraint.apply(self.model)
        self.steps.base_hook_ran = True

    def round_end(self) -> None:
        self.lr_schedulers().step()

    # ---- evaluation ---------------------------------------------------------------------------
    def predict_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores used for every accuracy; cosine-classifier methods override this."""
        return self.model(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict_logits(x)

    # ---- client state: where the files go, checkpoints ----------------------------------------

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
        path = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
        base = Path(path).parent / "client_states" if path else None
        self.client_states.load_checkpoint_state(checkpoint.get("fl_client_states", {"states": {}}), base=base)

    # ---- multi-device -------------------------------------------------------------------------
    def mean_across_devices(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients taken with torch.autograd.grad bypass DDP's all-reduce; average them here so
        every rank perturbs identically (a no-op on one device, and when the ranks train different
        clients: `--federation.parallel clients`)."""
        if self._trainer is None or self._trainer.world_size == 1 or clients_in_parallel(self._trainer):
            return tensors
        return [self.trainer.strategy.reduce(t, reduce_op="mean") for t in tensors]


@abstract_base
class SharedModelMethod(FederatedMethod):
    """Methods with one global model that every client starts from. FedAvg's behaviour is the
    default of every hook; methods override what differs. Between rounds `self.model` holds the
    global model, so Lightning's validation loop, checkpoints and `validate`/`test` see it with
    no extra plumbing.

    A method can leave part of the model with the clients (`personal_keys`: FedPer/FedRep's head,
    FedBN's BatchNorm layers): those state_dict entries are never uploaded nor averaged; each
    client keeps its own (`client_states[k]` under "model."), starting from the initial global
    values, which the server never changes.

    Args:
        model: architecture name (see `fl_lightning.models.MODELS`).
        lr, momentum, weight_decay, lr_decay, lr_milestones, lr_milestone_gamma, server_lr,
            data_spec, constraint: see `FederatedMethod`.
    """

    needs_global_model: bool = False  # methods that run the frozen round-start model set this

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        spec = self.hparams.data_spec
        self.model: FLModel = self.build_network(self.hparams.model, spec)
        self.val_eval = Evaluation(spec.num_classes, sync=True)
        self.test_eval = Evaluation(spec.num_classes, sync=True)
        self.global_weights: dict[str, torch.Tensor] | None = None
        self._load_global_weights: Callable[[], None] | None = None  # _bind_global_weights
        self._drift_pairs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._personal: list[str] | None = None

    def build_network(self, name: str, spec: DataSpec) -> FLModel:
        return build_model(name, spec)

    def personal_keys(self, model: nn.Module) -> list[str]:
        """The state_dict keys of `model` each client keeps for itself (see the class docstring);
        none by default."""
        return []

    @property
    def personal(self) -> list[str]:
        """`personal_keys(self.model)`, asked once."""
        if self._personal is None:
            self._personal = list(self.personal_keys(self.model))
        return self._personal

    def analysis_models(self, max_clients: int) -> list[tuple[str, nn.Module]]:
        return [("", self.model)]

    # ---- server: round start ------------------------------------------------------------------
    def round_start(self, round_idx: int, clients: list[int]) -> None:
        super().round_start(round_idx, clients)
        self.global_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._bind_global_weights()
        if self.needs_global_model:
            # eval(): a teacher's output should not depend on BN batch mode or dropout draws
            self.copies.get("teacher", self.model, self.global_weights, self.device)
        if self.constraint != "none":
            names = constrained_names(self.model)
            self._constraint = ChannelConstraint(self.constraint, self.global_weights, names)

    @property
    def global_model(self) -> FLModel:
        """The frozen round-start global model (a working copy: never trained, never saved)."""
        if not self.needs_global_model or "teacher" not in self.copies:
            raise RuntimeError(f"{type(self).__name__} must set needs_global_model = True")
        return self.copies["teacher"]

    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: self.global_weights[n] for n, _ in self.model.named_parameters()}

    def _bind_global_weights(self) -> None:
        """Binds the round's global weights to the model's tensors for what every client does
        with them, loading them at its start and measuring its drift from them at its end: once a
        round rather than once a client (load_state_dict and named_parameters walk the module
        tree each time); again after anything gives the module new tensors (`_apply`)."""
        self._load_global_weights = state_loader(self.model, self.global_weights)
        shared = [(p, self.global_weights[n]) for n, p in self.model.named_parameters() if n not in self.personal]
        self._drift_pairs = ([p for p, _ in shared], [g for _, g in shared])

    def _apply(self, fn, *args, **kwargs):
        self._load_global_weights = self._drift_pairs = None  # bound to tensors `fn` may replace
        return super()._apply(fn, *args, **kwargs)

    # ---- client -------------------------------------------------------------------------------
    def client_start(self, client: int, num_samples: int) -> None:
        self.current_client, self.current_num_samples = client, num_samples
        self.seed_client(client)
        if self._load_global_weights is None:
            self._bind_global_weights()
        self._load_global_weights()
        if self.personal:
            self.load_model_part(self.personal_state(client))
        self.reset_optimizer_state()
        self.steps.taken = 0
        self.model.train()

    def client_end(self) -> ClientUpload:
        state = self.model.state_dict()
        weights = {k: v.detach().clone() for k, v in state.items() if k not in self.personal}
        upload = ClientUpload(self.current_client, self.current_num_samples, weights,
                              {"drift": self.distance_to_global()})
        if self.personal:
            upload.kept.update(self.prefixed("model.", {k: state[k] for k in self.personal}))
        return upload

    def personal_state(self, client: int) -> dict[str, torch.Tensor]:
        """Client `client`'s own part of the model (`personal_keys`); the initial global values
        (which the server never changes) for a client that has not trained yet."""
        own = self.client_state(client, "model.")
        if own is not None:
            return own
        source = self.global_weights if self.global_weights is not None else self.model.state_dict()
        return {k: source[k] for k in self.personal}

    def load_model_part(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copies `state` (some of the model's state_dict entries) into `self.model`."""
        with torch.no_grad():
            current = self.model.state_dict()
            for k, v in state.items():
                current[k].copy_(v)

    def distance_to_global(self) -> float:
        """||w_k - w_g||_2 over the shared parameters (a personal part has no global counterpart)."""
        if self._drift_pairs is None:
            self._bind_global_weights()
        params, global_params = self._drift_pairs
        if not params:
            return 0.0
        # one norm per tensor, then the norm of the norms: cheaper than squaring and summing
        # every difference (and torch's norm accumulates more accurately); the foreach forms are
        # the same per-tensor operations on the CPU in two calls rather than one per tensor
        with torch.no_grad():
            norms = torch._foreach_norm(torch._foreach_sub(params, global_params))
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def local_model_stats(self, test_loader: Callable[[], Iterable], per_class: bool = False) -> dict[str, float]:
        result = self.evaluate(test_loader(), per_class=per_class)
        stats = {"local_acc": result.accuracy, "local_loss": result.loss}
        if per_class:
            stats["local_class_acc"] = result.class_accuracy.tolist()
        return stats

    def finetune_start(self, client: int) -> FLModel:
        return self.model

    def personal_model(self, client: int) -> nn.Module | None:
        """With a personal part: the global model with client `client`'s own part, a new module
        on `self.device` (FedPer/FedRep/FedBN's personalised model); else None."""
        if not self.personal:
            return None
        # between rounds self.model is the global model; inside a round it is a client's model
        state = self.model.state_dict() if self.current_client is None else self.global_weights
        state = {k: v.detach().clone() for k, v in state.items()}
        state.update(self.personal_state(client))
        model = copy.deepcopy(self.model).requires_grad_(True).eval()
        model.load_state_dict(state)
        return model.to(self.device)

    def global_test_metrics(self, loader: Callable[[], Iterable]) -> dict[str, float]:
        return {"global_test_acc": self.evaluate(loader()).accuracy}

    # ---- server -------------------------------------------------------------------------------
    def server_step(self, uploads: RoundUploads) -> ServerUpdate:
        """Sample-weighted FedAvg with a server step size: w_g + eta * (avg(w_k) - w_g)."""
        return ServerUpdate(global_state=self.global_from_average(uploads.weighted_average(lambda u: u.weights)))

    def global_from_average(self, avg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The next global state from the clients' average: the server step size applied, and the
        entries the average lacks (personal, frozen) kept at their round-start values."""
        eta = self.hparams.server_lr
        out = {}
        for k, g in self.global_weights.items():
            if k not in avg:
                out[k] = g
            elif eta == 1.0 or not torch.is_floating_point(g):
                out[k] = avg[k]
            else:
                out[k] = g + eta * (avg[k] - g)
        return out

    def apply_server_update(self, update: ServerUpdate) -> None:
        super().apply_server_update(update)
        if update.global_state is not None:
            self.model.load_state_dict(update.global_state)

    def abandon_round(self) -> None:
        super().abandon_round()
        self.model.load_state_dict(self.global_weights)

    def loss_context(self) -> LossContext:
        """The round-start global model is the teacher of methods that set needs_global_model."""
        return LossContext(teacher=self.global_model) if self.needs_global_model else NO_CONTEXT

    # ---- evaluation ---------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx: int):
        x, y = batch
        self.val_eval.update(self.predict_logits(x), y)

    def on_validation_epoch_start(self) -> None:
        self.val_eval.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval(self.val_eval)

    def test_step(self, batch, batch_idx: int):
        x, y = batch
        self.test_eval.update(self.predict_logits(x), y)

    def on_test_epoch_start(self) -> None:
        self.test_eval.reset()

    def on_test_epoch_end(self) -> None:
        self._log_eval(self.test_eval)

    def _log_eval(self, metrics: Evaluation) -> None:
        """Logged once per evaluation (its counts summed over processes), not per batch; the same
        names in fit's validation, `validate` and `test`: they all evaluate the global model on the
        global test set. In fit, the round's values are published as the round's other values are
        (`log_round_metrics`, which says why not through Lightning's `self.log`)."""
        trainer = self.trainer
        acc, loss = metrics.compute(trainer.strategy)
        metrics.reset()
        values = {"global/test_loss": loss, "global/test_acc": acc}
        if trainer.state.fn != "fit":
            # validate/test: Lightning's returned and printed results. The values are the same on
            # every process already; its mean over them (sync_dist) changes nothing and keeps its
            # distributed-logging warning quiet
            for key, value in values.items():
                self.log(key, value, on_epoch=True, prog_bar=key == "global/test_acc", sync_dist=True)
        elif not trainer.sanity_checking:
            log_round_metrics(trainer, values, progress_bar=("global/test_acc",))

    def evaluate(self, loader, per_class: bool = False) -> EvalResult:
        """The current `self.model` (with this method's class scores) on a loader."""
        return evaluate(self.model, loader, self.hparams.data_spec.num_classes, self.device,
                        scores=self.predict_logits, per_class=per_class)
