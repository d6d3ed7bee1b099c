"""The shared base of model-heterogeneous methods (FedORGP and its baselines).

There is no global model: client k owns its own architecture (`models/hetero.py`, client k gets
model k mod |group|) and keeps it across rounds. How that fits the contract of `base.py`:

- The N client models live in the client-state store with every other per-client state
  (`client_states[k]` under "model.", client_store.py): a cache of at most
  `--federation.client_cache_size` clients in memory, the rest in checked per-client files next
  to the checkpoints. A client's model exists as a module only while it is used: `client_start`
  loads the client's weights into the one module kept per architecture
  (`client_architecture(client)`), on the device, and installs it as `self.model` (so `loss`,
  `sgd_step`, `predict_logits` work unchanged); `client_end` returns the trained weights as the
  state the client keeps (`upload.kept`), which the round callback stores. Evaluation and
  personalised fine-tuning load them the same way. So the memory of client models is bounded by
  the cache, not by N. Between clients `self.model` is None: there is no global model.
- The local optimizer is created once (Lightning's `configure_optimizers`) over a one-element
  anchor tensor; `client_start` rebinds its parameter group to the client's parameters and clears
  its state (fresh momentum for every client, every round), `client_end` rebinds it to the anchor
  so checkpoints hold a client-independent optimizer.
- The round checkpoint names the store's files; it writes only the states that changed since
  the last one (the clients that trained), and resume restores them all. The server state of each
  method (prototypes, heads, shared models) is in `self.server`; what the server gives every
  client (LG-FedAvg's head) is applied when a client's model is loaded (`on_client_model_loaded`),
  not written into every client's file.
- Evaluation is personalised, as in the papers: after every round each client's own model is
  evaluated on its own test split, and accuracy = total correct / total test samples over all
  clients (`clients/test_acc`, the run's accuracy: `accuracy_key`). The global test set is not
  used (`local_model_stats` has nothing to add), and personalised
  fine-tuning starts from the client's own model (`finetune_start`).

The federation carries only what each subclass's `upload` returns.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from fl_lightning import compat
from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import Tally, eval_mode
from fl_lightning.methods.base import FederatedMethod, abstract_base
from fl_lightning.models.base import FLModel
from fl_lightning.models.hetero import build_group_model, client_architecture, group_members
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
        self.model: FLModel | None = None  # the installed client's model, only while it is used
        self._installed_client: int | None = None
        self._num_clients = 0  # 0: the client models are not built yet
        self._expected_clients: int | None = None  # the data's number of clients (setup)
        # one module per architecture, into which the client in use is loaded (never two at once)
        self._architecture_modules: dict[str, FLModel] = {}
        self._anchor = [torch.zeros(1, requires_grad=True)]

    # ---- client models ------------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        self._ensure_client_models()
        return self._num_clients

    @property
    def client_models(self) -> Sequence[FLModel]:
        """Client k's model as a new module on the CPU, loaded from the store: a snapshot for
        reading (analyses, tests); changing it does not change the client's model."""
        self._ensure_client_models()
        return _ClientModelSnapshots(self)

    def build_client_models(self, num_clients: int, store: bool = True) -> None:
        """Builds every client's initial model in client order and writes each to the store as
        soon as it is built, so a bounded cache holds at most its size in memory. `store=False`
        keeps only one module per architecture (a checkpoint is about to provide the weights).

        The models are drawn from the run's seed (`seed_everything`) whatever happened to the
        global RNG before: set-up consumes it differently on one process and on several
        (Lightning re-seeds each process as it joins), and the initial models must not depend on
        that. With clients in parallel every process takes rank 0's."""
        h = self.hparams
        trainer = compat.attached_trainer(self)
        parallel = trainer is not None and clients_in_parallel(trainer)
        seed = int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))
        self._architecture_modules = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for client in range(num_clients):
                architecture = self.client_architecture(client)
                model = build_group_model(architecture, h.data_spec, h.feature_dim)
                if trainer is not None:  # in the precision's dtype (float64 for 64-true), as
                    # Lightning converts the module itself; client models are not its submodules
                    model = trainer.precision_plugin.convert_module(model)
                model = self.in_memory_format(model)  # the layout of configure_model, for the same reason
                if store:
                    if parallel:
                        compat.sync_module_states(model)
                    self.client_states[client] = self.prefixed("model.", model.state_dict())
                self._architecture_modules.setdefault(architecture, model)
            if store:
                self.client_states.mark_synced()  # every process drew the same initial models
            self._num_clients = num_clients
            self.on_client_models_built()

    def _ensure_client_models(self) -> None:
        if not self._num_clients:
            if self._expected_clients is None:
                raise RuntimeError(f"{type(self).__name__}: no client models before setup (or build_client_models)")
            self.build_client_models(self._expected_clients)

    def on_client_models_built(self) -> None:
        """Hook: server state sized by the number of clients (FedGen's label counts)."""

    def on_client_model_loaded(self, client: int, model: FLModel) -> None:
        """Hook: what the server gives every client, applied whenever a client's model is loaded
        from the store (LG-FedAvg's and FedGH's global head)."""

    def client_architecture(self, client: int) -> str:
        return client_architecture(self.hparams.model, client)

    def architectures(self) -> tuple[str, ...]:
        return group_members(self.hparams.model)

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
        if self._num_clients and self._num_clients != dm.num_clients:
            raise FLUserError(
                f"the method holds {self._num_clients} client models but the data has {dm.num_clients} clients"
            )
        # Built at fit start (once the store knows where its files go), or when first needed, or
        # replaced by a checkpoint's.
        self._expected_clients = dm.num_clients

    def load_client_model(self, client: int) -> FLModel:
        """Client k's model: its weights from the store, loaded into its architecture's module on
        the device (that module is shared by all clients of the architecture: one at a time)."""
        self._ensure_client_models()
        model = self._architecture_modules[self.client_architecture(client)].to(self.device)
        model.load_state_dict(self.client_state(client, "model."))
        self.on_client_model_loaded(client, model)
        return model

    def client_model_copy(self, client: int, device: torch.device | str | None = None) -> FLModel:
        """A new module holding client k's model (not shared with anything)."""
        self._ensure_client_models()
        model = copy.deepcopy(self._architecture_modules[self.client_architecture(client)]).to(device or self.device)
        model.load_state_dict(self.client_state(client, "model."))
        self.on_client_model_loaded(client, model)
        return model

    def _install(self, client: int) -> FLModel:
        self.model = self.load_client_model(client)
        self._installed_client = client
        return self.model

    def _uninstall(self) -> None:
        for p in self.model.parameters():
            p.grad = None
        self.model = None
        self._installed_client = None

    @contextlib.contextmanager
    def client_model(self, client: int):
        """`self.model` is client's own model (on the device) inside the block."""
        self._install(client)
        try:
            yield self.model
        finally:
            self._uninstall()

    def analysis_models(self, max_clients: int) -> list[tuple[str, nn.Module]]:
        """Clients 0 .. max_clients-1's own models (there is no global model)."""
        return [(f"client_{c}/", self.client_models[c]) for c in range(min(max_clients, self.num_clients))]

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
        self.current_client, self.current_num_samples = client, num_samples
        self.seed_client(client)
        self._install(client)
        self.receive(client)
        self._bind_optimizer()
        self.steps.taken = 0
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
        gave a gradient norm of 1e7 and NaN weights in the next round. A
        client smaller than one batch keeps its only batch (one sample cannot be normalised).
        """
        full = self.trainer.datamodule.hparams.batch_size
        if self.current_num_samples >= full:
            return size < full
        return size < 2

    def upload(self) -> dict[str, dict[str, torch.Tensor]]:
        """What the installed client sends, as the upload's named groups of tensors (e.g.
        {"prototypes": {"0": ..., "3": ...}}, see `ClientUpload`); the only thing that crosses
        the network."""
        raise NotImplementedError

    def client_end(self) -> ClientUpload:
        groups = self.upload()
        stats = self.client_stats()
        # copies: the architecture's module is loaded with the next client's weights in place
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        kept = {**self.prefixed("model.", model), **self.kept_extras()}
        self._uninstall()
        self._bind_optimizer()  # back to the anchor: checkpoints hold no client's parameters
        client, n = self.current_client, self.current_num_samples
        self.current_client = None
        return ClientUpload(client, n, groups, stats=stats, kept=kept)

    def client_stats(self) -> dict[str, float]:
        return {}

    def kept_extras(self) -> dict[str, torch.Tensor]:
        """Hook: the installed client's persistent extras besides its model (e.g. FedKD's W_h,
        under a prefix of their own), kept with it."""
        return {}

    def client_train_loader(self, client: int):
        """The client's own training samples, without augmentation (prototypes)."""
        return self.trainer.datamodule.client_loader(client, "train", augment=False)

    # ---- personalised evaluation --------------------------------------------------------------
    def validation_step(self, batch, batch_idx: int):
        return None  # there is no global model to evaluate on the global test set

    def test_step(self, batch, batch_idx: int):
        return None

    accuracy_key = "clients/test_acc"

    @torch.no_grad()
    def evaluate_clients(self) -> tuple[float, float, list[float]]:
        """Each client's own model on its own test split: (total correct / total, mean CE, per-client acc)."""
        dm, num_classes = self.trainer.datamodule, self.hparams.data_spec.num_classes
        overall = Tally(num_classes)
        per_client = []
        for client in range(self.num_clients):
            mine = Tally(num_classes)
            with self.client_model(client) as model, eval_mode(model):
                for x, y in dm.client_loader(client, "test"):
                    x, y = self.trainer.precision_plugin.convert_input(x.to(self.device)), y.to(self.device)
                    logits = self.predict_logits(x)
                    overall.update(logits, y)
                    mine.update(logits, y)
            result = mine.result()
            per_client.append(result.correct / max(result.samples, 1))
        result = overall.result()
        return result.correct / max(result.samples, 1), result.loss, per_client

    def _log_client_eval(self) -> None:
        acc, loss, per_client = self.evaluate_clients()
        self.publish_evaluation({"clients/test_acc": acc, "clients/test_loss": loss,
                                 "clients/test_acc_client_std": float(torch.tensor(per_client).std(unbiased=False))},
                                "clients/test_acc")

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._log_client_eval()

    def on_test_epoch_end(self) -> None:
        self._log_client_eval()

    def finetune_start(self, client: int) -> FLModel:
        """The client's own model, on the device (personalised evaluation copies it)."""
        return self.client_model_copy(client)

    # ---- checkpoints --------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        # after a checkpoint was restored (which provides the models) and the store was told where
        # its files go: a fresh run builds its clients' models now, straight into the bounded store
        self._ensure_client_models()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["fl_num_clients"] = self._num_clients

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        num_clients = checkpoint.get("fl_num_clients")
        if num_clients is None:
            raise FLUserError("the checkpoint holds no client models (fl_num_clients); it is not a checkpoint "
                              "of this model-heterogeneous method")
        expected = self._num_clients or self._expected_clients or num_clients
        if num_clients != expected:
            raise FLUserError(f"checkpoint holds {num_clients} client models, the run has {expected}")
        if not self._num_clients:
            # the architectures' modules (and the same random draws as a fresh run's models)
            self.build_client_models(num_clients, store=False)
        super().on_load_checkpoint(checkpoint)
        missing = [c for c in range(num_clients) if c not in self.client_states]
        if missing:
            raise FLUserError(f"the checkpoint names no model for client {missing[0]}")


class _ClientModelSnapshots(Sequence):
    """`HeteroMethod.client_models`: client k's model, built from the store when indexed."""

    def __init__(self, method: HeteroMethod):
        self._method = method

    def __len__(self) -> int:
        return self._method.num_clients

    def __getitem__(self, client):
        if isinstance(client, slice):
            return [self[c] for c in range(*client.indices(len(self)))]
        if not -len(self) <= client < len(self):
            raise IndexError(client)
        return self._method.client_model_copy(client % len(self), "cpu")
