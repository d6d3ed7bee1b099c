"""FedAvg per round: fl-lightning against FL-bench (KarhouTam/FL-bench) doing the same work, one
thread, in one process, round by round (the target: no slower). FL-bench is not part of
this project: pass a checkout of it, and a directory holding the packages its modules import that
this project does not install (ray is not needed: FL-bench's serial mode, the one timed here, never
calls it, and a stand-in module takes its import). Written against FL-bench's commit 06e658b: the
harness builds its server without `__init__`, which a later version may extend.

    git clone https://github.com/KarhouTam/FL-bench ../FL-bench
    pip install --target ../flbench-deps omegaconf hydra-core rich nvidia-ml-py
    PYTHONPATH=. python benchmarks/peer_flbench.py --checkout ../FL-bench --deps ../flbench-deps

The same work on both sides, so that both do the same arithmetic (max |dw| of the final weights):
- MNIST-5k, the project's Dirichlet-0.1 partition of 50 clients and its clients each round, the
  same mini-batches in the same order (FL-bench's client DataLoader takes them from the project's
  round plan through a batch sampler), the same initial weights of the project's `fedavg_cnn`;
- SGD 0.01, momentum 0.9, weight decay 1e-5, reset for every client, no learning-rate decay
  (FL-bench has no per-round decay);
- no local-model evaluation (FL-bench's `client_side_evaluation` off; the project's
  `eval_local_models` off); the global model evaluated on the test set once a round (FL-bench's
  centralized evaluation every round, over its clients' test indices: the test set split 50 ways).
FL-bench runs its serial mode with its own defaults otherwise (no log file, no monitor); its
dataset is the digits as tensors without transforms. The project side is a Trainer with the
federated callback only (peer_fedsol.py's (b)). Times are CPU seconds of this process per round,
each project round followed by FL-bench's same round (FL-bench's `train` loop body: client
training, aggregation, centralized test, metrics display); the first round of a run is dropped.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import statistics
import sys
import time
import types
import warnings

import numpy as np
import torch
from peer_fedsol import OPT, SETTING, _EpochBatches, _PairedRounds, bare_fit
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.models import build_model


class _Digits(TensorDataset):
    """Training then test digits as one tensor dataset, as FL-bench's MNIST holds them, with the
    train()/eval() switches its clients and server call (no transforms to switch)."""

    def train(self) -> None:
        pass

    def eval(self) -> None:
        pass


def flbench_modules(checkout: str, deps: str | None):
    """FL-bench's modules this harness uses (OmegaConf, FedAvgServer, initialize_data_loaders), with
    the checkout first on the path and `deps` last."""
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    if deps and deps not in sys.path:
        sys.path.append(deps)  # after this project's packages: only what they lack comes from there
    try:
        import ray  # noqa: F401
    except ImportError:  # imported by FL-bench's trainer for its parallel mode only
        ray = types.ModuleType("ray")
        ray.actor = types.ModuleType("ray.actor")
        ray.actor.ActorHandle = object
        sys.modules["ray"], sys.modules["ray.actor"] = ray, ray.actor
    from omegaconf import OmegaConf
    from src.server.fedavg import FedAvgServer
    from src.utils.functional import initialize_data_loaders

    return OmegaConf, FedAvgServer, initialize_data_loaders


class FLbenchRounds:
    """FL-bench's FedAvg server in its serial mode on the same work (module docstring), one round
    a call. Its server is built without its `__init__` (which needs Hydra's run directory and the
    dataset files FL-bench's generate_data.py writes); the attributes set here are those
    `__init__` sets for this configuration, and the round runs FL-bench's own methods."""

    def __init__(self, checkout: str, deps: str | None):
        OmegaConf, FedAvgServer, initialize_data_loaders = flbench_modules(checkout, deps)
        args = OmegaConf.load(os.path.join(checkout, "config", "defaults.yaml"))
        OmegaConf.update(args, "dataset.name", "mnist")
        for key, value in {"optimizer.lr": OPT["lr"], "optimizer.momentum": OPT["momentum"],
                           "optimizer.weight_decay": OPT["weight_decay"], "lr_scheduler.name": None,
                           "mode": "serial", "common.join_ratio": SETTING["sample_ratio"],
                           "common.batch_size": SETTING["batch_size"], "common.local_epoch": SETTING["local_epochs"],
                           "common.use_cuda": False, "common.client_side_evaluation": False,
                           "common.reset_optimizer_on_global_epoch": True, "common.buffers": "global",
                           "common.test.client.interval": 0, "common.test.client.test": False,
                           "common.test.server.interval": 1, "common.test.server.test": True,
                           "common.verbose_gap": 10**6, "common.monitor": None, "common.save_log": False}.items():
            OmegaConf.update(args, key, value)
        self.dm = dm = FederatedDataModule(**SETTING)
        dm.setup()
        train, test = dm.train_set.tensors(), dm.test_set.tensors()
        n_train, clients = len(train.labels), SETTING["num_clients"]
        test_shares = np.array_split(np.arange(len(test.labels)) + n_train, clients)
        model = build_model("fedavg_cnn", dm.spec)
        model.device = torch.device("cpu")  # FL-bench's DecoupledModel attribute, read by its evaluate_model
        server = FedAvgServer.__new__(FedAvgServer)
        server.args, server.device, server.client_num = args, torch.device("cpu"), clients
        server.train_clients = server.val_clients = server.test_clients = list(range(clients))
        server.model = model
        server.public_model_param_names = [n for n, _ in model.named_parameters()]
        server.public_model_params = collections.OrderedDict((n, p.data.clone()) for n, p in model.named_parameters())
        server.clients_personal_model_params = {i: {} for i in range(clients)}
        server.client_optimizer_states = {i: {} for i in range(clients)}
        server.client_lr_scheduler_states = {i: {} for i in range(clients)}
        server.client_local_epoches = [SETTING["local_epochs"]] * clients
        server.client_metrics = {i: {} for i in range(clients)}
        server.aggregated_client_metrics = {stage: {"train": [], "val": [], "test": []}
                                            for stage in ("before", "after")}
        server.selected_clients, server.current_epoch, server.testing, server.verbose = [], 0, False, False
        server.test_results = {}
        server.dataset = _Digits(torch.cat([train.images, test.images]), torch.cat([train.labels, test.labels]))
        server.client_data_indices = [{"train": dm.client_parts[c].tolist(), "val": [], "test": test_shares[c].tolist()}
                                      for c in range(clients)]
        server.init_trainer()
        (server.trainloader, server.testloader, server.valloader,
         server.trainset, server.testset, server.valset) = initialize_data_loaders(
            server.dataset, server.client_data_indices, args.common.batch_size)
        worker = server.trainer.worker
        load_data_indices = worker.load_data_indices
        self.plan: dict = {}

        def own_batches():  # the client's round-plan batches instead of its shuffled loader
            load_data_indices()
            worker.trainloader = DataLoader(server.dataset, batch_sampler=_EpochBatches(self.plan[worker.client_id]))

        worker.load_data_indices = own_batches
        self.server = server

    def start(self, init: dict) -> None:
        self.server.public_model_params.update({k: v.clone() for k, v in init.items()})
        self.server.model.load_state_dict(self.server.public_model_params, strict=False)

    def global_state(self) -> dict:
        return self.server.public_model_params

    def run_round(self, round_idx: int) -> float:
        """CPU seconds of FL-bench's round `round_idx` (the body of its `FedAvgServer.train`)."""
        s = self.server
        started = time.process_time()
        s.current_epoch = round_idx
        s.verbose = (round_idx + 1) % s.args.common.verbose_gap == 0
        self.plan = {w.client: w for w in self.dm.plan_round(round_idx).clients}
        s.selected_clients = list(self.plan)
        s.train_one_round()
        if s.args.common.test.server.interval > 0 and (round_idx + 1) % s.args.common.test.server.interval == 0:
            s.test_global_model()
        s.display_metrics()
        return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", required=True, help="a checkout of github.com/KarhouTam/FL-bench")
    parser.add_argument("--deps", help="a directory with omegaconf, hydra-core, rich, nvidia-ml-py (pip --target)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.checkout, "src", "server", "fedavg.py")):
        parser.error(f"--checkout {args.checkout}: no src/server/fedavg.py there; "
                     "clone https://github.com/KarhouTam/FL-bench and pass its directory")
    try:
        flbench_modules(args.checkout, args.deps)
    except ImportError as error:
        parser.error(f"FL-bench's modules need {error.name}, which is not installed: pip install --target DIR "
                     "omegaconf hydra-core rich nvidia-ml-py, then pass --deps DIR")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    project, theirs, diff = [], [], 0.0
    for _ in range(args.repeats):
        clock = _PairedRounds(FLbenchRounds(args.checkout, args.deps))
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            bare_fit(args.rounds, clock, lr_decay=1.0, eval_local_models=False)
        project += clock.project[1:]
        theirs += clock.theirs[1:]
        diff = max(diff, clock.max_weight_difference())
    per_round = statistics.median(a / b for a, b in zip(project, theirs, strict=True))
    print(f"FedAvg CNN, MNIST-5k (Dirichlet 0.1, 10 of 50 clients, 5 local epochs, batch 50, no local-model "
          f"evaluation), 1 thread, {args.repeats} runs x {args.rounds - 1} rounds, each round paired with FL-bench's")
    print(f"  the federated callback only: {sum(project) / len(project):.3f} s/round against FL-bench "
          f"{sum(theirs) / len(theirs):.3f}: {sum(project) / sum(theirs):.3f}x over all rounds, per round median "
          f"{per_round:.3f}x (target <= 1.00)  max|dw| {diff:.1e}")


if __name__ == "__main__":
    main()
