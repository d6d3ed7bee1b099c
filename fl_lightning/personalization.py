"""Personalised evaluation: fine-tune a copy of the global model on every client, test it on that
client's own test set, report mean and std over clients (FedAvg-FT, FedSOL-FT, FedBABU-FT,
FedDr+FT), and the local-only baseline (each client trains alone from the initial model).
Methods that keep their own personalised models (FedPer, FedRep, Ditto, Per-FedAvg, kNN-Per:
`SharedModelMethod.personal_model`) are also tested as they are (`personal/own_acc_*`).

Every fine-tuning runs on a deep copy with its own optimizer, so the global model, the trainer's
optimizer and lr schedule and the next round are untouched. Per-client test sets come from the data
module (`--data.client_test partition|align|split`).

Configured from the CLI as `--personalization.*` (like `--federation.*`); off unless
`--personalization.enabled true`.
"""

from __future__ import annotations

import copy
from typing import Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from fl_lightning import compat
from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import as_model_input, evaluate, model_dtype
from fl_lightning.methods.base import LossContext


class PersonalizationCallback(L.Callback):
    """Personalised evaluation: each client's fine-tuned copy of the global model, on its own test set.

    Fine-tunes a copy of the global model on every client and reports its accuracy on the
    client's own test set (the global model is never changed).

    Args:
        enabled: run personalised evaluation at all.
        epochs: fine-tuning epochs at which each client's model is evaluated (cumulative, e.g.
            [1, 5] = FedSOL-FT's e = 1 and e = 5 from one 5-epoch fine-tuning).
        objective: "ce" (FedAvg-FT, FedSOL-FT, FedBABU-FT) or "method": the method's own local
            loss (its `loss` hook, as in local training; FedDr+FT), with the model fine-tuning
            starts from as the frozen teacher.
        finetune: "trainable" = the parameters the method trains locally (a frozen classifier stays
            frozen); "all" = every parameter, frozen head included (FedBABU-FT).
        lr: fine-tuning lr (None = the method's initial lr).
        momentum: momentum of the fine-tuning SGD.
        weight_decay: weight decay of the fine-tuning SGD.
        every_n_rounds: also evaluate during training after every n rounds (0 = only at the end).
        at_end: evaluate after training.
        local_only: also train each client alone from the initial model for `local_only_epochs`
            epochs (same objective/optimizer) and report it.
        local_only_epochs: epochs of that local-only training.
        max_clients: evaluate only the first n clients (0 = all), to bound the cost.
        seed: shuffling seed of the fine-tuning batches.
    """

    def __init__(self, enabled: bool = False, epochs: list[int] | None = None,
                 objective: Literal["ce", "method"] = "ce",
                 finetune: Literal["trainable", "all"] = "trainable",
                 lr: float | None = None, momentum: float = 0.9, weight_decay: float = 1e-5,
                 every_n_rounds: int = 0, at_end: bool = True, local_only: bool = False,
                 local_only_epochs: int = 10, max_clients: int = 0, seed: int = 0):
        super().__init__()
        self.enabled = enabled
        self.epochs = sorted(set(epochs or [5]))
        if self.epochs[0] < 0:
            raise FLUserError(f"--personalization.epochs must be >= 0, got {self.epochs}")
        self.objective, self.finetune = objective, finetune
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.every_n_rounds, self.at_end = every_n_rounds, at_end
        self.local_only, self.local_only_epochs = local_only, local_only_epochs
        self.max_clients, self.seed = max_clients, seed
        self._initial_states: dict[int, dict[str, torch.Tensor]] = {}
        self.results: dict[str, float] = {}
        self.per_client: dict[str, list[float]] = {}

    # ---- hooks --------------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        if not self.enabled:
            return
        dm = trainer.datamodule
        if not hasattr(dm, "client_loader"):
            raise FLUserError("personalised evaluation needs a FederatedDataModule")
        if dm.client_test_mode == "none":
            raise FLUserError("personalised evaluation needs per-client test sets: set --data.client_test "
                              "partition|align, or --data.client_test_fraction > 0")
        # The initial model of the local-only baseline (on resume this is the resumed model); one
        # copy per distinct starting model (all clients share the global model's)
        self._initial_states = {}
        if self.local_only:
            copies: dict[int, dict[str, torch.Tensor]] = {}
            for client in self.clients(dm):
                start = pl_module.finetune_start(client)
                if id(start) not in copies:
                    copies[id(start)] = {k: v.detach().clone() for k, v in start.state_dict().items()}
                self._initial_states[client] = copies[id(start)]

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.enabled and self.every_n_rounds and (trainer.current_epoch + 1) % self.every_n_rounds == 0:
            self._log(trainer, self.evaluate(trainer, pl_module, local_only=False), trainer.current_epoch)

    def on_fit_end(self, trainer, pl_module) -> None:
        # on_fit_end runs after the method's on_train_end (e.g. SphereFed's recalibration).
        if self.enabled and self.at_end:
            # after fit, current_epoch counts the completed rounds
            metrics = self.evaluate(trainer, pl_module, local_only=self.local_only)
            self._log(trainer, metrics, trainer.current_epoch - 1)

    # ---- the evaluation -----------------------------------------------------------------------
    def clients(self, dm) -> list[int]:
        n = dm.num_clients if not self.max_clients else min(self.max_clients, dm.num_clients)
        return list(range(n))

    def evaluate(self, trainer, pl_module, local_only: bool = False) -> dict[str, float]:
        dm = trainer.datamodule
        per: dict[str, list[float]] = {"global": []}
        per.update({f"ft{e}": [] for e in self.epochs})
        if local_only:
            per["local_only"] = []
        for client in self.clients(dm):
            test = dm.client_loader(client, "test")
            start = pl_module.finetune_start(client)  # the global model, or the client's own
            per["global"].append(self.accuracy(start, test, pl_module))
            own = pl_module.personal_model(client)
            if own is not None:  # the method's own personalised model (1-step pFL)
                per.setdefault("own", []).append(self.accuracy(own, test, pl_module))
            accs = self.train_and_test(pl_module, start, start.state_dict(), dm, client, test, self.epochs)
            for e, acc in zip(self.epochs, accs, strict=True):
                per[f"ft{e}"].append(acc)
            if local_only:
                acc = self.train_and_test(pl_module, start, self._initial_states[client], dm, client, test,
                                          [self.local_only_epochs])
                per["local_only"].append(acc[0])
        self.per_client = per
        out = {f"final/{k}": v for k, v in pl_module.global_test_metrics(dm.test_dataloader).items()}
        for key, values in per.items():
            arr = np.asarray(values, dtype=np.float64)
            out[f"personal/{key}_acc_mean"] = float(arr.mean())
            out[f"personal/{key}_acc_std"] = float(arr.std())
        self.results = out
        return out

    def train_and_test(self, pl_module, like, start_state, dm, client: int, test,
                       checkpoints: list[int]) -> list[float]:
        """Fine-tune a copy of `like` from `start_state` on one client's train data; accuracy on
        its test set after each epoch count in `checkpoints`."""
        device = pl_module.device
        model = copy.deepcopy(like)
        model.load_state_dict(start_state)
        teacher = copy.deepcopy(model).requires_grad_(False).eval()
        if self.finetune == "all":
            model.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        lr = self.lr if self.lr is not None else float(pl_module.hparams.lr)
        opt = torch.optim.SGD(params, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay)
        counts = torch.as_tensor(dm.client_class_counts(client), dtype=torch.float32, device=device)
        dtype = model_dtype(model)  # float64 under 64-true, bfloat16 under bf16-true: inputs follow
        accs = []
        epoch = 0
        for target in checkpoints:
            while epoch < target:
                model.train()
                for x, y in dm.client_loader(client, "train", shuffle=True, seed=self.seed * 100003 + epoch):
                    x, y = as_model_input(x, device, dtype), y.to(device)
                    if self.objective == "method":
                        loss = pl_module.loss(model, (x, y), LossContext(teacher, counts, finetuning=True))
                    else:
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    compat.release_gradients(opt)
                    loss.backward()
                    compat.step_optimizer(opt)
                epoch += 1
            accs.append(self.accuracy(model, test, pl_module))
        return accs

    @staticmethod
    def accuracy(model, loader, pl_module) -> float:
        """`model`'s accuracy on a client's test loader (the one evaluation function)."""
        return evaluate(model, loader, pl_module.hparams.data_spec.num_classes, pl_module.device).accuracy

    def _log(self, trainer, metrics: dict[str, float], round_idx: int) -> None:
        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        parts = []
        for k, v in metrics.items():
            if k.endswith("_acc_mean"):
                std = metrics[k.replace("_mean", "_std")]
                parts.append(f"{k.removeprefix('personal/').removesuffix('_acc_mean')} {v:.4f}+-{std:.4f}")
        head = (f"global test acc {metrics['final/global_test_acc']:.4f}; "
                if "final/global_test_acc" in metrics else "")
        rank_zero_info(f"round {round_idx + 1}: {head}personalised accuracy (mean+-std over clients): "
                       + ", ".join(parts))
