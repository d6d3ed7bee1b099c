"""The W&B side of `fl-lightning sweep` (without --local): W&B's sweep server picks the runs and
`wandb agent` processes run them, one per GPU.

Here the sweep is created (`wandb.sweep`) and its agents started (`CUDA_VISIBLE_DEVICES` per
agent, or `--gpus 0,1`); W&B's server does the grid, random or bayes search. Each agent launches
`fl-lightning fit ... --key=value` itself, and such a run gets its own directory
`runs/<sweep id>/<run id>` (`agent_run_dir_args`, applied by fl_lightning/cli.py), so that the runs
of a sweep, which share their command apart from the swept values, never share a run directory.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from fl_lightning.errors import FLUserError
from fl_lightning.sweep.spec import Spec
from fl_lightning.wandb_online import wandb_online


def agent_commands(sweep_path: str, gpus: list[str] | None, workers: int,
                   count: int | None) -> list[tuple[dict, list[str]]]:
    """(environment, argv) of each `wandb agent`: one per GPU, else `workers` on the CPU."""
    wandb_bin = str(Path(sys.executable).with_name("wandb"))
    argv = [wandb_bin, "agent", *(["--count", str(count)] if count else []), sweep_path]
    if gpus:
        return [({"CUDA_VISIBLE_DEVICES": g}, argv) for g in gpus]
    return [({}, argv) for _ in range(workers)]


def agent_run_dir_args(args: list[str]) -> list[str]:
    """A run launched by a W&B agent (WANDB_SWEEP_ID and WANDB_RUN_ID set) gets its own directory
    `runs/<sweep id>/<run id>`, so agents never share a run directory."""
    sweep_id, run_id = os.environ.get("WANDB_SWEEP_ID"), os.environ.get("WANDB_RUN_ID")
    if not (sweep_id and run_id) or not args or args[0] != "fit":
        return args
    return [*args, f"--trainer.default_root_dir=runs/{sweep_id}/{run_id}"]


def require_online() -> None:
    """A W&B sweep needs W&B's server: without a login, or with W&B switched offline, one line that
    says to run the sweep with --local (asked first: it needs nothing imported)."""
    if not wandb_online():
        raise FLUserError("a W&B sweep needs W&B online (wandb login or WANDB_API_KEY, and WANDB_MODE not offline); "
                          "without it run the sweep here with --local")


def online(spec: Spec, gpus: list[str] | None, workers: int, count: int | None, project: str | None,
           entity: str | None) -> int:
    """Create the sweep on W&B's server and run its agents here until they end; their worst exit code."""
    require_online()
    import wandb

    config = {k: v for k, v in spec.config.items()}
    config.setdefault("name", spec.name)
    sweep_id = wandb.sweep(config, project=project or config.get("project") or "fl-lightning", entity=entity)
    path = "/".join(p for p in (entity, project or config.get("project") or "fl-lightning", sweep_id) if p)
    procs = []
    for env, argv in agent_commands(path, gpus, workers, count):
        print(f"{' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(argv)}".strip(), flush=True)
        procs.append(subprocess.Popen(argv, env={**os.environ, **env}))
    try:
        return max(p.wait() for p in procs)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        return 130
