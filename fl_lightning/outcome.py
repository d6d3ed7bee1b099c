"""A run's outcome: one value, decided once, stored with the run (`summary.json` and the round
checkpoint), and read by everything that needs it (`report`, `sweep`, the CLI's exit code) through
`read_outcome`, so that no two places tell "diverged" from "failed" in two ways.

The exit codes of `fl-lightning fit` follow from it (`EXIT_CODES`), and the README's reliability
section documents them:

    0    every round ran (the outcome may still be failed or diverged where on_collapse: mark or
         on_divergence: skip_client let the run go on)
    2    refused: bad input (an option, a config, a data file, a checkpoint, a damaged state file)
    3    stopped by a decision: diverged (NaN/inf), or failed (collapse) with on_collapse: stop
    4    lost: a process of the run died or the disk refused a write; resume with --ckpt_path last
    130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (128 + the signal's number)
    1    crashed: a bug (the traceback is printed)
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path


class Outcome(StrEnum):
    RUNNING = "running"  # no end recorded: in progress, or killed without a chance to record one (kill -9)
    FINISHED = "finished"  # every round ran, and nothing marked it failed or diverged
    DIVERGED = "diverged"  # NaN/inf weights or test loss (the papers' tables print it as diverged)
    FAILED = "failed"  # collapsed to chance accuracy with finite weights (the papers' "Failed")
    INTERRUPTED = "interrupted"  # a signal (SIGTERM, SIGINT) ended it after its last completed round
    LOST = "lost"  # a process died or a write failed; the last completed round is saved
    CRASHED = "crashed"  # an error that is a bug

    @property
    def final(self) -> bool:
        """The run is over: a sweep does not run it again, a report counts it."""
        return self in (Outcome.FINISHED, Outcome.DIVERGED, Outcome.FAILED)


EXIT_OK, EXIT_CRASHED, EXIT_USER_ERROR, EXIT_STOPPED, EXIT_LOST = 0, 1, 2, 3, 4
# A process Lightning's launcher started (rank > 0 on one machine) that failed on its own (a
# damaged state file, the disk refusing its write) prints its line itself and exits with this plus
# its exit code, so that rank 0, which only sees its peer vanish, says nothing more and exits with
# that code: a private code between the run's processes, never the command's.
REPORTED_ELSEWHERE = 64


def read_outcome(run_dir: str | Path) -> Outcome | None:
    """The outcome recorded in `<run_dir>/summary.json`; None when there is no readable summary.

    Summaries written before the outcome was recorded carry only `finished`, `diverged` and
    `failed` flags; they are read the way the report read them then."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    recorded = summary.get("outcome")
    if recorded in [o.value for o in Outcome]:
        return Outcome(recorded)
    if summary.get("diverged"):
        return Outcome.DIVERGED
    if summary.get("finished"):
        return Outcome.FAILED if summary.get("failed") else Outcome.FINISHED
    return Outcome.RUNNING


class FLInterrupted(BaseException):
    """SIGTERM or SIGINT: the current round is abandoned (a BaseException, like KeyboardInterrupt,
    so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# A signal that arrived inside `uninterrupted` (it ends the run when the block is done), and how
# many such blocks are open.
_deferred_signals: list[int] = []
_uninterrupted_depth = 0


@contextmanager
def uninterrupted():
    """A block that a signal must not cut short: W&B's calls wait on its service and its own
    thread, and an exception raised in the middle of one leaves them waiting for each other (its
    teardown then never returns). A SIGTERM or SIGINT that arrives inside ends the run as soon as
    the block is done (`interrupt`)."""
    global _uninterrupted_depth
    _uninterrupted_depth += 1
    try:
        yield
    finally:
        _uninterrupted_depth -= 1
    if _uninterrupted_depth == 0 and _deferred_signals:
        raise FLInterrupted(_deferred_signals.pop())


def interrupt(signum: int) -> None:
    """A signal ends the run: FLInterrupted now, or at the end of the `uninterrupted` block it
    arrived in."""
    if _uninterrupted_depth:
        _deferred_signals.append(signum)
        return
    raise FLInterrupted(signum)


class FLLostProcess(RuntimeError):
    """A process of a multi-process run died (found by the CLI's watchdog, or by a collective that
    lost its peer)."""


# What torch.distributed's backends say when a peer process is gone (gloo, NCCL, the TCP store).
_LOST_PEER_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "glhf",
                    "communicator was aborted", "socket timeout", "connection refused", "nccl error",
                    "timed out", "timeout", "recvbytes", "sendbytes")
# What the OS says when the disk refuses a write: full, read-only, no permission, over quota.
DISK_ERRNOS = (28, 30, 13, 122, 1)


def lost_peer(exception: BaseException) -> bool:
    """True when `exception` (or one in its chain) is a collective that lost a peer process."""
    import torch.distributed as dist

    seen: BaseException | None = exception
    while seen is not None:
        if isinstance(seen, FLLostProcess | dist.DistBackendError | dist.DistNetworkError):
            return True
        if isinstance(seen, RuntimeError) and any(m in str(seen).lower() for m in _LOST_PEER_MARKS) and (
                dist.is_available() and dist.is_initialized()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def disk_refused(exception: BaseException) -> OSError | None:
    """The OSError in `exception`'s chain that is the disk refusing a write, else None: the first
    one that happened (the deepest in the chain; a refused round checkpoint, not W&B's media copy
    that then failed on the same disk while the run was being ended)."""
    seen: BaseException | None = exception
    found = None
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            found = seen
        seen = seen.__cause__ or seen.__context__
    return found


def describe_refusal(refused: OSError) -> str:
    """"No space left on device: <file>" (the file where the error knows it)."""
    what = refused.strerror or f"errno {refused.errno}"
    return f"{what}: {refused.filename}" if refused.filename else what


def outcome_of_exception(exception: BaseException) -> tuple[Outcome, str]:
    """The outcome of a run an exception ended, and a line that says why."""
    if isinstance(exception, FLInterrupted):
        return Outcome.INTERRUPTED, f"interrupted by {exception}"
    if lost_peer(exception):
        return Outcome.LOST, f"a process of the run was lost ({_first_line(exception)})"
    refused = disk_refused(exception)
    if refused is not None:
        return Outcome.LOST, f"the disk refused a write ({describe_refusal(refused)})"
    return Outcome.CRASHED, f"{type(exception).__name__}: {_first_line(exception)}"


def _first_line(exception: BaseException) -> str:
    text = str(exception).strip()
    return text.splitlines()[0][:200] if text else type(exception).__name__
