"""The W&B run of a fit starts in a thread of its own while the first round starts: the round does
not wait for W&B's service, and the run ends as complete as when it was started first; an error
starting it still ends the fit in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_outcomes import TINY, assert_one_line, env

from fl_lightning.outcome import EXIT_LOST

# The CLI with W&B's start made slow (a service slow to come up) or failing, and the order in
# which the rounds and the W&B run started, printed at the end.
LAUNCHER = r'''
import errno, sys, time, wandb
from fl_lightning import cli, federation
events, real_init = [], wandb.init

def init(*args, **kwargs):
    if sys.argv[1] == "fails":
        raise OSError(errno.ENOSPC, "No space left on device", sys.argv[2])
    time.sleep(3)
    run = real_init(*args, **kwargs)
    events.append("W&B run started")
    return run

wandb.init = init
round_starts = federation.FederatedCallback.on_train_epoch_start

def on_round_start(self, trainer, module):
    events.append(f"round {trainer.current_epoch + 1} starts")
    return round_starts(self, trainer, module)

federation.FederatedCallback.on_train_epoch_start = on_round_start
try:
    cli.main(sys.argv[3:])
finally:
    print("events:", events, flush=True)
'''


def fit(root: Path, how: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCHER, how, str(root / "wandb"), "fit", *TINY, *args,
                           "--trainer.default_root_dir", str(root)],
                          env=env(), capture_output=True, text=True, timeout=600)


def test_the_first_round_starts_while_the_wandb_run_starts_and_the_run_is_complete(tmp_path):
    root = tmp_path / "run"
    proc = fit(root, "slow", "--trainer.max_epochs", "2", "--analysis.partition", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = eval(proc.stdout.rsplit("events:", 1)[1])
    assert events[0] == "round 1 starts" and events.count("W&B run started") == 1, events
    assert sorted(events) == ["W&B run started", "round 1 starts", "round 2 starts"], events

    from fl_lightning.loggers import read_offline_history
    from fl_lightning.wandb_run import fit_wandb_run_id

    run_id = fit_wandb_run_id(root)
    assert f"upload to W&B with: wandb sync {root / 'wandb'}/offline-run-*-{run_id}" in proc.stdout
    rows = read_offline_history(next((root / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")))
    assert [r["round"] for r in rows] == [0.0, 1.0, 2.0]  # the partition's row first, then one per round
    assert rows[0]["analysis/partition/_type"] == "image-file" and "analysis/partition_counts/_type" in rows[0]
    assert all("global/test_acc" in r for r in rows[1:]), rows


def test_a_wandb_run_that_fails_to_start_ends_the_fit_in_one_line(tmp_path):
    root = tmp_path / "run"
    proc = fit(root, "fails", "--trainer.max_epochs", "2")
    assert proc.returncode == EXIT_LOST, proc.stderr[-3000:]
    assert_one_line(proc.stderr, rf"error: the disk refused a write \(No space left on device: "
                                 rf"{root / 'wandb'}\).*")
    assert "round 2 starts" not in proc.stdout  # at the W&B run's first use at the latest


def test_the_loggers_version_is_the_started_runs_id(tmp_path, monkeypatch):
    """Lightning names a ModelCheckpoint's default folder after the logger's version, the W&B run's
    id: it is the run's id also while the run is still starting (not the None of no run)."""
    import time

    import wandb

    from fl_lightning.loggers import FLWandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    real_init = wandb.init

    def slow_init(*args, **kwargs):
        time.sleep(1)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", slow_init)
    logger = FLWandbLogger(offline=True, save_dir=str(tmp_path), name="version")
    logger.experiment  # noqa: B018 - as Lightning's set-up asks for it, to have it created
    try:
        version = logger.version
        assert version is not None and version == wandb.run.id
    finally:
        wandb.finish()
