"""Writes tests/data/experiment_configs/<experiment>.yaml: the `fl-lightning fit --print_config` of
every experiment as the single-file configs of git revision REV defined it (before the configs
were split into settings and methods). tests/test_configs.py checks that each experiment's composed
command (configs/README.md) still prints the same config.

    .venv/bin/python tests/data/make_experiment_configs.py dc40642

The old files are read from git (`git show REV:configs/...`), so the references can be rebuilt
after the files are gone. An experiment is named by its old path under configs/ without `.yaml`
(`fedsol_cifar10`, `fedorgp/fedgen_cifar10_pathological`); overlays (`demo_*`) and the
methods/, sweeps/ and tables/ folders are not experiments by themselves. The offline FedORGP demo
overlay layered over each FedORGP method's CIFAR-10 pathological file (as
benchmarks/fedorgp_hmg3_offline.sh runs it) is: `fedorgp/<method>_cifar10_pathological+demo_mnist5k_hmg3`.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "experiment_configs"


def old_experiments(rev: str) -> list[str]:
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "configs/"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    names = [f[len("configs/"):-len(".yaml")] for f in files if f.endswith(".yaml")]
    return sorted(n for n in names if n.split("/")[0] not in ("methods", "sweeps", "tables")
                  and not n.split("/")[-1].startswith("demo_"))


OVERLAY = "fedorgp/demo_mnist5k_hmg3"


def print_config(args: list[str]) -> str:
    """`fl-lightning fit <args> --print_config`, run in this process by the CLI's own parser."""
    from fl_lightning.sweep import cli_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli_parser().parse_args(["fit", *args, "--print_config"])
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise RuntimeError(f"--print_config of {args} failed") from None
    return out.getvalue()


def main(rev: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        def old_file(name: str) -> Path:
            text = subprocess.run(["git", "show", f"{rev}:configs/{name}.yaml"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
            src = Path(tmp) / f"{name}.yaml"
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_text(text)
            return src

        experiments = old_experiments(rev)
        layered = [[name, OVERLAY] for name in experiments if name.startswith("fedorgp/")
                   and name.endswith("_cifar10_pathological")]
        for names in [[name] for name in experiments] + layered:
            target = OUT / f"{'+'.join(n.split('/')[-1] for n in names)}.yaml"
            if names[0].startswith("fedorgp/"):
                target = OUT / "fedorgp" / target.name
            target.parent.mkdir(parents=True, exist_ok=True)
            args = [a for n in names for a in ("--config", str(old_file(n)))]
            command = " ".join(f"--config configs/{n}.yaml" for n in names)
            target.write_text(f"# fl-lightning fit {command} --print_config, at {rev}\n" + print_config(args))
            print(target.relative_to(REPO))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_experiment_configs.py GIT_REVISION")
    main(sys.argv[1])
