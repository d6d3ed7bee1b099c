"""Writes tests/data/experiment_configs/: the former one-file-per-experiment configs as git revision
REV holds them (`configs/<name>.yaml`, `configs/fedorgp/<name>.yaml`, and the FedORGP offline demo
overlay `configs/fedorgp/demo_mnist5k_hmg3.yaml`), before the configs were split into settings and
methods. tests/test_configs.py parses each of them and its composed command (configs/README.md)
with the current CLI and compares the two `--print_config`s, so options added to the code later
change both sides alike.

    .venv/bin/python tests/data/make_experiment_configs.py dc40642

The files are read from git (`git show REV:configs/...`), so they can be rebuilt after the
originals are gone; the methods/, sweeps/ and tables/ folders are not experiments.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "experiment_configs"


def former_configs(rev: str) -> list[str]:
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "configs/"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    return sorted(f[len("configs/"):] for f in files if f.endswith(".yaml")
                  and f.split("/")[1] not in ("methods", "sweeps", "tables"))


def main(rev: str) -> None:
    for name in former_configs(rev):
        text = subprocess.run(["git", "show", f"{rev}:configs/{name}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        target = OUT / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"# configs/{name} at {rev}, verbatim below\n{text}")
        print(target.relative_to(REPO))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_experiment_configs.py GIT_REVISION")
    main(sys.argv[1])
