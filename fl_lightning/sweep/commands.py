"""From a spec's parameter sets to the runs of a sweep: each run's name and its fl-lightning command.

A run's command is the spec's `command` with `${args}` filled in by W&B's own function, so a run
started here gets exactly the arguments a W&B agent would give it. Every command is parsed by the
CLI's own parser (in-process, `--config` files and all) before anything starts, so a spec with an
unknown option or a bad value is refused in one `error:` line instead of failing run by run.

Run names (`config=fedsol,rho=2,seed=0`) are the runs' directory names below the sweep's. They
name only the parameters that take more than one value in the spec: a setting every run shares says
nothing about which run this is, and `report` prints such settings once, under its table. Keys and
values read as in `report`'s columns (`short_keys`, `display_value`). A run that a sweep already
recorded under another name (`.sweep/<name>.json`, written by a version that named runs otherwise)
keeps that name, so the sweep still skips or resumes it.
"""

from __future__ import annotations

import contextlib
import functools
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.errors import FLUserError
from fl_lightning.sweep.records import recorded_names
from fl_lightning.sweep.spec import Spec, canonical, expand


@dataclass
class PlannedRun:
    """One run of a sweep: its place in the spec's order, its directory name, its values, its command."""

    index: int
    name: str
    params: dict[str, Any]
    args: list[str] = field(default_factory=list)  # fl-lightning arguments (after the program name)


# ---------------------------------------------------------------------------------------------
# Names


def display_value(value: Any) -> str:
    """How a parameter value reads in a run name or a table: class paths by their class name,
    config files by their stem."""
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    if isinstance(value, str) and text.endswith((".yaml", ".yml")):
        return Path(text).stem
    if isinstance(value, str) and "." in text and text.rsplit(".", 1)[-1][:1].isupper():
        return text.rsplit(".", 1)[-1]
    return text


def short_keys(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix that tells each key apart (`data.alpha` vs `init_args.alpha`);
    `model.class_path` reads as `model`, `seed_everything` as `seed`."""
    def base(key: str) -> list[str]:
        parts = key.split(".")
        if parts[-1] == "class_path" and len(parts) > 1:
            parts = parts[:-1]
        if parts == ["seed_everything"]:
            parts = ["seed"]
        return parts
    out = {}
    for key in keys:
        parts = base(key)
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if all(short != ".".join(base(k)[-n:]) for k in keys if k != key):
                break
        out[key] = short
    return out


def varying_keys(spec: Spec) -> list[str]:
    """The parameters that take more than one value in the spec (a `values` list of several
    different values, or a distribution to draw from), in spec order: the ones that tell its runs
    apart. A `value`, or `values` with one value, is a setting every run shares."""
    out = []
    for key, p in spec.config["parameters"].items():
        if "value" in p:
            continue
        if "values" in p and len({canonical(v) for v in p["values"]}) < 2:
            continue
        out.append(key)
    return out


def run_names(spec: Spec, param_sets: list[dict]) -> list[str]:
    """Readable, unique, stable directory names: `config=fedsol,seed=0` for a grid, naming only the
    parameters that vary (all of them where none does); random runs are numbered (`r000,...`)
    because their drawn values need not be unique."""
    every = list(spec.config["parameters"])
    keys = varying_keys(spec) or every
    short = short_keys(every)  # told apart from every swept key, so `alpha` is never the other one
    names = []
    for i, params in enumerate(param_sets):
        label = ",".join(f"{short[k]}={display_value(params[k])}" for k in keys)
        label = label.replace("/", "_").replace(" ", "")
        names.append(f"r{i:03d},{label}" if spec.config["method"] == "random" else label)
    if len(set(names)) != len(names):
        names = [f"{i:03d},{n}" for i, n in enumerate(names)]
    return names


def name_runs(spec: Spec, root: Path, seed: int = 0, count: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Each run's directory name and parameter set, without building or parsing a command (so a
    sweep whose runs are all over says so at once). A run the sweep below `root` recorded under
    another name keeps it (`keep_recorded_names`)."""

    param_sets = expand(spec, seed=seed, count=count)
    if not param_sets:
        raise FLUserError(f"sweep spec {spec.path}: empty grid: no runs to start")
    names = keep_recorded_names(run_names(spec, param_sets), param_sets, recorded_names(root / spec.name))
    return list(zip(names, param_sets, strict=True))


def keep_recorded_names(names: list[str], param_sets: list[dict], recorded: dict[str, list[str]]) -> list[str]:
    """`names`, except that a run whose parameter set the sweep recorded under another name
    (`recorded`: canonical parameters to the names recorded with them) keeps the recorded one, where
    that is unambiguous: one record for those parameters, one planned run with them, and no planned
    run already named so or recorded under its own name."""
    planned = [canonical(p) for p in param_sets]
    own = {name for names_of in recorded.values() for name in names_of}
    out = list(names)
    for i, (name, key) in enumerate(zip(names, planned, strict=True)):
        found = recorded.get(key, [])
        if (name in own or len(found) != 1 or found[0] == name or planned.count(key) != 1
                or found[0] in names):
            continue
        out[i] = found[0]
    return out


# ---------------------------------------------------------------------------------------------
# Commands


def wandb_args(params: dict[str, Any]) -> list[str]:
    """`${args}` exactly as a W&B agent formats it (`--key=value`), by W&B's own function."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})["args"]


def fl_args(spec: Spec, params: dict[str, Any]) -> list[str]:
    """The fl-lightning arguments of the spec's `command` with `${args}` filled in; `${env}` and
    `${interpreter}` are for the agent's process launch and dropped."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command

    command = [str(c) for c in create_sweep_command(list(spec.config["command"]))]
    after = command[command.index("fl-lightning") + 1:]
    out: list[str] = []
    for token in after:
        if token == "${args}":
            out += wandb_args(params)
        elif token == "${program}":
            continue
        elif token.startswith("${") and token.endswith("}"):
            raise FLUserError(f"sweep spec {spec.path}: macro {token} is not supported after fl-lightning; "
                              f"use ${{args}}")
        else:
            out.append(token)
    if "${args}" not in after:
        raise FLUserError(f"sweep spec {spec.path}: `command` must end in ${{args}} so the swept values reach "
                          f"the CLI")
    return out


@functools.cache
def cli_parser():
    """The CLI's own parser (LightningCLI with every fl-lightning option), built once: building it
    is most of the work of parsing one command, and a table has hundreds of commands to check."""
    from fl_lightning.lightning_cli import build_parser

    with contextlib.redirect_stderr(io.StringIO()):
        return build_parser()


def parse_with_cli(args: list[str]) -> dict:
    """Parse one fl-lightning command as the CLI does (the same parser, --config files and all) and
    return the resolved config of its subcommand; raises FLUserError with the CLI's own one-line
    message if it does not parse."""
    from fl_lightning.config_files import layered_config_args
    from fl_lightning.lightning_cli import one_line_error

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cfg = cli_parser().parse_args(layered_config_args(list(args)))
    except Exception as err:
        reported = one_line_error(err, list(args))
        raise FLUserError(reported[0] if reported else str(err).strip().splitlines()[0]) from None
    return cfg[cfg.subcommand].as_dict()


def plan(spec: Spec, root: Path, seed: int = 0, count: int | None = None, validate: bool = True) -> list[PlannedRun]:
    """Every run of the spec with its full command; with `validate`, each command is parsed by the
    CLI first, so a spec naming an unknown option fails before any run starts."""
    runs = []
    names_logger: bool | None = None
    for i, (name, params) in enumerate(name_runs(spec, root, seed=seed, count=count)):
        args = [*fl_args(spec, params), f"--trainer.default_root_dir={root / spec.name / name}"]
        if validate and names_logger is None:
            resolved = _parse_run(spec, name, args)
            logger = (resolved.get("trainer") or {}).get("logger")
            names_logger = isinstance(logger, dict) and "group" in (logger.get("init_args") or {})
        if names_logger:  # W&B run name and group: the run and its sweep
            args += [f"--trainer.logger.init_args.name={name}", f"--trainer.logger.init_args.group={spec.name}"]
        if validate:
            _parse_run(spec, name, args)
        runs.append(PlannedRun(index=i, name=name, params=params, args=args))
    return runs


def _parse_run(spec: Spec, name: str, args: list[str]) -> dict:
    try:
        return parse_with_cli(args)
    except FLUserError as err:
        raise FLUserError(f"sweep spec {spec.path}: run {name}: {err}") from None
