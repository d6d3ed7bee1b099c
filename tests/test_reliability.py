"""A long run survives what happens to long runs, tested the way it happens: CLI subprocesses
killed with SIGKILL during training, evaluation and the checkpoint write, SIGTERM, damaged and
foreign checkpoints, a second fit into a used directory and two fits at once.

Every resume is compared with an uninterrupted run of the same command: the final checkpoint's
weights and client states bit for bit, and metrics.csv row for row."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fl_test_utils import reproducible_rows

from fl_lightning.checkpointing import completed_rounds
from fl_lightning.client_store import read_client_states
from fl_lightning.results import read_metrics

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 6
TINY = ["--data.dataset", "digits", "--data.num_clients", "10", "--data.local_epochs", "1",
        "--data.min_size", "5", "--data.batch_size", "20", "--federation.local_eval_samples", "100",
        "--trainer.max_epochs", str(ROUNDS), "--trainer.enable_progress_bar", "false"]
METHODS = {
    "fedsol": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--config",
               str(REPO / "configs/methods/fedsol/fedsol.yaml"), "--model.init_args.model", "mlp", *TINY],
    "scaffold": ["--config", str(REPO / "configs/settings/fedsol_cifar10.yaml"), "--config",
                 str(REPO / "configs/methods/fedsol/scaffold.yaml"), "--model.init_args.model", "mlp",
                 "--data.augment", "false", *TINY],
    # the vectorised engine: a round's clients trained together, killed inside that step
    "fedsol_vectorized": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--config",
                          str(REPO / "configs/methods/fedsol/fedsol.yaml"), "--model.init_args.model", "mlp",
                          "--federation.engine", "vectorized", *TINY],
    # server state of a server optimizer (FedAdam's m and v) and personal BatchNorm layers (FedBN)
    "fedadam": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--model", "FedAdam",
                "--model.init_args.model", "mlp", *TINY],
    # the other server optimizers' state: FedAvgM's momentum u, FedYogi's and FedAdagrad's m and v
    "fedavgm": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--model", "FedAvgM",
                "--model.init_args.model", "mlp", *TINY],
    "fedyogi": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--model", "FedYogi",
                "--model.init_args.model", "mlp", *TINY],
    "fedadagrad": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--model", "FedAdagrad",
                   "--model.init_args.model", "mlp", *TINY],
    "fedbn": ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--model", "FedBN",
              "--model.init_args.model", "mlp_bn", *TINY],
    # a bounded cache: client models are evicted to files mid-round, where the kill lands
    "fedproto": ["--config", str(REPO / "configs/settings/fedorgp_cifar10_pathological.yaml"), "--config",
                 str(REPO / "configs/methods/fedorgp/fedproto.yaml"),
                 "--model.init_args.model", "mlp,mlp", "--model.init_args.feature_dim", "16",
                 "--data.augment", "false", "--federation.client_cache_size", "2", *TINY],
}


def env() -> dict:
    e = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), e.get("PYTHONPATH", "")])
    return e


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fl_lightning.cli", *args]


def start(method: str, root: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(cli("fit", *METHODS[method], "--trainer.default_root_dir", str(root), *extra),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_switch(round_: int, where: str, sig: str = "SIGKILL") -> list[str]:
    spec = {"class_path": "killswitch.KillSwitch", "init_args": {"round": round_, "where": where, "sig": sig}}
    return [f"--trainer.callbacks+={json.dumps(spec)}"]


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def final_state(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def assert_same_run(a: Path, b: Path) -> None:
    sa, sb = final_state(a), final_state(b)
    assert completed_rounds(sa) == completed_rounds(sb) == ROUNDS
    assert sa["state_dict"].keys() == sb["state_dict"].keys()
    for key in sa["state_dict"]:
        assert torch.equal(sa["state_dict"][key], sb["state_dict"][key]), key
    # every client's own state (control variates, heterogeneous clients' models), read from the
    # files the checkpoint names, beside it
    clients_a = read_client_states(sa["fl_client_states"], a / "checkpoints" / "client_states")
    clients_b = read_client_states(sb["fl_client_states"], b / "checkpoints" / "client_states")
    assert clients_a.keys() == clients_b.keys()
    for client in clients_a:
        assert clients_a[client].keys() == clients_b[client].keys()
        for key in clients_a[client]:
            assert torch.equal(clients_a[client][key], clients_b[client][key]), (client, key)
    rows_a, rows_b = read_metrics(a / "metrics.csv"), read_metrics(b / "metrics.csv")
    assert [r["round"] for r in rows_a] == list(range(1, ROUNDS + 1))
    assert reproducible_rows(rows_a) == reproducible_rows(rows_b)


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """The uninterrupted reference run of every method, started side by side."""
    base = tmp_path_factory.mktemp("straight")
    procs = {m: start(m, base / m) for m in METHODS}
    for method, proc in procs.items():
        code, err = finish(proc)
        assert code == 0, f"{method}: {err[-2000:]}"
    return {m: base / m for m in METHODS}


@pytest.mark.parametrize(("method", "where"), [("fedsol", "train"), ("fedsol_vectorized", "train"),
                                               ("scaffold", "train"), ("fedproto", "train"),
                                               ("fedsol", "eval"), ("fedsol", "write"), ("fedadam", "train"),
                                               ("fedavgm", "train"), ("fedyogi", "train"), ("fedadagrad", "train"),
                                               ("fedbn", "write")])
def test_sigkill_in_round_4_then_resume_equals_uninterrupted(method, where, straight_runs, tmp_path):
    root = tmp_path / "run"
    code, err = finish(start(method, root, *kill_switch(4, where)))
    assert code == -signal.SIGKILL, err[-2000:]
    saved = final_state(root)
    assert completed_rounds(saved) == 3  # rounds 1-3 completed and checkpointed; round 4 was cut off
    if where == "write":
        assert list((root / "checkpoints").glob(".partial-*")), "the killed write should have left its temp file"
    code, err = finish(start(method, root, "--ckpt_path", "last"))
    assert code == 0, err[-2000:]
    assert not list(root.glob("**/.partial-*")), "stray temporary files are removed on restart"
    assert_same_run(straight_runs[method], root)


def test_sigterm_exits_non_zero_with_a_resumable_checkpoint(straight_runs, tmp_path):
    root = tmp_path / "run"
    code, err = finish(start("fedsol", root, *kill_switch(4, "train", sig="SIGTERM")))
    assert code == 128 + signal.SIGTERM
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "--ckpt_path last" in lines[0] and "3 completed" in lines[0]
    assert "Traceback" not in err
    summary = json.loads((root / "summary.json").read_text())
    assert summary["finished"] is False and summary["rounds_completed"] == 3
    code, err = finish(start("fedsol", root, "--ckpt_path", "last"))
    assert code == 0, err[-2000:]
    assert_same_run(straight_runs["fedsol"], root)
    assert json.loads((root / "summary.json").read_text())["finished"] is True


def test_a_signal_inside_a_wandb_call_ends_the_run_when_the_call_is_done(tmp_path):
    """SIGINT while W&B logs round 2's row: the call completes (an exception raised in the middle
    of one leaves W&B's service and its thread waiting for each other, and the run's end then hangs
    in W&B's teardown), then the run ends as interrupted: exit 130, one line, a resumable run."""
    root = tmp_path / "run"
    spec = {"class_path": "killswitch.SignalInsideWandbLog", "init_args": {"round": 2, "sig": "SIGINT"}}
    code, err = finish(start("fedsol", root, f"--trainer.callbacks+={json.dumps(spec)}"), timeout=300)
    assert code == 128 + signal.SIGINT, err[-2000:]
    assert (root / "wandb-log-2-done").exists(), "W&B's call was cut short by the signal"
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "SIGINT" in lines[0] and "Traceback" not in err, err[-2000:]
    assert completed_rounds(final_state(root)) >= 2


def test_sigterm_from_outside_a_running_fit(tmp_path):
    """The signal a scheduler sends, at whatever moment it arrives."""
    root = tmp_path / "run"
    proc = start("fedsol", root, "--trainer.max_epochs", "200")
    deadline = time.time() + 300
    while not (root / "checkpoints" / "last.ckpt").exists():
        assert proc.poll() is None and time.time() < deadline, "the run should be training"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 128 + signal.SIGTERM
    assert [line for line in err.splitlines() if line.startswith("error:")][0].count("--ckpt_path last") == 1
    assert completed_rounds(final_state(root)) >= 1


# ---- damaged and foreign files: one line, exit 2, no traceback -------------------------------------


def _one_line_exit_2(args: list[str]) -> str:
    result = subprocess.run(cli(*args), env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def good_checkpoint(straight_runs) -> Path:
    return straight_runs["fedsol"] / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("damage", ["empty", "truncated", "random", "text", "pickle_of_a_list", "directory"])
def test_damaged_checkpoint_is_one_line(damage, good_checkpoint, tmp_path):
    bad = tmp_path / "bad.ckpt"
    data = good_checkpoint.read_bytes()
    if damage == "empty":
        bad.write_bytes(b"")
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "random":
        bad.write_bytes(os.urandom(4096))
    elif damage == "text":
        bad.write_text("model: FedSOL\nthis is not a checkpoint\n")
    elif damage == "pickle_of_a_list":
        torch.save([1, 2, 3], bad)
    else:
        bad.mkdir()
    line = _one_line_exit_2(["fit", *METHODS["fedsol"], "--trainer.default_root_dir", str(tmp_path / "r"),
                             "--ckpt_path", str(bad)])
    assert str(bad) in line


def test_foreign_checkpoints_are_refused(straight_runs, tmp_path):
    scaffold = straight_runs["scaffold"] / "checkpoints" / "last.ckpt"
    line = _one_line_exit_2(["fit", *METHODS["fedsol"], "--trainer.default_root_dir", str(tmp_path / "a"),
                             "--ckpt_path", str(scaffold)])
    assert "SCAFFOLD" in line and "FedSOL" in line
    fedsol = straight_runs["fedsol"] / "checkpoints" / "last.ckpt"
    line = _one_line_exit_2(["fit", *METHODS["fedsol"], "--model.init_args.model", "fedavg_cnn",
                             "--trainer.default_root_dir", str(tmp_path / "b"), "--ckpt_path", str(fedsol)])
    assert "model.model" in line and "'mlp'" in line and "'fedavg_cnn'" in line
    line = _one_line_exit_2(["fit", *METHODS["fedsol"], "--data.alpha", "0.5",
                             "--trainer.default_root_dir", str(tmp_path / "c"), "--ckpt_path", str(fedsol)])
    assert "data.alpha" in line


def test_a_second_fit_into_a_used_directory_is_refused(straight_runs, tmp_path):
    root = straight_runs["fedsol"]
    before = (root / "checkpoints" / "last.ckpt").read_bytes()
    line = _one_line_exit_2(["fit", *METHODS["scaffold"], "--trainer.default_root_dir", str(root)])
    assert "--ckpt_path last" in line and "--overwrite" in line
    assert (root / "checkpoints" / "last.ckpt").read_bytes() == before


def test_two_fits_at_once_in_one_directory(tmp_path):
    root = tmp_path / "run"
    first = start("fedsol", root, "--trainer.max_epochs", "200")
    deadline = time.time() + 300
    while not (root / "checkpoints" / "last.ckpt").exists():
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.2)
    try:
        line = _one_line_exit_2(["fit", *METHODS["fedsol"], "--trainer.default_root_dir", str(root),
                                 "--ckpt_path", "last"])
        assert "another fit is running" in line and str(first.pid) in line
    finally:
        first.kill()
        first.communicate()


# ---- a NaN global evaluation with finite weights ----------------------------------------------------


def test_non_finite_global_test_loss_goes_through_the_divergence_policy(caplog):
    from fl_test_utils import fit, one_client_module, toy_data

    from fl_lightning.methods import FedAvg
    from fl_lightning.outcome import Outcome

    class NaNLogitsFromRound2(FedAvg):
        """Finite weights, non-finite class scores: what an overflowing logit looks like."""

        def predict_logits(self, x):
            logits = super().predict_logits(x)
            return logits * float("nan") if self.round_idx >= 1 else logits

    x, y = toy_data(n=12)
    dm = one_client_module(x, y)
    trainer = fit(NaNLogitsFromRound2(model="mlp", data_spec=dm.spec), dm, rounds=3)
    record = trainer.callbacks[0].record  # stopped by the policy, through trainer.should_stop
    assert record.stopped and record.outcome is Outcome.DIVERGED and trainer.current_epoch == 2
    assert re.search("test loss is nan.*round 2/3", record.reason)
    dm = one_client_module(x, y)
    caplog.clear()
    trainer = fit(NaNLogitsFromRound2(model="mlp", data_spec=dm.spec), dm, rounds=3, on_divergence="skip_client")
    assert trainer.current_epoch == 3
    assert "non-finite global test loss (nan) at round 2/3" in caplog.text
    assert "round 2/3: global test acc" in caplog.text  # the round's line is reported, not skipped


# ---- W&B history is complete on disk when a command returns ------------------------------------------


def test_wandb_rows_are_on_disk_when_the_run_is_finished(tmp_path, monkeypatch):
    """wandb.finish() can return before W&B's core process writes the last block (measured here:
    2 of 3 small offline runs were still a 7-byte file right after finish)."""
    import wandb

    from fl_lightning.loggers import read_offline_history
    from fl_lightning.wandb_run import finish_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    for attempt in range(5):
        run = wandb.init(project="t", dir=str(tmp_path), name=f"r{attempt}")
        for i in range(5):
            run.log({"global/test_acc": i / 10})
        finish_wandb(exit_code=0)
        rows = read_offline_history(next(Path(run.dir).parent.glob("run-*.wandb")))
        assert [r["global/test_acc"] for r in rows] == [0.0, 0.1, 0.2, 0.3, 0.4]


def test_a_damaged_wandb_file_is_an_error_not_missing_rows(tmp_path):
    import wandb

    from fl_lightning.loggers import IncompleteRunFile, read_offline_history
    from fl_lightning.wandb_run import finish_wandb

    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    run.log({"a": 1})
    finish_wandb(exit_code=0)
    path = next(Path(run.dir).parent.glob("run-*.wandb"))
    data = bytearray(path.read_bytes())
    (tmp_path / "cut.wandb").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(IncompleteRunFile):
        read_offline_history(tmp_path / "cut.wandb")
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "flipped.wandb").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum|exit record"):
        read_offline_history(tmp_path / "flipped.wandb")


def test_summary_of_a_model_heterogeneous_run_uses_the_clients_accuracy(tmp_path):
    """The summary reads the run's accuracy under the method's `accuracy_key` (no family known to
    the results callback) and its best from the round callback's one tracker."""
    from types import SimpleNamespace

    from fl_lightning.federation import FederatedCallback
    from fl_lightning.methods import FedProto
    from fl_lightning.results import ResultsCallback

    results, federation = ResultsCallback(tmp_path), FederatedCallback()
    results.rows = [{"round": 1, "clients/test_acc": 0.5}, {"round": 2, "clients/test_acc": 0.7},
                    {"round": 3, "clients/test_acc": 0.6}]
    for row in results.rows:
        federation.best.update(row["clients/test_acc"], row["round"])
    trainer = SimpleNamespace(callbacks=[federation], max_epochs=3)
    summary = results.summary(trainer, SimpleNamespace(accuracy_key=FedProto.accuracy_key))
    assert summary["accuracy"] == "clients/test_acc"
    assert (summary["final_acc"], summary["final_round"]) == (0.6, 3)
    assert (summary["best_acc"], summary["best_round"]) == (0.7, 2)


SHARED_SERVICE = """
import subprocess, sys, json, wandb
wandb.setup()  # a W&B service of this process's, which its children find in WANDB_SERVICE
killed = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True)
resumed = subprocess.run(json.loads(sys.argv[2]), capture_output=True, text=True)
print(json.dumps([killed.returncode, resumed.returncode, resumed.stderr[-3000:]]))
"""


def test_a_killed_fit_resumes_into_its_w_and_b_run_under_a_parents_service(tmp_path):
    """A fit started by a process that runs a W&B service (a test runner, a job script with W&B)
    connects to that service; killed with SIGKILL, its run's stream can stay open there, and the
    resumed fit, continuing the same W&B run id, was refused ("run ID ... is in use")."""
    root = tmp_path / "run"
    fit = cli("fit", *METHODS["fedsol"], "--trainer.max_epochs", "3", "--trainer.default_root_dir", str(root))
    done = subprocess.run([sys.executable, "-c", SHARED_SERVICE, json.dumps([*fit, *kill_switch(2, "train")]),
                           json.dumps([*fit, "--ckpt_path", "last"])],
                          env=env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    killed, resumed, err = json.loads(done.stdout.strip().splitlines()[-1])
    assert killed == -signal.SIGKILL
    assert resumed == 0, err
    parts = sorted((root / "wandb").glob("offline-run-*"))
    assert len(parts) == 2 and len({p.name.rsplit("-", 1)[1] for p in parts}) == 1, parts  # one run, two parts
