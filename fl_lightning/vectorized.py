"""The vectorised engine (`--federation.engine vectorized`): a round's clients take their local
steps together, as one step over stacked parameters, instead of one client after the other.

Every sampled client of a round starts from the same global weights and, for the methods whose
local step is a loss on the shared model (FedAvg, FedProx, FedSOL), runs the same computation on
its own data. So the clients' parameters are stacked along a leading dimension and each local
step is one call of `torch.func.vmap` over `torch.func.grad` of the method's own objective
(`FederatedMethod.vectorized_loss`, by default its `loss(model, batch, context)`, evaluated with
`torch.func.functional_call`), followed by torch's SGD update written on the stacked tensors. The
method's math is therefore not written a second time: the same hook computes the loss in both
engines.

What stays per client, exactly as in the sequential engine:
- the data: each client steps through its own `ClientWork` mini-batches, in its own order
  (`FederatedDataModule.minibatches`); at step t the clients whose batches have the same shape are
  one vmap call (an epoch's smaller last batch is a call of its own);
- the number of steps: a client with fewer batches stops after its last, the others go on;
- the optimizer state: momentum buffers per client, starting from zero (torch's first-step
  `buf = grad` is `0 * momentum + grad`, to the bit);
- what the round driver sees: the engine trains a group of clients when the first of them reaches
  `training_step`; each client's own `training_step` then loads its trained weights into the
  module and records its per-step logs, so `client_end`, the upload, the local evaluation, the
  per-client rows and the round's means are computed by the unchanged code of the sequential
  engine.

Results equal the sequential engine's to float32 rounding (a batched matrix product adds in
another order), not to the bit.

What the engine cannot do is refused when the fit is set up, in one line naming the sequential
engine (`refusal`): methods that do not declare `vectorized = True` (or that override a hook the
engine bypasses), models with BatchNorm statistics or dropout, precision other than 32-true,
64-true and mixed precision without loss scaling (bf16-mixed, whose forward passes run under the
step's autocast as in the sequential engine), gradient clipping, FedCONST constraints, several
processes sharing a client's batches (`--federation.parallel batch`), and callbacks listening to
per-step hooks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fl_lightning import compat
from fl_lightning.loss_scaling import scaler_of
from fl_lightning.methods.base import PADDED_LABEL
from fl_lightning.methods.local_step import per_step_listeners
from fl_lightning.parallel import clients_in_parallel

ENGINES = ("sequential", "vectorized")
SEQUENTIAL = "--federation.engine sequential"

# the hooks the vectorised engine replaces or takes from the class that declared support: a
# subclass that overrides one of them changes the local step in a way the engine would not see
BYPASSED_HOOKS = ("training_step", "minibatch_step", "loss", "loss_context", "vectorized_loss",
                  "vectorized_logs", "after_backward", "after_optimizer_step", "on_before_optimizer_step",
                  "client_start", "client_end", "local_parameters", "configure_optimizers", "personal_keys")
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


# ---- the refusals ---------------------------------------------------------------------------------
def refusal(trainer: L.Trainer, method) -> str | None:
    """Why `method` cannot train with the vectorised engine in this fit, or None when it can."""
    for check in (_method_refusal, _model_refusal, _trainer_refusal):
        reason = check(trainer, method)
        if reason is not None:
            return f"--federation.engine vectorized {reason}; use {SEQUENTIAL}"
    return None


def _declarer(cls: type, flag: str = "vectorized") -> type | None:
    """The class that set `flag` (`vectorized`, `vectorized_one_backward`) to True for `cls` (None
    when it is not set)."""
    for klass in cls.__mro__:
        if flag in klass.__dict__:
            return klass if klass.__dict__[flag] else None
    return None


def _changed_hooks(cls: type, declarer: type) -> list[str]:
    return [h for h in BYPASSED_HOOKS if getattr(cls, h, None) is not getattr(declarer, h, None)]


def supported_methods() -> list[str]:
    """The CLI's methods the vectorised engine can train (with their options' defaults)."""
    from fl_lightning import methods
    from fl_lightning.cli_parsing import method_names

    classes = [getattr(methods, name) for name in method_names()]
    return [c.__name__ for c in classes if (d := _declarer(c)) is not None and not _changed_hooks(c, d)]


def _method_refusal(trainer, method) -> str | None:
    cls = type(method)
    declarer = _declarer(cls)
    if declarer is None:
        return (f"does not support {cls.__name__} (it runs the methods whose local step is a loss on the "
                f"shared model: {', '.join(supported_methods())})")
    changed = _changed_hooks(cls, declarer)
    if changed:
        return (f"does not support {cls.__name__}: it changes {', '.join(changed)} of {declarer.__name__}, "
                f"which the vectorised step does not run")
    if getattr(method, "constraint", "none") != "none":
        return "does not apply FedCONST constraints (--model.constraint)"
    own = method.vectorized_refusal()
    return None if own is None else f"does not support {cls.__name__} with {own}"


def _model_refusal(trainer, method) -> str | None:
    model = method.model
    name = method.hparams.get("model", type(model).__name__)
    if any(True for _ in model.buffers()):
        return f"cannot train model '{name}': it keeps buffers (BatchNorm statistics) that every step updates"
    if any(isinstance(m, DROPOUT) for m in model.modules()):
        return f"cannot train model '{name}': its dropout draws differ from the sequential engine's"
    return None


def _trainer_refusal(trainer, method) -> str | None:
    plugin = trainer.precision_plugin
    if type(plugin) not in (Precision, DoublePrecision, MixedPrecision):
        return "runs in 32-true, 64-true and bf16-mixed precision only (not --trainer.precision " \
               f"{getattr(trainer, 'precision', '?')})"
    if scaler_of(trainer) is not None:
        return (f"does not scale losses (--trainer.precision {getattr(trainer, 'precision', '?')}): the loss scale "
                "carries over from one client's steps to the next client's, which clients trained together cannot "
                "reproduce; bf16-mixed needs no scaling")
    if float(getattr(trainer, "local_gradient_clip_val", 0.0) or 0.0) > 0:
        return "does not clip gradients (--trainer.gradient_clip_val)"
    if trainer.world_size > 1 and not clients_in_parallel(trainer):
        return "trains whole clients on each process (--federation.parallel clients), not shares of their batches"
    listeners = per_step_listeners(trainer.callbacks)
    if listeners:
        return f"takes no per-step hooks, which {', '.join(listeners)} listens to"
    return None


# ---- the local optimizer on stacked tensors -----------------------------------------------------
def sgd_update(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor] | None, lr: float, momentum: float, weight_decay: float) -> None:
    """torch.optim.SGD's step (no dampening, no Nesterov) on every client's row at once, in place:
    the same element-wise operations in the same order, so each row is what torch's SGD gives that
    client. `buffers` start at zero: momentum * 0 + grad is torch's first-step buffer `grad`."""
    for name, p in params.items():
        d = grads[name]
        if weight_decay != 0:
            d = d.add(p, alpha=weight_decay)
        if momentum != 0:
            d = buffers[name].mul_(momentum).add_(d)
        p.add_(d, alpha=-lr)


def _optimizer_settings(method) -> tuple[float, float, float]:
    group = method.optimizers().optimizer.param_groups[0]
    if group.get("nesterov") or group.get("dampening"):
        raise RuntimeError("the vectorised engine applies SGD without Nesterov or dampening")
    return float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])


# ---- one group of clients -------------------------------------------------------------------------
class _Objective(nn.Module):
    """Holds the method's model as a submodule, so that `functional_call` swaps its parameters for
    one client's while the method's own loss runs on it (`fn(model, batch)`)."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.fn(self.model, (x, y))


@dataclass
class ClientResult:
    """A client's trained weights (trainable parameters by name), its per-step logs (values and
    batch size, in step order) and its number of steps."""

    weights: dict[str, torch.Tensor]
    logs: list[tuple[dict[str, float], int]] = field(default_factory=list)
    steps: int = 0


class _GroupBatches:
    """A group's mini-batches, one list per client in step order: `per_client[i][t]` is client i's
    batch at local step t (in the form of the subclass)."""

    def __init__(self, per_client: list[list]):
        self.per_client = per_client

    def __len__(self) -> int:
        return len(self.per_client)

    def reordered(self, order: list[int]):
        """The same batches with the clients in `order`."""
        moved = copy.copy(self)
        moved.per_client = [self.per_client[i] for i in order]
        return moved

    def steps(self, i: int) -> int:
        return len(self.per_client[i])


class ListedBatches(_GroupBatches):
    """The group's mini-batches as (x, y) tensors, client by client."""

    def size(self, i: int, step: int) -> int:
        return len(self.per_client[i][step][1])

    def stacked(self, rows: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _padded([self.per_client[i][step] for i in rows])


class IndexedBatches(_GroupBatches):
    """The group's mini-batches as the clients' sample indices (`ClientWork.batches`), made by the
    data module one step at a time: the rows of a step are one gather and one conversion of their
    samples (`FederatedDataModule.samples`), where a client's own batches would each be converted
    and then copied into the stack. Used where the data module makes batches from indices;
    `ListedBatches` otherwise (augmented or decoded data)."""

    def __init__(self, per_client: list[list[np.ndarray]], samples, convert):
        super().__init__(per_client)
        self.samples, self.convert = samples, convert

    def size(self, i: int, step: int) -> int:
        return len(self.per_client[i][step])

    def stacked(self, rows: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = [self.per_client[i][step] for i in rows]
        x, y = self.convert(self.samples(np.concatenate(chosen)))
        sizes = [len(c) for c in chosen]
        if len(set(sizes)) == 1:  # one shape: the stack is a view of the gathered samples
            return x.view(len(rows), sizes[0], *x.shape[1:]), y.view(len(rows), sizes[0])
        return _padded(list(zip(x.split(sizes), y.split(sizes), strict=True)))


def _padded(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`batches` stacked; batches shorter than the longest are padded with zero images and
    ignored labels, which a loss of mean cross-entropy leaves out."""
    xs, ys = zip(*batches, strict=True)
    size = max(len(y) for y in ys)
    if all(len(y) == size for y in ys):
        return torch.stack(xs), torch.stack(ys)
    x = xs[0].new_zeros((len(ys), size, *xs[0].shape[1:]))
    y = ys[0].new_full((len(ys), size), PADDED_LABEL)
    for i, (xb, yb) in enumerate(zip(xs, ys, strict=True)):
        x[i, : len(yb)] = xb
        y[i, : len(yb)] = yb
    return x, y


def _calls(batches, count: int, step: int, padded: bool) -> list[list[int]]:
    """The clients stepping together at `step` (those with a batch there: a prefix, as the group
    is sorted by steps, longest first), one list per vmap call: all of them, padded to one batch
    size, or grouped by their batches' sizes."""
    rows = [i for i in range(count) if step < batches.steps(i)]
    if padded:
        return [rows]
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(batches.size(i, step), []).append(i)
    return list(groups.values())


class _Stacks:
    """The group's stacked trainable parameters and momentum buffers, and the SGD step on some
    of their rows: a leading range of rows is stepped in place through views, other rows through
    a copy that is written back."""

    def __init__(self, model: nn.Module, count: int, momentum: float):
        start = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.params = {n: p.detach().unsqueeze(0).repeat(count, *([1] * p.dim())) for n, p in start.items()}
        self.buffers = {n: torch.zeros_like(p) for n, p in self.params.items()} if momentum != 0 else None
        self.laid_out = False  # whether the stacks took their gradients' memory order (_take_layouts)

    def _rows(self, count: int):
        """Views of the first `count` rows of the stacked parameters and momentum buffers."""
        params = {n: p[:count] for n, p in self.params.items()}
        buffers = None if self.buffers is None else {n: b[:count] for n, b in self.buffers.items()}
        return params, buffers

    def step(self, rows: list[int], step_fn, x, y, settings: tuple[float, float, float]) -> dict[str, torch.Tensor]:
        """One local step of the clients `rows` on (x, y); returns the step's logs."""
        if rows == list(range(len(rows))):
            params, buffers = self._rows(len(rows))
            grads, logs = step_fn(params, x, y)
            if not self.laid_out and self._take_layouts(grads):  # at the first step
                params, buffers = self._rows(len(rows))  # the moved stacks' rows
            sgd_update(params, grads, buffers, *settings)
            return logs
        index = torch.as_tensor(rows, device=x.device)
        params = {n: p.index_select(0, index) for n, p in self.params.items()}
        buffers = None if self.buffers is None else {n: b.index_select(0, index) for n, b in self.buffers.items()}
        grads, logs = step_fn(params, x, y)
        sgd_update(params, grads, buffers, *settings)
        for n, p in params.items():
            self.params[n].index_copy_(0, index, p)
            if buffers is not None:
                self.buffers[n].index_copy_(0, index, buffers[n])
        return logs

    def _take_layouts(self, grads: dict[str, torch.Tensor]) -> bool:
        """Store each stacked parameter (and its momentum buffer) in the memory order of its
        gradient, which a batched matrix product returns transposed: the update's element-wise
        operations then walk all their tensors in one order. True when something was moved."""
        self.laid_out, moved = True, False
        for n, g in grads.items():
            p = self.params[n]
            order = sorted(range(g.dim()), key=lambda d: -g.stride(d))
            if g.dim() < 2 or order == list(range(g.dim())) or order[0] != 0:
                continue
            inverse = sorted(range(g.dim()), key=order.__getitem__)
            self.params[n] = p.permute(order).contiguous().permute(inverse)
            if self.buffers is not None:
                self.buffers[n] = self.buffers[n].permute(order).contiguous().permute(inverse)
            moved = True
        return moved


def train_together(method, batches: ListedBatches | IndexedBatches) -> list[ClientResult]:
    """Every client's local training from the round-start global weights, as one vectorised step
    per local step (or a few, where batch sizes differ and the method cannot pad them)."""
    lr, momentum, weight_decay = _optimizer_settings(method)
    count = len(batches)
    order = sorted(range(count), key=lambda i: -batches.steps(i))  # active clients: a prefix
    batches = batches.reordered(order)
    stacks = _Stacks(method.model, count, momentum)
    records: list[tuple[list[int], dict[str, torch.Tensor]]] = []
    for step in range(batches.steps(0) if count else 0):
        step_fn = _step_function(method, step)
        for rows in _calls(batches, count, step, method.vectorized_padding):
            x, y = batches.stacked(rows, step)
            logs = stacks.step(rows, step_fn, x, y, (lr, momentum, weight_decay))
            records.append((rows, {k: v.detach() for k, v in logs.items()}))
    results = _results(stacks.params, batches, count, records)
    return [results[order.index(i)] for i in range(count)]


def _step_function(method, step: int):
    """(stacked params, stacked x, stacked y) -> (stacked gradients, stacked per-step logs).

    `vmap` of `torch.func.grad`, not one backward through a vmapped loss: under `grad` a client's
    parameters are tensors that require gradients, as in the sequential engine (methods select
    their trainable tensors by `requires_grad`), where under a bare `vmap` they would not."""
    objective = _Objective(method.model, lambda model, batch: method.vectorized_loss(model, batch, step))

    def client_step(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        def loss_of(p):
            return functional_call(objective, {f"model.{n}": t for n, t in p.items()}, (x, y))

        grads, (_, logs) = grad_and_value(loss_of, has_aux=True)(params)
        return grads, method.vectorized_logs(logs, grads)

    together = vmap(client_step)

    def one_client(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        # one client left (the others have run out of batches): plain autograd on its row, without
        # the cost of vmap's and grad's wrapping of every operation
        leaves = {n: p[0].detach().requires_grad_(True) for n, p in params.items()}
        loss, logs = functional_call(objective, {f"model.{n}": t for n, t in leaves.items()}, (x[0], y[0]))
        found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(leaves.items(), found, strict=True)}
        logs = method.vectorized_logs(logs, grads)
        return ({n: g.unsqueeze(0) for n, g in grads.items()},
                {k: v.detach().unsqueeze(0) for k, v in logs.items()})

    def one_backward(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        # the clients' losses are independent, so the gradient of their sum with respect to a
        # client's row of the stacked parameters is that client's gradient
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        losses, logs = vmap(lambda p, xi, yi: functional_call(
            objective, {f"model.{n}": t for n, t in p.items()}, (xi, yi)))(leaves, x, y)
        found = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(leaves.items(), found, strict=True)}
        return grads, {k: v.detach() for k, v in logs.items()}

    if _one_backward(method):
        together = one_backward
    return lambda params, x, y: one_client(params, x, y) if len(x) == 1 else together(params, x, y)


LOSS_HOOKS = ("loss", "vectorized_loss", "vectorized_logs")


def _one_backward(method) -> bool:
    """Whether the engine may take `method`'s step as one backward pass (see
    `FederatedMethod.vectorized_one_backward`): the class that declares it gives the loss hooks
    the method uses, so a subclass with a loss of its own takes the general path."""
    declarer = _declarer(type(method), "vectorized_one_backward")
    if declarer is None:
        return False
    return all(getattr(type(method), hook) is getattr(declarer, hook) for hook in LOSS_HOOKS)


def _results(params: dict[str, torch.Tensor], batches, count: int, records: list) -> list[ClientResult]:
    """Per client: its row of the stacked weights, and its logs in step order (read from the
    device once for the whole group)."""
    results = [ClientResult({n: p[i] for n, p in params.items()}, steps=batches.steps(i)) for i in range(count)]
    step_of = [0] * count
    for rows, logs in records:
        values = {k: v.double().cpu().tolist() for k, v in logs.items()}
        for position, i in enumerate(rows):
            results[i].logs.append(({k: v[position] for k, v in values.items()}, batches.size(i, step_of[i])))
            step_of[i] += 1
    return results


# ---- how many clients train together ------------------------------------------------------------
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
ONE_AT_A_TIME = ("--federation.engine vectorized: the clients of model '{model}' train one at a time on a CPU, "
                 "where its convolutions stacked over clients run slower than each client's own; "
                 "--federation.engine_group N stacks N of them")


def group_size(requested: int | None, trainer: L.Trainer, method) -> int:
    """The clients trained together at most (0: all of a round's; 1: each alone, with the
    sequential engine's step). `requested` (`--federation.engine_group`) when given; else all,
    except for a model with convolutions on a CPU: there `vmap` makes a convolution over stacked
    clients a grouped convolution, which CPU kernels run slower than the clients' own, and the
    stacked activations leave the caches that one client's fit in (benchmarks/vectorized_engine.py
    measures both), so its clients train one at a time. On a GPU the stacked step fills the device
    that one small client leaves idle."""
    if requested is not None:
        return requested
    on_cpu = trainer.strategy.root_device.type == "cpu"
    if on_cpu and any(isinstance(m, CONVOLUTIONS) for m in method.model.modules()):
        return 1
    return 0


# ---- the engine inside a fit ----------------------------------------------------------------------
class VectorizedEngine:
    """Trains a round's clients (this process's) in groups of at most `group_size` (0: all of the
    round's at once) when the first client of a group reaches `training_step`, and hands each
    client its result in its own `training_step` (`train_client`)."""

    def __init__(self, group_size: int = 0):
        self.group_size = group_size
        self._results: dict[tuple[int, int], ClientResult] = {}

    def train_client(self, method, work) -> None:
        """Client `work.client`'s local training (called from `training_step`): its trained
        weights into `method.model`, its per-step logs into the method's local logs."""
        key = (work.round, work.client)
        if key not in self._results:
            self._results.clear()  # a previous round's leftovers (a round that stopped early)
            self._train_group_from(method, work)
        result = self._results.pop(key)
        with torch.no_grad():
            own = dict(method.model.named_parameters())
            for name, value in result.weights.items():
                own[name].copy_(value)
        for values, size in result.logs:
            method.log_local(values, size)
        method.steps.taken = result.steps
        if result.steps:
            compat.count_manual_optimizer_steps(method.trainer, result.steps)

    def _train_group_from(self, method, work) -> None:
        trainer = method.trainer
        dm = trainer.datamodule
        plan = getattr(dm, "rank_plan", None) or dm.round_plan
        clients = list(plan.clients)
        first = next(i for i, c in enumerate(clients) if c.client == work.client)
        group = clients[first:] if self.group_size == 0 else clients[first:first + self.group_size]
        convert = trainer.precision_plugin.convert_input
        if dm.samples_from_indices:
            batches = IndexedBatches([c.batches for c in group], dm.samples, convert)
        else:
            batches = ListedBatches([[convert(b) for b in dm.minibatches(c)] for c in group])
        for c, result in zip(group, train_together(method, batches), strict=True):
            self._results[(c.round, c.client)] = result
