"""How long the CLI itself takes, whole processes, interleaved, medians, against the targets:

- `fl-lightning --help` and `fl-lightning fit --help` within 1.5 s of `python -c "import lightning.pytorch"`
  (the floor of anything that builds the Lightning CLI);
- `fl-lightning sweep configs/tables/demo_mnist5k.yaml --local --dry-run` (15 commands, each parsed
  with the CLI's parser) within 2x of one `fl-lightning fit ... --print_config`.

    python benchmarks/cli_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FL = shutil.which("fl-lightning") or str(Path(sys.executable).with_name("fl-lightning"))
SETTING = ["--config", "configs/settings/mnist5k.yaml", "--config", "configs/methods/fedsol/fedavg.yaml"]
COMMANDS = {
    "import lightning.pytorch": [sys.executable, "-c", "import lightning.pytorch"],
    "fl-lightning --help": [FL, "--help"],
    "fl-lightning fit --help": [FL, "fit", "--help"],
    "fit --print_config": [FL, "fit", *SETTING, "--print_config"],
    "sweep --dry-run (15 runs)": [FL, "sweep", "configs/tables/demo_mnist5k.yaml", "--local", "--dry-run"],
}


def seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   env={**os.environ, "WANDB_MODE": "offline"})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):  # interleaved: a neighbour's load hits every command alike
        for name, command in COMMANDS.items():
            times[name].append(seconds(command))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:28s} min {min(t):6.2f} s  median {med[name]:6.2f} s  max {max(t):6.2f} s")
    floor = med["import lightning.pytorch"]
    for name in ("fl-lightning --help", "fl-lightning fit --help"):
        extra = med[name] - floor
        print(f"{name} beyond import lightning.pytorch: {extra:+.2f} s (target <= 1.5 s: "
              f"{'met' if extra <= 1.5 else 'NOT met'})")
    ratio = med["sweep --dry-run (15 runs)"] / med["fit --print_config"]
    print(f"dry run of 15 commands / one fit --print_config: {ratio:.2f}x (target <= 2x: "
          f"{'met' if ratio <= 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
