"""Round time of the vectorised engine against the sequential one (`--federation.engine`).

Two settings on MNIST-5k, 10 clients a round, batch 50, SGD 0.01/0.9/1e-5, local-model evaluation
off, with the `mlp` and the FedAvg CNN, FedAvg (and optionally FedSOL):
- "equal": 10 IID clients of 400 training digits, all sampled, 4 local epochs: 32 steps each;
- "demo": configs/settings/mnist5k.yaml (50 clients, Dirichlet 0.1, 20% a round, 5 local
  epochs), where clients hold from a few to a few hundred digits: fewer clients step together in
  a round's later steps.

A round is timed from its start to the start of its validation (the clients' training, uploads and
the server step; the global model's evaluation is the same for both engines and left out), in CPU
time. The two engines run alternately, `--repeats` times each, and every run's first round is
dropped as warm-up; the script prints the median round of each engine and their ratio, and how far
apart the two engines' final weights are.

    taskset -c 1 python benchmarks/vectorized_engine.py [--rounds 4] [--repeats 3]
        [--models mlp fedavg_cnn] [--settings equal demo] [--methods fedavg fedsol] [--group N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg, FedSOL

SETTINGS = {
    "equal": dict(dataset="mnist5k", num_clients=10, sample_ratio=1.0, local_epochs=4, batch_size=50,
                  partition="iid", partition_seed=0, seed=0),
    "demo": dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
                 partition="dirichlet", alpha=0.1, partition_seed=0, seed=0),
}
OPT = dict(lr=0.01, momentum=0.9, weight_decay=1e-5)
METHODS = {"fedavg": (FedAvg, {}), "fedsol": (FedSOL, {"rho": 2.0})}


class RoundTimer(L.Callback):
    """From a round's start to the start of its validation, in CPU time of the process (one
    thread: on a shared machine wall time mostly measures the neighbours)."""

    def __init__(self):
        self.times, self._start = [], 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.process_time()

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.times.append(time.process_time() - self._start)


def run(engine: str, setting: str, model: str, method: str, rounds: int,
        group: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    dm = FederatedDataModule(**SETTINGS[setting])
    cls, kw = METHODS[method]
    module = cls(model=model, data_spec=dm.spec, **OPT, **kw)
    timer = RoundTimer()
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(eval_local_models=False, engine=engine, engine_group=group),
                                   timer])
    trainer.fit(module, dm)
    return timer.times[1:], {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (the first is dropped)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine, alternating")
    parser.add_argument("--models", nargs="+", default=["mlp", "fedavg_cnn"])
    parser.add_argument("--methods", nargs="+", default=["fedavg"], choices=list(METHODS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group", type=int, default=None,
                        help="--federation.engine_group (default: not given, the engine's choice: all of "
                             "the round's clients, one at a time for a convolutional model on a CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.rounds} rounds x "
          f"{args.repeats} runs per engine (first round of each run dropped)")
    for setting in args.settings:
        for model in args.models:
            for method in args.methods:
                compare(setting, model, method, args.rounds, args.repeats, args.group)


def compare(setting: str, model: str, method: str, rounds: int, repeats: int, group: int | None) -> None:
    times: dict[str, list[float]] = {"sequential": [], "vectorized": []}
    final = {}
    for _ in range(repeats):
        for engine in times:
            measured, final[engine] = run(engine, setting, model, method, rounds, group)
            times[engine] += measured
    seq, vec = (statistics.median(times[e]) for e in times)
    diff = max(float((final["sequential"][k] - final["vectorized"][k]).abs().max()) for k in final["sequential"])
    label = "" if group is None else f" group {group}"
    print(f"{setting:6s} {model:11s} {method:7s}{label} sequential {seq * 1e3:8.1f} ms/round  "
          f"vectorized {vec * 1e3:8.1f} ms/round  sequential/vectorized {seq / vec:5.2f}x  "
          f"max |w_seq - w_vec| {diff:.1e}")


if __name__ == "__main__":
    main()
