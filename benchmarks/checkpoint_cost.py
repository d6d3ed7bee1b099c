"""Seconds and bytes of the per-round checkpoint (`last.ckpt`, written atomically with fsync).

    python benchmarks/checkpoint_cost.py            # the demo (FedSOL, MNIST-5k) and 20 HMG3 clients

Runs each setting for a few rounds in-process and prints the median write time per round and the
file size, from the checkpoint callback's debug line.
"""

from __future__ import annotations

import logging
import re
import statistics
import sys
import tempfile
from pathlib import Path

from fl_lightning.cli import main

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "demo (FedSOL, MNIST-5k, fedavg_cnn, 50 clients)": [
        "--config", str(REPO / "configs/settings/mnist5k.yaml"),
        "--config", str(REPO / "configs/methods/fedsol/fedsol.yaml"), "--data.local_epochs", "1"],
    "20 HMG3 clients (FedORGP, MNIST-5k at 3x32x32, 20% per round)": [
        "--config", str(REPO / "configs/settings/fedorgp_demo_mnist5k_hmg3.yaml"),
        "--config", str(REPO / "configs/methods/fedorgp/fedorgp.yaml"), "--data.sample_ratio", "0.2",
        "--data.local_epochs", "1"],
}


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.rows: list[tuple[int, float]] = []

    def emit(self, record):
        found = re.search(r"(\d+) bytes in ([\d.]+) s", record.getMessage())
        if found:
            self.rows.append((int(found.group(1)), float(found.group(2))))


def measure(args: list[str], rounds: int) -> tuple[float, int]:
    handler = Collect()
    logger = logging.getLogger("fl_lightning.checkpointing")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    with tempfile.TemporaryDirectory() as root:
        try:
            main(["fit", *args, "--trainer.max_epochs", str(rounds), "--trainer.default_root_dir", root,
                  "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"])
        except SystemExit as stop:
            if stop.code:
                sys.exit(stop.code)
    logger.removeHandler(handler)
    return statistics.median(t for _, t in handler.rows), handler.rows[-1][0]


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for name, args in SETTINGS.items():
        seconds, size = measure(args, rounds)
        print(f"{name}: {seconds * 1000:.1f} ms per round checkpoint (median of {rounds}), {size / 1e6:.1f} MB")
