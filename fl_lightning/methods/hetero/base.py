"""The shared base of model-heterogeneous methods (FedORGP and its baselines).

There is no global model: client k owns its own architecture (`models/hetero.py`, client k gets
model k mod |group|) and keeps it across rounds. How that fits the contract of `base.py`:

- The N client models live in a plain list, not as submodules, so Lightning neither moves them
  to the accelerator nor puts them in `state_dict`. They stay on the CPU; `client_start` moves the
  client's model to the device and installs it as `self.model` (so `local_loss`, `sgd_step`,
  `predict_logits` work unchanged), `client_end` moves it back. Between clients `self.model` is
  None: there is no global model.
- The local optimizer is created once (Lightning's `configure_optimizers`) over a one-element
  anchor tensor; `client_start` rebinds its parameter group to the client's parameters and clears
  its state (fresh momentum for every client, every round), `client_end` rebinds it to the anchor
  so checkpoints hold a client-independent optimizer.
- Every client model is kept in a client-state store next to the round checkpoint, which names
  the files (`fl_client_models`); a checkpoint writes only the models that changed since the last
  one, and resume restores them all. The server state of each method (prototypes, heads, shared models) is registered on
  the module and rides in `state_dict`.
- Evaluation is personalised, as in the papers: after every round each client's own model is
  evaluated on its own test split, and accuracy = total correct / total test samples over all
  clients (`clients/test_acc`, with the best round so far in `clients/best_test_acc`). The
  global test set is not used (`local_model_stats` has nothing to add), and personalised
  fine-tuning starts from the client's own model (`finetune_start`).

The federation carries only what each subclass's `upload` returns.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from fl_lightning.client_store import ClientStateStore, state_digest
from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
from fl_lightning.methods.base import FederatedMethod, abstract_base
from fl_lightning.models.base import FLModel
from fl_lightning.models.hetero import build_client_models, client_architecture, group_members
from fl_lightning.parallel import clients_in_parallel
from fl_lightning.uploads import ClientUpload


@abstract_base
class HeteroMethod(FederatedMethod):
    """Holds one persistent model per client and runs the per-client personalised evaluation.

    Args:
        model: a model group (HMG3, HMG5, HMG8, HMG10) or a comma-separated list of architectures.
        feature_dim: K, the common feature size of every client's body (heads are Linear(K, C)).
        lr: learning rate of the local SGD (HtFL papers: 0.01).
        momentum: momentum of the local SGD (HtFL papers: 0, plain SGD).
        weight_decay: weight decay of the local SGD (HtFL papers: 0).
        lr_decay: local lr multiplied by this after every round (HtFL papers: 1, no decay).
    """

    def __init__(
        self,
        model: str = "HMG8",
        feature_dim: int = 512,
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 1.0,
        data_spec: DataSpec | None = None,
        **kwargs,
    ):
        if feature_dim < 1:
            raise FLUserError(f"feature_dim must be >= 1, got {feature_dim}")
        group_members(model)  # an unknown group fails at construction, before any data is loaded
        super().__init__(
            model=model,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            lr_decay=lr_decay,
            data_spec=data_spec,
            **kwargs,
        )
        self.save_hyperparameters()
        self.model: FLModel | None = None  # the installed client's model, only while it trains
        # every client's model as of the last checkpoint, in files next to it (client_store.py)
        self.client_model_states = ClientStateStore()
        self._stored_marks: dict[int, tuple[tuple, str]] = {}
        self._client_models: list[FLModel] = []
        self._anchor = [torch.zeros(1, requires_grad=True)]
        self._trained: list[int] = []  # this round's clients on this process
        self.register_buffer("best_acc", torch.tensor(-1.0))
        self.register_buffer("best_round", torch.tensor(-1))

    # ---- client models ------------------------------------------------------------------------
    @property
    def client_models(self) -> list[FLModel]:
        return self._client_models

    def build_client_models(self, num_clients: int) -> None:
        """The clients' initial models, drawn from the run's seed (`seed_everything`) whatever
        happened to the global RNG before: set-up consumes it differently on one process and on
        several (Lightning re-seeds each process as it joins), and the initial models must not
        depend on that."""
        h = self.hparams
        seed = int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._client_models = build_client_models(h.model, h.data_spec, h.feature_dim, num_clients)
            self.on_client_models_built()

    def on_client_models_built(self) -> None:
        """Hook: e.g. give every client the same initial shared head (LG-FedAvg, FedGH)."""

    def client_architecture(self, client: int) -> str:
        return client_architecture(self.hparams.model, client)

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "client_loader"):
            raise FLUserError("model-heterogeneous methods need a FederatedDataModule")
        if not dm.hparams.client_test_fraction > 0:
            raise FLUserError(
                "model-heterogeneous methods evaluate each client on its own test split: set "
                "data.client_test_fraction (the papers use 0.25)"
            )
        if self.trainer.world_size > 1 and not clients_in_parallel(self.trainer):
            # The installed client model is swapped in after DDP has wrapped the module, so its
            # gradients would not be synchronised across ranks.
            raise FLUserError("model-heterogeneous methods split over processes by client, not by batch: "
                              "set --federation.parallel clients (or --trainer.devices 1)")
        if not self._client_models:
            self.build_client_models(dm.num_clients)
            if clients_in_parallel(self.trainer):  # every process starts from rank 0's client models
                for model in self._client_models:
                    _sync_module_states(model)
        elif len(self._client_models) != dm.num_clients:
            raise FLUserError(
                f"the method holds {len(self._client_models)} client models but the data has "
                f"{dm.num_clients} clients"
            )

    def _install(self, client: int) -> FLModel:
        model = self._client_models[client].to(self.device)
        self.model = model
        return model

    def _uninstall(self) -> None:
        self.model.to("cpu")
        self.model = None

    @contextlib.contextmanager
    def client_model(self, client: int):
        """`self.model` is client's own model (on the device) inside the block."""
        self._install(client)
        try:
            yield self.model
        finally:
            self._uninstall()

    # ---- optimizer ----------------------------------------------------------------------------
    def local_parameters(self) -> Iterable[nn.Parameter]:
        if self.model is None:
            return self._anchor
        return [p for p in self.model.parameters() if p.requires_grad] + list(self.extra_local_parameters())

    def extra_local_parameters(self) -> Iterable[nn.Parameter]:
        """Trained alongside the client's model (FML/FedKD's shared model, FedKD's W_h)."""
        return []

    def _bind_optimizer(self) -> None:
        opt = self.optimizers().optimizer
        opt.param_groups[0]["params"] = list(self.local_parameters())
        opt.state.clear()

    # ---- the round ----------------------------------------------------------------------------
    def client_start(self, client: int, num_samples: int) -> None:
        self._trained.append(client)
        self.current_client, self.current_num_samples = client, num_samples
        self.seed_client(client)
        self._install(client)
        self.receive(client)
        self._bind_optimizer()
        self.local_step = 0
        self.model.train()

    def receive(self, client: int) -> None:
        """Hook: load what the server sends into the installed client (shared model, W_h, ...)."""

    def minibatch_step(self, batch):
        if self.drops_batch(len(batch[1])):
            return None
        return super().minibatch_step(batch)

    def drops_batch(self, size: int) -> bool:
        """Whether a local batch of `size` samples is skipped: the incomplete last batch of every
        local epoch, as HtFLlib (the code behind the FedORGP tables) drops it (`drop_last=True`).

        Why it matters: MobileNetV2 and GoogLeNet on 32x32 inputs end in 1x1 maps, where a
        train-mode BatchNorm normalises only `size` values per channel. With 2 values its output is
        +-1 whatever the input, so the true gradient is 0 and backward returns the eps-dominated
        derivative, up to 1/sqrt(eps) ~ 316 per layer; chained through the network a 2-sample tail
        gave a gradient norm of 1e7 and NaN weights in the next round (issue 9, finding 8). A
        client smaller than one batch keeps its only batch (one sample cannot be normalised).
        """
        full = self.trainer.datamodule.hparams.batch_size
        if self.current_num_samples >= full:
            return size < full
        return size < 2

    def upload(self) -> dict:
        """What the installed client sends, as `ClientUpload` fields (e.g. {"prototypes": ...});
        the only thing that crosses the network."""
        raise NotImplementedError

    def client_end(self) -> ClientUpload:
        fields = self.upload()
        stats = self.client_stats()
        self.client_done()
        self._uninstall()
        self._bind_optimizer()  # back to the anchor: checkpoints hold no client's parameters
        client, n = self.current_client, self.current_num_samples
        self.current_client = None
        return ClientUpload(client, n, stats=stats, **fields)

    def client_stats(self) -> dict[str, float]:
        return {}

    def client_done(self) -> None:
        """Hook: save the installed client's persistent extras (e.g. FedKD's W_h) before it leaves."""

    def client_train_loader(self, client: int):
        """The client's own training samples, without augmentation (prototypes)."""
        return self.trainer.datamodule.client_loader(client, "train", augment=False)

    # ---- personalised evaluation --------------------------------------------------------------
    def validation_step(self, batch, batch_idx: int):
        return None  # there is no global model to evaluate on the global test set

    def test_step(self, batch, batch_idx: int):
        return None

    @torch.no_grad()
    def evaluate_clients(self) -> tuple[float, float, list[float]]:
        """Each client's own model on its own test split: (total correct / total, mean CE, per-client acc)."""
        dm = self.trainer.datamodule
        correct, total, loss_sum, per_client = 0, 0, 0.0, []
        for client in range(len(self._client_models)):
            with self.client_model(client) as model:
                model.eval()
                c_correct, c_total = 0, 0
                for x, y in dm.client_loader(client, "test"):
                    x, y = x.to(self.device), y.to(self.device)
                    logits = self.predict_logits(x).float()
                    finite = torch.where(torch.isfinite(logits), logits, torch.full_like(logits, -1e30))
                    loss_sum += float(F.cross_entropy(finite, y, reduction="sum"))
                    c_correct += int((logits.argmax(1) == y).sum())
                    c_total += len(y)
                model.train()
            correct, total = correct + c_correct, total + c_total
            per_client.append(c_correct / max(c_total, 1))
        return correct / max(total, 1), loss_sum / max(total, 1), per_client

    def _log_client_eval(self, prefix: str) -> None:
        acc, loss, per_client = self.evaluate_clients()
        metrics = {
            f"{prefix}/test_acc": acc,
            f"{prefix}/test_loss": loss,
            f"{prefix}/test_acc_client_std": float(torch.tensor(per_client).std(unbiased=False)),
        }
        if prefix == "clients" and self.trainer.state.fn == "fit":
            if acc > float(self.best_acc):
                self.best_acc.fill_(acc)
                self.best_round.fill_(self.current_epoch)
            metrics["clients/best_test_acc"] = float(self.best_acc)
            metrics["clients/best_round"] = float(self.best_round) + 1  # 1-based, as printed
            rank_zero_info(
                f"round {self.current_epoch + 1}/{self.trainer.max_epochs}: client test acc {acc:.4f} "
                f"(best {float(self.best_acc):.4f} at round {int(self.best_round) + 1}), loss {loss:.4f}"
            )
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._log_client_eval("clients")

    def on_test_epoch_end(self) -> None:
        self._log_client_eval("test/clients")

    def finetune_start(self, client: int) -> FLModel:
        """The client's own model, on the device (personalised evaluation copies it)."""
        return copy.deepcopy(self._client_models[client]).to(self.device)

    # ---- clients in parallel -------------------------------------------------------------------
    def round_start(self, round_idx: int, clients: list[int]) -> None:
        super().round_start(round_idx, clients)
        self._trained = []

    def sync_client_states(self, collective) -> None:
        """Every process holds every client model (each evaluates all of them after a round):
        the models this process trained go to the others. After aggregation, so what a server
        step writes into every client (LG-FedAvg's head) is in place on every process alike."""
        super().sync_client_states(collective)
        if not collective.distributed:
            return
        mine = {c: {k: v.detach().cpu() for k, v in self._client_models[c].state_dict().items()}
                for c in self._trained}
        for rank, part in enumerate(collective.gather(mine)):
            if rank != collective.rank:
                for client, state in part.items():
                    self._client_models[client].load_state_dict(state)

    # ---- checkpoints --------------------------------------------------------------------------
    def configure_client_stores(self, directory, cache_size: int) -> None:
        super().configure_client_stores(directory, cache_size)
        self.client_model_states.configure(None if directory is None else Path(directory) / "models", cache_size)

    def _changed_models(self) -> list[int]:
        """Clients whose model differs from what the store holds. A model counts as unchanged
        if no tensor was replaced or modified in place since it was stored, or, when one was
        (e.g. moved between devices for evaluation), if its bytes are the same."""
        changed = []
        for client, model in enumerate(self._client_models):
            state = model.state_dict()
            marks = tuple((t.data_ptr(), t._version) for t in state.values())
            known = self._stored_marks.get(client)
            if known is not None and known[0] == marks:
                continue
            digest = state_digest(state)
            if known is not None and known[1] == digest:
                self._stored_marks[client] = (marks, digest)
                continue
            self._stored_marks[client] = (marks, digest)
            changed.append(client)
        return changed

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._trainer is not None and clients_in_parallel(self.trainer) and self.trainer.global_rank != 0:
            return  # rank 0 writes the checkpoint and, holding every client model, their files
        # only the models that changed since the last checkpoint are written (the clients that
        # trained, or all of them when the server sends every client something)
        for client in self._changed_models():
            self.client_model_states[client] = self._client_models[client].state_dict()
        checkpoint["fl_client_models"] = {"num_clients": len(self._client_models),
                                          **self.client_model_states.checkpoint_state()}
        self.client_model_states.release()  # the models themselves are in memory already

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("fl_client_models")
        if saved is None:
            return
        if isinstance(saved, list):  # a checkpoint from before the client-state store
            saved = {"num_clients": len(saved), "states": dict(enumerate(saved))}
        saved = dict(saved)
        num_clients = saved.pop("num_clients")
        if not self._client_models:
            self.build_client_models(num_clients)
        if num_clients != len(self._client_models):
            raise FLUserError(
                f"checkpoint holds {num_clients} client models, the run has {len(self._client_models)}"
            )
        self.client_model_states.load_checkpoint_state(saved)
        for client, model in enumerate(self._client_models):
            model.load_state_dict(self.client_model_states[client])
        self.client_model_states.release()
        self._stored_marks = {}
        self._changed_models()  # what is loaded is what the store holds
