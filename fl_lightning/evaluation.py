"""One way to evaluate class scores, used by every evaluation in the project: the global model in
Lightning's validation and test loops, the round's local models on the global test subset, each
heterogeneous client's own model on its own test split, personalised fine-tuning, and the
analyses' per-class accuracy.

`Tally` counts accuracy, mean cross-entropy and (optionally) per-class accuracy the way
torchmetrics does; `evaluate` runs a model over batches with it (an evaluation a process makes for
itself), and `Evaluation` sums its counts over processes (the global model's evaluation, which the
method logs). One NaN policy for all of them: class scores are taken as they are (in float32),
so a model with NaN/inf scores gets a NaN loss, never dropped, never replaced, and the divergence
check sees it. (A method that wants to exclude classes from its predictions, such as prediction by
the nearest prototype among the classes that have one, gives them a large finite negative score,
not -inf.) The best accuracy of a run has one tracker, `BestAccuracy`, with the same policy: a NaN
accuracy is never the best.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for the duration, then every submodule's own train/eval flag restored."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in flags:
            m.training = training


@dataclass(frozen=True)
class EvalResult:
    """An evaluation's figures: accuracy = correct / samples (NaN without samples), the mean
    cross-entropy, and per class (NaN for a class without samples) when asked for."""

    accuracy: float
    loss: float
    correct: int
    samples: int
    class_accuracy: torch.Tensor | None = None


class Evaluation(nn.Module):
    """The global model's evaluation in Lightning's validation and test loops: `Tally`'s counts
    (accuracy, mean cross-entropy), summed over processes with `sync` when computed.

    Its figures are those of torchmetrics' micro-averaged accuracy and a float64 mean of the
    per-sample losses (tests/test_evaluation.py holds them equal), counted without the metric
    objects: their update, compute and logging through `self.log` cost more than a small model's
    forward pass over the test set (benchmarks/core_overhead.py measures it).

    Args:
        num_classes: number of classes of the scores.
        sync: sum the counts of every process when computed (one all_reduce; every process must
            compute then).
    """

    def __init__(self, num_classes: int, sync: bool = False):
        super().__init__()
        self.sync = sync
        self.tally = Tally(num_classes)

    def update(self, scores: torch.Tensor, y: torch.Tensor) -> None:
        self.tally.update(scores, y)

    def compute(self, strategy=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(accuracy, mean loss), summed over processes with `sync` through Lightning's `strategy`:
        the accuracy in float32 and the loss in float64, as torchmetrics computed them."""
        counts = self.tally.counts()
        if self.sync and strategy is not None and strategy.world_size > 1:
            counts = strategy.reduce(counts.to(strategy.root_device), reduce_op="sum")
        correct, samples, loss_total = counts.cpu().unbind()
        if not samples:
            return torch.tensor(math.nan), torch.tensor(math.nan, dtype=torch.float64)
        return correct.float() / samples.float(), loss_total / samples

    def reset(self) -> None:
        self.tally.reset()


def _eval_result(correct: int, samples: int, loss_total: float,
                 per_class: tuple[torch.Tensor, torch.Tensor] | None) -> EvalResult:
    """EvalResult from counts: correct and samples, the cross-entropy summed over the samples, and
    (correct, samples) per class when counted."""
    class_accuracy = None
    if per_class is not None:
        hits, support = per_class[0].double(), per_class[1].double()
        class_accuracy = torch.where(support > 0, hits / support.clamp_min(1), torch.full_like(hits, math.nan))
    if not samples:
        return EvalResult(math.nan, math.nan, correct, samples, class_accuracy)
    return EvalResult(correct / samples, loss_total / samples, correct, samples, class_accuracy)


def correct_predictions(scores: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Which predictions are right: the argmax over classes (NaN scores included, as torchmetrics
    counts them) equal to the label. Every accuracy of the project is a count of these."""
    return scores.argmax(dim=1) == y


class Tally:
    """The counts of every evaluation (accuracy, mean cross-entropy, per-class accuracy), with one
    NaN policy: the global model's (through `Evaluation`), a local model's, a client's own model's,
    the analyses' class-wise accuracy. They are what torchmetrics' metric objects count (its
    micro-averaged accuracy: the argmax over classes, NaN scores included, equal to the label; per
    class, the same hits counted by label; tests/test_evaluation.py holds them equal), without
    their argument handling and bookkeeping, which for a small model cost more than its forward
    pass, in a round that evaluates every client's model (benchmarks/core_overhead.py). Counts
    stay on the device until `result`."""

    def __init__(self, num_classes: int, per_class: bool = False):
        self.num_classes, self.per_class = num_classes, per_class
        self.reset()

    def reset(self) -> None:
        self._correct: torch.Tensor | int = 0
        self._loss_total: torch.Tensor | float = 0.0
        self._samples = 0
        self._class_hits: torch.Tensor | int = 0  # per class, once a batch is counted
        self._class_support: torch.Tensor | int = 0

    def update(self, scores: torch.Tensor, y: torch.Tensor) -> None:
        scores = scores.float()
        right = correct_predictions(scores, y)
        first = not self._samples  # the first batch's counts are the counts (no adding to zeros)
        correct = right.sum()
        self._correct = correct if first else self._correct + correct
        if self.per_class:
            # one count by (label, right or not): the wrong ones per class, then the right ones
            wrong, hits = torch.bincount(y + self.num_classes * right, minlength=2 * self.num_classes).view(2, -1)
            self._class_hits = hits if first else self._class_hits + hits
            self._class_support = wrong + hits if first else self._class_support + wrong + hits
        loss = F.cross_entropy(scores, y, reduction="sum").double()
        self._loss_total = loss if first else self._loss_total + loss
        self._samples += len(y)

    def counts(self) -> torch.Tensor:
        """(correct, samples, summed loss) as one float64 tensor on the CPU (a sum over processes
        of it is the counts of their union)."""
        return torch.stack([torch.as_tensor(v).to("cpu", torch.float64)
                            for v in (self._correct, self._samples, self._loss_total)])

    def result(self) -> EvalResult:
        per_class = None
        if self.per_class:
            counted = torch.is_tensor(self._class_hits)
            none = torch.zeros(self.num_classes, dtype=torch.long)
            per_class = (self._class_hits, self._class_support) if counted else (none, none)
        return _eval_result(int(self._correct), self._samples, float(self._loss_total), per_class)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of `model`'s floating parameters: float64 under --trainer.precision 64-true,
    bfloat16 under bf16-true, float32 otherwise (bf16-mixed and 16-mixed keep float32 weights)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def as_model_input(x: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A batch's inputs on `device`, floating inputs converted to `dtype` (the model's, see
    `model_dtype`), as Lightning's precision plugin converts training inputs: data loaders give
    float32, which a float64 or bfloat16 model cannot take. Integer inputs (token ids) stay."""
    return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, num_classes: int, device: torch.device | str | None = None,
             scores: Callable[[torch.Tensor], torch.Tensor] | None = None, per_class: bool = False) -> EvalResult:
    """`model` (in eval mode for the duration, its flags restored after) on `batches` of (x, y):
    its class scores are `scores(x)` if given (e.g. a method's cosine or prototype predictions
    with `model` installed), else `model(x)`."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    dtype = model_dtype(model)
    metrics = Tally(num_classes, per_class)
    forward = scores or model
    with eval_mode(model):
        for x, y in batches:
            x, y = as_model_input(x, device, dtype), y.to(device)
            metrics.update(forward(x), y)
    return metrics.result()


class BestAccuracy:
    """The run's best accuracy and the (1-based) round it was reached in: the first of equal
    values; a NaN accuracy is never the best. Its state goes through checkpoints."""

    def __init__(self):
        self.value = math.nan
        self.round: int | None = None

    def update(self, accuracy: float, round_number: int) -> None:
        if math.isfinite(accuracy) and (self.round is None or accuracy > self.value):
            self.value, self.round = accuracy, round_number

    def state_dict(self) -> dict:
        return {"value": self.value, "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.round = float(state.get("value", math.nan)), state.get("round")
