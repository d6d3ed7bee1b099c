"""FedAvg or FedSOL per round: fl-lightning against the official FedSOL code (Lee-Gihun/FedSOL, the
paper's authors) doing the same work, one thread, in one process, round by round (the targets:
FedAvg no slower, FedSOL at most 0.7x). The official code is not part of this project: pass a
checkout of it (written against its commit ebc3f64; the harness replaces three of its private
methods, which a later version may rename).

    git clone https://github.com/Lee-Gihun/FedSOL ../FedSOL
    PYTHONPATH=. python benchmarks/peer_fedsol.py --checkout ../FedSOL [--method fedsol] [--rounds 7] [--repeats 3]

The same work on both sides, so that both do the same arithmetic (the final global weights are
compared, max |dw|):
- MNIST-5k, the project's Dirichlet-0.1 partition of 50 clients, 10 clients a round: the
  official sampler is replaced by the project's round plan, so both train the same clients;
- the same mini-batches in the same order: the official client's DataLoader (over the training
  tensors, batch 50, no workers) takes its batches from the round plan through a batch sampler;
- the project's `fedavg_cnn` with the same initial weights (the official MNIST CNN repeats the
  digit into 3 channels: more arithmetic in its first layer than the project's);
- SGD 0.01 (momentum 0.9, weight decay 1e-5) decayed 0.99 a round (the official StepLR);
- `--method fedsol`: FedSOL with the project's defaults (configs/methods/fedsol/fedsol.yaml: KL
  proximal loss at temperature 3, rho 2.0, adaptive radius, only the head perturbed) against the
  official `fedsol_adaptive` server and client with rho 2.0, perturb_head on, perturb_body off
  (its configs use rho 1.0 and the whole model). The adaptive radius is normalised as the official
  code does it, |w - w_g| along dim 0 of each tensor (the project's `adaptive: dim0`; its default
  `layer` normalises over the whole tensor, paper eq. 7: a different number, the same cost);
- every local model evaluated on the same 300 test digits (the official client also evaluates
  on its own training data: left out here), the global model on the test set once a round.
Two choices favour the official code: W&B is disabled there (its `wandb.log` is a no-op), and its
DataLoaders read tensors (its own pipeline decodes PIL images with augmentation in 5 workers).

The project runs twice: (a) `fl-lightning fit` on configs/settings/mnist5k.yaml as a user runs it
(with FedSOL: configs/methods/fedsol/fedsol.yaml layered on it, `--model.init_args.adaptive dim0`),
every default on (W&B offline, the round checkpoint, divergence statistics and their heatmap every
5 rounds, metrics.csv / clients.csv / summary.json); (b) a Trainer with the federated callback
only (the official code's work, no more). Times are CPU seconds of this process per round, start
to start (the last round to the end of training); the first round of every run is dropped. After
each project round the official code runs the same round (same clients, same batches; the round's
time differs from round to round with its clients' data): the ratio of the sums over rounds and
repeats (which counts (a)'s heatmap rounds), and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
import time
import warnings

import torch
from core_overhead import MNIST, OPT, bare_trainer
from peer_servers import OfficialRounds, Work

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg, FedSOL
from fl_lightning.models import build_model

SETTING = MNIST  # = configs/settings/mnist5k.yaml
LR_DECAY = 0.99
LOCAL_EVAL_SAMPLES = 300  # configs/settings/mnist5k.yaml's federation.local_eval_samples
USER_RUN = ["fit", "--config", "configs/settings/mnist5k.yaml"]
# FedSOL on both sides (module docstring): the project's defaults with the official code's
# normalisation of the adaptive radius, and the official client's switches that mean the same
# (peer_servers.OFFICIAL_PARAMS: rho 2.0, only the head perturbed).
FEDSOL = dict(proximal="kl", temperature=3.0, rho=2.0, adaptive="dim0", perturb="head")
USER_METHOD = {"fedavg": [], "fedsol": ["--config", "configs/methods/fedsol/fedsol.yaml",
                                        "--model.init_args.adaptive", FEDSOL["adaptive"]]}
TARGET = {"fedavg": 1.00, "fedsol": 0.70}
HEADER = {"fedavg": "FedAvg CNN",
          "fedsol": "FedSOL (KL, T 3, rho 2.0, adaptive dim0, head perturbed) with the FedAvg CNN"}


def describe_work(rounds: int, init: dict | None = None, lr_decay: float = LR_DECAY) -> Work:
    """The demo setting's first `rounds` rounds (module docstring) as a peer's server takes them:
    the project's digits, partition, round plans and 300 local-evaluation digits; `init` the
    initial global weights, when the peer is not started from the project's model."""
    dm = FederatedDataModule(**SETTING)
    dm.setup()
    train, test = dm.train_set.tensors(), dm.test_set.tensors()
    subset = dm.global_test_subset_loader(LOCAL_EVAL_SAMPLES).dataset.indices  # the project's 300 digits
    plans = [[{"client": w.client, "batch_size": w.batch_size, "orders": [torch.as_tensor(o) for o in w.orders]}
              for w in dm.plan_round(r).clients] for r in range(rounds)]
    return Work(train.images, train.labels, test.images, test.labels,
                [torch.as_tensor(dm.client_parts[c]) for c in range(SETTING["num_clients"])],
                torch.as_tensor(subset), plans, dict(init or {}), dm.spec.num_classes, SETTING["sample_ratio"],
                SETTING["local_epochs"], dm.hparams.eval_batch_size, lr_decay=lr_decay, **OPT)


def official_rounds(checkout: str, method: str, rounds: int) -> OfficialRounds:
    """The official server on the demo setting's first `rounds` rounds, with the project's model."""
    work = describe_work(rounds)
    return OfficialRounds(checkout, method, work, build_model("fedavg_cnn", FederatedDataModule(**SETTING).spec))


class _PairedRounds:
    """Times the fits run inside the `with` block round by round (CPU seconds, from the federated
    callback's epoch start to the next one, the last round to the end of training) and runs the
    official code's same round between two of the project's rounds, outside both clocks, so that
    each pair meets the same machine (a shared machine's speed drifts by 20% in a minute)."""

    def __init__(self, official):  # OfficialRounds, or any peer with start, run_round, global_state
        self.official = official
        self.project: list[float] = []
        self.theirs: list[float] = []
        self.module = None
        self._started: float | None = None

    def _round_over(self) -> None:
        self.project.append(time.process_time() - self._started)
        self.theirs.append(self.official.run_round(len(self.theirs)))

    def __enter__(self):
        self._epoch_start = FederatedCallback.on_train_epoch_start
        epoch_start, clock = self._epoch_start, self

        def on_train_epoch_start(callback, trainer, module):
            if clock._started is not None:
                clock._round_over()
            else:
                clock.official.start(module.model.state_dict())
            clock.module = module
            clock._started = time.process_time()
            return epoch_start(callback, trainer, module)

        def on_train_end(callback, trainer, module):
            clock._round_over()

        FederatedCallback.on_train_epoch_start = on_train_epoch_start
        FederatedCallback.on_train_end = on_train_end
        return self

    def __exit__(self, *exc):
        FederatedCallback.on_train_epoch_start = self._epoch_start
        del FederatedCallback.on_train_end  # the base class's no-op again

    def max_weight_difference(self) -> float:
        theirs = self.official.global_state()
        return max(float((v - theirs[k]).abs().max()) for k, v in self.module.model.state_dict().items())


def user_fit(rounds: int, clock: _PairedRounds, method: str = "fedavg") -> None:
    """(a): `fl-lightning fit` on the demo setting, in this process, every default on."""
    from fl_lightning.cli import main as fl_lightning

    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as run_dir, clock, open(os.devnull, "w") as quiet, \
            contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        fl_lightning([*USER_RUN, *USER_METHOD[method], "--trainer.max_epochs", str(rounds),
                      "--trainer.default_root_dir", run_dir])


def bare_fit(rounds: int, clock: _PairedRounds, lr_decay: float = LR_DECAY, eval_local_models: bool = True,
             method: str = "fedavg") -> None:
    """(b): a Trainer with the federated callback only (local models evaluated on 300 digits, unless
    `eval_local_models` is off)."""
    torch.manual_seed(0)
    dm = FederatedDataModule(**SETTING)
    if method == "fedsol":
        module = FedSOL(model="fedavg_cnn", data_spec=dm.spec, lr_decay=lr_decay, **FEDSOL, **OPT)
    else:
        module = FedAvg(model="fedavg_cnn", data_spec=dm.spec, lr_decay=lr_decay, **OPT)
    trainer = bare_trainer(rounds, [FederatedCallback(eval_local_models=eval_local_models,
                                                      local_eval_samples=LOCAL_EVAL_SAMPLES)])
    with clock:
        trainer.fit(module, dm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", required=True, help="a checkout of github.com/Lee-Gihun/FedSOL")
    parser.add_argument("--method", choices=("fedavg", "fedsol"), default="fedavg")
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
    for _ in range(args.repeats):
        for side, fit in (("user", user_fit), ("bare", bare_fit)):
            clock = _PairedRounds(official_rounds(args.checkout, args.method, args.rounds))
            fit(args.rounds, clock, method=args.method)
            project[side] += clock.project[1:]
            official[side] += clock.theirs[1:]
            diff[side] = max(diff[side], clock.max_weight_difference())
    med = statistics.median
    print(f"{HEADER[args.method]}, MNIST-5k (Dirichlet 0.1, 10 of 50 clients, 5 local epochs, batch 50), 1 thread, "
          f"{args.repeats} repeats x {args.rounds - 1} rounds a side, each round paired with the official code's "
          f"same round, run right after it")
    for side, what in (("user", "(a) fl-lightning fit, every default on"),
                       ("bare", "(b) the federated callback only        ")):
        p, q = project[side], official[side]
        per_round = med(a / b for a, b in zip(p, q, strict=True))
        print(f"  {what}: {sum(p) / len(p):.3f} s/round against {sum(q) / len(q):.3f}: {sum(p) / sum(q):.3f}x "
              f"the official code over all rounds, per round median {per_round:.3f}x "
              f"(target <= {TARGET[args.method]:.2f})  max|dw| {diff[side]:.1e}")

if __name__ == "__main__":
    main()
