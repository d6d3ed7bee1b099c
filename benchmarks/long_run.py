"""Does a round cost the same at round 400 as at round 10? (the round's fixed costs.)
A `fl-lightning fit` in this process with every default on (metrics.csv, clients.csv and
summary.json rewritten each round, the round checkpoint, W&B offline, the analyses' defaults),
FedAvg with the `mlp` on the 8x8 digits, 10 clients a round, one local epoch: a run whose rounds
are short, so that any per-round cost that grows with the rounds before it shows. Prints the
median CPU ms of a round, of the results files' write and of the round checkpoint, over the first
and the last 50 rounds, and their ratios (1.0 is a round whose cost does not grow). One thread.

    PYTHONPATH=. python benchmarks/long_run.py [--rounds 400]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import lightning as L
import torch
from lightning.pytorch.trainer.trainer import Trainer

import fl_lightning.lightning_cli as cli
from fl_lightning.results import ResultsCallback

SETTING = ["--config", "configs/settings/mnist5k.yaml", "--config", "configs/methods/fedsol/fedavg.yaml",
           "--data.dataset=digits", "--model.init_args.model=mlp", "--data.num_clients=10", "--data.min_size=5",
           "--trainer.enable_progress_bar=false", "--seed_everything=1"]
PARTS = {"round": None, "results files": (ResultsCallback, "on_train_epoch_end"),
         "round checkpoint": (Trainer, "save_checkpoint")}


class RoundStarts(L.Callback):
    def __init__(self, times: list[float]):
        self.times = times

    def on_train_epoch_start(self, trainer, pl_module):
        self.times.append(time.process_time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    rounds = parser.parse_args().rounds
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    torch.set_num_threads(1)
    times: dict[str, list[float]] = defaultdict(list)
    for label, target in PARTS.items():
        if target is not None:
            owner, name = target
            setattr(owner, name, _timed(getattr(owner, name), times[label]))
    starts = times["round"]
    make_trainer = cli.FLCLI.instantiate_trainer

    def with_round_starts(self, **kwargs):
        trainer = make_trainer(self, **kwargs)
        trainer.callbacks.insert(0, RoundStarts(starts))
        return trainer

    cli.FLCLI.instantiate_trainer = with_round_starts
    with tempfile.TemporaryDirectory() as root:
        sys.argv = ["fl-lightning", "fit", *SETTING, f"--trainer.max_epochs={rounds}",
                    f"--trainer.default_root_dir={root}/run"]
        try:
            cli.main()
        except SystemExit as stop:
            if stop.code:
                raise
    times["round"] = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    print(f"{rounds} rounds of FedAvg, mlp, 8x8 digits, every default on; CPU ms, medians of 50 rounds")
    for label, values in times.items():
        first, last = statistics.median(values[:50]) * 1e3, statistics.median(values[-50:]) * 1e3
        print(f"  {label:18s} rounds 1-50: {first:7.2f}   last 50: {last:7.2f}   last/first {last / first:.2f}x")


def _timed(function, into: list[float]):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            into.append(time.process_time() - start)

    return timed


if __name__ == "__main__":
    main()
