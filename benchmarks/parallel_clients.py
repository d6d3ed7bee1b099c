"""Seconds per round with a round's clients on 1 or 2 processes (issue: parallel clients).

FedAvg CNN on MNIST-5k (configs/settings/mnist5k.yaml: 50 clients, 10 per round, 5 local epochs),
on the CPU:

    1 process  x 1 thread
    1 process  x 2 threads
    2 processes x 1 thread, --federation.parallel clients   (each process trains 5 clients)
    2 processes x 1 thread, --federation.parallel batch     (DDP splits every mini-batch)

A round's time is `perf/round_seconds` from metrics.csv (round start to the end of aggregation,
as each run logs it; the first round, with its warm-up, is left out). The configurations are run
interleaved, REPS times each, and the medians compared, since the machine may be shared.

    python benchmarks/parallel_clients.py [ROUNDS=4] [REPS=3]

Then the peak memory (max RSS of one process) of a FedAvg run with 1,000 clients and 10 per round
against 100 clients: idle clients cost their partition indices, nothing more.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.accelerator", "cpu", "--federation.eval_local_models", "false", "--analysis.divergence", "false",
        "--analysis.partition", "false"]
CONFIGS = {
    "1 proc x 1 thread": (1, 1, []),
    "1 proc x 2 threads": (1, 2, []),
    "2 procs x 1 thread, clients": (2, 1, ["--federation.parallel", "clients"]),
    "2 procs x 1 thread, batch": (2, 1, ["--federation.parallel", "batch"]),
}


def run(processes: int, threads: int, extra: list[str], rounds: int, root: Path) -> list[float]:
    launch = ["--trainer.strategy", "ddp", "--trainer.devices", str(processes)] if processes > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "fl_lightning.cli", "fit", *BASE, *launch, *extra, "--trainer.max_epochs",
           str(rounds), "--trainer.default_root_dir", str(root), "--overwrite", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    with open(root / "metrics.csv") as f:
        return [float(r["perf/round_seconds"]) for r in csv.DictReader(f)][1:]


def peak_rss_mib(num_clients: int) -> float:
    """Max RSS of a 2-round FedAvg fit with `num_clients` clients, 10 per round (its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        code = (
            "import resource, sys\n"
            "from fl_lightning.cli import main\n"
            f"main(['fit', *{BASE!r}, '--model.init_args.model', 'mlp', '--data.num_clients', '{num_clients}',"
            f" '--data.sample_ratio', '{10 / num_clients}', '--data.partition', 'iid', '--data.min_size', '1',"
            f" '--data.local_epochs', '1', '--trainer.max_epochs', '2', '--trainer.default_root_dir', '{tmp}/run'])\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        return int(proc.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for name, (processes, threads, extra) in CONFIGS.items():
                times[name] += run(processes, threads, extra, rounds, Path(tmp) / f"{rep}-{processes}-{threads}")
                print(f"rep {rep + 1}/{reps} {name}: median so far {statistics.median(times[name]):.2f} s/round",
                      flush=True)
    base = statistics.median(times["1 proc x 1 thread"])
    print(f"\nFedAvg CNN, MNIST-5k, 10 clients per round; median s/round over {reps} x {rounds - 1} rounds "
          f"(load {os.getloadavg()[0]:.1f})")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"  {name:32s} {m:7.2f} s/round   speed-up vs 1 x 1: {base / m:5.2f}x")
    clients = statistics.median(times["2 procs x 1 thread, clients"])
    print(f"  2 x 1 (clients) vs 1 x 2 threads: {statistics.median(times['1 proc x 2 threads']) / clients:5.2f}x")
    small, large = peak_rss_mib(100), peak_rss_mib(1000)
    print(f"\npeak RSS, FedAvg mlp, 10 clients per round: 100 clients {small:.0f} MiB, 1,000 clients {large:.0f} MiB "
          f"({large - small:+.0f} MiB)")


if __name__ == "__main__":
    main()
