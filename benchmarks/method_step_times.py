"""Median wall time of one local step of every method, as a ratio to FedAvg's, in one process.

Setting: FedAvg CNN on MNIST-5k shapes (1x28x28, 10 classes), batch 50, one client, SGD
0.01/0.9/1e-5, one CPU thread. Each method runs `--steps` local steps per pass; `minibatch_step` is
timed, except a client's first step. Passes alternate over the methods (`--passes`) so
that a change in machine load hits every method alike; the figure per method is the median over all
its timed steps. Random inputs: the cost of a step does not depend on the pixel values.

    PYTHONPATH=. python benchmarks/method_step_times.py [--steps 20] [--passes 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning as L
import torch

from fl_lightning import methods
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.data.datasets import DataSpec, register_dataset, tensor_dataset
from fl_lightning.federation import FederatedCallback

METHODS = ["FedAvg", "FedProx", "SCAFFOLD", "FedNova", "FedDyn", "MOON", "FedNTD", "FedSAM", "FedASAM",
           "FedExP", "FedSOL"]


def time_steps(method) -> list[float]:
    """Wraps the method's per-mini-batch step; a client's first step (for FedSOL a plain step) is
    not timed."""
    times: list[float] = []
    step = method.minibatch_step

    def timed(batch):
        first = method.local_step == 0
        t0 = time.perf_counter()
        out = step(batch)
        if not first:
            times.append(time.perf_counter() - t0)
        return out

    method.minibatch_step = timed
    return times


def one_pass(name: str, dataset: str, spec: DataSpec, steps: int) -> list[float]:
    torch.manual_seed(0)
    dm = FederatedDataModule(dataset=dataset, num_clients=1, sample_ratio=1.0, local_epochs=1, batch_size=50,
                             partition="iid", min_size=1)
    method = getattr(methods, name)(model="fedavg_cnn", data_spec=spec)
    times = time_steps(method)
    trainer = L.Trainer(max_epochs=1, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(eval_local_models=False)])
    trainer.fit(method, dm)
    assert len(times) == steps - 1
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    spec = DataSpec(10, 1, 28)
    n = 50 * args.steps
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    sets = (tensor_dataset(x, y), tensor_dataset(x[:50], y[:50]))
    register_dataset("bench_mnist_shapes", spec, lambda request: sets)

    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(args.passes):
        for name in METHODS:
            times[name] += one_pass(name, "bench_mnist_shapes", spec, args.steps)
    base = statistics.median(times["FedAvg"])
    print(f"local step, FedAvg CNN, batch 50, 1x28x28, 1 thread; "
          f"{args.passes} passes x {args.steps - 2} timed steps per method")
    print(f"{'method':<10} {'median ms':>10} {'x FedAvg':>9}")
    for name in METHODS:
        med = statistics.median(times[name])
        print(f"{name:<10} {1000 * med:>10.1f} {med / base:>9.2f}")


if __name__ == "__main__":
    main()
