"""The CLI end to end on offline data: fit, W&B offline logging, per-round checkpoints, resume with
--ckpt_path last, validate from a checkpoint, and one-line errors with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_lightning.cli import main
from fl_lightning.loggers import read_offline_history

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(REPO / "configs/settings/mnist5k.yaml"),
         "--config", str(REPO / "configs/methods/fedsol/fedsol.yaml"), "--data.dataset", "digits",
         "--model.init_args.model", "mlp", "--data.num_clients", "10", "--data.local_epochs", "1",
         "--data.min_size", "5", "--federation.local_eval_samples", "200"]


def run(args, capsys=None):
    try:
        main(args)
    except SystemExit as stop:
        return stop.code
    return 0


def wandb_rows(root: Path) -> list[dict]:
    files = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {root}"
    return read_offline_history(files[0])


def test_fit_logs_resumes_and_validates(tmp_path, capsys, caplog):
    root = tmp_path / "run"
    assert run(["fit", *SMALL, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root)]) == 0
    ckpt = root / "checkpoints" / "last.ckpt"
    assert ckpt.exists() and (root / "config.yaml").exists()
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    rounds_done = state["epoch"]
    rows = wandb_rows(root)
    accuracy = {r["round"]: r["global/test_acc"] for r in rows if "global/test_acc" in r}
    assert sorted(accuracy) == [1, 2] and all(0.0 <= a <= 1.0 for a in accuracy.values())
    per_round = {}
    for r in rows:  # every row carries the 1-based round, W&B's x-axis (0: the partition at fit start)
        per_round.setdefault(r["round"], {}).update(r)
    assert sorted(per_round) == [0, 1, 2]
    for key in ("local/local_acc_mean", "local/local_acc_std", "local/drift_mean", "lr", "fedsol/prox_loss",
                "fedsol/cos_update_prox", "train/loss"):
        assert key in per_round[2], key
    assert per_round[2]["lr"] == pytest.approx(0.01 * 0.99)  # the lr used in round 2
    assert per_round[2]["local/drift_mean"] > 0

    caplog.clear()
    assert run(["fit", *SMALL, "--trainer.max_epochs", "3", "--trainer.default_root_dir", str(root),
                "--ckpt_path", "last"]) == 0
    assert "round 3/3" in caplog.text and "round 1/3" not in caplog.text  # resumed after round 2
    resumed = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert resumed["epoch"] == rounds_done + 1

    assert run(["validate", *SMALL, "--trainer.default_root_dir", str(root), "--ckpt_path", str(ckpt)]) == 0
    err = capsys.readouterr()
    assert "global/test_acc" in err.out + err.err


@pytest.mark.parametrize("extra, message", [
    (["--model", "FedFoo"], "--model FedFoo: unknown method"),
    (["--model.init_args.model", "nonet"], "unknown model 'nonet'"),
    (["--data.dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--data.alpha", "0"], "alpha must be > 0"),
    (["--data.num_clients", "5000"], "at most 1500 clients"),
    (["--data.partition", "shard", "--data.shards_per_client", "3", "--data.num_clients", "7"], "multiple of the 10"),
    (["--data.dataset", "cifar10", "--data.download", "false"], "cifar-10-batches-py"),
    (["--ckpt_path", "last"], "no checkpoint at"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    code = run(["fit", *SMALL, "--trainer.max_epochs", "1", "--trainer.logger", "false",
                "--trainer.default_root_dir", str(tmp_path), "--data.root", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *SMALL, "--data.alpha", "-1",
                           "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: dirichlet alpha must be > 0, got -1.0"
    assert "Traceback" not in proc.stderr


def test_ddp_on_two_cpu_processes_matches_one_process(tmp_path):
    """Each client's batches are split across ranks and gradients averaged (DDP's all-reduce for
    backward, an explicit mean for FedSOL's torch.autograd.grad), so two CPU processes with gloo
    train the same global model as one process when batches divide evenly (here the round's two
    clients hold 151 and 34 samples: batches of 10 split 5/5, tails of 4 split 2/2, and a tail of
    1 is the same sample on both ranks)."""
    args = [*SMALL, "--trainer.max_epochs", "1", "--trainer.logger", "false", "--data.batch_size", "10",
            "--model.init_args.perturb", "all", "--trainer.accelerator", "cpu"]
    finals = []
    for name, extra in (("one", []), ("ddp", ["--trainer.strategy", "ddp", "--trainer.devices", "2",
                                              "--federation.parallel", "batch"])):
        root = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *args, *extra,
                               "--trainer.default_root_dir", str(root)],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        finals.append(torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True))
    one, ddp = (f["state_dict"] for f in finals)
    for key in one:
        torch.testing.assert_close(ddp[key], one[key], atol=2e-5, rtol=1e-4)
