"""The library internals fl-lightning depends on, each behind one function here, so that an
upgrade of Lightning, jsonargparse or W&B breaks in one place (each has a test in
tests/test_compat.py that fails if the internal changes)."""

from __future__ import annotations


def skip_next_validation(trainer) -> None:
    """Lightning runs validation at the end of every training epoch, also one that
    `trainer.should_stop` ends early; a round that stopped before its server step has no new model
    to evaluate. (`_TrainingEpochLoop._skip_next_val`, read once at the epoch's last batch.)"""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_skip_next_val"):
        raise RuntimeError("Lightning's training epoch loop has no _skip_next_val any more: "
                           "update fl_lightning/compat.py")
    loop._skip_next_val = True


def launched_processes(trainer) -> list[tuple[int, object]]:
    """(global rank, subprocess.Popen) of the processes Lightning's launcher started from this one
    (ranks 1.. of `--trainer.strategy ddp` on this machine; none under torchrun or SLURM, whose
    agents watch their processes themselves). (`_SubprocessScriptLauncher.procs`.)"""
    launcher = getattr(trainer.strategy, "launcher", None)
    procs = getattr(launcher, "procs", None)
    if not procs:
        return []
    base = trainer.node_rank * trainer.num_devices
    return [(base + local_rank, proc) for local_rank, proc in enumerate(procs, start=1)]


def set_collective_timeout(strategy, seconds: float) -> None:
    """The timeout of the process group a DDP strategy creates (`DDPStrategy._timeout`, read when
    the group is initialised)."""
    import datetime

    if not hasattr(strategy, "_timeout"):
        raise RuntimeError("Lightning's DDPStrategy has no _timeout any more: update fl_lightning/compat.py")
    strategy._timeout = datetime.timedelta(seconds=seconds)
