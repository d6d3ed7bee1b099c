"""FedAvg per round: fl-lightning against the official FedSOL code (Lee-Gihun/FedSOL, the paper's
authors) doing the same work, one thread, in one process, runs alternating (issue 22's target:
no slower). The official code is not part of this project: pass a checkout of it.

    git clone https://github.com/Lee-Gihun/FedSOL ../FedSOL
    PYTHONPATH=. python benchmarks/peer_fedsol.py --checkout ../FedSOL [--rounds 7] [--repeats 3]

The same work on both sides, so that both do the same arithmetic (the final global weights are
compared, max |dw|):
- MNIST-5k, the project's Dirichlet-0.1 partition of 50 clients, 10 clients a round: the
  official sampler is replaced by the project's round plan, so both train the same clients;
- the same mini-batches in the same order: the official client's DataLoader (over the training
  tensors, batch 50, no workers) takes its batches from the round plan through a batch sampler;
- the project's `fedavg_cnn` with the same initial weights (the official MNIST CNN repeats the
  digit into 3 channels: more arithmetic in its first layer than the project's);
- SGD 0.01 (momentum 0.9, weight decay 1e-5) decayed 0.99 a round (the official StepLR);
- every local model evaluated on the same 300 test digits (the official client also evaluates
  on its own training data: left out here), the global model on the test set once a round.
Two choices favour the official code: W&B is disabled there (its `wandb.log` is a no-op), and its
DataLoaders read tensors (its own pipeline decodes PIL images with augmentation in 5 workers).

The project runs twice: (a) `fl-lightning fit` on configs/settings/mnist5k.yaml as a user runs it,
every default on (W&B offline, the round checkpoint, divergence statistics and their heatmap every
5 rounds, metrics.csv / clients.csv / summary.json); (b) a Trainer with the federated callback
only (the official code's work, no more). Times are CPU seconds of this process per round, start
to start (the last round to the end of training); the first round of every run is dropped. Each
project round is set against the official code's same round (same clients, same batches): the
ratio of the sums over rounds and repeats (which counts (a)'s heatmap rounds), and the median of
the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
import types
import warnings

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg
from fl_lightning.models import build_model

OPT = dict(lr=0.01, momentum=0.9, weight_decay=1e-5)
LR_DECAY = 0.99
LOCAL_EVAL_SAMPLES = 300  # configs/settings/mnist5k.yaml's federation.local_eval_samples
SETTING = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
               partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)  # = configs/settings/mnist5k.yaml
USER_RUN = ["fit", "--config", "configs/settings/mnist5k.yaml"]


class _RoundStarts:
    """CPU time at each round's start (the federated callback's epoch start) and at the end of
    training (after every callback's last epoch end), and the global model's first and last
    weights, of the fits run inside the `with` block."""

    def __init__(self):
        self.marks: list[float] = []
        self.init: dict | None = None
        self.module = None

    def __enter__(self):
        self._start = FederatedCallback.on_train_epoch_start
        start, clock = self._start, self

        def on_train_epoch_start(callback, trainer, module):
            clock.marks.append(time.process_time())
            if clock.init is None:
                clock.init = {k: v.clone() for k, v in module.model.state_dict().items()}
            clock.module = module
            return start(callback, trainer, module)

        def on_train_end(callback, trainer, module):
            clock.marks.append(time.process_time())

        FederatedCallback.on_train_epoch_start = on_train_epoch_start
        FederatedCallback.on_train_end = on_train_end
        return self

    def __exit__(self, *exc):
        FederatedCallback.on_train_epoch_start = self._start
        del FederatedCallback.on_train_end  # the base class's no-op again

    def result(self) -> tuple[list[float], dict, dict]:
        times = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return times, self.init, {k: v.clone() for k, v in self.module.model.state_dict().items()}


def user_fit(rounds: int):
    """(a): `fl-lightning fit` on the demo setting, in this process, every default on."""
    from fl_lightning.cli import main as fl_lightning

    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as run_dir, _RoundStarts() as clock, open(os.devnull, "w") as quiet, \
            contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        fl_lightning([*USER_RUN, "--trainer.max_epochs", str(rounds), "--trainer.default_root_dir", run_dir])
    return clock.result()


def bare_fit(rounds: int):
    """(b): a Trainer with the federated callback only (local models evaluated on 300 digits)."""
    torch.manual_seed(0)
    dm = FederatedDataModule(**SETTING)
    module = FedAvg(model="fedavg_cnn", data_spec=dm.spec, lr_decay=LR_DECAY, **OPT)
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(local_eval_samples=LOCAL_EVAL_SAMPLES)])
    with _RoundStarts() as clock:
        trainer.fit(module, dm)
    return clock.result()


class _EpochBatches:
    """A batch sampler that gives a client's round-plan batches one local epoch per iteration,
    as the official client iterates its train loader once per local epoch."""

    def __init__(self, work):
        self.epochs = [[order[s : s + work.batch_size].tolist() for s in range(0, len(order), work.batch_size)]
                       for order in work.orders]
        self.epoch = 0

    def __iter__(self):
        batches = self.epochs[self.epoch]
        self.epoch += 1
        return iter(batches)

    def __len__(self):
        return len(self.epochs[self.epoch])


def official_fit(checkout: str, rounds: int, init: dict):
    """The official FedSOL code's FedAvg `Server.run` on the same work (module docstring)."""
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    import algorithms.BaseServer as base_server
    from algorithms.fedavg import Server
    from algorithms.measures import evaluate_model_on_loaders

    base_server.wandb = types.SimpleNamespace(log=lambda *args, **kwargs: None)  # W&B disabled
    dm = FederatedDataModule(**SETTING)
    dm.setup()
    train, test = dm.train_set.tensors(), dm.test_set.tensors()
    train_set = TensorDataset(train.images, train.labels)
    eval_batch = dm.hparams.eval_batch_size
    # the project's fixed 300-digit subset (FederatedDataModule.global_test_subset_loader)
    subset = np.sort(np.random.default_rng(SETTING["partition_seed"]).choice(len(test.labels), LOCAL_EVAL_SAMPLES,
                                                                            replace=False))
    local_test = DataLoader(TensorDataset(test.images[subset], test.labels[subset]), batch_size=eval_batch)
    model = build_model("fedavg_cnn", dm.spec)
    model.load_state_dict(init)
    optimizer = torch.optim.SGD(model.parameters(), **OPT)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=LR_DECAY)
    clients = range(SETTING["num_clients"])
    data = {"num_classes": dm.spec.num_classes,
            "global": {"test": DataLoader(TensorDataset(test.images, test.labels), batch_size=eval_batch)},
            "partition_map": {c: dm.client_parts[c] for c in clients},
            "local_sizes": {c: len(dm.client_parts[c]) for c in clients},
            "local": {c: {"train": None, "test": local_test} for c in clients}}
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        server = Server({}, model, data, optimizer, scheduler, n_rounds=rounds,
                        sample_ratio=SETTING["sample_ratio"], local_epochs=SETTING["local_epochs"], device="cpu")
    marks, plans = [], {}

    def client_sampling(round_idx):  # the project's clients, and the round's start
        marks.append(time.process_time())
        plans[round_idx] = {w.client: w for w in dm.plan_round(round_idx).clients}
        return list(plans[round_idx])

    def set_client_data(client_idx):
        work = plans[len(marks) - 1][client_idx]
        server.client.datasize = data["local_sizes"][client_idx]
        server.client.local_loaders = {"train": DataLoader(train_set, batch_sampler=_EpochBatches(work)),
                                       "test": local_test}

    def local_stats():  # the local model on the 300 test digits only
        return evaluate_model_on_loaders(server.client.model, {"test": local_test}, "cpu", "Local")

    server._client_sampling, server._set_client_data = client_sampling, set_client_data
    server.client._get_local_stats = local_stats
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        server.run()
    marks.append(time.process_time())
    times = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return times, server.server_model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", required=True, help="a checkout of github.com/Lee-Gihun/FedSOL")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.checkout, "algorithms", "BaseServer.py")):
        parser.error(f"--checkout {args.checkout}: no algorithms/BaseServer.py there; "
                     "clone https://github.com/Lee-Gihun/FedSOL and pass its directory")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    project, official = {"user": [], "bare": []}, {"user": [], "bare": []}
    diff = {"user": 0.0, "bare": 0.0}
    for _ in range(args.repeats):  # alternating: the machine's drift meets every side
        for side, fit in (("user", user_fit), ("bare", bare_fit)):
            project_times, init, final = fit(args.rounds)
            official_times, official_final = official_fit(args.checkout, args.rounds, init)
            project[side] += project_times[1:]
            official[side] += official_times[1:]
            diff[side] = max(diff[side], max(float((final[k] - official_final[k]).abs().max()) for k in final))
    med = statistics.median
    print(f"FedAvg CNN, MNIST-5k (Dirichlet 0.1, 10 of 50 clients, 5 local epochs, batch 50), 1 thread, "
          f"{args.repeats} repeats x {args.rounds - 1} rounds a side, each round against the official code's "
          f"same round (the clients' data, so a round's time, differ from round to round)")
    for side, what in (("user", "(a) fl-lightning fit, every default on"),
                       ("bare", "(b) the federated callback only        ")):
        p, q = project[side], official[side]
        per_round = med(a / b for a, b in zip(p, q, strict=True))
        print(f"  {what}: {sum(p) / len(p):.3f} s/round against {sum(q) / len(q):.3f}: {sum(p) / sum(q):.3f}x "
              f"the official code over all rounds, per round median {per_round:.3f}x "
              f"(target <= 1.00)  max|dw| {diff[side]:.1e}")

if __name__ == "__main__":
    main()
