"""A round's clients in parallel across processes (`--federation.parallel clients`).

With `--trainer.strategy ddp` and several processes (devices, nodes, torchrun or SLURM through
Lightning's cluster environments), every rank trains a share of the round's sampled clients, one
after another, and the server step becomes a reduction (uploads.RoundUploads): each rank sums its
uploads' weighted contributions in float64, one all_reduce adds the ranks' sums, and every rank
finishes the same server step, so every rank holds the same global model. Server rules that are
not weighted sums gather what they need explicitly.

Why not Lightning's DDP as is: it splits every mini-batch across the ranks and all-reduces every
local step's gradients. With the papers' batches of 50 and small CNNs the ranks then spend their
time synchronising tiny gradients, and the clients still train one after another. Here nothing is
synchronised during local training (the module is not wrapped in DistributedDataParallel), so
ranks with different numbers of local steps never wait for each other until the round ends.

A run's result does not depend on the number of processes: every client's randomness is seeded by
(seed, round, client) (data order, augmentation, dropout, a method's draws), and the reductions
accumulate in float64.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from fl_lightning import compat

DDP_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}


class ClientParallelStrategy(DDPStrategy):
    """Lightning's DDP strategy (process launch, cluster environments, collectives, checkpoint
    saving on rank 0) without the DistributedDataParallel wrapper: no gradient all-reduce happens
    during local training. Every rank starts from rank 0's initial weights."""

    strategy_name = "ddp_clients"

    def configure_ddp(self) -> None:
        compat.sync_module_states(self.model)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        # Lightning's training loop broadcasts a SIGTERM flag from rank 0 before every batch, a
        # collective that would pair up the ranks' batches: here a batch is a client and ranks
        # train different numbers of clients. A signal is handled by the CLI in the process that
        # receives it (cli.py), and the launcher (Lightning's, torchrun's) stops the others.
        compat.skip_per_batch_sigterm_broadcast(trainer)
        # Every process logs the same round values (the round's reductions made them equal), so
        # Lightning's advice to sync epoch-level logs across devices does not apply.
        warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting.*")


for _name, _start in DDP_START_METHODS.items():
    # `--trainer.strategy ddp --federation.parallel clients` becomes `ddp_clients` (cli.py)
    StrategyRegistry.register(f"{_name}_clients", ClientParallelStrategy,
                              description="DDP processes that train different clients (no gradient all-reduce)",
                              start_method=_start, override=True)


def client_strategy_name(strategy: str) -> str | None:
    """The client-parallel name of a DDP strategy name ("ddp" -> "ddp_clients"), else None."""
    return f"{strategy}_clients" if strategy in DDP_START_METHODS else None


def check_process_count(processes: int, clients_per_round: int) -> None:
    """Every process needs at least one client per round."""
    from fl_lightning.errors import FLUserError

    if processes > clients_per_round:
        raise FLUserError(f"--federation.parallel clients: {processes} processes but only {clients_per_round} "
                          f"clients per round; use at most {clients_per_round} processes (--trainer.devices x "
                          f"--trainer.num_nodes) or sample more clients (--data.sample_ratio)")


def lost_processes(trainer: Any, wait: float = 2.0) -> list[str]:
    """The processes of this run that Lightning's launcher started from this one and that died
    (killed by a signal, or exited with an error), each as "rank r (pid p) was killed by SIGKILL";
    waits up to `wait` seconds for a process whose connection dropped to be reaped."""
    import signal
    import time

    from fl_lightning import compat
    from fl_lightning.outcome import EXIT_STOPPED, REPORTED_ELSEWHERE

    children = compat.launched_processes(trainer)
    deadline = time.monotonic() + wait
    while True:
        lost = []
        for rank, proc in children:
            code = proc.poll()
            if code is None or code in (0, EXIT_STOPPED):
                continue
            if code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            elif code - 128 in (signal.SIGINT, signal.SIGTERM):  # it took a signal of its own and stopped
                how = f"stopped on {signal.Signals(code - 128).name} (exit code {code})"
            elif REPORTED_ELSEWHERE < code < 128:
                how = f"stopped on an error of its own, in its error: line (exit code {code - REPORTED_ELSEWHERE})"
            else:
                how = f"exited with code {code}"
            lost.append(f"rank {rank} (pid {proc.pid}) {how}")
        if lost or not children or time.monotonic() >= deadline:
            return lost
        time.sleep(0.1)


def reported_elsewhere(trainer: Any, wait: float = 2.0) -> int | None:
    """The exit code of a process Lightning's launcher started from this one that ended on an error
    it reported itself (outcome.REPORTED_ELSEWHERE), else None; waits up to `wait` seconds for a
    process whose connection dropped to be reaped."""
    import time

    from fl_lightning import compat
    from fl_lightning.outcome import REPORTED_ELSEWHERE

    children = compat.launched_processes(trainer)
    deadline = time.monotonic() + wait
    while True:
        codes = [proc.poll() for _, proc in children]
        for code in codes:
            if code is not None and REPORTED_ELSEWHERE < code < 128:
                return code - REPORTED_ELSEWHERE
        if all(code is not None for code in codes) or time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def clients_in_parallel(trainer: Any) -> bool:
    """True when the round's clients are spread over several processes."""
    return (trainer is not None and isinstance(getattr(trainer, "strategy", None), ClientParallelStrategy)
            and trainer.world_size > 1)


def assign_clients(steps: Sequence[int], world_size: int) -> list[list[int]]:
    """Positions of the round's clients per rank, balanced by local steps: longest first, each to
    the rank with the fewest steps so far (ties: the lower position, then the lower rank); each
    rank's share in plan order. Deterministic, so every rank computes the same assignment."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for position in sorted(range(len(steps)), key=lambda i: (-steps[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(position)
        loads[rank] += steps[position]
    return [sorted(share) for share in shares]


class Collective:
    """The two collectives a round needs, over all processes; with one process (or none
    initialised) they return their input."""

    def __init__(self, device: torch.device | str = "cpu", distributed: bool = False):
        self.distributed = bool(distributed and dist.is_available() and dist.is_initialized())
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        # gloo reduces CPU tensors, NCCL device tensors
        self.device = torch.device(device) if self.distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    @classmethod
    def of(cls, trainer: Any) -> Collective:
        if not clients_in_parallel(trainer):
            return cls()
        return cls(trainer.strategy.root_device, distributed=True)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (pickled: for small metadata and what a server rule
        that is not a sum needs)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per key, the sum over ranks, in float64, in one all_reduce. Every rank must pass the
        same keys and shapes (RoundUploads agrees on them first)."""
        if not self.distributed or not tensors:
            return {k: v.double() for k, v in tensors.items()}
        keys = sorted(tensors)
        flat = torch.cat([tensors[k].detach().to(self.device, torch.float64).reshape(-1) for k in keys])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        out, offset = {}, 0
        for k in keys:
            n = tensors[k].numel()
            out[k] = flat[offset : offset + n].reshape(tensors[k].shape).to(tensors[k].device)
            offset += n
        return out
