"""Test-only callback that kills its own process with SIGKILL (no clean-up, like the OOM killer or
a lost node) at a chosen point of a chosen round, or sends itself SIGTERM (a preempted job).
Loaded into CLI subprocesses with `--trainer.callbacks+=<json>` and PYTHONPATH=tests."""

import os
import signal

import lightning as L

import fl_lightning.atomic as atomic


class KillSwitch(L.Callback):
    """`where`: "train" (after the round's first client trained), "eval" (during the global evaluation),
    "write" (inside the checkpoint write: the temporary file is half written, then the process
    dies before the rename). `round` is 1-based. `sig` is the signal's name."""

    def __init__(self, round: int, where: str = "train", sig: str = "SIGKILL"):
        self.round, self.where, self.sig = round, where, getattr(signal, sig)

    def _fire(self) -> None:
        os.kill(os.getpid(), self.sig)

    def _this_round(self, trainer) -> bool:
        return trainer.current_epoch + 1 == self.round

    def setup(self, trainer, pl_module, stage) -> None:
        if self.where != "write":
            return
        real_fsync, switch = atomic.os.fsync, self

        def fsync_then_die(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            name = os.path.basename(path)
            if switch._this_round(trainer) and name.startswith(atomic.TEMP_MARK) and name.endswith(".ckpt"):
                os.ftruncate(fd, os.fstat(fd).st_size // 2)
                switch._fire()
            real_fsync(fd)

        atomic.os.fsync = fsync_then_die

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # one Trainer batch is one client: after the round's first client (the round and its
        # checkpoint are not complete yet, even when that client was the round's only one)
        if self.where == "train" and self._this_round(trainer) and batch_idx == 0:
            self._fire()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "eval" and self._this_round(trainer) and not trainer.sanity_checking:
            self._fire()
