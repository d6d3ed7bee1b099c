"""`SharedModelMethod`: the methods with one global model that every client starts from (FedAvg's
behaviour is the default of every hook). The contract a method implements, in tiers, is
`FederatedMethod`'s (methods/base.py); the model-heterogeneous family's base is methods/hetero/base.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import EvalResult, Evaluation, evaluate
from fl_lightning.methods.base import NO_CONTEXT, FederatedMethod, LossContext, abstract_base
from fl_lightning.methods.local_step import round_constraint
from fl_lightning.models import FLModel, build_model
from fl_lightning.uploads import WEIGHTS, ClientUpload, RoundUploads, ServerUpdate


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
        server_lr: the server's step size eta on the round's update: w + eta * (the clients'
            weighted average - w) for FedAvg (1.0 = plain FedAvg), and the same eta on the
            server optimizer's step for FedAvgM, FedAdagrad, FedAdam and FedYogi.
        model: architecture name (see `fl_lightning.models.MODELS`).
        lr, momentum, weight_decay, lr_decay, lr_milestones, lr_milestone_gamma, data_spec,
            constraint: see `FederatedMethod`.
    """

    needs_global_model: bool = False  # methods that run the frozen round-start model set this

    def __init__(self, server_lr: float = 1.0, **kwargs):
        if server_lr <= 0:
            raise FLUserError(f"server_lr must be > 0, got {server_lr}")
        super().__init__(**kwargs)
        spec = self.hparams.data_spec
        self.model: FLModel = self.build_network(self.hparams.model, spec)
        self.val_eval = Evaluation(spec.num_classes, sync=True)
        self.test_eval = Evaluation(spec.num_classes, sync=True)
        self.global_weights: dict[str, torch.Tensor] | None = None
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
        if self.needs_global_model:
            # eval(): a teacher's output should not depend on BN batch mode or dropout draws
            self.copies.get("teacher", self.model, self.global_weights, self.device)
        if self.constraint != "none":
            self.steps.constraint = round_constraint(self.constraint, self.model, self.global_weights)

    @property
    def global_model(self) -> FLModel:
        """The frozen round-start global model (a working copy: never trained, never saved)."""
        if not self.needs_global_model or "teacher" not in self.copies:
            raise RuntimeError(f"{type(self).__name__} must set needs_global_model = True")
        return self.copies["teacher"]

    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: self.global_weights[n] for n, _ in self.model.named_parameters()}

    # ---- client -------------------------------------------------------------------------------
    def client_start(self, client: int, num_samples: int) -> None:
        self.current_client, self.current_num_samples = client, num_samples
        self.seed_client(client)
        self.model.load_state_dict(self.global_weights)
        if self.personal:
            self.load_model_part(self.personal_state(client))
        self.reset_optimizer_state()
        self.steps.taken = 0
        self.model.train()

    def client_end(self) -> ClientUpload:
        state = self.model.state_dict()
        weights = {k: v.detach().clone() for k, v in state.items() if k not in self.personal}
        upload = ClientUpload(self.current_client, self.current_num_samples, {WEIGHTS: weights},
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
        # one norm per tensor, then the norm of the norms (torch's norm accumulates more accurately
        # than squaring and summing every difference): what torch's total gradient norm computes
        with torch.no_grad():
            differences = [p - self.global_weights[n] for n, p in self.model.named_parameters()
                           if n not in self.personal]
            return float(torch.nn.utils.get_total_norm(differences)) if differences else 0.0

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
        return ServerUpdate(global_state=self.global_from_average(uploads.weighted_average(WEIGHTS)))

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
        acc, loss = metrics.compute(self.trainer.strategy)
        metrics.reset()
        self.publish_evaluation({"global/test_loss": loss, "global/test_acc": acc}, "global/test_acc")

    def evaluate(self, loader, per_class: bool = False) -> EvalResult:
        """The current `self.model` (with this method's class scores) on a loader."""
        return evaluate(self.model, loader, self.hparams.data_spec.num_classes, self.device,
                        scores=self.predict_logits, per_class=per_class)
