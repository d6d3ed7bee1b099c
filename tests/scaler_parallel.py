"""Clients in parallel on 2 processes under 16-mixed's autocast with and without a CPU GradScaler,
for tests/test_grad_scaler.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scaler_parallel.py OUT

Rank 0 writes OUT/<method>_<scaled|plain>.pt: every client's kept state and the global state
gathered to rank 0 (each process holds the clients it trained), the final scale, the world size;
and OUT/overflow_scalers.pt: every rank's scaler state after a step that overflowed on rank 1 only;
every rank OUT/process_group_at_exit_<rank>.txt: whether its process group outlived the exit functions.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch
from fl_test_utils import fit, learnable_shard_module
from test_grad_scaler import METHODS, OPT, plugin, state

from fl_lightning.methods import FedAvg
from fl_lightning.trainer import FLTrainer

RUNS = {"FedAvg": 0.5, "SCAFFOLD": None, "Ditto": None}  # method: gradient clipping


def main(out: Path) -> None:
    overflow_on_one_rank(out)
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


class OverflowOnRankOne(FedAvg):
    """FedAvg whose first local step of the first round overflows on rank 1 only."""

    def loss(self, model, batch, context):
        loss = super().loss(model, batch, context)
        if self.trainer.global_rank == 1 and self.round_idx == 0 and self.local_step == 0:
            loss = loss * float("inf")
        return loss


def overflow_on_one_rank(out: Path) -> None:
    """A step skipped on rank 1 alone: every rank's scaler state after each round, to rank 0."""
    torch.manual_seed(0)
    dm = learnable_shard_module(clients=4, sample_ratio=0.5)
    dm.setup()
    method = OverflowOnRankOne(data_spec=dm.spec, **OPT)
    trainer = fit(method, dm, rounds=2, plugins=[plugin(True)], trainer_class=FLTrainer, strategy="ddp_clients",
                  devices=2)
    states = [None] * trainer.world_size
    torch.distributed.all_gather_object(states, trainer.precision_plugin.scaler.state_dict())
    if trainer.global_rank == 0:
        torch.save(states, out / "overflow_scalers.pt")


def record_process_group_at_exit(out: Path) -> None:
    """Registered before anything else, so it runs last at exit: whether the process group is still
    there for the interpreter's teardown (where gloo's threads can abort a finished process)."""
    rank = os.environ["RANK"]
    atexit.register(lambda: (out / f"process_group_at_exit_{rank}.txt").write_text(
        str(torch.distributed.is_initialized())))


if __name__ == "__main__":
    record_process_group_at_exit(Path(sys.argv[1]))
    main(Path(sys.argv[1]))
