"""One run per run directory (`trainer.default_root_dir`).

Two fits in one directory would overwrite each other's `config.yaml`, checkpoint and results, and
a resume would continue whichever run wrote last. So a `fit` takes an exclusive lock on
`<dir>/.fl-lightning.lock` for its whole life (an OS lock: it is released when the process dies,
even by `kill -9`, so a stale lock never blocks a resume), and a new fit into a directory that
already holds a run is refused unless it resumes it (`--ckpt_path last`) or overwrites it
(`--overwrite true`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from fl_lightning.atomic import remove_stray_temporaries
from fl_lightning.errors import FLUserError

LOCK_NAME = ".fl-lightning.lock"
# What makes a directory "hold a run", and what --overwrite removes (W&B keeps its own run folders).
RUN_FILES = ("config.yaml", "checkpoints", "metrics.csv", "summary.json")


def is_first_process() -> bool:
    """Rank 0 of node 0, read from the environment because the run directory is claimed before the
    Trainer exists (the other ranks of a DDP run, started by Lightning's launcher, torchrun or
    srun, share rank 0's directory and must not lock or clear it)."""
    return all(int(os.environ.get(name, "0") or 0) == 0
               for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"))


class RunDirectory:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._lock_fd: int | None = None
        self.created: list[Path] = []  # the directories this fit made (root first, then parents)

    def holds_run(self) -> bool:
        return any((self.root / name).exists() for name in RUN_FILES)

    def lock(self) -> None:
        """Exclusive for this process; one line if another process holds it."""
        if not self.created:
            self.created = [p for p in (self.root, *self.root.parents) if not p.exists()]
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FLUserError(f"another fit is running in {self.root} (pid {holder}); wait for it, or give this "
                              f"run its own --trainer.default_root_dir") from None
        self._lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as err:  # a full disk: the error names the run directory's lock file
            err.filename = err.filename or str(self.root / LOCK_NAME)
            self.unlock()
            raise
        # left by a process killed mid-write (results, checkpoint, client-state files, the fit's
        # analyses; not `analyze`'s posthoc_round_* folders, which that command may be writing now)
        states, analysis = self.root / "checkpoints" / "client_states", self.root / "analysis"
        for directory in (self.root, self.root / "checkpoints", states, *sorted(states.glob("rank*")), analysis,
                          *sorted(analysis.glob("round_*"))):
            remove_stray_temporaries(directory)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the lock
            self._lock_fd = None

    def clear(self) -> None:
        """--overwrite: remove the previous run's files (not its W&B runs) before starting anew."""
        for name in RUN_FILES:
            path = self.root / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        for path in self.root.glob("hpc_ckpt_*.ckpt"):  # Lightning would resume these on SLURM
            path.unlink()

    def abandon(self) -> None:
        """A fit refused after it claimed the directory and before it completed a round (bad input
        found while the model or the clients were built): leave nothing that would make the
        corrected command find "a run" here. A directory this fit made is removed; in one that
        existed, the run files it wrote (config.yaml, summary.json, ...) are. Parent directories it made
        go too when they are empty."""
        self.unlock()
        if not self.created:
            self.clear()
            return
        shutil.rmtree(self.root, ignore_errors=True)
        for parent in self.created[1:]:  # runs/<setting>/ too, if this fit made it and it is empty
            try:
                parent.rmdir()
            except OSError:
                break  # not empty: another run lives there

    def requeued_by_slurm(self) -> bool:
        """A SLURM job requeued by Lightning's auto-requeue restarts with its original command;
        Lightning then resumes from the `hpc_ckpt_*.ckpt` it saved (which holds the last
        completed round, see checkpointing.AtomicCheckpointIO)."""
        restarted = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        return restarted and any(self.root.glob("hpc_ckpt_*.ckpt"))

    def prepare_fit(self, resuming: bool, overwrite: bool) -> None:
        self.lock()
        if resuming or self.requeued_by_slurm():
            return
        if self.holds_run():
            if not overwrite:
                self.unlock()
                if not (self.root / "checkpoints" / "last.ckpt").exists():
                    raise FLUserError(f"{self.root} already holds a run, stopped before its first round was saved "
                                      f"(nothing to resume); start it again with --overwrite true, or start this one "
                                      f"in a new --trainer.default_root_dir")
                raise FLUserError(f"{self.root} already holds a run; resume it with --ckpt_path last, start this one "
                                  f"in a new --trainer.default_root_dir, or replace it with --overwrite true")
            self.clear()
