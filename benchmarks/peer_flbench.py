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
import contextlib
import logging
import os
import statistics
import warnings

import torch
from peer_fedsol import SETTING, _PairedRounds, bare_fit, describe_work
from peer_servers import FLbenchRounds, flbench_modules

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.models import build_model


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
        peer = FLbenchRounds(args.checkout, args.deps, describe_work(args.rounds, lr_decay=1.0),
                             build_model("fedavg_cnn", FederatedDataModule(**SETTING).spec))
        clock = _PairedRounds(peer)
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
