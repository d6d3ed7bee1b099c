"""What a local sweep pays per run beyond training: the same N one-round runs
(FedAvg, tiny `mlp` on the 8x8 digits, one per seed) run by `fl-lightning sweep --local --workers 1`
(warm worker: imports once, forks a process per run) and as N `fl-lightning fit` processes started
one after the other (what the sweep did before), interleaved over repeats, medians. Also checks
that each warm run's final weights equal its cold twin's (torch.equal).

    python benchmarks/sweep_startup.py [--runs 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/settings/mnist5k.yaml", "--config", "configs/methods/fedsol/fedavg.yaml",
        "--data.dataset=digits", "--model.init_args.model=mlp", "--data.num_clients=10", "--data.min_size=5",
        "--federation.eval_local_models=false", "--trainer.enable_progress_bar=false", "--trainer.max_epochs=1"]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# the cold fits get the thread limits the sweep gives its one worker (all the cores)
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": str(CORES),
       "MKL_NUM_THREADS": str(CORES), "OPENBLAS_NUM_THREADS": str(CORES), "CUDA_VISIBLE_DEVICES": ""}


def warm(root: Path, runs: int) -> float:
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "method": "grid",
                                    "parameters": {"seed_everything": {"values": list(range(runs))}},
                                    "command": ["${env}", "fl-lightning", "fit", *TINY, "${args}"]}))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fl_lightning.cli", "sweep", str(spec), "--local", "--workers", "1",
                    "--root", str(root / "warm")],
                   cwd=REPO, env=ENV, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def cold(root: Path, runs: int) -> float:
    start = time.perf_counter()
    for seed in range(runs):
        subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *TINY, f"--seed_everything={seed}",
                        f"--trainer.default_root_dir={root / 'cold' / f'seed={seed}'}"],
                       cwd=REPO, env=ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def training_seconds(run_dirs) -> float:
    return statistics.median(json.loads((d / "summary.json").read_text())["wall_time_s"] for d in run_dirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    same = True
    per_run: list[float] = []  # a warm run's start to its end, as the sweep's records say
    for _ in range(args.repeats):
        root = Path(tempfile.mkdtemp(prefix="sweep_startup_"))
        times["warm"].append(warm(root, args.runs))
        times["cold"].append(cold(root, args.runs))
        train = training_seconds(sorted((root / "warm" / "s").glob("seed*")))
        records = [json.loads(p.read_text()) for p in (root / "warm" / "s" / ".sweep").glob("seed*.json")]
        per_run.append(statistics.median(r["ended"] - r["started"] for r in records))
        for seed in range(args.runs):
            a = torch.load(root / "warm" / "s" / f"seed={seed}" / "checkpoints" / "last.ckpt", weights_only=True)
            b = torch.load(root / "cold" / f"seed={seed}" / "checkpoints" / "last.ckpt", weights_only=True)
            same &= all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
        shutil.rmtree(root)
    w, c = statistics.median(times["warm"]), statistics.median(times["cold"])
    print(f"{args.runs} one-round runs: warm sweep {w:.1f} s, {args.runs} cold fits {c:.1f} s "
          f"(saved {c - w:.1f} s, {(c - w) / args.runs:.2f} s a run); ratio {w / c:.2f}")
    run = statistics.median(per_run)
    print(f"per run: warm {w / args.runs:.2f} s (the sweep's own start included), cold {c / args.runs:.2f} s; "
          f"a warm run from its start to its end {run:.2f} s, of which training (summary wall_time_s) {train:.2f} s "
          f"-> overhead beyond training {run - train:.2f} s a run (target <= 1 s)")
    print(f"final weights warm == cold for every run: {same}")


if __name__ == "__main__":
    main()
