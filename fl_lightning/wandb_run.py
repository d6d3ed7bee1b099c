"""The W&B run of one `fl-lightning fit|validate|test|analyze`: where its files go, what it is
called and grouped with, the round it logs as, and how it is closed.

A fit's W&B run lives in its run directory (`<trainer.default_root_dir>/wandb`), and a resumed fit
(`--ckpt_path last`, a requeued SLURM job) continues it: the same run id, read from the name of the
run's newest folder there (`offline-run-<time>-<id>`, or `run-<time>-<id>` online). Online, W&B
resumes the run on its server; offline, each part is a folder of its own with that id, and one
`wandb sync` of them all uploads them as one run, in order of start time. validate, test
and analyze of a checkpoint log into a W&B run of their own, in the fit's group, kept under
`<run dir>/posthoc/` so that the fit's files stay as the fit left them. The run is closed when the
command ends, with the command's exit code, and its files are complete on disk when the command
returns (an offline run is then ready for `wandb sync`). The logger itself (offline unless logged
in, one history row per round) is fl_lightning/loggers.py.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from fl_lightning import compat
from fl_lightning.loggers import FLWandbLogger, describe_wandb_run, offline_records, wait_for_wandb_starts
from fl_lightning.outcome import DISK_ERRNOS, uninterrupted

__all__ = ["configure_wandb_logger", "continue_fit_wandb_run", "describe_wandb_run", "finish_wandb",
           "fit_wandb_run_id", "log_as_checkpoint_round", "logged_steps", "post_run_wandb_run", "sync_hint"]

# W&B's folder of one run (one part of it, for a resumed run): `[offline-]run-<YYYYMMDD_HHMMSS>-<id>`
RUN_FOLDER = re.compile(r"^(?:offline-)?run-(\d{8}_\d{6})-([A-Za-z0-9_-]+)$")


def configure_wandb_logger(logger, command: str, root: str) -> None:
    """Completes the configured logger (`trainer.logger`, as parsed) of a `command` whose run
    directory is `root`: a W&B logger left without a save_dir writes into the run directory, and
    validate/test/analyze get a W&B run of their own (`post_run_wandb_run`)."""
    init = getattr(logger, "init_args", None)
    if init is None:
        return
    if "save_dir" in init and init.save_dir is None:
        init.save_dir = root
    if command != "fit":
        post_run_wandb_run(init, command, root)


def post_run_wandb_run(init, command: str, root: str) -> None:
    """validate, test and analyze log into a W&B run of their own: job_type the command, in the
    fit's group, named `<fit's name>/<command>`, and kept under `<run dir>/posthoc/` so that the
    fit's W&B files and its `latest-run` link stay as the fit left them. Never the fit's id: that
    would make the command's numbers a part of the fit's run (a resumed fit's parts share an id)."""
    if "save_dir" in init and (init.save_dir is None or Path(init.save_dir) == Path(root)):
        init.save_dir = str(Path(root) / "posthoc")
    for key in ("id", "version"):
        if key in init:
            init[key] = None
    if "job_type" in init and not init.job_type:
        init.job_type = command
    if "group" in init and not init.group and init.get("name"):
        init.group = init.name
    if init.get("name"):
        init.name = f"{init.name}/{command}"


def fit_wandb_run_id(save_dir: str | Path) -> str | None:
    """The id of the W&B run whose files W&B keeps in `<save_dir>/wandb`: its newest folder's (by the
    start time in its name), or None when it holds none. In a run directory that is the fit's (the
    runs of validate, test and analyze are under `posthoc/`); after `--overwrite true`, the newest
    folder is the new fit's, as W&B keeps the replaced run's folders."""
    wandb_dir = Path(save_dir) / "wandb"
    found = [m.groups() for m in map(RUN_FOLDER.match, (p.name for p in wandb_dir.glob("*run-*") if p.is_dir()))
             if m]
    return max(found)[1] if found else None


def continue_fit_wandb_run(loggers, root: str | Path) -> None:
    """A resumed fit logs into the W&B run it started: every FLWandbLogger whose files are in the run
    directory `root` and that was given no id of its own takes the id of the run there, with W&B's
    resume="allow" (online: the server's run goes on where it stopped; offline: a new folder with
    the same id, uploaded into the same run). A logger with its own save_dir elsewhere, or a run
    directory without a W&B run yet, starts a new W&B run."""
    for logger in loggers:
        if not isinstance(logger, FLWandbLogger) or Path(logger.save_dir).absolute() != Path(root).absolute():
            continue
        init = compat.wandb_init_kwargs(logger)
        run_id = init.get("id") or fit_wandb_run_id(root)
        if run_id:
            init["id"] = run_id
            init["resume"] = init.get("resume") or "allow"
            logger.first_step = logged_steps(root, run_id)
            # A W&B service inherited from a parent process (WANDB_SERVICE in the environment: a
            # test runner's, a job script's) may still hold this run's stream for the fit that was
            # killed, and refuses the same id ("run ID ... is in use"): this process starts its own.
            os.environ.pop("WANDB_SERVICE", None)


def logged_steps(save_dir: str | Path, run_id: str) -> int:
    """The number of history steps the parts of W&B run `run_id` in `<save_dir>/wandb` hold (its
    last step + 1), read from their run files (`run-<id>.wandb`, kept online and offline); a part
    whose file cannot be read (a process killed before W&B wrote it) counts for nothing."""
    steps = [0]
    for run_file in Path(save_dir, "wandb").glob(f"*run-*-{run_id}/run-{run_id}.wandb"):
        try:
            steps += [r.history.step.num + 1 for r in offline_records(run_file, require_complete=False)
                      if r.WhichOneof("record_type") == "history"]
        except (OSError, ValueError):
            continue
    return max(steps)


def log_as_checkpoint_round(loggers, rounds: int) -> None:
    """validate/test/analyze of a checkpoint log their numbers at the round the checkpoint holds
    (Lightning's epoch counter is 0 when a checkpoint is only evaluated)."""
    for logger in loggers:
        if isinstance(logger, FLWandbLogger):
            logger.checkpoint_round = rounds


def sync_hint() -> str:
    """Where the command's W&B run went, as the end of its last line: "; upload to W&B with: wandb
    sync <wandb dir>/offline-run-*-<id>" while an offline W&B run is open, "; W&B run: <url>" for an
    online one, else "". The glob names every part of the run (a resumed fit's parts share its id),
    which `wandb sync` uploads into one run, in order of their start time; parts already uploaded
    are skipped (W&B marks them with a `.wandb.synced` file)."""
    wait_for_wandb_starts()
    wandb = sys.modules.get("wandb")
    run = wandb.run if wandb is not None else None
    if run is None:
        return ""
    if run.settings.mode in ("offline", "dryrun"):
        wandb_dir = Path(run.dir).parent.parent
        return f"; upload to W&B with: wandb sync {shlex.quote(str(wandb_dir))}/offline-run-*-{run.id}"
    url = getattr(run, "url", None)
    return f"; W&B run: {url}" if url else ""


def finish_wandb(exit_code: int) -> OSError | None:
    """Close the W&B run so its summary and history are complete on disk (offline runs are then
    ready for `wandb sync`); a diverged or failed run is closed with a non-zero exit code.

    Returns the disk's refusal when W&B could not write its files (a full disk: its log file's
    last flush fails inside finish()), naming the W&B run's directory, instead of raising it:
    a run that an error already ended keeps that error as its outcome and its one line, and only
    a run that ended well makes the refusal its outcome (`FLCLI.after_fit`)."""
    wait_for_wandb_starts()
    wandb = sys.modules.get("wandb")
    if wandb is None or wandb.run is None:
        return None
    where, refused = str(Path(wandb.run.dir).parent), None
    for close in (lambda: wandb.finish(exit_code=exit_code),
                  # finish() can return before W&B's core process has written the run's last block
                  # (a small offline run's file is then just its header); teardown waits for it, so
                  # the run's files are complete when the command returns (for `wandb sync`, sweeps,
                  # tests). After a refused finish it still stops W&B's service.
                  wandb.teardown):
        try:
            with uninterrupted():
                close()
        except OSError as err:
            if err.errno not in DISK_ERRNOS:
                raise
            # a new error, not W&B's: its chain (a log file's flush, failing again on close)
            # names no file, and the first error of a chain is the one a line reports
            refused = refused or OSError(err.errno, err.strerror, err.filename or where)
    return refused
