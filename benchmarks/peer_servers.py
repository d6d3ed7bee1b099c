"""The two peer codebases' servers (the official FedSOL code, FL-bench) on a description of the
work, importable without fl_lightning or Lightning, so that a peer can also run as a process of its
own that imports only torch, numpy and the peer's modules, as a user of that codebase meets it.

The work (`Work`): the training and test digits as tensors, each client's sample indices, every
round's clients with the order of each client's samples in each local epoch (cut into batches of
`batch_size`), the 300 test digits local models are evaluated on, the optimiser's settings and the
initial weights. peer_fedsol.py and peer_flbench.py describe the project's round plan this way and
run a peer round by round in their own process; peer_process.py writes the description to a file
and runs this module as the peer's process:

    python benchmarks/peer_servers.py fedsol --checkout ../FedSOL --work work.pt --out final.pt
    python benchmarks/peer_servers.py flbench --checkout ../FL-bench --deps ../flbench-deps \
        --work work.pt --out final.pt

It builds the peer's server on the work, runs every round of it, prints "round 1/R: global test acc
..." right after round 1's evaluation and the same line for the last round, saves the final global
weights to `--out` and exits.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import os
import sys
import time
import types

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OFFICIAL_PARAMS = {"fedavg": {}, "fedsol": {"rho": 2.0, "perturb_head": True, "perturb_body": False}}
OFFICIAL_SERVER = {"fedavg": "algorithms.fedavg", "fedsol": "algorithms.fedsol_adaptive"}


@dataclasses.dataclass
class Work:
    """What both sides do (module docstring). `rounds[r]` lists round r's clients as dicts with
    `client`, `batch_size` and `orders` (one index tensor per local epoch)."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    client_parts: list  # one index tensor per client
    local_test: torch.Tensor  # indices into the test set: the digits local models are evaluated on
    rounds: list
    init: dict  # the global model's initial weights
    num_classes: int
    sample_ratio: float
    local_epochs: int
    eval_batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    lr_decay: float

    def save(self, path: str) -> None:
        torch.save(dataclasses.asdict(self), path)

    @classmethod
    def load(cls, path: str) -> Work:
        return cls(**torch.load(path, weights_only=True))  # tensors, numbers and lists only

    def plan(self, round_idx: int) -> dict:
        """Round `round_idx`'s clients: client id -> its work (attributes client, batch_size, orders)."""
        return {w["client"]: types.SimpleNamespace(**w) for w in self.rounds[round_idx]}

    @property
    def opt(self) -> dict:
        return dict(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


class FedAvgCNN(nn.Module):
    """fl-lightning's `fedavg_cnn` (fl_lightning/models/cnn.py) in plain torch, with the same
    parameter names, for the peer's process, which does not import fl_lightning (peer_process.py
    checks that both give the same logits from the same weights)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, hidden: int = 512):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(64 * (image_size // 4) ** 2, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.body(x)))


class _EpochBatches:
    """A batch sampler that gives a client's round-plan batches one local epoch per iteration,
    as the peers' clients iterate their train loader once per local epoch."""

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


class _AlgoParams(dict):
    """The official code's configuration object: its servers read `params["rho"]`, its clients
    `params.perturb_head`."""

    def __getattr__(self, key):
        return self[key]


class OfficialRounds:
    """The official FedSOL code's FedAvg or FedSOL (adaptive) server on `work`, one round a call:
    its `run` loop body, step by step (client sampling, client training, aggregation, global
    evaluation, its results and log calls, the scheduler step). Its sampler, its clients' data and
    its local statistics are replaced: the work's clients, batches and 300 test digits."""

    def __init__(self, checkout: str, method: str, work: Work, model: nn.Module):
        if checkout not in sys.path:
            sys.path.insert(0, checkout)
        import algorithms.BaseServer as base_server
        from algorithms.measures import evaluate_model_on_loaders

        Server = importlib.import_module(OFFICIAL_SERVER[method]).Server

        base_server.wandb = types.SimpleNamespace(log=lambda *args, **kwargs: None)  # W&B disabled
        self.evaluate = evaluate_model_on_loaders
        self.work = work
        self.train_set = TensorDataset(work.train_images, work.train_labels)
        test, subset = (work.test_images, work.test_labels), work.local_test
        self.local_test = DataLoader(TensorDataset(test[0][subset], test[1][subset]), batch_size=work.eval_batch_size)
        optimizer = torch.optim.SGD(model.parameters(), **work.opt)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=work.lr_decay)
        clients = range(len(work.client_parts))
        self.data = {"num_classes": work.num_classes,
                     "global": {"test": DataLoader(TensorDataset(*test), batch_size=work.eval_batch_size)},
                     "partition_map": {c: work.client_parts[c] for c in clients},
                     "local_sizes": {c: len(work.client_parts[c]) for c in clients},
                     "local": {c: {"train": None, "test": self.local_test} for c in clients}}
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            self.server = Server(_AlgoParams(OFFICIAL_PARAMS[method]), model, self.data, optimizer, scheduler,
                                 n_rounds=len(work.rounds), sample_ratio=work.sample_ratio,
                                 local_epochs=work.local_epochs, device="cpu")
        self.plan: dict = {}
        self.accuracy = float("nan")  # the global model's test accuracy after the last round run
        self.server._client_sampling = self._client_sampling
        self.server._set_client_data = self._set_client_data
        self.server.client._get_local_stats = self._local_stats

    def _client_sampling(self, round_idx: int) -> list[int]:  # the work's clients
        self.plan = self.work.plan(round_idx)
        return list(self.plan)

    def _set_client_data(self, client_idx: int) -> None:
        client = self.server.client
        client.datasize = self.data["local_sizes"][client_idx]
        client.local_loaders = {"train": DataLoader(self.train_set, batch_sampler=_EpochBatches(self.plan[client_idx])),
                                "test": self.local_test}

    def _local_stats(self) -> dict:  # the local model on the 300 test digits only
        return self.evaluate(self.server.client.model, {"test": self.local_test}, "cpu", "Local")

    def start(self, init: dict) -> None:
        self.server.server_model.load_state_dict(init)

    def global_state(self) -> dict:
        return self.server.server_model.state_dict()

    def run_round(self, round_idx: int) -> float:
        """CPU seconds of round `round_idx` (its first round's initial evaluation excluded, as the
        official code times its rounds)."""
        s = self.server
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            if round_idx == 0:
                s.server_results = s._results_updater(s.server_results, self.evaluate(s.server_model, s.global_loaders,
                                                                                     s.device))
            started = time.process_time()
            sampled = s._client_sampling(round_idx)
            s.server_results = s._results_updater(s.server_results, {"client_history": sampled})
            weights, sizes, local_results = s._clients_training(sampled)
            s.server_model.load_state_dict(s._aggregation(weights, sizes))
            global_results = self.evaluate(s.server_model, s.global_loaders, s.device, "Global")
            s.server_results = s._results_updater(s.server_results, global_results)
            s._print_stats_with_logging(global_results, round_idx)
            s._print_stats_with_logging(local_results, round_idx)
            s.scheduler.step()
            self.accuracy = global_results["Global_test"]
            return time.process_time() - started


class _Digits(TensorDataset):
    """Training then test digits as one tensor dataset, as FL-bench's MNIST holds them, with the
    train()/eval() switches its clients and server call (no transforms to switch)."""

    def train(self) -> None:
        pass

    def eval(self) -> None:
        pass


def flbench_modules(checkout: str, deps: str | None):
    """FL-bench's modules the harness uses (OmegaConf, FedAvgServer, initialize_data_loaders), with
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
    """FL-bench's FedAvg server in its serial mode on `work`, one round a call (no learning-rate
    decay, which FL-bench does not have, and no local-model evaluation). Its server is built
    without its `__init__` (which needs Hydra's run directory and the dataset files FL-bench's
    generate_data.py writes); the attributes set here are those `__init__` sets for this
    configuration, and the round runs FL-bench's own methods."""

    def __init__(self, checkout: str, deps: str | None, work: Work, model: nn.Module):
        OmegaConf, FedAvgServer, initialize_data_loaders = flbench_modules(checkout, deps)
        args = OmegaConf.load(os.path.join(checkout, "config", "defaults.yaml"))
        OmegaConf.update(args, "dataset.name", "mnist")
        for key, value in {"optimizer.lr": work.lr, "optimizer.momentum": work.momentum,
                           "optimizer.weight_decay": work.weight_decay, "lr_scheduler.name": None,
                           "mode": "serial", "common.join_ratio": work.sample_ratio,
                           "common.batch_size": work.rounds[0][0]["batch_size"],
                           "common.local_epoch": work.local_epochs,
                           "common.use_cuda": False, "common.client_side_evaluation": False,
                           "common.reset_optimizer_on_global_epoch": True, "common.buffers": "global",
                           "common.test.client.interval": 0, "common.test.client.test": False,
                           "common.test.server.interval": 1, "common.test.server.test": True,
                           "common.verbose_gap": 10**6, "common.monitor": None, "common.save_log": False}.items():
            OmegaConf.update(args, key, value)
        self.work = work
        n_train, clients = len(work.train_labels), len(work.client_parts)
        test_shares = np.array_split(np.arange(len(work.test_labels)) + n_train, clients)
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
        server.client_local_epoches = [work.local_epochs] * clients
        server.client_metrics = {i: {} for i in range(clients)}
        server.aggregated_client_metrics = {stage: {"train": [], "val": [], "test": []}
                                            for stage in ("before", "after")}
        server.selected_clients, server.current_epoch, server.testing, server.verbose = [], 0, False, False
        server.test_results = {}
        server.dataset = _Digits(torch.cat([work.train_images, work.test_images]),
                                 torch.cat([work.train_labels, work.test_labels]))
        server.client_data_indices = [{"train": work.client_parts[c].tolist(), "val": [],
                                       "test": test_shares[c].tolist()} for c in range(clients)]
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
        self.accuracy = float("nan")  # the global model's test accuracy after the last round run

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
        self.plan = self.work.plan(round_idx)
        s.selected_clients = list(self.plan)
        s.train_one_round()
        if s.args.common.test.server.interval > 0 and (round_idx + 1) % s.args.common.test.server.interval == 0:
            s.test_global_model()
        s.display_metrics()
        elapsed = time.process_time() - started
        results = s.test_results.get(round_idx + 1)
        if results is not None:
            self.accuracy = results["centralized"]["after"]["test"].accuracy / 100
        return elapsed


def main() -> None:
    """The peer's process (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=("fedsol", "flbench"))
    parser.add_argument("--checkout", required=True)
    parser.add_argument("--deps", help="FL-bench's extra packages (peer_flbench.py)")
    parser.add_argument("--work", required=True, help="a Work saved by peer_process.py")
    parser.add_argument("--out", required=True, help="where to save the final global weights")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Work.load(args.work)
    model = FedAvgCNN(work.train_images.shape[1], work.num_classes, work.train_images.shape[-1])
    if args.peer == "fedsol":
        peer = OfficialRounds(args.checkout, "fedavg", work, model)
    else:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            peer = FLbenchRounds(args.checkout, args.deps, work, model)
    peer.start(work.init)
    rounds = len(work.rounds)
    for r in range(rounds):
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # FL-bench's metrics table
            peer.run_round(r)
        if r in (0, rounds - 1):
            print(f"round {r + 1}/{rounds}: global test acc {peer.accuracy:.4f}", flush=True)
    torch.save({k: v.detach().clone() for k, v in peer.global_state().items()}, args.out)
    print(f"imported Lightning: {'lightning' in sys.modules}, fl_lightning: {'fl_lightning' in sys.modules}",
          flush=True)


if __name__ == "__main__":
    main()
