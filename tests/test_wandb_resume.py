"""A resumed fit (`--ckpt_path last`) continues its own W&B run: the same run id in every part,
the partition logged once (at fit start, `_step` 0), every round's row at `_step` = its round, and
an end line whose `wandb sync` command uploads every part of the run into one. Tested the way a
user meets it: CLI subprocesses, W&B offline, the offline run files read back."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_outcomes import TINY, callback, env

from fl_lightning.loggers import offline_records

WANDB = str(Path(sys.executable).with_name("wandb"))


def fit(root: Path, *args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *TINY, "--analysis.partition", "true",
                           *args, "--trainer.default_root_dir", str(root)],
                          env=env(), capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def offline_part(folder: Path) -> tuple[str, list[dict]]:
    """The run id and the history rows of one offline part (an `offline-run-<time>-<id>` folder)."""
    (run_file,) = folder.glob("run-*.wandb")
    records = list(offline_records(run_file))
    run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return run_id, rows


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A 2-round fit, then the same command resumed to 3 rounds: (run dir, each part's end line)."""
    root = tmp_path_factory.mktemp("wandb-resume") / "run"
    lines = []
    for extra in ((), ("--ckpt_path", "last")):
        code, out, err = fit(root, *extra, "--trainer.max_epochs", "2" if not extra else "3")
        assert code == 0, err[-3000:]
        lines.append(out.strip().splitlines()[-1])
    return root, lines


def test_a_resumed_fit_continues_its_wandb_run(resumed):
    root, _ = resumed
    parts = sorted((root / "wandb").glob("offline-run-*"))  # W&B names them by start time
    assert len(parts) == 2, parts
    (first_id, first), (second_id, second) = (offline_part(p) for p in parts)
    assert first_id == second_id and parts[1].name.endswith("-" + first_id)
    # the first part: the partition at fit start (step 0), then rounds 1 and 2
    assert [r["_step"] for r in first] == [r["round"] for r in first] == [0, 1, 2]
    assert any(key.startswith("analysis/partition/") for key in first[0])  # the heatmap, an image
    # the resumed part: round 3 alone, at step 3; no second partition row
    assert [r["_step"] for r in second] == [r["round"] for r in second] == [3]
    assert not any(key.startswith("analysis/partition") for r in second for key in r)
    assert "global/test_acc" in second[0]


def test_the_end_line_of_a_resume_names_the_sync_of_every_part(resumed):
    root, (first_line, second_line) = resumed
    run_id = sorted((root / "wandb").glob("offline-run-*"))[0].name.rpartition("-")[2]
    assert first_line.startswith(f"run directory {root}: metrics.csv"), first_line
    assert second_line.startswith(f"run directory {root}: metrics.csv"), second_line
    command = second_line.partition("upload to W&B with: ")[2]
    assert command, second_line
    # the command as a shell would run it (its glob expanded): every part of this run, nothing else
    expanded = subprocess.run(["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True,
                              check=True).stdout.split()
    assert expanded[:2] == ["wandb", "sync"], command
    named = [Path(p) for p in expanded[2:] if not p.startswith("-")]
    assert sorted(named) == sorted((root / "wandb").glob(f"offline-run-*-{run_id}")), command
    # W&B's own CLI finds both parts of one run there (--dry-run: what it would upload, without a server)
    listed = subprocess.run([WANDB, "sync", "--dry-run", *expanded[2:]], env=env(), capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "Would sync 2 run(s)" in listed.stdout + listed.stderr, listed.stdout + listed.stderr
    assert shlex.split(command)  # one line a user can paste


def test_validate_after_a_resume_is_a_wandb_run_of_its_own(resumed):
    root, _ = resumed
    fit_id = sorted((root / "wandb").glob("offline-run-*"))[0].name.rpartition("-")[2]
    proc = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "validate", "--config",
                           str(root / "config.yaml"), "--ckpt_path", str(root / "checkpoints" / "last.ckpt")],
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (posthoc,) = (root / "posthoc" / "wandb").glob("offline-run-*")
    run_id, rows = offline_part(posthoc)
    assert run_id != fit_id
    assert [r["round"] for r in rows] == [3]


def test_a_round_logged_before_its_checkpoint_is_not_logged_again(tmp_path):
    """SIGTERM while round 2's checkpoint is written: the first part holds round 2's row, the
    checkpoint round 1. The resumed part trains round 2 again (the same numbers) and logs from
    round 3 on, so that the run holds every step once (uploaded, a second step 2 would follow
    step 2 in the run's history; online, W&B refuses it with a warning)."""
    root = tmp_path / "run"
    code, _, err = fit(root, "--trainer.max_epochs", "3",
                       callback("killswitch.KillSwitch", round=2, where="write", sig="SIGTERM"))
    assert code == 143, err[-3000:]
    code, _, err = fit(root, "--trainer.max_epochs", "3", "--ckpt_path", "last")
    assert code == 0, err[-3000:]
    (first_id, first), (second_id, second) = (offline_part(p) for p in sorted((root / "wandb").glob("offline-run-*")))
    assert first_id == second_id
    assert [r["_step"] for r in first] == [0, 1, 2]
    assert [r["_step"] for r in second] == [r["round"] for r in second] == [3]


class _ResumedRun:
    """W&B's run as a resumed online fit sees it: `step` is the step after the last one the server
    holds, and a log at an explicit step sets it (W&B refuses a lower one with a warning)."""

    def __init__(self, step: int):
        self.step, self.logged = step, []

    def log(self, row, step=None):
        assert step is not None and step >= self.step, (step, self.step)
        self.step = step
        self.logged.append((step, dict(row)))


def test_rows_go_at_their_round_and_a_round_the_run_holds_is_not_sent_again(tmp_path):
    """A fit stopped after it logged round 2 and before round 2's checkpoint trains round 2 again
    when resumed; online, W&B resumes that run at step 3 and would drop the row with a warning."""
    from fl_lightning import compat
    from fl_lightning.loggers import FLWandbLogger

    logger = FLWandbLogger(offline=True, save_dir=str(tmp_path))
    run = _ResumedRun(step=3)
    compat.set_wandb_run(logger, run)
    for values in ({"round": 2.0, "acc": 0.5}, {"round": 3.0, "acc": 0.6}, {"round": 3.0, "loss": 1.0},
                   {"round": 4.0, "acc": 0.7}):
        logger.add_to_round(values)
    logger.flush_round()
    assert run.logged == [(3, {"round": 3.0, "acc": 0.6, "loss": 1.0}), (4, {"round": 4.0, "acc": 0.7})]


def test_the_fits_wandb_run_is_the_newest_in_its_run_directory(tmp_path):
    from fl_lightning.wandb_run import fit_wandb_run_id

    assert fit_wandb_run_id(tmp_path) is None
    wandb_dir = tmp_path / "wandb"
    for name in ("offline-run-20260102_090000-bbbb2222", "run-20260101_120000-aaaa1111", "data", "cache"):
        (wandb_dir / name).mkdir(parents=True)
    (wandb_dir / "debug.log").write_text("")
    (wandb_dir / "latest-run").symlink_to(wandb_dir / "run-20260101_120000-aaaa1111")
    assert fit_wandb_run_id(tmp_path) == "bbbb2222"  # by the start time in the name, not the link
