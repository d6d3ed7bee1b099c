"""The round: a Lightning Callback that turns one training epoch into one communication round.

It knows no method by name. At round start it asks the method to take the global state; one
Trainer batch is one client, so before each batch it starts that client and after it collects the
client's upload (and checks it is finite); after the round's last client it has the method
aggregate the accepted uploads (and lets those clients keep their new local state), before
Lightning's validation loop evaluates the new global model. What the method
uploads (`uploads.ClientUpload`) and how the server combines it is entirely the method's business
(`methods/base.py`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from fl_lightning.data.datamodule import clients_per_round
from fl_lightning.errors import FLUserError
from fl_lightning.parallel import (
    ClientParallelStrategy,
    Collective,
    check_method,
    check_process_count,
    clients_in_parallel,
)
from fl_lightning.uploads import ClientUpload, RoundUploads, all_finite


class FLDivergedError(RuntimeError):
    """A loss or an uploaded tensor became NaN/inf: the run stops instead of training on garbage."""


class FederatedCallback(L.Callback):
    """Drives clients and aggregation inside Lightning's fit loop.

    Args:
        eval_local_models: evaluate every sampled client's local model on (a subset of) the global
            test set, the papers' "local on global" measure of forgetting.
        local_eval_samples: size of that subset (0 = the whole test set).
        on_divergence: "stop" ends the run with one line naming round, client and method;
            "skip_client" drops that client's upload and continues.
        collapse_rounds: the papers' "Failed" (divergence to chance accuracy with finite weights):
            after the global test accuracy has once exceeded the constant-predictor accuracy
            (the majority class's share of the test set) by 0.1, it falls to within 0.01 of it for
            this many consecutive rounds. 0 switches the check off.
        on_collapse: "mark" prints one line and marks the W&B summary (`failed`, `failed_at`) and
            trains on; "stop" also ends the run (exit code 3).
        client_cache_size: clients whose persistent state (control variates, personal models,
            heterogeneous client models) stays in memory; the others wait in per-client files in
            the run directory (0 = all in memory). Results do not depend on it.
        parallel: with several processes (`--trainer.strategy ddp` and devices/nodes > 1),
            "clients" spreads each round's clients over the processes (parallel.py; the default:
            federated clients are small, and splitting their batches cannot beat one device);
            "batch" splits every client's mini-batches across the processes instead (DDP's usual
            data parallelism, for settings with one large client batch).
    """

    def __init__(self, eval_local_models: bool = True, local_eval_samples: int = 1000,
                 on_divergence: Literal["stop", "skip_client"] = "stop", collapse_rounds: int = 5,
                 on_collapse: Literal["mark", "stop"] = "mark", client_cache_size: int = 0,
                 parallel: Literal["clients", "batch"] = "clients"):
        super().__init__()
        self.parallel = parallel
        if client_cache_size < 0:
            raise FLUserError(f"federation.client_cache_size must be >= 0 (0 = all in memory), got "
                              f"{client_cache_size}")
        self.client_cache_size = client_cache_size
        if collapse_rounds < 0:
            raise FLUserError(f"federation.collapse_rounds must be >= 0 (0 = off), got {collapse_rounds}")
        if local_eval_samples < 0:
            raise FLUserError(f"federation.local_eval_samples must be >= 0 (0 = the whole test set), "
                              f"got {local_eval_samples}")
        self.eval_local_models = eval_local_models
        self.local_eval_samples = local_eval_samples
        self.on_divergence = on_divergence
        self.collapse_rounds, self.on_collapse = collapse_rounds, on_collapse
        self._collapse = {"best_acc": -1.0, "rounds_at_chance": 0, "failed_at": ""}
        self._chance_acc: float | None = None
        self._plan = None
        self._starts: dict[int, Any] = {}
        self._ends: dict[int, Any] = {}
        self._uploads: list[ClientUpload] = []
        self._all_uploads: list[ClientUpload] = []
        # set by a callback that reads every client's upload each round (analysis divergence): with
        # clients in parallel the uploads are then gathered to every process after aggregation
        self.share_round_uploads = False
        self._local_loader = None
        self._skipped: list[int] = []

    @property
    def round_uploads(self) -> list[ClientUpload]:
        """The current round's accepted uploads (typed, see uploads.py), complete from the end of
        its last client until the next round starts: what an analysis callback reads, e.g. in
        its own on_train_batch_end or on_validation_end. With clients in parallel, every
        process's uploads when `share_round_uploads` is set, else this process's."""
        return list(self._all_uploads)

    # ---- set-up -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.reload_dataloaders_every_n_epochs != 1:
            raise FLUserError("federated training needs trainer.reload_dataloaders_every_n_epochs=1 "
                              "(every round has its own clients)")
        if not hasattr(trainer.datamodule, "round_plan"):
            raise FLUserError("federated training needs a FederatedDataModule as data")
        self._check_parallel(trainer, pl_module)
        # Per-client state goes to files next to the checkpoints (so a checkpoint only names them),
        # or, for a bounded cache without checkpoints, into the run directory.
        checkpoint = trainer.checkpoint_callback
        directory = None
        if checkpoint is not None and getattr(checkpoint, "dirpath", None):
            directory = Path(checkpoint.dirpath) / "client_states"
        elif self.client_cache_size:
            directory = Path(trainer.default_root_dir) / "client_states"
        pl_module.configure_client_stores(directory, self.client_cache_size)

    def _check_parallel(self, trainer, pl_module) -> None:
        world = trainer.world_size
        if world == 1 or self.parallel == "batch":
            return
        if not isinstance(trainer.strategy, ClientParallelStrategy):
            raise FLUserError(f"--federation.parallel clients runs with --trainer.strategy ddp (got "
                              f"{type(trainer.strategy).__name__}); or set --federation.parallel batch")
        check_method(type(pl_module))
        dm = trainer.datamodule
        check_process_count(world, clients_per_round(dm.hparams.num_clients, dm.hparams.sample_ratio))

    # ---- the round ----------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module) -> None:
        dm = trainer.datamodule
        plan = dm.round_plan
        if plan is None or plan.round != trainer.current_epoch:
            raise RuntimeError(f"round plan is for round {getattr(plan, 'round', None)}, "
                               f"not {trainer.current_epoch}")
        self._plan = plan
        self._mine = getattr(dm, "rank_plan", None) or plan  # this process's clients
        self._round_started = time.perf_counter()
        self._clients_done = 0
        self._uploads, self._all_uploads, self._skipped, self._diverged_at = [], [], [], None
        self._local_stats: list[dict[str, float]] = []
        pl_module.round_start(plan.round, [c.client for c in plan.clients])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        pl_module.client_start(batch.client, batch.num_samples)  # one batch = one client

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        upload = pl_module.client_end()
        self._clients_done += 1
        if not all_finite(upload):
            self._diverged(trainer, pl_module, batch.client)
        else:
            stats = dict(upload.stats)
            if self.eval_local_models:
                stats.update(pl_module.local_model_stats(lambda: self._local_eval_loader(trainer)))
            self._local_stats.append((upload.client, stats))
            self._uploads.append(upload)
        if self._clients_done == len(self._mine.clients):
            self._finish_round(trainer, pl_module)

    @property
    def round_client_stats(self) -> list[dict[str, float]]:
        """Per accepted client of that round (of every process), its logged statistics (e.g.
        local_acc), in client order."""
        return [stats for _, stats in self._local_stats]

    def _finish_round(self, trainer, pl_module) -> None:
        collective = Collective.of(trainer)
        local_logs = [pl_module.flush_local_logs()]
        if collective.distributed:
            # One gather of what every process saw: a divergence stops every process together
            # (not one process while the others wait in a collective), and the round's logged
            # means are over every client, whichever process trained it.
            parts = collective.gather({"stats": self._local_stats, "skipped": self._skipped,
                                       "diverged": self._diverged_at, "logs": local_logs,
                                       "accepted": len(self._uploads)})
            self._local_stats = sorted((s for p in parts for s in p["stats"]), key=lambda cs: cs[0])
            self._skipped = sorted(c for p in parts for c in p["skipped"])
            diverged_at = min((p["diverged"] for p in parts if p["diverged"]), default=None)
            accepted = sum(p["accepted"] for p in parts)
            local_logs = [p["logs"][0] for p in parts]
        else:
            diverged_at, accepted = self._diverged_at, len(self._uploads)
        local_logs = pl_module.merge_local_logs(local_logs)
        if diverged_at is not None:
            raise FLDivergedError(f"diverged: non-finite weights at {diverged_at[1]}; "
                                  f"lower the lr or set --federation.on_divergence skip_client")
        if not accepted:
            raise FLDivergedError(f"diverged: every client's upload was non-finite at "
                                  f"{self._where(trainer, pl_module)}")
        lr = pl_module.current_lr()
        uploads = RoundUploads(self._uploads, collective, pl_module.device)
        pl_module.aggregate(uploads)
        self._all_uploads = uploads.gathered() if self.share_round_uploads else list(self._uploads)
        pl_module.commit_kept_states(self._uploads)
        pl_module.sync_client_states(collective)
        if not all_finite(pl_module.aggregated_state()):
            # finite uploads can still aggregate to inf/NaN (a server step size, a control variate,
            # overflow); no client to skip then, so the run stops either way
            raise FLDivergedError(f"diverged: non-finite global model after aggregation at "
                                  f"{self._where(trainer, pl_module)}")
        pl_module.round_end()
        seconds = time.perf_counter() - self._round_started
        samples = sum(c.num_samples * len(c.orders) for c in self._plan.clients)
        metrics = {"round": float(self._plan.round), "lr": lr, "clients/skipped": float(len(self._skipped)),
                   "perf/round_seconds": seconds, "perf/client_updates_per_s": len(self._plan.clients) / seconds,
                   "perf/samples_per_s": samples / seconds}
        metrics.update(local_logs)
        stats = self.round_client_stats
        for key in sorted({k for s in stats for k in s}):
            values = torch.tensor([s[key] for s in stats if key in s], dtype=torch.float64)
            metrics[f"local/{key}_mean"] = float(values.mean())
            if key == "local_acc":
                metrics["local/local_acc_std"] = float(values.std(unbiased=False))
        # With clients in parallel every process now holds the same values (no sync needed);
        # with batch parallelism every process trained every client, so the mean is the value.
        # perf/* is each process's own clock, logged from rank 0.
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1,
                           sync_dist=not collective.distributed and trainer.world_size > 1)

    def _where(self, trainer, pl_module, client: int | None = None) -> str:
        """1-based round, as in the per-round log line."""
        who = "" if client is None else f", client {client}"
        return f"round {self._plan.round + 1}/{trainer.max_epochs}{who}, method {type(pl_module).__name__}"

    def _diverged(self, trainer, pl_module, client: int) -> None:
        where = self._where(trainer, pl_module, client)
        self._mark_summary(trainer, "diverged", where)
        if self.on_divergence == "skip_client":
            rank_zero_info(f"non-finite upload at {where}: skipping this client's upload")
            self._skipped.append(client)
            return
        if clients_in_parallel(trainer):  # the other processes stop with it at the round's end
            self._diverged_at = min(self._diverged_at or (client, where), (client, where))
            return
        raise FLDivergedError(f"diverged: non-finite weights at {where}; "
                              f"lower the lr or set --federation.on_divergence skip_client")

    def _non_finite_evaluation(self, trainer, pl_module, loss: float) -> None:
        """Finite weights can still give a NaN/inf test loss (an overflowing logit, a cosine of a
        zero feature): the model is as unusable as one with NaN weights, so the same policy holds."""
        where = f"round {trainer.current_epoch + 1}/{trainer.max_epochs}, method {type(pl_module).__name__}"
        self._mark_summary(trainer, "diverged", where)
        if self.on_divergence == "stop":
            raise FLDivergedError(f"diverged: the global model's test loss is {loss} (its weights are finite) at "
                                  f"{where}; lower the lr or set --federation.on_divergence skip_client")
        rank_zero_info(f"non-finite global test loss ({loss}) at {where}; training continues "
                       f"(--federation.on_divergence stop ends such runs)")

    @staticmethod
    def _mark_summary(trainer, flag: str, where: str) -> None:
        """W&B summary flags, so dashboards can filter the runs a paper table calls diverged/failed."""
        summary = getattr(getattr(trainer.logger, "experiment", None), "summary", None)
        if summary is not None:
            summary[flag] = True
            summary[f"{flag}_at"] = where

    def _local_eval_loader(self, trainer):
        if self._local_loader is None:
            self._local_loader = trainer.datamodule.global_test_subset_loader(self.local_eval_samples)
        return self._local_loader

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        m = trainer.callback_metrics
        acc, loss = m.get("global/test_acc"), m.get("global/test_loss")
        if acc is not None and loss is not None:
            rank_zero_info(f"round {trainer.current_epoch + 1}/{trainer.max_epochs}: "
                           f"global test acc {float(acc):.4f}, loss {float(loss):.4f}")
            if not math.isfinite(float(loss)) and trainer.state.fn == "fit":
                self._non_finite_evaluation(trainer, pl_module, float(loss))
        if acc is not None and self.collapse_rounds and trainer.state.fn == "fit":
            self._check_collapse(trainer, pl_module, float(acc))

    # ---- "Failed": collapse to chance accuracy -----------------------------------------------
    def chance_accuracy(self, trainer) -> float:
        """The accuracy of always predicting the global test set's most frequent class."""
        if self._chance_acc is None:
            labels = torch.as_tensor(trainer.datamodule.test_set.labels)
            self._chance_acc = float(torch.bincount(labels).max()) / max(len(labels), 1)
        return self._chance_acc

    def _check_collapse(self, trainer, pl_module, acc: float) -> None:
        state, chance = self._collapse, self.chance_accuracy(trainer)
        state["best_acc"] = max(state["best_acc"], acc)
        learned = state["best_acc"] >= chance + 0.1
        state["rounds_at_chance"] = state["rounds_at_chance"] + 1 if learned and acc <= chance + 0.01 else 0
        if state["rounds_at_chance"] < self.collapse_rounds or state["failed_at"]:
            return
        where = f"round {trainer.current_epoch + 1}/{trainer.max_epochs}, method {type(pl_module).__name__}"
        state["failed_at"] = where
        self._mark_summary(trainer, "failed", where)
        message = (f"failed: global test accuracy has been at chance level (<= {chance:.3f} + 0.01, the "
                   f"majority class's share) for {self.collapse_rounds} rounds after reaching "
                   f"{state['best_acc']:.3f}, at {where}")
        if self.on_collapse == "stop":
            raise FLDivergedError(message + "; lower the lr or set --federation.on_collapse mark")
        rank_zero_info(message + "; training continues (--federation.on_collapse stop ends such runs)")

    def state_dict(self) -> dict[str, Any]:
        return dict(self._collapse)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._collapse.update(state_dict)
