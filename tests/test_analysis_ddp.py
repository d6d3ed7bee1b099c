"""`--analysis.*` under DDP (two CPU processes, gloo): the Hessian spectrum and the loss surface
are computed by global rank 0 only, their files are written once, and the run finishes (a rank
waiting in a collective that rank 0 never enters would hang: the test then fails on its timeout).

The run goes through a small launcher script that counts, per rank, the analysis work done in that
process (Hessian-vector products, surface evaluations, PNG writes) and then calls the CLI; Lightning's
DDP launcher starts rank 1 by running the same script again."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from test_cli import REPO

PROBE = '''
import json, os, sys
from pathlib import Path

import torch.distributed as dist

from fl_lightning.analysis import callback, objective, plots, surface

OUT = Path(os.environ["ANALYSIS_PROBE_DIR"])


def rank():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("LOCAL_RANK", "0"))


def counted(owner, name, event):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        with open(OUT / f"rank{rank()}.events", "a") as f:
            f.write(event + "\\n")
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


counted(objective.SubsetObjective, "hvp", "hvp")
counted(objective.SubsetObjective, "loss_and_accuracy", "loss")
counted(plots, "save_png", "png")
counted(callback.AnalysisCallback, "write_files", "write_files")

from fl_lightning.cli import main

main()
'''


def events(probe_dir: Path, rank: int) -> dict[str, int]:
    path = probe_dir / f"rank{rank}.events"
    lines = path.read_text().split() if path.exists() else []
    return {e: lines.count(e) for e in set(lines)}


def test_ddp_analysis_runs_on_rank_zero_only_and_writes_once(tmp_path):
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    script = tmp_path / "probe_cli.py"
    script.write_text(PROBE)
    root = tmp_path / "run"
    args = ["fit", "--config", str(REPO / "configs/settings/mnist5k.yaml"), "--data.dataset", "digits",
            "--model.init_args.model", "mlp", "--data.num_clients", "4", "--data.sample_ratio", "0.5",
            "--data.local_epochs", "1", "--data.min_size", "5", "--data.batch_size", "20",
            "--federation.local_eval_samples", "100", "--trainer.max_epochs", "2", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.strategy", "ddp", "--trainer.default_root_dir", str(root),
            "--analysis.every_n_rounds", "1", "--analysis.samples", "100", "--analysis.max_hvps", "8",
            "--analysis.trace_probes", "2", "--analysis.layer_hvps", "3", "--analysis.surface_points", "3",
            "--analysis.heatmap_every_n_rounds", "1"]
    env = dict(os.environ, ANALYSIS_PROBE_DIR=str(probe_dir), WANDB_MODE="offline", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    # own session: on a timeout (a deadlock) the whole group, rank 1 included, is killed
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise AssertionError(f"the DDP run with analysis did not finish in 300 s (deadlock?):\n"
                             f"{stderr[-3000:]}") from None
    assert proc.returncode == 0, stderr[-3000:]

    rank0, rank1 = events(probe_dir, 0), events(probe_dir, 1)
    assert rank0.get("hvp", 0) > 0 and rank0.get("loss", 0) >= 2 * 9  # spectrum and 3 x 3 surface, each round
    assert rank0.get("write_files", 0) == 2
    assert rank1.get("hvp", 0) == 0 and rank1.get("loss", 0) == 0, f"rank 1 repeated rank 0's analysis: {rank1}"
    assert rank1.get("png", 0) == 0 and rank1.get("write_files", 0) == 0

    out = root / "analysis"
    assert sorted(p.name for p in out.iterdir()) == ["partition.json", "partition.png", "round_001", "round_002",
                                                    "spectrum_history.png"]
    for round_no in (1, 2):
        folder = out / f"round_{round_no:03d}"
        result = json.loads((folder / "analysis.json").read_text())
        assert result["round"] == round_no and result["spectrum"]["lambda_1"] > 0
        assert len(result["surface"]["loss"]) == 3
        assert sorted(p.name for p in folder.iterdir()) == ["analysis.json", "classwise_local.png", "spectrum.png",
                                                             "surface_acc.png", "surface_loss.png"]
    # the PNGs of both rounds (4 each), the partition, and the spectrum history (rewritten each
    # analysis round), each written by rank 0 only
    assert rank0["png"] == 1 + 2 * 4 + 2
