"""Time to the first round: from starting the process to the end of round 1's
evaluation, `fl-lightning fit` on the demo setting (configs/settings/mnist5k.yaml with FedAvg, as
the user starts it: W&B offline, checkpoint, results files, analyses' defaults) against a plain
PyTorch script that imports torch, loads the same MNIST-5k arrays (the project's cache file),
builds the same FedAvg CNN and trains round 1's clients on the same batches, then evaluates the
global model on the test set. Both print a line when round 1 is evaluated; this script timestamps
it from outside. Interleaved repeats, medians; one thread each.

    python benchmarks/first_round.py [--repeats 3]

Also prints `python -c "import torch"` and `python -c "import lightning.pytorch"`: the difference
is what any CLI built on Lightning pays before it can parse a single option. Most of it is
torchmetrics (`python -c "import torch, torchmetrics"`): Lightning requires it, and `import
lightning` imports it (lightning/fabric/utilities/imports.py reads its version with
`compare_version`, which imports the package), and torchmetrics imports its image and audio
metrics, hence torchvision (torch._dynamo, sympy) and scipy.signal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FL = shutil.which("fl-lightning") or str(Path(sys.executable).with_name("fl-lightning"))
SETTING = ["--config", "configs/settings/mnist5k.yaml", "--config", "configs/methods/fedsol/fedavg.yaml"]

PLAIN = r"""
import sys, time
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
torch.set_num_threads(1)
plan = np.load(sys.argv[1], allow_pickle=True)
data = np.load(sys.argv[2])
train_x, train_y, test_x, test_y = (torch.as_tensor(data[k]) for k in ("train_x", "train_y", "test_x", "test_y"))
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, 10))
global_w = {k: v.clone() for k, v in model.state_dict().items()}
uploads, sizes = [], []
for steps, size in zip(plan["clients"], plan["sizes"]):
    model.load_state_dict(global_w)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    for idx in steps:
        idx = torch.as_tensor(idx)
        opt.zero_grad()
        F.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
        opt.step()
    uploads.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    sizes.append(int(size))
model.load_state_dict({k: sum(u[k] * (n / sum(sizes)) for u, n in zip(uploads, sizes)) for k in global_w})
with torch.no_grad():
    acc = float((model(test_x).argmax(1) == test_y).float().mean())
print(f"round 1: global test acc {acc:.4f}", flush=True)
"""


def round_one_plan(tmp: Path) -> tuple[Path, Path]:
    """Round 1's clients and the sample indices of each of their steps as the project draws them,
    and MNIST-5k's split as the project makes it (written once, before timing)."""
    from fl_lightning.data.datamodule import FederatedDataModule

    dm = FederatedDataModule(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
                             partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)
    dm.setup()
    plan = dm.plan_round(0)
    clients = np.empty(len(plan.clients), dtype=object)
    clients[:] = [[np.asarray(b) for b in work.batches] for work in plan.clients]
    np.savez(tmp / "plan.npz", clients=clients, sizes=[work.num_samples for work in plan.clients])
    train, test = dm.train_set.tensors(), dm.test_set.tensors()
    np.savez(tmp / "data.npz", train_x=train.images.numpy(), train_y=train.labels.numpy(),
             test_x=test.images.numpy(), test_y=test.labels.numpy())
    return tmp / "plan.npz", tmp / "data.npz"


def seconds_to(command: list[str], marker: str, env: dict) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = None
    for line in process.stdout:
        if seen is None and line.startswith(marker):
            seen = time.perf_counter() - started
    process.wait()
    if seen is None:
        raise RuntimeError(f"{command[:3]} never printed {marker!r} (exit {process.returncode})")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        plan, arrays = round_one_plan(Path(tmp))
        commands = {
            "python -c 'import torch'": ([sys.executable, "-c", "import torch; print('imported')"], "imported"),
            "python -c 'import torch, torchmetrics'": (
                [sys.executable, "-c", "import torch, torchmetrics; print('imported')"], "imported"),
            "python -c 'import lightning.pytorch'": (
                [sys.executable, "-c", "import lightning.pytorch; print('imported')"], "imported"),
            "plain loop, round 1": ([sys.executable, "-c", PLAIN, str(plan), str(arrays)], "round 1"),
            "fl-lightning fit, round 1": ([FL, "fit", *SETTING, "--trainer.max_epochs", "1", "--overwrite", "true",
                                          "--trainer.default_root_dir", str(Path(tmp) / "run")], "round 1/"),
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):  # interleaved
            for name, (command, marker) in commands.items():
                times[name].append(seconds_to(command, marker, env))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:38s} median {med[name]:6.2f} s  (min {min(t):.2f}, max {max(t):.2f})")
    gap = med["fl-lightning fit, round 1"] - med["plain loop, round 1"]
    floor = med["python -c 'import lightning.pytorch'"] - med["python -c 'import torch'"]
    metrics = med["python -c 'import torch, torchmetrics'"] - med["python -c 'import torch'"]
    verdict = "met" if gap <= 2 else "NOT met"
    print(f"first round: fl-lightning {gap:+.2f} s after the plain loop (target <= 2 s: {verdict}); importing "
          f"Lightning alone costs {floor:.2f} s over torch, of which torchmetrics {metrics:.2f} s (Lightning "
          f"requires it and imports it with itself)")


if __name__ == "__main__":
    main()
