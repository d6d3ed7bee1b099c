"""Test-only callbacks that make a CLI run fail the way runs fail, at an exact point (whatever the
machine's load): `KillSwitch` kills its own process with SIGKILL (no clean-up, like the OOM killer
or a lost node) or sends it a signal (a preempted job, an impatient Ctrl-C); `DiskFault` makes the
disk refuse writes (full, read-only). Loaded into CLI subprocesses with
`--trainer.callbacks+=<json>` and PYTHONPATH=tests."""

import atexit
import errno
import os
import signal
import time

import lightning as L

import fl_lightning.atomic as atomic


class KillSwitch(L.Callback):
    """`where`: "train" (after the round's first client trained), "eval" (during the global
    evaluation), "write" (inside the checkpoint write: the temporary file is half written, then
    the process dies before the rename), "end" (after the last round, its checkpoint and records:
    the run is over), "exit" (while the process exits, after the CLI's main() returned: from an
    atexit function, as W&B's and torch's run then), "finalization" (later still: while the
    interpreter tears itself down after its last exit function, from an object's __del__).
    `round` is 1-based. `sig` is the signal's name. `rank`: fire only in the process of this
    global rank (None: every process). `then`: a second signal sent while the first one is being
    handled (from Lightning's exception hooks). `group`: the signal goes to the whole process group
    (a local sweep started in a session of its own, with every run it started). `armed_by`: fire
    only when this environment variable is set (so the same command can run again unharmed)."""

    def __init__(self, round: int, where: str = "train", sig: str = "SIGKILL", rank: int | None = None,
                 then: str | None = None, group: bool = False, armed_by: str | None = None):
        self.round, self.where, self.sig, self.rank = round, where, getattr(signal, sig), rank
        self.then = getattr(signal, then) if then else None
        self.group, self.armed = group, armed_by is None or bool(os.environ.get(armed_by))

    def _fire(self) -> None:
        if not self.armed:
            return
        if self.group:
            os.killpg(os.getpgrp(), self.sig)
        os.kill(os.getpid(), self.sig)

    def _this_round(self, trainer) -> bool:
        return trainer.current_epoch + 1 == self.round and (self.rank is None or trainer.global_rank == self.rank)

    def setup(self, trainer, pl_module, stage) -> None:
        if self.where == "exit" and (self.rank is None or trainer.global_rank == self.rank):
            atexit.register(self._fire)
        if self.where == "finalization" and self.armed:
            global _AT_FINALIZATION
            _AT_FINALIZATION = _SignalWhenCollected(self.sig)
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

    def on_train_end(self, trainer, pl_module) -> None:
        if self.where == "end" and (self.rank is None or trainer.global_rank == self.rank):
            self._fire()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.then is not None:
            os.kill(os.getpid(), self.then)


_AT_FINALIZATION = None


class _SignalWhenCollected:
    """Sends `sig` to this process when collected: a module global is collected while the
    interpreter finalizes, after every exit function (everything it needs is bound now: module
    globals may be gone by then)."""

    def __init__(self, sig: int):
        self.sig, self._kill, self._pid, self._sleep = sig, os.kill, os.getpid(), time.sleep

    def __del__(self):
        self._kill(self._pid, self.sig)
        self._sleep(0.2)  # a signal with its default action would end the process here


class DiskFault(L.Callback):
    """From round `round` (1-based) on, every atomic write (results, checkpoints, client-state
    files) fails with `error` ("ENOSPC": the disk is full; "EROFS": it is read-only), as the OS
    would report it; `round` 0 fails from the start of the fit. `rank`: only in the process of this
    global rank (None: every process)."""

    def __init__(self, round: int, error: str = "ENOSPC", rank: int | None = None):
        self.round, self.errno, self.rank = round, getattr(errno, error), rank

    def _break(self) -> None:
        code = self.errno

        def refuse(path, mode="r", *args, **kwargs):
            if any(m in mode for m in "wax+"):
                raise OSError(code, os.strerror(code), str(path))
            return open(path, mode, *args, **kwargs)

        atomic.open = refuse  # the module's writes find this before the builtin

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.round == 0 and self.rank in (None, trainer.global_rank):
            self._break()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.round and trainer.current_epoch + 1 == self.round and self.rank in (None, trainer.global_rank):
            self._break()


class SignalInsideWandbLog(L.Callback):
    """Sends `sig` to its own process from inside W&B's `Run.log` of round `round`'s row, then lets
    the call go on; when that call returns, a file `wandb-log-<round>-done` appears in the run
    directory (an exception raised in the middle of the call leaves it unwritten)."""

    def __init__(self, round: int, sig: str = "SIGINT"):
        self.round, self.sig, self.fired = round, getattr(signal, sig), False

    def setup(self, trainer, pl_module, stage) -> None:
        from wandb.sdk.wandb_run import Run

        real_log, switch, root = Run.log, self, trainer.default_root_dir

        def log_with_a_signal(run, data, *args, step=None, **kwargs):
            if step != switch.round or switch.fired:
                return real_log(run, data, *args, step=step, **kwargs)
            switch.fired = True
            os.kill(os.getpid(), switch.sig)
            time.sleep(0.5)  # the handler runs in here, between two bytecodes, if it is not deferred
            result = real_log(run, data, *args, step=step, **kwargs)
            with open(os.path.join(root, f"wandb-log-{switch.round}-done"), "w"):
                pass
            return result

        Run.log = log_with_a_signal
