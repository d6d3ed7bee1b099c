"""Local-step time of the FedAvg CNN on MNIST-5k by Trainer precision, on this machine's CPU
(bf16-mixed against 32-true). One thread, rounds timed start to start (the first round
of every run dropped as warm-up), precisions interleaved over repeats, medians.

    PYTHONPATH=. python benchmarks/precision_step_time.py [--repeats 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from core_overhead import MNIST, OPT  # noqa: E402

from fl_lightning.data.datamodule import FederatedDataModule  # noqa: E402
from fl_lightning.federation import FederatedCallback  # noqa: E402
from fl_lightning.methods import FedAvg  # noqa: E402


class RoundTimes(L.Callback):
    def __init__(self):
        self.starts: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())


def seconds_per_round(precision: str, rounds: int) -> list[float]:
    torch.manual_seed(0)
    dm = FederatedDataModule(**MNIST)
    module = FedAvg(model="fedavg_cnn", data_spec=dm.spec, **OPT)
    clock = RoundTimes()
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, precision=precision,
                        callbacks=[clock, FederatedCallback(eval_local_models=False)])
    trainer.fit(module, dm)
    return [b - a for a, b in zip(clock.starts[1:], clock.starts[2:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times: dict[str, list[float]] = {p: [] for p in args.precisions}
    for _ in range(args.repeats):
        for precision in args.precisions:
            times[precision] += seconds_per_round(precision, args.rounds)
    base = statistics.median(times[args.precisions[0]])
    for precision, t in times.items():
        med = statistics.median(t)
        print(f"{precision:10s} {med:.3f} s/round (median of {len(t)}), {med / base:.2f}x {args.precisions[0]}")


if __name__ == "__main__":
    main()
