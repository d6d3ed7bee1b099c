"""The round: a Lightning Callback that turns one training epoch into one communication round.

It knows no method by name. At round start it asks the method to take the global state; one
Trainer batch is one client, so before each batch it starts that client and after it collects the
client's upload, checks it is finite and stores the state the client keeps; after the round's last
client it asks the method's server step for its result (`uploads.ServerUpdate`), checks it,
applies it, syncs the client states between processes and logs the round, before Lightning's
validation loop evaluates the new global model. What the method uploads and how the server
combines it is entirely the method's business (`methods/base.py`).

It also decides the run's outcome (`outcome.py`) where the decision is the round's: a diverged
round (NaN/inf uploads, a NaN/inf server step, a NaN/inf test loss) and a collapse to chance
accuracy (the papers' "Failed"). Every process takes the same decision (the round's facts are
gathered, and the decision is reduced across processes as Lightning's EarlyStopping does), and a
run that must stop stops through `trainer.should_stop`, never by raising, so every process ends
the same way, with the same summary and exit code. What each round did is published as
`round_report` (the round's clients, uploads, per-client rows and metrics), which the other
callbacks read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from fl_lightning import compat, vectorized
from fl_lightning.data.datamodule import clients_per_round
from fl_lightning.errors import FLUserError
from fl_lightning.evaluation import BestAccuracy
from fl_lightning.loss_scaling import agree_on_scale, scaler_of
from fl_lightning.outcome import Outcome
from fl_lightning.parallel import ClientParallelStrategy, Collective, check_process_count
from fl_lightning.round_decision import Collapse, Decision, Policy, RoundFacts, decide
from fl_lightning.round_metrics import log_round_metrics
from fl_lightning.state import ServerState
from fl_lightning.uploads import ClientUpload, RoundUploads, ServerUpdate, all_finite

CLIENT_COLUMNS = ("client", "samples", "local_acc", "local_loss", "drift", "train_loss", "skipped")
LOCAL_CLASS_ACC = "local_class_acc"


@dataclass
class RoundReport:
    """What one round did, for the callbacks that follow the round callback (analysis, results).

    Attributes:
        round: 1-based.
        completed: the round's server step was applied and its model evaluated (False for a round
            that stopped the run before its server step).
        uploads: the accepted uploads (every process's when `share_round_uploads` is set, else
            this process's), complete from the end of the round's last client.
        clients: one row per client of the round, every process's, in client order:
            `CLIENT_COLUMNS` (a skipped client has `skipped` 1 and no measures), and in rounds a
            callback asked for it (`local_class_accuracy`) `LOCAL_CLASS_ACC`: the local model's
            accuracy per class on the same test subset (a list, not averaged nor written to clients.csv).
        metrics: the round's logged values (`round`, `lr`, `perf/*`, `local/*` means, the server
            step's metrics).
    """

    round: int
    completed: bool = False
    uploads: list[ClientUpload] = field(default_factory=list)
    clients: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class OutcomeRecord:
    """The run's outcome as the round callback decided it (checkpointed with the callback).

    `marks` are what was seen without stopping the run (a NaN test loss under skip_client, a
    collapse under on_collapse mark): they decide the outcome of a run that runs to its end."""

    outcome: Outcome = Outcome.RUNNING
    reason: str = ""  # the one line that says why (for a stop: the `error:` line)
    round: int | None = None
    stopped: bool = False  # ended early by a decision (exit code 3)
    marks: dict[str, str] = field(default_factory=dict)

    def final_outcome(self) -> Outcome:
        """A run that ran every round: diverged or failed if marked so (diverged first), else finished."""
        for mark in (Outcome.DIVERGED, Outcome.FAILED):
            if mark.value in self.marks:
                return mark
        return Outcome.FINISHED


class FederatedCallback(L.Callback):
    """Drives clients and the server step inside Lightning's fit loop.

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
        on_collapse: "mark" prints one line and marks the run failed (summary.json, the W&B
            summary) and trains on; "stop" also ends the run (exit code 3).
        client_cache_size: clients whose persistent state (control variates, personal models,
            heterogeneous client models) stays in memory; the others wait in per-client files in
            the run directory (0 = all in memory). Results do not depend on it.
        parallel: with several processes (`--trainer.strategy ddp` and devices/nodes > 1),
            "clients" spreads each round's clients over the processes (parallel.py; the default:
            federated clients are small, and splitting their batches cannot beat one device);
            "batch" splits every client's mini-batches across the processes instead (DDP's usual
            data parallelism, for settings with one large client batch).
        collective_timeout: seconds a process waits in a collective (the round's gather and
            reductions) for the others before the run ends as lost. Processes meet once a round,
            so a wait is at most the slowest process's share of a round, plus rank 0's analyses
            (`--analysis.every_n_rounds`) and the round checkpoint; raise it for analyses of large
            models. (On one machine a process that dies is noticed at once, see cli.py.)
        engine: how a round's clients train: "sequential" (one after the other, every method) or
            "vectorized" (together, as one step over stacked parameters, for the methods that
            declare it: vectorized.py, which says what it refuses).
        engine_group: with the vectorized engine, the clients trained together at most: 0 all of
            a round's clients on this process, N at most N (lower it when they do not fit in
            memory), 1 each client alone with the sequential engine's step. Not given: all,
            except a model with convolutions on a CPU, whose clients then train one at a time
            (vectorized.group_size says why).
    """

    def __init__(self, eval_local_models: bool = True, local_eval_samples: int = 1000,
                 on_divergence: Literal["stop", "skip_client"] = "stop", collapse_rounds: int = 5,
                 on_collapse: Literal["mark", "stop"] = "mark", client_cache_size: int = 0,
                 parallel: Literal["clients", "batch"] = "clients", collective_timeout: float = 1800.0,
                 engine: Literal["sequential", "vectorized"] = "sequential", engine_group: int | None = None):
        super().__init__()
        if engine not in vectorized.ENGINES:
            raise FLUserError(f"federation.engine must be one of {', '.join(vectorized.ENGINES)}, got '{engine}'")
        if engine_group is not None and engine_group < 0:
            raise FLUserError(f"--federation.engine_group must be >= 0 (0 = all of a round's clients), "
                              f"got {engine_group}")
        if client_cache_size < 0:
            raise FLUserError(f"--federation.client_cache_size must be >= 0 (0 = all in memory), got "
                              f"{client_cache_size}")
        if collapse_rounds < 0:
            raise FLUserError(f"--federation.collapse_rounds must be >= 0 (0 = off), got {collapse_rounds}")
        if local_eval_samples < 0:
            raise FLUserError(f"--federation.local_eval_samples must be >= 0 (0 = the whole test set), "
                              f"got {local_eval_samples}")
        if not collective_timeout > 0:
            raise FLUserError(f"--federation.collective_timeout must be > 0 seconds, got {collective_timeout}")
        self.eval_local_models, self.local_eval_samples = eval_local_models, local_eval_samples
        self.policy = Policy(on_divergence, on_collapse, collapse_rounds)  # what the round's facts decide
        self.client_cache_size, self.parallel = client_cache_size, parallel
        self.collective_timeout = collective_timeout
        self.engine, self.engine_group = engine, engine_group
        self.record = OutcomeRecord()
        self.best = BestAccuracy()  # the run's accuracy (the method's accuracy_key)
        self._rounds_at_chance = 0
        self._chance_acc: float | None = None
        # set by a callback that reads every client's upload each round (analysis divergence): with
        # clients in parallel the uploads are then gathered to every process after the server step
        self.share_round_uploads = False
        # set by a callback that needs every local model's per-class accuracy this round (the
        # analysis' class-wise heatmap): the local-model evaluation counts per class too, instead
        # of that callback evaluating every uploaded model again
        self.local_class_accuracy = False
        self.round_report = RoundReport(round=0)
        self._local_loader = None

    # ---- set-up -------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            compat.destroy_process_group_at_exit()  # the strategy has just made it
        # The module in the precision's dtype before a checkpoint is restored into it: Lightning
        # restores first and converts later, so a float64 (64-true) checkpoint would be rounded
        # through float32 parameters and buffers on every resume, validate and test.
        trainer.precision_plugin.convert_module(pl_module)
        # Per-client state files go next to the checkpoints (so a checkpoint only names them):
        # into the run's checkpoint folder, or beside the checkpoint being evaluated (validate,
        # test), or, for a bounded cache without checkpoints, into the run directory. Set before a
        # checkpoint is restored (Lightning restores after `setup`).
        directory = None
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and getattr(checkpoint, "dirpath", None):
            directory = Path(checkpoint.dirpath) / "client_states"
        elif trainer.ckpt_path:
            directory = Path(trainer.ckpt_path).parent / "client_states"
        elif self.client_cache_size:
            directory = Path(trainer.default_root_dir) / "client_states"
        pl_module.configure_client_stores(directory, self.client_cache_size, rank=trainer.global_rank)
        self._set_engine(trainer, pl_module, stage)

    def _set_engine(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        """The vectorised engine, for a fit that asks for it and can run it (else one line)."""
        engine = None
        if self.engine == "vectorized" and stage == "fit":
            reason = vectorized.refusal(trainer, pl_module)
            if reason is not None:
                raise FLUserError(reason)
            group = vectorized.group_size(self.engine_group, trainer, pl_module)
            if group == 1:  # a client alone: the sequential engine's step is the vectorised one's
                if self.engine_group is None:
                    rank_zero_info(vectorized.ONE_AT_A_TIME.format(model=pl_module.hparams.get("model", "?")))
            else:
                engine = vectorized.VectorizedEngine(group)
        pl_module.steps.engine = engine

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.reload_dataloaders_every_n_epochs != 1:
            raise FLUserError("federated training needs trainer.reload_dataloaders_every_n_epochs=1 "
                              "(every round has its own clients)")
        if not hasattr(trainer.datamodule, "round_plan"):
            raise FLUserError("federated training needs a FederatedDataModule as data")
        self._check_parallel(trainer)
        if self.record.stopped:
            # a run a decision stopped (diverged, failed) is over: resuming it completes its records
            trainer.should_stop = True
        elif self.record.outcome.final and (self.record.round or 0) < trainer.max_epochs:
            # a finished run resumed with more rounds (--trainer.max_epochs raised) trains on
            self.record = OutcomeRecord(marks=dict(self.record.marks))

    def _check_parallel(self, trainer) -> None:
        if trainer.world_size == 1 or self.parallel == "batch":
            return
        if not isinstance(trainer.strategy, ClientParallelStrategy):
            raise FLUserError(f"--federation.parallel clients runs with --trainer.strategy ddp (got "
                              f"{type(trainer.strategy).__name__}); or set --federation.parallel batch")
        dm = trainer.datamodule
        check_process_count(trainer.world_size, clients_per_round(dm.hparams.num_clients, dm.hparams.sample_ratio))

    # ---- the round ----------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module) -> None:
        dm = trainer.datamodule
        plan = dm.round_plan
        if plan is None or plan.round != trainer.current_epoch:
            raise RuntimeError(f"round plan is for round {getattr(plan, 'round', None)}, "
                               f"not {trainer.current_epoch}")
        self._plan = plan
        self._mine = getattr(dm, "rank_plan", None) or plan  # this process's clients
        compat.keep_validation_data(trainer)
        self._round_started = time.perf_counter()
        self._uploads: list[ClientUpload] = []
        self._rows: list[dict[str, float]] = []
        self._loss_spans: list[tuple[dict[str, float], dict[str, int], dict[str, int]]] = []
        self.round_report = RoundReport(round=plan.round + 1)
        pl_module.round_start(plan.round, [c.client for c in plan.clients])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        pl_module.client_start(batch.client, batch.num_samples)  # one batch = one client
        self._log_mark = pl_module.local_log_position()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        upload = pl_module.client_end()
        row: dict[str, float] = {"client": upload.client, "samples": upload.num_samples, "skipped": 0}
        if not all_finite(upload):
            row["skipped"] = 1  # left out of the server step; `decide` says whether the run goes on
        else:
            if upload.kept:  # the state the client keeps: stored now that its upload is accepted
                pl_module.client_states[upload.client] = upload.kept
                upload.kept = {}
            row.update(upload.stats)
            # its mean training loss is taken when the round ends, with the others' in a row, where
            # the local-log buffers are read once for every client
            self._loss_spans.append((row, self._log_mark, pl_module.local_log_position()))
            if self.eval_local_models:
                row.update(pl_module.local_model_stats(lambda: self._local_eval_loader(trainer),
                                                       per_class=self.local_class_accuracy))
            self._uploads.append(upload)
        self._rows.append(row)
        if len(self._rows) == len(self._mine.clients):
            self._finish_round(trainer, pl_module)

    def _finish_round(self, trainer, pl_module) -> None:
        """After the round's last client: gather the round's facts, decide, take the server step,
        decide again, then apply the step or stop."""
        collective = Collective.of(trainer)
        rows, local_logs = self._gather_round(trainer, pl_module, collective)
        self.round_report.clients = rows
        facts = RoundFacts(self._plan.round + 1, trainer.max_epochs, type(pl_module).__name__, clients=len(rows),
                           nonfinite_clients=tuple(int(r["client"]) for r in rows if r["skipped"]))
        decision = decide(facts, self.policy)
        for client in decision.skipped:
            rank_zero_info(f"non-finite upload at {facts.where(client)}: skipping this client's upload")
        if self._agreed(trainer, not decision.stops):
            lr = pl_module.current_lr()
            uploads = RoundUploads(self._uploads, collective, pl_module.device)
            update = pl_module.server_step(uploads)
            facts = replace(facts, server_step_finite=self._agreed(trainer, _update_finite(update, pl_module.server)))
        elif not decision.stops:
            facts = replace(facts, refused_elsewhere=True)
        decision = decide(facts, self.policy)
        if decision.stops:
            self._apply(trainer, pl_module, decision, facts)
            return
        pl_module.apply_server_update(update)
        self.round_report.uploads = uploads.gathered() if self.share_round_uploads else list(self._uploads)
        self.round_report.completed = True
        pl_module.client_states.sync(collective)
        pl_module.round_end()
        self._log_round(trainer, pl_module, lr, update, pl_module.merge_local_logs(local_logs), collective)

    def _gather_round(self, trainer, pl_module, collective: Collective) -> tuple[list[dict[str, float]], list]:
        """The round's client rows (in client order) and local logs, every process's: one gather,
        so that every process takes the same decision and the round's logged means are over every
        client, whichever process trained it. The processes' loss scalers agree too."""
        for row, since, until in self._loss_spans:  # each accepted client's local steps
            train_loss = pl_module.local_log_means(since, until).get("train/loss")
            if train_loss is not None:
                row["train_loss"] = train_loss
        rows, local_logs = self._rows, [pl_module.flush_local_logs()]
        if collective.distributed:
            scaler = scaler_of(trainer)
            parts = collective.gather({"rows": rows, "logs": local_logs,
                                       "scaler": None if scaler is None else scaler.state_dict()})
            rows = [r for p in parts for r in p["rows"]]
            local_logs = [p["logs"][0] for p in parts]
            if scaler is not None:
                agree_on_scale(scaler, [p["scaler"] for p in parts])
        rows.sort(key=lambda r: r["client"])
        return rows, local_logs

    def _log_round(self, trainer, pl_module, lr: float, update: ServerUpdate, local_logs: dict[str, float],
                   collective: Collective) -> None:
        seconds = time.perf_counter() - self._round_started
        samples = sum(c.num_samples * len(c.orders) for c in self._plan.clients)
        rows = self.round_report.clients
        metrics = {"round": float(self._plan.round + 1), "lr": lr,
                   "clients/skipped": float(sum(r["skipped"] for r in rows)),
                   "perf/round_seconds": seconds, "perf/client_updates_per_s": len(self._plan.clients) / seconds,
                   "perf/samples_per_s": samples / seconds}
        metrics.update(local_logs)
        metrics.update(update.metrics)
        measured = [r for r in rows if not r["skipped"]]
        for key in sorted({k for r in measured for k in r} - {*CLIENT_COLUMNS[:2], "skipped", "train_loss",
                                                                  LOCAL_CLASS_ACC}):
            values = torch.tensor([r[key] for r in measured if key in r], dtype=torch.float64)
            metrics[f"local/{key}_mean"] = float(values.mean())
            if key == "local_acc":
                metrics["local/local_acc_std"] = float(values.std(unbiased=False))
        self.round_report.metrics = metrics
        # With clients in parallel every process now holds the same values (no sync needed);
        # with batch parallelism every process trained its share of every client's batches, so
        # the mean over processes is the value. perf/* is each process's own clock.
        log_round_metrics(trainer, metrics, mean_over_processes=not collective.distributed and trainer.world_size > 1)

    def _agreed(self, trainer, ok: bool) -> bool:
        """True when every process says ok (one reduction; every process gets the same answer)."""
        return bool(trainer.strategy.reduce_boolean_decision(bool(ok), all=True))

    def _apply(self, trainer, pl_module, decision: Decision, facts: RoundFacts) -> None:
        """Records the decision's marks (where: the round's) and, for a stop, ends the run after
        this round (EarlyStopping's way: `should_stop`, not an exception)."""
        for outcome, message in decision.marks:
            if outcome.value not in self.record.marks:
                self.record.marks[outcome.value] = facts.where()
                rank_zero_info(message)
        if not decision.stops:
            return
        self.record = OutcomeRecord(decision.outcome, decision.reason, facts.round, stopped=True,
                                    marks=dict(self.record.marks))
        trainer.should_stop = True
        if not decision.round_completed:
            # the round never reached its server step: the model goes back to the round's start,
            # nothing of the round is evaluated, logged or checkpointed
            pl_module.abandon_round()
            compat.skip_next_validation(trainer)
            self.round_report.completed = False

    def _local_eval_loader(self, trainer):
        if self._local_loader is None:
            dm = trainer.datamodule
            self._local_loader = dm.batches_of(dm.global_test_subset_loader(self.local_eval_samples))
        return self._local_loader

    # ---- after the round's evaluation ---------------------------------------------------------
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0 or trainer.state.fn != "fit":
            return
        acc, loss = self._evaluation(trainer, pl_module)
        if acc is not None:
            label = "client test acc" if pl_module.accuracy_key.startswith("clients/") else "global test acc"
            rank_zero_info(f"round {trainer.current_epoch + 1}/{trainer.max_epochs}: {label} {acc:.4f}, "
                           f"loss {loss:.4f}")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.record.stopped:
            return
        round_number = self.round_report.round
        acc, loss = self._evaluation(trainer, pl_module)
        if acc is not None:
            self.best.update(acc, round_number)
        if self.best.round is not None:
            group = pl_module.accuracy_key.split("/")[0]
            log_round_metrics(trainer, {f"{group}/best_test_acc": self.best.value,
                                        f"{group}/best_round": float(self.best.round)})
        facts = RoundFacts(round_number, trainer.max_epochs, type(pl_module).__name__, server_step_finite=True,
                           test_loss=loss,
                           test_loss_finite=loss is None or self._agreed(trainer, math.isfinite(loss)))
        decision = decide(facts, self.policy)
        if not decision.stops and acc is not None and self.policy.collapse_rounds and self._collapsed(trainer, acc):
            decision = decide(replace(facts, collapse=Collapse(self.chance_accuracy(trainer), self.best.value)),
                              self.policy)
        self._apply(trainer, pl_module, decision, facts)
        if decision.stops:
            return
        if round_number >= trainer.max_epochs:
            self.record.outcome = self.record.final_outcome()
            self.record.round = round_number

    def _evaluation(self, trainer, pl_module) -> tuple[float | None, float | None]:
        """The round's accuracy (the method's `accuracy_key`) and the matching test loss."""
        metrics = trainer.callback_metrics
        key = pl_module.accuracy_key
        acc, loss = metrics.get(key), metrics.get(key.replace("_acc", "_loss"))
        return (None if acc is None else float(acc)), (None if loss is None else float(loss))

    # ---- "Failed": collapse to chance accuracy -----------------------------------------------
    def chance_accuracy(self, trainer) -> float:
        """The accuracy of always predicting the global test set's most frequent class."""
        if self._chance_acc is None:
            labels = torch.as_tensor(trainer.datamodule.test_set.labels)
            self._chance_acc = float(torch.bincount(labels).max()) / max(len(labels), 1)
        return self._chance_acc

    def _collapsed(self, trainer, acc: float) -> bool:
        """True in the round the collapse is first confirmed (once per run)."""
        chance = self.chance_accuracy(trainer)
        learned = self.best.value >= chance + 0.1
        self._rounds_at_chance = self._rounds_at_chance + 1 if learned and acc <= chance + 0.01 else 0
        confirmed = (self._rounds_at_chance >= self.policy.collapse_rounds
                     and Outcome.FAILED.value not in self.record.marks)
        return not self._agreed(trainer, not confirmed)

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        r = self.record
        return {"outcome": r.outcome.value, "reason": r.reason, "round": r.round, "stopped": r.stopped,
                "marks": dict(r.marks), "best": self.best.state_dict(), "rounds_at_chance": self._rounds_at_chance}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.record = OutcomeRecord(Outcome(state_dict.get("outcome", "running")), state_dict.get("reason", ""),
                                    state_dict.get("round"), bool(state_dict.get("stopped", False)),
                                    dict(state_dict.get("marks", {})))
        self.best.load_state_dict(state_dict.get("best", {}))
        self._rounds_at_chance = int(state_dict.get("rounds_at_chance", 0))


def _update_finite(update: ServerUpdate, server: ServerState) -> bool:
    tensors = {str(i): t for i, t in enumerate(server.tensors_of(update.server_state))}
    return all_finite(update.global_state or {}) and all_finite(tensors)


def callback_of(trainer, kind: type[L.Callback]):
    """The trainer's first callback of type `kind`, or None."""
    return next((c for c in trainer.callbacks if isinstance(c, kind)), None)


def federation_of(trainer) -> FederatedCallback | None:
    """The run's round callback (the public per-round report other callbacks read)."""
    return callback_of(trainer, FederatedCallback)


def federation_before(trainer, callback: L.Callback) -> FederatedCallback | None:
    """The run's round callback, checked to come before `callback` among the trainer's callbacks.

    Lightning calls a hook on the callbacks in their order. The results and analysis callbacks
    read, in their `on_train_epoch_end`, what the round callback decided in its own (the round's
    report, the run's outcome), and the analysis callback sets at a round's start what the round
    callback reads during the round: run before it, they would read the previous round's."""
    federation = federation_of(trainer)
    callbacks = list(trainer.callbacks)
    if federation is not None and callbacks.index(federation) > callbacks.index(callback):
        raise RuntimeError(f"{type(callback).__name__} must come after FederatedCallback in trainer.callbacks: it "
                           f"reads the round's report in the same hooks")
    return federation
