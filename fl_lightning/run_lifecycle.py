"""How one `fl-lightning fit|validate|test|analyze` process ends: its exit code and at most one
`error:` line, whatever ended it (outcome.py lists the codes).

- Signals: SIGTERM and SIGINT raise FLInterrupted in the main thread (the current round is
  abandoned, the last completed round's checkpoint kept), after the W&B call they may arrive in
  (`outcome.uninterrupted`); a second signal while the first is handled, or one after the run's
  end, changes nothing.
- Errors: `one_line_error` turns an error the user or the environment caused (bad input, a lost
  process, a disk that refuses writes) into its line and exit code; anything else is a bug and
  keeps its traceback.
- Several processes (Lightning's DDP launcher): rank 0 says what happened and the other ranks
  exit with the same code. A process other than rank 0 that failed on its own says so itself and
  tells rank 0 by exiting with its code plus REPORTED_ELSEWHERE; rank 0 stops the processes it
  started before it reports, and LostProcessWatchdog ends a run whose process died while rank 0
  waits in a collective.

`RunLifecycle` holds one `main()` call's state: it is started before the CLI is built, turns an
interruption or an error into an `Ending`, and ends the process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from fl_lightning import compat
from fl_lightning.cli_parsing import summarise_parse_error
from fl_lightning.errors import FLUserError
from fl_lightning.federation import callback_of, federation_of
from fl_lightning.outcome import (
    EXIT_LOST,
    EXIT_USER_ERROR,
    REPORTED_ELSEWHERE,
    FLInterrupted,
    describe_refusal,
    disk_refused,
    interrupt,
    lost_peer,
)
from fl_lightning.parallel import lost_processes, reported_elsewhere
from fl_lightning.progress import close_bars
from fl_lightning.results import ResultsCallback
from fl_lightning.rundir import is_first_process
from fl_lightning.wandb_run import finish_wandb

_INITIAL_PARENT = os.getppid()
_REPORT_GRACE_SECONDS = 3.0
_PARENT_EXIT_SECONDS = 2.0  # a killed process's exit, from its sockets closing to its children reparented

# The CLI of this process's current run (FLCLI sets itself when it is constructed, `RunLifecycle`
# clears it when a run starts): what the lines below read the run's trainer and checkpoint from.
_active = None


def set_active_cli(cli) -> None:
    global _active
    _active = cli


def active_cli():
    return _active


@dataclass
class Ending:
    """How the process ends: its exit code, and the text of its `error:` line (None: no line)."""

    code: int
    line: str | None = None
    says_own_error: bool = False  # a process other than rank 0 reports its own error itself


class RunLifecycle:
    """One `main()` call: `in_process` is a call from Python (tests, sweeps), whose signal handlers
    and logging switch are given back afterwards; otherwise the process is the command and exits."""

    def __init__(self, in_process: bool):
        self.in_process = in_process
        os.environ.setdefault("WANDB_SILENT", "true")
        # A log file the disk refuses (W&B's debug.log on a full disk) would print a traceback for
        # every message logged to it, thousands in a run; the refusal is said once, as the run's
        # outcome, by the run's own writes or W&B's finish (logging's own switch for applications).
        self._raise_logging_errors, logging.raiseExceptions = logging.raiseExceptions, False
        compat.quiet_library_notices()
        self._previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
        set_active_cli(None)
        self.first = is_first_process()  # rank 0 says what happened; the other ranks exit with the same code
        if not in_process:
            # registered first, so it runs last: from there on the interpreter tears itself down (its
            # final garbage collection takes seconds) with Python's signal handlers gone
            atexit.register(_block_signals_at_finalization)

    def interrupted(self, err: FLInterrupted) -> Ending:
        """A signal ended the run."""
        _stop_launched_processes()
        return _after_interrupt(err)

    def failed(self, err: Exception, args: list[str] | None) -> Ending | None:
        """An error ended the run: its Ending, or None for a bug (the caller re-raises it). The
        W&B run is closed and the processes rank 0 started are stopped either way."""
        if not self.first and lost_peer(err):
            # A rank 0 killed mid-run closes its sockets before the kernel hands this process to a
            # new parent, so the lost collective can be seen before rank 0 looks gone: without
            # this wait the line (which must name rank 0 when it died) was left unsaid.
            _parent_gone(wait=_PARENT_EXIT_SECONDS)
        reported = one_line_error(err, args)
        if reported is not None and reported[1] == EXIT_LOST and self.first and lost_peer(err):
            reported = _lost_on_rank_0(reported)
        _stop_launched_processes()
        finish_wandb(exit_code=reported[1] if reported else 1)
        if reported is None:
            return None
        ending = Ending(reported[1], reported[0])
        if ending.code == EXIT_USER_ERROR:
            _abandon_failed_start()
        if not self.first and not _parent_gone():
            _report_from_launched_process(ending, err)
        return ending

    def release(self) -> None:
        """The run is over (however it ended): its run directory is unlocked and, in-process, the
        caller's signal handlers and logging switch are as they were."""
        cli = active_cli()
        if cli is not None and cli.run_dir is not None:
            cli.run_dir.unlock()
        if self.in_process:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            logging.raiseExceptions = self._raise_logging_errors

    def end(self, ending: Ending) -> None:
        """Prints the line (rank 0, or a process whose rank 0 is gone or that reports its own
        error) and exits with the code (returns for 0)."""
        said = ending.line and (self.first or _parent_gone() or ending.says_own_error)
        unsaid = [f"error: {ending.line}"] if said else []
        if said:
            close_bars()  # the line starts a line of its own, not the bar's
        if not self.in_process:
            _end_on_signal(ending.code, unsaid)
        while unsaid:
            print(unsaid.pop(), file=sys.stderr, flush=True)
        if ending.code:
            sys.exit(ending.code)


def _raise_interrupted(signum, frame) -> None:
    # the first signal ends the run; later ones (an impatient Ctrl-C Ctrl-C, a scheduler's TERM
    # then INT) must not cut the clean-up short: they are ignored from here on
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    interrupt(signum)


def _lost_on_rank_0(reported: tuple[str, int]) -> tuple[str | None, int]:
    """Rank 0 lost a process: the run's records name it, and when that process printed its own
    line (a damaged file, a full disk) rank 0 says nothing and exits with that process's code."""
    trainer = _trainer()
    elsewhere = None if trainer is None else reported_elsewhere(trainer, wait=_REPORT_GRACE_SECONDS + 2)
    # the summary's reason is the line (which names the process), not gloo's words
    _record_lost(reported[0] if elsewhere is None else _lost_line())
    return reported if elsewhere is None else (None, elsewhere)


def _report_from_launched_process(ending: Ending, err: Exception) -> None:
    """A process Lightning's launcher started, whose rank 0 is alive: a lost peer is rank 0's to
    name; its own error, which rank 0 only sees as a vanished peer, it says itself (after a moment
    in which rank 0, failing alike, would have stopped it) and tells rank 0 by its exit code that
    it did."""
    if lost_peer(err):
        ending.line = None
    elif ending.line and _launched_by_rank_0():
        time.sleep(_REPORT_GRACE_SECONDS)
        ending.code += REPORTED_ELSEWHERE
        ending.says_own_error = True


class LostProcessWatchdog(Callback):
    """On rank 0 of a run whose other processes Lightning's launcher started here: if one of them
    dies (kill -9, out of memory, a crash), the run ends as lost with one line naming it, instead of
    rank 0 waiting in its next collective (gloo notices a dead peer within seconds and this only
    adds the name; NCCL would wait for the collective timeout)."""

    POLL_SECONDS, GRACE_SECONDS = 0.5, 10.0

    def __init__(self):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.is_global_zero and compat.launched_processes(trainer) and self._thread is None:
            compat.disarm_child_process_observer()  # this watchdog decides when a dead process ends the run
            self._thread = threading.Thread(target=self._watch, args=(trainer, pl_module), daemon=True)
            self._thread.start()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop.set()

    def _watch(self, trainer, pl_module) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            if lost_processes(trainer, wait=0):
                # the main thread usually hears of it from its collective first and ends the run
                # itself; if it is still running after the grace period, it is stuck there
                if self._stop.wait(self.GRACE_SECONDS):
                    return
                line = _lost_line()
                results = callback_of(trainer, ResultsCallback)
                if results is not None:
                    with contextlib.suppress(Exception):
                        results.record_lost(trainer, pl_module, line)
                elsewhere = reported_elsewhere(trainer, wait=0)  # that process printed the line itself
                if elsewhere is None:
                    print(f"error: {line}", file=sys.stderr, flush=True)
                for _, proc in compat.launched_processes(trainer):
                    with contextlib.suppress(OSError):
                        proc.kill()
                os._exit(EXIT_LOST if elsewhere is None else elsewhere)


def _raised_by_trainer_init(err: BaseException) -> bool:
    """An error from Lightning's Trainer constructor is a bad trainer.* option (an unknown
    accelerator, devices 'abc', ...): Lightning validates its arguments there."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "__init__" and code.co_filename.endswith(os.path.join("pytorch", "trainer", "trainer.py")):
            return True
        tb = tb.tb_next
    return False


def one_line_error(err: BaseException, args: list[str] | None = None) -> tuple[str, int] | None:
    """The one line (and exit code) for an error the user caused or the environment did (a lost
    process, a disk that refuses writes), or None for a real bug. Errors raised while jsonargparse
    instantiates a class arrive wrapped, so walk the chain."""
    seen = err
    while seen is not None:
        if isinstance(seen, FLUserError):
            return str(seen), EXIT_USER_ERROR
        seen = seen.__cause__ or seen.__context__
    if lost_peer(err):
        return _lost_line(), EXIT_LOST
    refused = disk_refused(err)
    if refused is not None:
        return (f"the disk refused a write ({describe_refusal(refused)}){_saved_rounds()}; make room "
                f"(or make the run directory writable) and run the same command{_resume_hint()}"), EXIT_LOST
    if isinstance(err, ValueError) and "Expected more than 1 value per channel when training" in str(err):
        data = getattr(getattr(active_cli(), "datamodule", None), "hparams", None)
        size = f" (its size is 1 more than a multiple of data.batch_size {data.batch_size})" if data else ""
        return (f"a mini-batch of 1 sample reached a BatchNorm layer in training (batch norm needs at least 2 "
                f"samples): a client's data ends in a 1-sample batch{size}; choose another --data.batch_size, or a "
                f"model without BatchNorm"), EXIT_USER_ERROR
    if type(err).__name__ == "ArgumentError":  # jsonargparse's parse errors (exit_on_error=False)
        return summarise_parse_error(str(err), args, active_cli()), EXIT_USER_ERROR
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(err, (ValueError, TypeError, MisconfigurationException)) and _raised_by_trainer_init(err):
        text = " ".join(str(err).split())
        if "No supported gpu backend found" in text or "can not run on your system since the accelerator" in text:
            return ("trainer.accelerator: this machine has no usable GPU (torch.cuda.is_available() is "
                    "False); use --trainer.accelerator cpu (or auto, which picks a GPU where there is one)"), \
                EXIT_USER_ERROR
        return f"trainer: {text}", EXIT_USER_ERROR
    return None


def _trainer():
    cli = active_cli()
    return getattr(cli, "trainer", None) if cli is not None else None


def _saved_checkpoint() -> tuple[int, Path] | None:
    """(completed rounds, file) of this run's round checkpoint: the rounds this process saved, or,
    before it saved any (a resume that failed before its first round), the ones `--ckpt_path last`
    holds; None without one (a new run, or one being overwritten)."""
    cli = active_cli()
    checkpoint = getattr(cli, "round_checkpoint", None) if cli is not None else None
    if checkpoint is None or not checkpoint.last_path.exists():
        return None
    if checkpoint.rounds_saved:
        return checkpoint.rounds_saved, checkpoint.last_path
    with contextlib.suppress(Exception):
        resumed = cli.subcommand_config().get("ckpt_path")
        if resumed and Path(resumed).resolve() == checkpoint.last_path.resolve() and cli.checkpoint_rounds:
            return cli.checkpoint_rounds, checkpoint.last_path
    return None


def _saved_rounds() -> str:
    """"; N completed round(s) are saved in <file>" when the run has a round checkpoint."""
    saved = _saved_checkpoint()
    return f"; {saved[0]} completed round(s) are saved in {saved[1]}" if saved else "; no completed round was saved"


def _resume_hint() -> str:
    return " with --ckpt_path last" if _saved_checkpoint() else ""


def _lost_line() -> str:
    trainer = _trainer()
    where = f" in round {trainer.current_epoch + 1}/{trainer.max_epochs}" if trainer is not None else ""
    lost = lost_processes(trainer) if trainer is not None else []
    if not lost and _parent_gone():  # a process Lightning's launcher started outlived rank 0, its parent
        lost = [f"rank 0 (pid {_INITIAL_PARENT}) is gone (killed, or ended without stopping this process)"]
    who = ", ".join(lost) if lost else "another process of the run stopped responding"
    return f"lost process: {who}{where}{_saved_rounds()}; run the same command{_resume_hint()} to resume"


def _interrupted_line(err: FLInterrupted) -> str:
    trainer = _trainer()
    where = f" in round {trainer.current_epoch + 1}/{trainer.max_epochs}" if trainer is not None else ""
    if _resume_hint():
        return f"interrupted by {err}{where}{_saved_rounds()}: resume with the same command and --ckpt_path last"
    return (f"interrupted by {err}{where}; no completed round was saved, so there is nothing to resume: start the "
            f"run again")


def _abandon_failed_start() -> None:
    """Bad input found after the fit claimed its run directory (a client model that cannot take the
    data's images is built in setup, say) and before any round was saved: the directory is left as
    if the command had never run, so the corrected command is not refused as "already holds a run"."""
    cli = active_cli()
    if cli is None or cli.run_dir is None or cli.subcommand != "fit":
        return
    checkpoint = cli.round_checkpoint
    if checkpoint is None or checkpoint.last_path.exists():
        return  # a round was saved (or is being resumed): the run stays
    cli.run_dir.abandon()


def _end_on_signal(code: int, unsaid: list[str]) -> None:
    """The run has ended: a signal from here on (while the process exits: W&B's, torch's exit
    functions) changes nothing; it ends the process at once, with the run's exit code and its
    line if that is not printed yet."""

    def handler(signum, frame) -> None:
        while unsaid:
            print(unsaid.pop(), file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)


def _block_signals_at_finalization() -> None:
    """The last exit function of an `fl-lightning` process: the outcome is decided, printed and on
    disk, and the exit code set; SIGTERM or SIGINT during the interpreter's teardown would otherwise
    take the default action and turn a finished run's exit code 0 into death by the signal."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def _stop_launched_processes() -> None:
    """Rank 0 of a run that an error or a signal ends: the processes Lightning's launcher started
    from it would only learn of it from their next collective (a lost peer) and report it as a
    second line, so they are stopped (SIGKILL: they hold nothing the run still needs, the round
    checkpoint and the records are rank 0's) before rank 0 reports and exits."""
    trainer = _trainer()
    if trainer is None:
        return
    for _, proc in compat.launched_processes(trainer):
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def _record_lost(line: str) -> None:
    trainer = _trainer()
    results = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, ResultsCallback)), None)
    if results is not None and trainer.lightning_module is not None:
        with contextlib.suppress(Exception):
            results.record_lost(trainer, trainer.lightning_module, line)


def _after_interrupt(err: FLInterrupted) -> Ending:
    """A signal: the run's own exit code if it had already ended (a signal after completion
    changes nothing), else 128 + the signal's number."""
    cli, trainer = active_cli(), _trainer()
    federation = federation_of(trainer) if trainer is not None else None
    if federation is not None and federation.record.outcome.final and cli is not None:
        finish_wandb(exit_code=cli.exit_code())
        return Ending(cli.exit_code(), cli.stop_line())
    finish_wandb(exit_code=128 + err.signum)
    return Ending(128 + err.signum, _interrupted_line(err))


def _launched_by_rank_0() -> bool:
    """This process is one Lightning's launcher started from rank 0 on this machine (ranks 1.. of
    `--trainer.strategy ddp`; not a process of torchrun or srun, whose agents start every rank)."""
    return (not is_first_process() and int(os.environ.get("LOCAL_RANK", "0") or 0) > 0
            and not any(name in os.environ for name in ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_LOCALID")))


def _parent_gone(wait: float = 0.0) -> bool:
    """For a process Lightning's launcher started (ranks > 0 on one machine): rank 0, its parent,
    has died, so nobody else will say what happened. With `wait`, up to that many seconds for a
    dying parent's exit to complete (this process is reparented only then)."""
    if is_first_process():
        return False
    deadline = time.monotonic() + wait
    while os.getppid() == _INITIAL_PARENT:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
