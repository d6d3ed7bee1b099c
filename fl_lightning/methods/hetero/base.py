"""The shared base of model-heterogeneous methods (FedORGP and its baselines).

There is no global model: client k owns its own architecture (`models/hetero.py`, client k gets
model k mod |group|) and keeps it across rounds. How that fits the contract of `base.py`:

- The N client models live in a client-state store (`client_model_states`, client_store.py): a
  cache of at most `--federation.client_cache_size` clients' weights in memory, the rest in
  per-client files next to the checkpoints. A client's model exists as a module only while it is
  used: `client_start` loads the client's weights into the one module kept per architecture
  (`client_architecture(client)`), on the device, and installs it as `self.model` (so `loss`,
  `sgd_step`, `predict_logits` work unchanged); `client_end` writes the trained weights back to
  the store. Evaluation and personalised fine-tuning load them the same way. So the memory of
  client models is bounded by the cache, not by N. Between clients `self.model` is None: there
  is no global model.
- The local optimizer is created once (Lightning's `configure_optimizers`) over a one-element
  anchor tensor; `client_start` rebinds its parameter group to the client's parameters and clears
  its state (fresh momentum for every client, every round), `client_end` rebinds it to the anchor
  so checkpoints hold a client-independent optimizer.
- The round checkpoint names the store's files (`fl_client_models`); it writes only the models
  that changed since the last one (the clients that trained), and resume restores them all. The
  server state of each method (prototypes, heads, shared models) is registered on the module and
  rides in `state_dict`; what the server gives every client (LG-FedAvg's head) is applied when a
  client's model is loaded (`on_client_model_loaded`), not written into every client's file.
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
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from fl_lightning.client_store import ClientStateStore
from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError
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
        # every client's model weights: a bounded cache over files next to the checkpoints
        self.client_model_states = ClientStateStore()
        self._num_clients = 0  # 0: the client models are not built yet
        self._expected_clients: int | None = None  # the data's number of clients (setup)
        # one module per architecture, into which the client in use is loaded (never two at once)
        self._architecture_modules: dict[str, FLModel] = {}
        self._anchor = [torch.zeros(1, requires_grad=True)]
        self._trained: list[int] = []  # this round's clients on this process
        self.register_buffer("best_acc", torch.tensor(-1.0))
        self.register_buffer("best_round", torch.tensor(-1))

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
        parallel = self._trainer is not None and clients_in_parallel(self.trainer)
        seed = int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))
        self._architecture_modules = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for client in range(num_clients):
                architecture = self.client_architecture(client)
                model = build_group_model(architecture, h.data_spec, h.feature_dim)
                if store:
                    if parallel:
                        _sync_module_states(model)
                    self.client_model_states[client] = model.state_dict()
                self._architecture_modules.setdefault(architecture, model)
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
        # Built once the store knows where its files go (configure_client_stores), or when first
        # needed, or replaced by a checkpoint's.
        self._expected_clients = dm.num_clients

    def load_client_model(self, client: int) -> FLModel:
        """Client k's model: its weights from the store, loaded into its architecture's module on
        the device (that module is shared by all clients of the architecture: one at a time)."""
        self._ensure_client_models()
        model = self._architecture_modules[self.client_architecture(client)].to(self.device)
        model.load_state_dict(self.client_model_states[client])
        self.on_client_model_loaded(client, model)
        return model

    def client_model_copy(self, client: int, device: torch.device | str | None = None) -> FLModel:
        """A new module holding client k's model (not shared with anything)."""
        self._ensure_client_models()
        model = copy.deepcopy(self._architecture_modules[self.client_architecture(client)]).to(device or self.device)
        model.load_state_dict(self.client_model_states[client])
        self.on_client_model_loaded(client, model)
        return model

    def _install(self, client: int) -> FLModel:
        self.model = self.load_client_model(client)
        self._installed_client = client
        return self.model

    def _uninstall(self, keep: bool) -> None:
        """`keep`: the client's model changed (it trained), so its weights go back to the store."""
        if keep:
            self.client_model_states[self._installed_client] = self.model.state_dict()
        for p in self.model.parameters():
            p.grad = None
        self.model = None
        self._installed_client = None

    @contextlib.contextmanager
    def client_model(self, client: int, keep: bool = False):
        """`self.model` is client's own model (on the device) inside the block; with `keep` its
        weights are written back to the store at the end."""
        self._install(client)
        try:
            yield self.model
        finally:
            self._uninstall(keep)

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
        self._uninstall(keep=True)
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
        for client in range(self.num_clients):
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
        return self.client_model_copy(client)

    # ---- clients in parallel -------------------------------------------------------------------
    def round_start(self, round_idx: int, clients: list[int]) -> None:
        super().round_start(round_idx, clients)
        self._trained = []

    def sync_client_states(self, collective) -> None:
        """Every process's store holds every client's model (each evaluates all of them after a
        round): the models this process trained go into the others' stores, after aggregation."""
        super().sync_client_states(collective)
        if not collective.distributed:
            return
        mine = {c: self.client_model_states[c] for c in self._trained}
        for rank, part in enumerate(collective.gather(mine)):
            if rank != collective.rank:
                for client, state in part.items():
                    self.client_model_states[client] = state

    # ---- checkpoints --------------------------------------------------------------------------
    def configure_client_stores(self, directory, cache_size: int) -> None:
        super().configure_client_stores(directory, cache_size)
        if directory is not None:
            directory = Path(directory) / "models"
            if self._trainer is not None and clients_in_parallel(self.trainer) and self.trainer.global_rank:
                # with clients in parallel every process evicts to its own folder, which rank 0's
                # pruning of the checkpoint's folder does not touch
                directory = directory / f"rank{self.trainer.global_rank}"
                self.client_model_states.rank = self.trainer.global_rank
        self.client_model_states.configure(directory, cache_size)
        if not self._num_clients and self._expected_clients is not None:
            self.build_client_models(self._expected_clients)  # straight into the bounded store

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._trainer is not None and clients_in_parallel(self.trainer) and self.trainer.global_rank != 0:
            # rank 0 writes the checkpoint and, holding every client model, their files; the
            # others prune the files their own evictions wrote (in their own folder)
            self.client_model_states.checkpoint_state()
            return
        # the store writes only the models that changed since the last checkpoint (the clients
        # that trained) and names all files
        checkpoint["fl_client_models"] = {"num_clients": self._num_clients,
                                          **self.client_model_states.checkpoint_state()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("fl_client_models")
        if saved is None:
            return
        if isinstance(saved, list):  # a checkpoint from before the client-state store
            saved = {"num_clients": len(saved), "states": dict(enumerate(saved))}
        saved = dict(saved)
        num_clients = saved.pop("num_clients")
        expected = self._num_clients or self._expected_clients or num_clients
        if num_clients != expected:
            raise FLUserError(f"checkpoint holds {num_clients} client models, the run has {expected}")
        if not self._num_clients:
            # the architectures' modules (and the same random draws as a fresh run's models)
            self.build_client_models(num_clients, store=False)
        self.client_model_states.load_checkpoint_state(saved)
        missing = [c for c in range(num_clients) if c not in self.client_model_states]
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
