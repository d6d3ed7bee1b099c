"""Median wall time of one local step, FedAvg vs FedAvg + CONST (joint), in one process.

    PYTHONPATH=$PWD python benchmarks/fedconst_step_time.py [--model fedavg_cnn] [--rounds 3]

Runs the methods in alternation (A, B, A, B, ...) on MNIST-5k, one thread, so both see the same
machine load; a step (the method's `minibatch_step`) is timed from its start to its end, in wall
time and in CPU time of this process (the robust figure on a shared machine). Prints the medians
and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg


def time_steps(method) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of every call of the method's per-mini-batch step."""
    times: list[tuple[float, float]] = []
    step = method.minibatch_step

    def timed(batch):
        t0 = (time.perf_counter(), time.process_time())
        out = step(batch)
        times.append((time.perf_counter() - t0[0], time.process_time() - t0[1]))
        return out

    method.minibatch_step = timed
    return times


def run(model: str, constraint: str, rounds: int, seed: int) -> list[tuple[float, float]]:
    L.seed_everything(seed, verbose=False)
    dm = FederatedDataModule(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5,
                             batch_size=50, partition="dirichlet", alpha=0.1, seed=seed)
    method = FedAvg(model=model, constraint=constraint, data_spec=dm.spec)
    times = time_steps(method)
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(eval_local_models=False)])
    trainer.fit(method, dm)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="fedavg_cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[tuple[float, float]]] = {"none": [], "joint": []}
    for r in range(args.repeats):
        for constraint in times:
            times[constraint] += run(args.model, constraint, args.rounds, seed=r)
    for i, kind in enumerate(("wall", "cpu")):
        med = {k: statistics.median(t[i] for t in v) for k, v in times.items()}
        print(f"model {args.model}, {kind} time: FedAvg median step {med['none'] * 1e3:.2f} ms "
              f"({len(times['none'])} steps); FedAvg+CONST(joint) {med['joint'] * 1e3:.2f} ms "
              f"({len(times['joint'])} steps); ratio {med['joint'] / med['none']:.3f}")


if __name__ == "__main__":
    main()
