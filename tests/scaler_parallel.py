"""Clients in parallel on 2 processes under 16-mixed's autocast with and without a CPU GradScaler,
for tests/test_grad_scaler.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scaler_parallel.py OUT

Rank 0 writes OUT/<method>_<scaled|plain>.pt: every client's kept state and the global state
gathered to rank 0 (each process holds the clients it trained), the final scale, the world size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from fl_test_utils import fit, learnable_shard_module
from test_grad_scaler import METHODS, plugin, state

from fl_lightning.trainer import FLTrainer

RUNS = {"FedAvg": 0.5, "SCAFFOLD": None, "Ditto": None}  # method: gradient clipping


def main(out: Path) -> None:
    for name, clip in RUNS.items():
        for scaled in (True, False):
            torch.manual_seed(0)
            dm = learnable_shard_module(clients=4, sample_ratio=0.5)  # 2 clients a round: one per process
            dm.setup()
            method = METHODS[name](dm.spec)
            trainer = fit(method, dm, rounds=2, plugins=[plugin(scaled)], trainer_class=FLTrainer,
                          gradient_clip_val=clip, strategy="ddp_clients", devices=2)
            parts = [None] * trainer.world_size
            torch.distributed.all_gather_object(parts, state(method))
            if trainer.global_rank == 0:
                scaler = trainer.precision_plugin.scaler
                torch.save({"states": {k: v for p in parts for k, v in p.items()}, "world_size": trainer.world_size,
                            "scale": scaler.get_scale() if scaler is not None else None},
                           out / f"{name}_{'scaled' if scaled else 'plain'}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
