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
    if recorded in Outcome._value2member_map_:
        return Outcome(recorded)
    if summary.get("diverged"):
        return Outcome.DIVERGED
    if summary.get("finished"):
        return Outcome.FAILED if summary.get("failed") else Outcome.FINISHED
    return Outcome.RUNNING
