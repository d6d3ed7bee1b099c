"""How a method's local step is taken (`FederatedMethod.sgd_step`), apart from what a method
decides in it.

One local step is: gradients released, backward, the module's `on_before_optimizer_step` (the
method's `after_backward` corrections, then `--trainer.gradient_clip_val` clipping), the
optimizer's step, the method's `after_optimizer_step` (whose base version enforces the FedCONST
constraint of the round, fedconst.py), and the count of steps taken. A method never needs this
module: it calls `sgd_step(loss)` and overrides the hooks around it.

Two paths take the step; where both can, they give the same weights to the bit:
- Lightning's (`manual_backward`, `LightningOptimizer.step`): the precision plugin's autocast and
  loss scaling, a DDP model's gradient all-reduce, and every callback's and the module's per-step
  hooks (`on_before_backward`, `on_after_backward`, `on_before_optimizer_step`,
  `on_before_zero_grad`) are applied there.
- A direct one (`LocalSteps._step_directly`), a second implementation of Lightning's manual
  optimizer step for the case where its wrappers have nothing to apply: one device per process
  (no DDP wrapper), 32-bit precision, and no callback nor the module overriding a per-step hook.
  There the wrappers would only dispatch hooks nobody listens to, and a small model's local step
  is short enough for that dispatch to be a large part of it. The direct path calls the module's
  `on_before_optimizer_step` itself (so corrections and clipping happen as on Lightning's path)
  and tells Lightning's step counter (`trainer.global_step`) of its steps when the client's
  training ends. Any other setting takes Lightning's path.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from fl_lightning import compat
from fl_lightning.fedconst import ChannelConstraint, constrained_names
from fl_lightning.parallel import ClientParallelStrategy

# the hooks Lightning's step wrappers call on every local step: a listener to any of them needs
# Lightning's path
PER_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def lightning_wrappers_idle(trainer: L.Trainer, module_type: type, base: type) -> bool:
    """True when Lightning's step wrappers would add nothing to a step (see the module
    docstring): one device per process (one device, or clients in parallel), 32-bit precision,
    and neither a callback nor `module_type` (against the hooks of `base`, the class that
    defines the method's own) overrides a per-step hook."""
    one_device = type(trainer.strategy) is SingleDeviceStrategy or type(trainer.strategy) is ClientParallelStrategy
    if not one_device or type(trainer.precision_plugin) is not Precision:
        return False
    return not per_step_listeners(trainer.callbacks) and not overrides_per_step_hook(module_type, base)


def overrides_per_step_hook(cls: type, parent: type) -> bool:
    """Whether `cls` overrides one of `parent`'s per-step hooks."""
    return any(getattr(cls, h) is not getattr(parent, h) for h in PER_STEP_HOOKS)


def per_step_listeners(callbacks) -> list[str]:
    """The names of the callbacks that listen to a per-step hook."""
    return [type(cb).__name__ for cb in callbacks if overrides_per_step_hook(type(cb), L.Callback)]


def round_constraint(mode: str, model: nn.Module, global_weights: dict[str, torch.Tensor]) -> ChannelConstraint:
    """FedCONST's constraint set of a round (`mode` "joint" or "sequential"): every trainable
    weight matrix of `model` kept on its channels' constraints around the round-start weights."""
    return ChannelConstraint(mode, global_weights, constrained_names(model))


class LocalSteps:
    """The local steps of a run's methods: how they are taken (set when training starts), the
    round's FedCONST constraint, and the current client's counts. A plain object, not module
    attributes: setting an attribute of an `nn.Module` checks its parameters, buffers and
    submodules, which every local step would pay.

    Attributes:
        taken: local steps the current client has taken this round (`local_step`).
        direct: the steps take the direct path (see the module docstring).
        uncounted: direct steps not yet added to Lightning's step counter.
        base_hook_ran: the base `after_optimizer_step` ran in the current step.
        optimizer: the torch optimizer of the local steps (None before training starts).
        clip: (`--trainer.gradient_clip_val`, `--trainer.gradient_clip_algorithm`); 0: no clipping.
        constraint: the round's FedCONST constraint set, None without one.
        engine: the vectorised engine (vectorized.py) that trains the clients instead of
            `training_step`'s loop, None for the sequential engine.
    """

    __slots__ = ("taken", "direct", "uncounted", "base_hook_ran", "optimizer", "clip", "constraint", "engine")

    def __init__(self):
        self.taken = self.uncounted = 0
        self.direct = self.base_hook_ran = False
        self.optimizer: torch.optim.Optimizer | None = None
        self.clip: tuple[float, str] = (0.0, "norm")
        self.constraint: ChannelConstraint | None = None
        self.engine = None

    def start_training(self, module: L.LightningModule, base: type) -> None:
        """Fixes how the steps of this fit are taken (`base`: see `lightning_wrappers_idle`)."""
        trainer = module.trainer
        self.direct = lightning_wrappers_idle(trainer, type(module), base)
        self.optimizer = module.optimizers().optimizer
        # --trainer.gradient_clip_val / _algorithm: Lightning refuses them under manual
        # optimization, so the CLI's Trainer (trainer.py:FLTrainer) keeps them for us
        self.clip = (float(getattr(trainer, "local_gradient_clip_val", 0.0) or 0.0),
                     getattr(trainer, "local_gradient_clip_algorithm", "norm"))

    def take(self, module: L.LightningModule, loss: torch.Tensor) -> None:
        """One local step of `module` on `loss` (its `sgd_step`)."""
        if self.direct:
            self._step_directly(module, loss)
        else:  # precision plugins (autocast, loss scaling), DDP and per-step callback hooks
            opt = module.optimizers()
            opt.zero_grad(set_to_none=True)
            module.manual_backward(loss)
            opt.step()  # Lightning calls on_before_optimizer_step inside, after unscaling
        self.base_hook_ran = False
        module.after_optimizer_step()
        if self.constraint is not None and not self.base_hook_ran:
            raise RuntimeError(f"{type(module).__name__}.after_optimizer_step() must call "
                               f"super().after_optimizer_step(): it enforces the FedCONST constraint")
        self.taken += 1

    def _step_directly(self, module: L.LightningModule, loss: torch.Tensor) -> None:
        """Lightning's manual optimizer step without its wrappers (module docstring): the same
        torch operations in the same order, the module's `on_before_optimizer_step` called here,
        the hooks nobody listens to left out. torch's profiler annotations of zero_grad and step
        are left out too unless a profiler records (compat.py)."""
        opt = self.optimizer
        compat.release_gradients(opt)
        loss.backward()
        module.on_before_optimizer_step(opt)
        compat.step_optimizer(opt)
        self.uncounted += 1

    def count_in(self, trainer: L.Trainer) -> None:
        """Adds the direct steps to Lightning's step counter (at the end of a client's training)."""
        if self.uncounted:
            compat.count_manual_optimizer_steps(trainer, self.uncounted)
            self.uncounted = 0

    def clip_gradients(self, module: L.LightningModule, optimizer) -> None:
        """The run's gradient clipping, through Lightning's `clip_gradients` (its precision plugin)."""
        clip_val, algorithm = self.clip
        if clip_val > 0:
            module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)

    def constrain(self, model: nn.Module) -> None:
        """The base `after_optimizer_step`: `model` back onto the round's constraint set."""
        if self.constraint is not None:
            self.constraint.apply(model)
        self.base_hook_ran = True
