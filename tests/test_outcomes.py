"""A run's outcome survives signals, other processes and damaged state, tested the way
it happens: CLI subprocesses on 1 and 2 gloo processes with faults injected at exact points
(tests/killswitch.py: SIGKILL, signals, a disk that refuses writes; tests/faulty_methods.py: a
client whose training diverges, a collapsing model), and real run directories whose client-state
files are deleted, truncated, swapped or flipped. Every fault ends in one `error:` line and a
documented exit code (fl_lightning/outcome.py), never a traceback."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fl_test_utils import reproducible_rows

from fl_lightning.checkpointing import completed_rounds
from fl_lightning.outcome import EXIT_LOST, EXIT_STOPPED, EXIT_USER_ERROR, Outcome, read_outcome
from fl_lightning.results import read_metrics

REPO = Path(__file__).resolve().parents[1]
S, M = REPO / "configs" / "settings", REPO / "configs" / "methods"
# the shorthand T, on the MNIST-5k setting with FedAvg
TINY = ["--config", str(S / "mnist5k.yaml"), "--config", str(M / "fedsol" / "fedavg.yaml"),
        "--data.dataset", "digits", "--model.init_args.model", "mlp", "--data.num_clients", "10",
        "--data.min_size", "5", "--federation.eval_local_models", "false", "--trainer.enable_progress_bar", "false",
        "--analysis.partition", "false"]
TWO_PROCESSES = ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.devices", "2"]
SCAFFOLD = ["--model", "SCAFFOLD", "--data.sample_ratio", "0.5"]  # the setting's FedAvg swapped for SCAFFOLD


def env() -> dict:
    e = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), e.get("PYTHONPATH", "")])
    return e


def start(root: Path, *args: str, session: bool = False) -> subprocess.Popen:
    """The fit in a subprocess (`session`: in a session of its own, as a terminal's job: a signal
    to its process group reaches every process of the run, and nothing else)."""
    return subprocess.Popen([sys.executable, "-m", "fl_lightning.cli", "fit", *TINY, *args,
                             "--trainer.default_root_dir", str(root)],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=session)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def run(root: Path, *args: str) -> tuple[int, str]:
    return finish(start(root, *args))


def callback(class_path: str, **init_args) -> str:
    return f"--trainer.callbacks+={json.dumps({'class_path': class_path, 'init_args': init_args})}"


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def summary(root: Path) -> dict:
    return json.loads((root / "summary.json").read_text())


def wandb_clients_tables(root: Path) -> dict[int, list[list]]:
    """The W&B run's clients tables by the round of their row: their rows, as (round, client)."""
    from fl_lightning.loggers import read_offline_history

    run_dir = next((root / "wandb").glob("offline-run-*"))
    rows = read_offline_history(next(run_dir.glob("run-*.wandb")), require_complete=False)
    tables = {int(r["round"]): json.loads((run_dir / "files" / r["clients/table/path"]).read_text())
              for r in rows if "clients/table/path" in r}
    return {n: [[int(row[0]), int(row[1])] for row in t["data"]] for n, t in tables.items()
            if t["columns"][:2] == ["round", "client"]}


def clients_of(root: Path) -> list[list[int]]:
    """clients.csv's rows as (round, client)."""
    return [[int(r["round"]), int(r["client"])] for r in read_metrics(root / "clients.csv")]


def assert_one_line(err: str, pattern: str) -> str:
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(pattern, lines[0]), lines[0]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


# ---- a decision to stop is the same on every process ----------------------------------------------
def stopped_alike_on_one_and_two_processes(tmp_path, args: list[str], line: str) -> tuple[str, dict, dict]:
    """The same command on 1 and on 2 processes: both exit 3 with the same single `line` (a
    regex); returns that line and the two runs' summary.json."""
    procs = {n: start(tmp_path / str(n), *args, *(TWO_PROCESSES if n == 2 else [])) for n in (1, 2)}
    lines = {}
    for n, proc in procs.items():
        code, err = finish(proc)
        assert code == EXIT_STOPPED, err[-3000:]
        lines[n] = assert_one_line(err, line)
    assert lines[1] == lines[2]
    return lines[1], summary(tmp_path / "1"), summary(tmp_path / "2")


def test_a_divergence_on_two_processes_ends_exactly_as_on_one(tmp_path):
    """lr 1e25: every client's weights become NaN on both processes (rank 1 used to crash in
    its W&B summary call with a traceback, and summary.json said diverged: false)."""
    diverging = ["--model.init_args.lr", "1e25", "--federation.collapse_rounds", "0", "--trainer.max_epochs", "3"]
    line, one, two = stopped_alike_on_one_and_two_processes(
        tmp_path, diverging, r"error: diverged: non-finite weights at round 1/3, client \d+, method FedAvg; "
                             r"lower the lr or set --federation.on_divergence skip_client")
    assert one["outcome"] == two["outcome"] == "diverged" and one["diverged"] and two["diverged"]
    assert one["reason"] == two["reason"] == line.removeprefix("error: ")
    assert read_outcome(tmp_path / "2") is Outcome.DIVERGED


def test_a_divergence_on_rank_1_only_ends_exactly_as_on_one_process(tmp_path):
    """One client's upload is NaN, and with 2 processes that client trains on rank 1 alone: rank 0
    saw only finite uploads, yet both processes stop after the same round, rank 0 prints the
    line once, and the run is recorded as on one process."""
    from fl_lightning.data.datamodule import FederatedDataModule
    from fl_lightning.parallel import assign_clients

    # TINY's data (seed_everything 0 is data.seed): round 2 samples clients 4 and 8, client 4 for
    # the first time, and the longest-first assignment gives it to rank 1
    data = FederatedDataModule(dataset="digits", num_clients=10, sample_ratio=0.2, local_epochs=5, batch_size=50,
                               partition="dirichlet", alpha=0.1, partition_seed=0, min_size=5, seed=0)
    data.setup()
    rounds = [data.plan_round(r).clients for r in range(2)]
    ranks = assign_clients([c.num_steps for c in rounds[1]], 2)
    assert 4 not in [c.client for c in rounds[0]]
    assert [rounds[1][i].client for i in ranks[1]] == [4] and 4 not in [rounds[1][i].client for i in ranks[0]]

    args = ["--model", "faulty_methods.PoisonedClient", "--model.init_args.poisoned", "4",
            "--federation.on_divergence", "stop", "--federation.collapse_rounds", "0", "--trainer.max_epochs", "3"]
    line, one, two = stopped_alike_on_one_and_two_processes(
        tmp_path, args, r"error: diverged: non-finite weights at round 2/3, client 4, method PoisonedClient; "
                        r"lower the lr or set --federation.on_divergence skip_client")
    for record in (one, two):
        assert record["outcome"] == "diverged" and record["diverged"] and not record["finished"]
        assert record["reason"] == line.removeprefix("error: ") and record["rounds_completed"] == 1
    assert read_outcome(tmp_path / "2") is Outcome.DIVERGED
    for n in (1, 2):  # round 1 is saved, the diverged round 2 is not
        saved = torch.load(tmp_path / str(n) / "checkpoints" / "last.ckpt", weights_only=True)
        assert completed_rounds(saved) == 1
    assert read_metrics(tmp_path / "1" / "metrics.csv")[0]["global/test_acc"] == \
        read_metrics(tmp_path / "2" / "metrics.csv")[0]["global/test_acc"]
    for n in (1, 2):  # round 1 was neither a 10th nor the last round: its clients go to W&B as the run ends
        assert wandb_clients_tables(tmp_path / str(n)) == {1: clients_of(tmp_path / str(n))}


def test_skip_client_on_two_processes_skips_the_same_client_and_runs_on(tmp_path):
    """One client's upload is NaN in every round it is sampled; on_divergence skip_client drops it
    on whichever process trained it, and both runs finish with the same per-round metrics."""
    args = ["--model", "faulty_methods.PoisonedClient", "--model.init_args.poisoned", "3",
            "--federation.on_divergence", "skip_client", "--data.sample_ratio", "0.5", "--trainer.max_epochs", "2"]
    procs = {n: start(tmp_path / str(n), *args, *(TWO_PROCESSES if n == 2 else [])) for n in (1, 2)}
    for proc in procs.values():
        code, err = finish(proc)
        assert code == 0 and not error_lines(err) and "Traceback" not in err, err[-3000:]
    rows = {n: read_metrics(tmp_path / str(n) / "metrics.csv") for n in procs}
    assert [r["clients/skipped"] for r in rows[1]] == [r["clients/skipped"] for r in rows[2]]
    assert sum(r["clients/skipped"] for r in rows[1]) >= 1  # client 3 was sampled and skipped
    assert [r["global/test_acc"] for r in rows[1]] == [r["global/test_acc"] for r in rows[2]]
    for n in procs:
        assert summary(tmp_path / str(n))["outcome"] == "finished"
        clients = read_metrics(tmp_path / str(n) / "clients.csv")  # the per-client rows say which
        assert {int(r["client"]) for r in clients if r["skipped"]} == {3}


def test_a_collapse_with_on_collapse_stop_on_two_processes_exits_3_once(tmp_path):
    args = ["--model", "faulty_methods.Collapsing", "--model.init_args.from_round", "2",
            "--federation.collapse_rounds", "1", "--federation.on_collapse", "stop", "--model.init_args.lr", "0.5",
            "--data.partition", "iid", "--trainer.max_epochs", "4", *TWO_PROCESSES]
    code, err = run(tmp_path / "run", *args)
    assert code == EXIT_STOPPED, err[-3000:]
    assert_one_line(err, r"error: failed: test accuracy has been at chance level .* at round 2/4, method Collapsing; "
                         r"lower the lr or set --federation.on_collapse mark")
    record = summary(tmp_path / "run")
    assert record["outcome"] == "failed" and record["rounds_completed"] == 2 and not record["finished"]


# ---- a finished run stays finished ---------------------------------------------------------------
def test_a_signal_after_the_end_changes_nothing_and_a_resume_completes_the_records(tmp_path):
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "2", callback("killswitch.KillSwitch", round=2, where="end",
                                                               sig="SIGTERM"))
    assert code == 0 and not error_lines(err), err[-3000:]  # the run had ended: exit 0, not 143
    done = summary(root)
    assert done["outcome"] == "finished" and done["finished"] and done["rounds_completed"] == 2
    rows = read_metrics(root / "metrics.csv")
    # the records are lost (or were never written: a kill -9 right after the last checkpoint);
    # resuming the checkpoint of the last round writes them again and trains nothing
    (root / "summary.json").unlink()
    (root / "metrics.csv").unlink()
    fit_runs = set((root / "wandb").glob("offline-run-*"))
    code, err = run(root, "--trainer.max_epochs", "2", "--ckpt_path", "last")
    assert code == 0 and not error_lines(err), err[-3000:]
    again = summary(root)
    assert again["outcome"] == "finished" and again["finished"]
    assert (again["final_acc"], again["best_acc"]) == (done["final_acc"], done["best_acc"])
    assert read_metrics(root / "metrics.csv") == rows
    assert read_outcome(root) is Outcome.FINISHED  # what sweep and report read
    # the resume's W&B run (offline: a run of its own) holds the completed summary too
    (resumed,) = set((root / "wandb").glob("offline-run-*")) - fit_runs
    dashboard = wandb_summary(resumed)
    for key in ("outcome", "finished", "rounds_completed", "final_acc", "final_round", "best_acc", "best_round"):
        assert dashboard.get(key) == done[key], key


def wandb_summary(offline_run: Path) -> dict:
    """The summary of an offline W&B run (its `offline-run-*` folder): the last value of every key
    its summary records set."""
    from fl_lightning.loggers import offline_records

    values = {}
    for record in offline_records(next(offline_run.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "summary":
            values.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in record.summary.update})
    return values


def test_a_run_killed_after_its_last_checkpoint_is_finished_and_resumes_to_exit_0(tmp_path):
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "2", callback("killswitch.KillSwitch", round=2, where="end"))
    assert code == -signal.SIGKILL, err[-3000:]
    assert summary(root)["outcome"] == "finished"  # decided with the last round, before its checkpoint
    code, err = run(root, "--trainer.max_epochs", "2", "--ckpt_path", "last")
    assert code == 0 and not error_lines(err), err[-3000:]
    assert summary(root)["finished"] is True
    code, err = run(root, "--trainer.max_epochs", "3", "--ckpt_path", "last")  # extended: trains round 3
    assert code == 0, err[-3000:]
    assert summary(root)["rounds_completed"] == 3 and summary(root)["outcome"] == "finished"


def test_a_stopped_run_resumed_says_so_again_and_trains_nothing(tmp_path):
    root = tmp_path / "run"
    args = ["--model", "faulty_methods.Collapsing", "--model.init_args.from_round", "2",
            "--federation.collapse_rounds", "1", "--federation.on_collapse", "stop", "--model.init_args.lr", "0.5",
            "--data.partition", "iid", "--trainer.max_epochs", "4"]
    code, first = run(root, *args)
    assert code == EXIT_STOPPED
    code, again = run(root, *args, "--ckpt_path", "last")
    assert code == EXIT_STOPPED and error_lines(again) == error_lines(first)
    assert summary(root)["rounds_completed"] == 2


def test_a_run_killed_before_its_first_checkpoint_is_told_to_start_again_not_to_resume(tmp_path, capsys):
    """`--ckpt_path last` said to run fit first, and fit said to resume with --ckpt_path last."""
    from fl_lightning.cli import main

    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "2", callback("killswitch.KillSwitch", round=1, where="train"))
    assert code == -signal.SIGKILL and not (root / "checkpoints" / "last.ckpt").exists()
    for extra in (["--ckpt_path", "last"], []):
        with pytest.raises(SystemExit) as stop:
            main(["fit", *TINY, "--trainer.max_epochs", "2", "--trainer.logger", "false",
                  "--trainer.default_root_dir", str(root), *extra])
        line = capsys.readouterr().err.strip()
        assert stop.value.code == EXIT_USER_ERROR and line.count("\n") == 0, line
        assert "stopped before its first round was saved" in line and "--overwrite true" in line, line
        assert "resume it" not in line and "run fit with the same" not in line, line


# ---- signals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("first,second", [("SIGTERM", "SIGINT"), ("SIGINT", "SIGINT"), ("SIGINT", "SIGTERM"),
                                          ("SIGTERM", "SIGTERM")])
def test_a_second_signal_during_the_clean_up_changes_nothing(tmp_path, first, second):
    """An impatient Ctrl-C Ctrl-C, a scheduler's TERM then INT, a Ctrl-C then the scheduler's TERM,
    a scheduler's TERM twice: the second arrives while the first is being handled (from
    Lightning's exception hooks); the exit is the first's, the checkpoint intact."""
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "3",
                    callback("killswitch.KillSwitch", round=2, where="train", sig=first, then=second))
    assert code == 128 + getattr(signal, first), err[-3000:]
    assert_one_line(err, rf"error: interrupted by {first} in round 2/3; 1 completed round\(s\) are saved in "
                         r".*last\.ckpt: resume with the same command and --ckpt_path last")
    assert completed_rounds(torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)) == 1
    assert summary(root)["outcome"] == "interrupted"


def test_a_signal_sends_the_clients_the_wandb_run_has_not_got_in_the_last_rows_table(tmp_path):
    """W&B's clients table goes every 10th round; a run interrupted before that still gives its
    W&B run the clients of its completed rounds, in the last round's row (one table a round
    before, without a round column)."""
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "4", callback("killswitch.KillSwitch", round=3, where="train",
                                                               sig="SIGTERM"))
    assert code == 128 + signal.SIGTERM, err[-3000:]
    clients = clients_of(root)
    assert sorted({r for r, _ in clients}) == [1, 2]
    assert wandb_clients_tables(root) == {2: clients}


# ---- a lost process ------------------------------------------------------------------------------
def test_a_process_killed_on_rank_1_ends_the_run_in_one_line_and_it_resumes(tmp_path):
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "3", *TWO_PROCESSES,
                    callback("killswitch.KillSwitch", round=2, where="train", rank=1))
    assert code == EXIT_LOST, err[-3000:]
    assert_one_line(err, r"error: lost process: rank 1 \(pid \d+\) was killed by SIGKILL in round 2/3; 1 completed "
                         r"round\(s\) are saved in .*last\.ckpt; run the same command with --ckpt_path last to resume")
    assert summary(root)["outcome"] == "lost"
    assert summary(root)["reason"] == error_lines(err)[0].removeprefix("error: ")  # the line, not gloo's words
    code, err = run(root, "--trainer.max_epochs", "3", *TWO_PROCESSES, "--ckpt_path", "last")
    assert code == 0, err[-3000:]
    assert summary(root)["outcome"] == "finished" and summary(root)["rounds_completed"] == 3


SAVED_1 = r"1 completed round\(s\) are saved in .*last\.ckpt"
RANK_0_FAULTS = {
    # a scheduler's SIGTERM to the run's main process: Lightning's own SIGTERM handler broadcast a
    # flag from rank 0 inside the handler while rank 1 waited in the round's gather: both hung for
    # the 30-minute collective timeout
    "SIGTERM to rank 0": (dict(where="train", rank=0, sig="SIGTERM"), 143, "interrupted",
                          rf"error: interrupted by SIGTERM in round 2/2; {SAVED_1}: resume with the same command "
                          r"and --ckpt_path last"),
    # Ctrl-C in a terminal reaches every process: the line was printed twice, or (Lightning's
    # launcher SIGKILLs every process once one exits non-zero) not at all, with exit code 137
    "Ctrl-C to every process": (dict(where="train", rank=1, sig="SIGINT", group=True), 130, "interrupted",
                                rf"error: interrupted by SIGINT in round 2/2; {SAVED_1}: resume with the same "
                                r"command and --ckpt_path last"),
    # rank 1 waited for rank 0's checkpoint, lost its peer, and printed a second line (the disk
    # refuses every write from round 2 on, summary.json's too: it stays round 1's)
    "full disk": (dict(disk=None), EXIT_LOST, "running",
                  rf"error: the disk refused a write \(No space left on device: .*\); {SAVED_1}; make room "
                  r"\(or make the run directory writable\) and run the same command with --ckpt_path last"),
    # only rank 1's write is refused (its SCAFFOLD states, written after the round): rank 1 exited
    # 4 without a word, and rank 0 said "lost process: rank 1 (pid ...) exited with code 4"
    "full disk on rank 1": (dict(disk=1), EXIT_LOST, "lost",
                            r"error: the disk refused a write \(No space left on device: .*/client_states/rank1/"
                            rf"client\d+\.v\d+\.safetensors\); {SAVED_1}; make room \(or make the run directory "
                            r"writable\) and run the same command with --ckpt_path last"),
    # rank 1 outlives its parent: it says so, and names rank 0 (the shell sees rank 0's -9)
    "kill -9 of rank 0": (dict(where="train", rank=0), -signal.SIGKILL, "running",
                          r"error: lost process: rank 0 \(pid \d+\) is gone .* in round 2/2; "
                          rf"{SAVED_1}; run the same command with --ckpt_path last to resume"),
    # after the last round: Lightning's handler sent SIGTERM on to rank 1, which stopped; rank 0
    # then printed "lost process ... in round 3/2" and exited 4, with a traceback from an exit function
    "SIGTERM to rank 0 after the end": (dict(where="end", rank=0, sig="SIGTERM"), 0, "finished", None),
}


@pytest.mark.parametrize("fault", list(RANK_0_FAULTS))
def test_a_fault_of_a_two_process_run_ends_in_one_line_and_no_process_stays(tmp_path, fault):
    switch, expected_code, outcome, pattern = RANK_0_FAULTS[fault]
    if "disk" in switch:  # with SCAFFOLD, rank 1 writes files of its own (its clients' states)
        inject = [callback("killswitch.DiskFault", round=2, rank=switch["disk"]), *(SCAFFOLD if switch["disk"] else [])]
    else:
        inject = [callback("killswitch.KillSwitch", round=2, **switch)]
    root = tmp_path / "run"
    proc = start(root, "--trainer.max_epochs", "2", *TWO_PROCESSES, *inject, session=True)
    try:
        code, err = finish(proc, timeout=240)  # every process has closed the pipe: none is left
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{fault}: the run hung")
    assert code == expected_code, err[-3000:]
    if pattern is None:
        assert not error_lines(err) and "Traceback" not in err, err[-3000:]
    else:
        assert_one_line(err, pattern)
    assert summary(root)["outcome"] == outcome
    saved = completed_rounds(torch.load(root / "checkpoints" / "last.ckpt", weights_only=True))
    assert saved == (2 if outcome == "finished" else 1)


@pytest.mark.parametrize("where", ["exit", "finalization"])
def test_a_signal_while_the_finished_process_exits_changes_nothing(tmp_path, where):
    """SIGTERM from an exit function (W&B's and torch's run after main() returned) raised the
    CLI's interrupt into the interpreter's shutdown: a traceback; later, in the interpreter's
    final garbage collection (seconds long, Python's handlers gone), it killed the finished
    process (-15: a scheduler records the job as failed)."""
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "1", callback("killswitch.KillSwitch", round=1, where=where,
                                                               sig="SIGTERM"))
    assert code == 0 and not error_lines(err) and "Traceback" not in err and "Exception ignored" not in err, err
    assert summary(root)["outcome"] == "finished"


def test_a_signal_during_the_round_checkpoint_write_says_which_round_is_saved(tmp_path):
    """The round-2 checkpoint was cut short: the line said 2 rounds were saved where the file holds
    1, and the half-written temporary stayed until the next start."""
    root = tmp_path / "run"
    code, err = run(root, "--trainer.max_epochs", "3", callback("killswitch.KillSwitch", round=2, where="write",
                                                               sig="SIGTERM"))
    assert code == 143, err[-3000:]
    assert_one_line(err, rf"error: interrupted by SIGTERM in round 2/3; {SAVED_1}: resume with the same command and "
                         r"--ckpt_path last")
    assert completed_rounds(torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)) == 1
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["last.ckpt"]


# ---- the disk refuses a write --------------------------------------------------------------------
def test_a_refused_write_names_its_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """On a full disk the half-written temporary held the space a resume needs, and the error
    (from write/fsync) named no file: "No space left on device: None"."""
    import fl_lightning.atomic as atomic

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", full)
    target = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(OSError) as refused:
        atomic.atomic_write_bytes(target, b"round")
    assert refused.value.filename == str(target)
    assert list(target.parent.iterdir()) == []


def test_the_refused_write_named_is_the_first_one():
    """A full disk refuses the round checkpoint, then W&B's media copy while the run is being
    ended: the line names the checkpoint (the cause), not W&B's temporary file."""
    from fl_lightning.outcome import disk_refused

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/a/checkpoints/last.ckpt")
        except OSError:
            raise OSError(errno.ENOSPC, "No space left on device", "/tmp/wandb-media/x.table.json") from None
    except OSError as err:
        assert disk_refused(err).filename == "/runs/a/checkpoints/last.ckpt"


@pytest.mark.parametrize("error,at", [("ENOSPC", 2), ("EROFS", 0)])
def test_a_disk_that_refuses_writes_ends_in_one_line(tmp_path, error, at):
    """Once there is room again, the resumed run ends with the weights of a run the disk never
    refused, bit for bit (started alongside as the reference)."""
    root = tmp_path / "run"
    straight = start(tmp_path / "straight", "--trainer.max_epochs", "3") if at else None
    code, err = run(root, "--trainer.max_epochs", "3", callback("killswitch.DiskFault", round=at, error=error))
    assert code == EXIT_LOST, err[-3000:]
    reason = "No space left on device" if error == "ENOSPC" else "Read-only file system"
    line = assert_one_line(err, rf"error: the disk refused a write \({reason}: .*\); .*")
    if at:  # round 1 is safe, and the same command resumes it once there is room
        assert "1 completed round(s) are saved" in line and line.endswith("run the same command with --ckpt_path last")
        code, err = run(root, "--trainer.max_epochs", "3", "--ckpt_path", "last")
        assert code == 0, err[-3000:]
        assert [r["round"] for r in read_metrics(root / "metrics.csv")] == [1, 2, 3]
        code, err = finish(straight)
        assert code == 0, err[-3000:]
        resumed, reference = (torch.load(r / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
                              for r in (root, tmp_path / "straight"))
        assert completed_rounds(resumed) == completed_rounds(reference) == 3
        assert resumed["state_dict"].keys() == reference["state_dict"].keys()
        for key, value in reference["state_dict"].items():
            assert torch.equal(resumed["state_dict"][key], value), key
        assert reproducible_rows(read_metrics(root / "metrics.csv")) == \
            reproducible_rows(read_metrics(tmp_path / "straight" / "metrics.csv"))


def on_a_full_disk(root: Path, *args: str, full: Path | None = None) -> tuple[int, str]:
    """The fit with every write under `full` refused as by a full disk, whoever writes it: the
    run's files, PIL's pictures, W&B's log files and media (tests/full_disk.py)."""
    extra = {"FULL_DISK": str(full)} if full is not None else {}
    proc = subprocess.run([sys.executable, "-c", "import full_disk; full_disk.run_cli()", "fit", *TINY, *args,
                           "--trainer.default_root_dir", str(root)],
                          env={**env(), **extra}, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr


def test_a_resume_on_a_full_disk_ends_in_one_line_and_loses_nothing(tmp_path):
    """A finished 1-round run resumed on a full disk: its records, written again, are the first
    write the disk refuses (the partition picture is kept from the fit), and W&B's log file refuses
    every message and then W&B's finish. It ended in exit
    1 and some 20,000 lines of tracebacks; it ends in the one line, exit 4, and the run's files as
    they were, which the same command completes once there is room."""
    root = tmp_path / "run"
    args = ["--analysis.partition", "true", "--trainer.max_epochs", "1"]
    code, err = run(root, *args)
    assert code == 0, err[-3000:]
    before = {name: (root / name).read_text() for name in ("summary.json", "metrics.csv", "clients.csv")}
    code, err = on_a_full_disk(root, *args, "--ckpt_path", "last", full=root)
    assert code == EXIT_LOST, err[-3000:]
    assert_one_line(err, rf"error: the disk refused a write \(No space left on device: "
                         rf"{re.escape(str(root / 'metrics.csv'))}\); 1 completed round\(s\) are saved "
                         rf"in {re.escape(str(root / 'checkpoints' / 'last.ckpt'))}; make room .* and run the same "
                         rf"command with --ckpt_path last")
    assert "Logging error" not in err and "wandb" not in err.lower(), err[-3000:]
    assert {name: (root / name).read_text() for name in before} == before  # the disk kept the finished run's files
    code, err = run(root, *args, "--ckpt_path", "last")
    assert code == 0 and not error_lines(err), err[-3000:]
    after = {name: (root / name).read_text() for name in before}
    assert after["metrics.csv"] == before["metrics.csv"] and after["clients.csv"] == before["clients.csv"]
    assert summary(root)["outcome"] == "finished" and (root / "analysis" / "partition.png").stat().st_size > 0


def test_a_disk_that_fills_as_the_run_ends_says_so_in_one_line(tmp_path):
    """Every round, record and checkpoint is written when the disk fills; W&B's last row and its
    finish are refused. The run's outcome stays finished; the command says in one line that the
    disk refused W&B's files (exit 4), not with W&B's traceback (exit 1)."""
    root = tmp_path / "run"
    code, err = on_a_full_disk(root, "--trainer.max_epochs", "1", callback("full_disk.FillsUp", directory=str(root)))
    assert code == EXIT_LOST, err[-3000:]
    assert_one_line(err, rf"error: the disk refused a write \(No space left on device: {re.escape(str(root / 'wandb'))}"
                         rf"/.*\); 1 completed round\(s\) are saved in .*last\.ckpt; make room .* and run the same "
                         rf"command with --ckpt_path last")
    assert "Logging error" not in err, err[-3000:]
    record = summary(root)
    assert record["outcome"] == "finished" and record["rounds_completed"] == 1


# ---- a home directory W&B cannot write in ---------------------------------------------------------
HOMES = {  # the environment, from a tmp_path holding the regular file `file` and the folders `home`, `mine`
    "HOME is a file": lambda t: {"HOME": t / "file"},
    "XDG directories are files": lambda t: {"HOME": t / "home", "XDG_DATA_HOME": t / "file",
                                            "XDG_CACHE_HOME": t / "file"},
    # a read-only HOME (root writes in any folder: a path under a file cannot be written even so)
    "HOME cannot exist, WANDB_DATA_DIR is the user's": lambda t: {"HOME": t / "file" / "home",
                                                                   "WANDB_DATA_DIR": t / "mine"},
}


@pytest.mark.parametrize("home", list(HOMES))
def test_a_home_directory_wandb_cannot_write_in_leaves_its_files_in_the_run(tmp_path, home):
    """W&B stages every table it logs under ~/.local/share/wandb, and its service logs into
    ~/.cache/wandb: with a HOME it cannot write in, the fit crashed at its first table (exit 1,
    W&B's traceback, summary.json "crashed" after 0 rounds) and W&B's service printed its log on
    stderr. The run now keeps those directories in its own wandb/ folder (one line says so), except
    one the user chose, and its W&B run is complete."""
    (tmp_path / "file").write_text("not a directory\n")
    (tmp_path / "home").mkdir()
    given = {k: str(v) for k, v in HOMES[home](tmp_path).items()}
    root = tmp_path / "run"
    e = {k: v for k, v in env().items() if not k.startswith(("XDG_", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"))}
    proc = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *TINY, "--trainer.max_epochs", "1",
                           "--trainer.default_root_dir", str(root)],
                          env={**e, **given}, capture_output=True, text=True, timeout=600)
    err = proc.stderr
    assert proc.returncode == 0 and not error_lines(err) and "Traceback" not in err, err[-3000:]
    record = summary(root)
    assert record["outcome"] == "finished" and record["rounds_completed"] == 1
    moved = ["WANDB_CACHE_DIR"] if "WANDB_DATA_DIR" in given else ["WANDB_DATA_DIR", "WANDB_CACHE_DIR"]
    notes = [line for line in err.splitlines() if line.startswith("W&B cannot write in the home directory")]
    assert len(notes) == 1 and notes[0].endswith(f"(set {' and '.join(moved)} to choose)"), err[-3000:]
    staging = Path(given.get("WANDB_DATA_DIR", root / "wandb" / "data")) / "artifacts" / "staging"
    assert staging.is_dir() and (root / "wandb" / "data").exists() == ("WANDB_DATA_DIR" not in given)
    assert list((root / "wandb" / "cache").rglob("core-debug-*.log"))  # W&B's service log, not on stderr
    assert "handleInformFinish" not in err, err[-3000:]
    assert not list((tmp_path / "home").rglob("*wandb*"))

    from fl_lightning.loggers import read_offline_history

    run_file = next((root / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = read_offline_history(run_file)  # complete: W&B's exit record is there
    assert [r["round"] for r in rows if "global/test_acc" in r] == [1.0]
    assert any("clients/table/path" in r for r in rows)


# ---- damaged client-state files ------------------------------------------------------------------


@pytest.fixture(scope="module")
def scaffold_run(tmp_path_factory):
    """2 rounds of SCAFFOLD: every sampled client keeps its c_i in a checked state file."""
    root = tmp_path_factory.mktemp("scaffold") / "run"
    code, err = run(root, *SCAFFOLD, "--trainer.max_epochs", "2")
    assert code == 0, err[-3000:]
    return root


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target


def _state_files(root: Path) -> list[Path]:
    return sorted((root / "checkpoints" / "client_states").glob("client*.safetensors"))


def _resume_in_process(root: Path, capsys) -> tuple[int, str]:
    from fl_lightning.cli import main

    try:
        main(["fit", *TINY, *SCAFFOLD, "--trainer.max_epochs", "3", "--trainer.logger", "false",
              "--trainer.default_root_dir", str(root), "--ckpt_path", "last"])
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "deleted": (lambda files: files[0].unlink(), "is missing"),
    "truncated": (lambda files: files[0].write_bytes(files[0].read_bytes()[:100]), "has 100 bytes where"),
    "empty": (lambda files: files[0].write_bytes(b""), "has 0 bytes where"),
    "garbage": (lambda files: files[0].write_bytes(os.urandom(files[0].stat().st_size)),
                "does not match its checksum"),
    "bit flipped": (lambda files: _flip_a_bit(files[0]), "does not match its checksum"),
    "swapped": (lambda files: (files[0].rename(files[0].with_suffix(".tmp")), files[1].rename(files[0]),
                               files[0].with_suffix(".tmp").rename(files[1])),
                r"holds client \d+'s state \(files swapped\?\)"),
    "folder deleted": (lambda files: shutil.rmtree(files[0].parent), "is missing"),
    "wrong architecture": (lambda files: _another_architecture(files[0]), "has \\d+ bytes where"),
}


def _another_architecture(path: Path) -> None:
    """The same client's state from a run of another model (a file copied in from elsewhere)."""
    from safetensors.torch import save

    client = re.search(r"client(\d+)\.", path.name).group(1)
    path.write_bytes(save({"body.0.weight": torch.zeros(16, 3, 5, 5)}, metadata={"client": client}))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_client_state_file_is_refused_in_one_line(damage, scaffold_run, tmp_path, capsys):
    root = _copy(scaffold_run, tmp_path)
    files = _state_files(root)
    assert len(files) >= 2
    corrupt, expected = DAMAGE[damage]
    corrupt(files)
    code, err = _resume_in_process(root, capsys)
    assert code == EXIT_USER_ERROR
    assert_one_line(err, rf"error: client-state file .*client\d+\.v\d+\.safetensors \(client \d+\) {expected}.*; "
                         r"the run cannot continue exactly without it: .*")


def test_a_swapped_file_is_refused_through_the_cli_before_anything_trains(scaffold_run, tmp_path):
    root = _copy(scaffold_run, tmp_path)
    a, b = _state_files(root)[:2]
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    code, err = run(root, *SCAFFOLD, "--trainer.max_epochs", "3", "--ckpt_path", "last")
    assert code == EXIT_USER_ERROR
    assert_one_line(err, r"error: client-state file .* holds client \d+'s state \(files swapped\?\).*")
    assert "Initializing" not in err and summary(root)["rounds_completed"] == 2  # nothing ran


def test_a_resume_on_a_read_only_disk_says_how_many_rounds_are_saved(scaffold_run, tmp_path, capsys, monkeypatch):
    """The run directory's lock is the first write of a resume: the line said "(Read-only file
    system: None); 0 completed round(s) are saved" of a checkpoint holding 2."""
    import fl_lightning.rundir as rundir

    def read_only(fd, length):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    root = _copy(scaffold_run, tmp_path)
    monkeypatch.setattr(rundir.os, "ftruncate", read_only)
    code, err = _resume_in_process(root, capsys)
    assert code == EXIT_LOST
    assert_one_line(err, r"error: the disk refused a write \(Read-only file system: .*\.fl-lightning\.lock\); "
                         r"2 completed round\(s\) are saved in .*last\.ckpt; make room .* and run the same command "
                         r"with --ckpt_path last")


def test_a_moved_run_directory_resumes_and_stray_temporaries_go(tmp_path, capsys):
    """The checkpoint names its state files relative to itself (it named them by absolute path: a
    moved run directory could not be resumed); a killed writer's temporaries in the state folders
    and the fit's analysis folders are removed on the next start (those of the client-state store
    and of the analyses never were)."""
    from fl_lightning.cli import main

    first = tmp_path / "first"
    main(["fit", *TINY, *SCAFFOLD, "--trainer.max_epochs", "2", "--trainer.logger", "false",
          "--trainer.default_root_dir", str(first)])  # exits only on failure
    root = first.rename(tmp_path / "elsewhere")  # the old path is gone
    stray = [root / "checkpoints" / "client_states" / ".partial-123-client3.v9.safetensors",
             root / "checkpoints" / "client_states" / "rank1" / ".partial-124-client4.v9.safetensors",
             root / "analysis" / ".partial-125-spectrum_history.png",
             root / "analysis" / "round_002" / ".partial-126-analysis.json"]
    # `analyze` may be writing its own folder while the fit starts: its temporary stays
    posthoc = root / "analysis" / "posthoc_round_002" / ".partial-127-analysis.json"
    for path in [*stray, posthoc]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    capsys.readouterr()
    code, err = _resume_in_process(root, capsys)
    assert code == 0, err[-3000:]
    assert summary(root)["rounds_completed"] == 3 and summary(root)["outcome"] == "finished"
    assert not any(p.exists() for p in stray) and posthoc.exists()


def test_a_launched_process_waits_for_its_dying_parent_before_it_decides_who_speaks(monkeypatch):
    """Rank 0 killed mid-run closes its sockets before the kernel reparents rank 1, so rank 1 can
    see the lost collective while rank 0 still looks alive; it then left the run's line unsaid
    (CI: `kill -9 of rank 0` ended with no error line, once). Rank 1 now waits for the parent's
    exit to complete before deciding that rank 0 will speak."""
    import time

    from fl_lightning import run_lifecycle

    monkeypatch.setenv("LOCAL_RANK", "1")
    dies_at = time.monotonic() + 0.3
    monkeypatch.setattr(run_lifecycle.os, "getppid",
                        lambda: run_lifecycle._INITIAL_PARENT if time.monotonic() < dies_at else 1)
    assert not run_lifecycle._parent_gone()  # the moment the collective failed
    assert run_lifecycle._parent_gone(wait=run_lifecycle._PARENT_EXIT_SECONDS)
    monkeypatch.setattr(run_lifecycle.os, "getppid", lambda: run_lifecycle._INITIAL_PARENT)
    started = time.monotonic()
    assert not run_lifecycle._parent_gone(wait=0.2) and time.monotonic() - started >= 0.2  # alive: no
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not run_lifecycle._parent_gone(wait=5)  # rank 0 has no such parent, and does not wait
