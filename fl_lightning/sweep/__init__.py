"""`fl-lightning sweep <spec>`: run a W&B sweep spec with W&B's agents, or locally without W&B.

A spec is a W&B sweep configuration (method grid/random/bayes, `parameters` named by CLI option,
a `command` running `fl-lightning fit --config ... ${args}`); a paper table in `configs/tables/`
holds one under its `sweep:` key. Two ways to run it:

- online (default): `wandb.sweep` creates the sweep and one `wandb agent` runs per GPU
  (`CUDA_VISIBLE_DEVICES` per agent, or `--gpus 0,1`). Each agent-launched run writes its
  directory under `runs/<sweep id>/<run id>` (see `agent_run_dir_args`).
- `--local`: no account, no network. Grid and seeded random specs are expanded here, with W&B's
  own formatting of `${args}` (`--key=value`), and run by N worker processes, each run offline in
  `<root>/<sweep>/<run-name>/` (named by the parameters that vary: `config=fedsol,seed=0`) and
  grouped in W&B by the sweep name. The sweep's bookkeeping (each run's command, parameters,
  status, exit code, error line, log) lives in `<root>/<sweep>/.sweep/`, never inside a run
  directory. Started again after an interruption, finished runs are skipped, runs with a checkpoint
  resume with `--ckpt_path last`, and runs without one start over with `--overwrite true`.

Every command is parsed through the CLI (in-process) before anything starts, so an unknown option
or a bad value is one `error:` line, not a failed run an hour later. Two answers need no command
and come first, before torch, Lightning and the CLI's parser are imported: a W&B sweep while W&B
is offline, and a local sweep whose runs are all over (finished, diverged or failed).

This module is the command line (`build_parser`, `main`); the work is in its modules, in the order
a sweep uses them:

    spec.py      the spec: YAML read and checked (`load_spec`), expanded into parameter sets (`expand`)
    commands.py  each run's name (`name_runs`) and fl-lightning command, parsed by the CLI before anything
                 starts (`plan`)
    local.py     --local: warm workers, resume/skip from each run's directory, records in `.sweep/`
    agents.py    online: the W&B sweep and its `wandb agent` processes, a directory per agent run

Their public names are importable from `fl_lightning.sweep` too (`report` reads the local records
and run names through them).
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from fl_lightning.errors import FLUserError, OneLineArgumentParser
from fl_lightning.sweep.agents import agent_commands, agent_run_dir_args, online, require_online
from fl_lightning.sweep.commands import (
    PlannedRun,
    cli_parser,
    display_value,
    fl_args,
    keep_recorded_names,
    name_runs,
    parse_with_cli,
    plan,
    run_names,
    short_keys,
    varying_keys,
    wandb_args,
)
from fl_lightning.sweep.local import (
    FINAL_STATES,
    LocalSweep,
    available_gpus,
    error_line,
    gpu_indices,
    parse_gpus,
    run_state,
    warm_workers,
    worker_envs,
)
from fl_lightning.sweep.records import read_json, read_record, recorded_names
from fl_lightning.sweep.spec import (
    DISTRIBUTIONS,
    NUMERIC_DISTRIBUTIONS,
    SEARCH_METHODS,
    SEED_KEYS,
    Spec,
    canonical,
    distribution_of,
    expand,
    load_spec,
)

__all__ = [
    "DISTRIBUTIONS", "FINAL_STATES", "NUMERIC_DISTRIBUTIONS", "SEARCH_METHODS", "SEED_KEYS", "LocalSweep",
    "PlannedRun", "Spec", "agent_commands", "agent_run_dir_args", "available_gpus", "build_parser", "canonical",
    "cli_parser", "display_value", "distribution_of", "error_line", "expand", "fl_args", "gpu_indices",
    "keep_recorded_names", "load_spec", "main", "name_runs", "online", "parse_gpus", "parse_with_cli", "plan",
    "read_json", "read_record", "recorded_names", "require_online", "run_names", "run_state", "short_keys",
    "varying_keys", "wandb_args", "warm_workers", "worker_envs",
]


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="fl-lightning sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="a W&B sweep spec (configs/sweeps/*.yaml) or a paper table (configs/tables/*.yaml)")
    p.add_argument("--local", action="store_true", help="expand and run the sweep here, offline, without W&B")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel runs (default: one per GPU, else 1); on CPU each gets cores/N threads")
    p.add_argument("--gpus", default=None, help="GPU indices to use, e.g. 0,1,2,3 (default: all visible)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("--root", default="runs", help="runs go to <root>/<sweep name>/<run name>/ (default: runs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the local random search (default 0)")
    p.add_argument("--count", type=int, default=None, help="number of runs (random search; default run_cap)")
    p.add_argument("--project", default=None, help="W&B project (online)")
    p.add_argument("--entity", default=None, help="W&B entity (online)")
    return p


def main(argv: list[str]) -> int:
    opts = build_parser().parse_args(argv)
    spec = load_spec(opts.spec)
    if opts.workers is not None and opts.workers < 1:
        raise FLUserError(f"--workers {opts.workers}: need at least 1")
    gpu_indices(opts.gpus)
    root = Path(opts.root)
    # The questions answered from files alone come before torch, Lightning and the CLI's parser are
    # imported: whether W&B is online for a W&B sweep, and whether a local sweep has anything left.
    if not opts.local and not opts.dry_run:
        require_online()
    if opts.local and _nothing_left(spec, root, opts):
        return 0
    gpu_count = available_gpus()
    gpus = parse_gpus(opts.gpus, gpu_count)
    if gpus is None and gpu_count:
        gpus = [str(i) for i in range(gpu_count)]
    workers = opts.workers or (len(gpus) if gpus else 1)
    if not opts.local:
        # Every command parses before the sweep is created (bayes: one random draw of its space).
        if spec.config["method"] == "bayes":
            plan(Spec(spec.name, {**spec.config, "method": "random"}, spec.path), root, count=1)
        else:
            plan(spec, root, seed=opts.seed, count=opts.count)
        if opts.dry_run:
            for env, argv in agent_commands("<sweep id>", gpus, workers, opts.count):
                print(f"{' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(argv)}".strip())
            return 0
        return online(spec, gpus, workers, opts.count, opts.project, opts.entity)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if opts.dry_run:
        LocalSweep(spec, plan(spec, root, seed=opts.seed, count=opts.count), root, []).dry_run()
        return 0
    # the workers import while the commands are parsed
    warm = warm_workers(spec, worker_envs(workers, gpus, cores), root)
    try:
        runs = plan(spec, root, seed=opts.seed, count=opts.count)
    except BaseException:
        for worker in warm:
            worker.close()
        raise
    return LocalSweep(spec, runs, root, warm).run()


def _nothing_left(spec: Spec, root: Path, opts: argparse.Namespace) -> bool:
    """True, after saying so in one line (or, with --dry-run, one `# <outcome>: <run>` line a run),
    when every run of the local sweep is over: then no command needs parsing and no worker starting."""
    runs = name_runs(spec, root, seed=opts.seed, count=opts.count)
    states = [run_state(root / spec.name / name) for name, _ in runs]
    if not all(state in FINAL_STATES for state in states):
        return False
    if opts.dry_run:
        for (name, _), state in zip(runs, states, strict=True):
            print(f"# {state}: {name}")
        return True
    counts = ", ".join(f"{states.count(s)} {s}" for s in FINAL_STATES if s in states)
    every = "its run is" if len(runs) == 1 else f"all {len(runs)} runs are"
    print(f"sweep {spec.name}: nothing left to run: {every} over ({counts}) in {root / spec.name}")
    return True
