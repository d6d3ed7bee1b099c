"""`fl-lightning sweep <spec>`: run a W&B sweep spec with W&B's agents, or locally without W&B.

A spec is a W&B sweep configuration (method grid/random/bayes, `parameters` named by CLI option,
a `command` running `fl-lightning fit --config ... ${args}`); a paper table in `configs/tables/`
holds one under its `sweep:` key. Two ways to run it:

- online (default): `wandb.sweep` creates the sweep and one `wandb agent` runs per GPU
  (`CUDA_VISIBLE_DEVICES` per agent, or `--gpus 0,1`). Each agent-launched run writes its
  directory under `runs/<sweep id>/<run id>` (see `agent_run_dir_args`).
- `--local`: no account, no network. Grid and seeded random specs are expanded here, with W&B's
  own formatting of `${args}` (`--key=value`), and run by N worker processes, each run offline in
  `<root>/<sweep>/<run-name>/` and grouped in W&B by the sweep name. The sweep's bookkeeping
  (each run's command, parameters, status, exit code, error line, log) lives in
  `<root>/<sweep>/.sweep/`, never inside a run directory. Started again after an interruption,
  finished runs are skipped, runs with a checkpoint resume with `--ckpt_path last`, and runs
  without one start over with `--overwrite true`.

Every command is parsed through the CLI (`--print_config`, in-process) before anything starts, so
an unknown option or a bad value is one `error:` line, not a failed run an hour later.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import json
import math
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.errors import FLUserError, OneLineArgumentParser
from fl_lightning.outcome import Outcome, read_outcome
from fl_lightning.warm import WarmWorker

SEARCH_METHODS = ("grid", "random", "bayes")
# Option keys that make runs of one experiment differ only by their seed (`report` groups over them).
SEED_KEYS = ("seed_everything", "data.seed", "data.partition_seed")


@dataclass
class Spec:
    """A W&B sweep configuration and the name its runs are grouped under."""

    name: str
    config: dict
    path: Path


@dataclass
class PlannedRun:
    index: int
    name: str
    params: dict[str, Any]
    args: list[str] = field(default_factory=list)  # fl-lightning arguments (after the program name)


# ---------------------------------------------------------------------------------------------
# Spec loading and expansion


def load_spec(path: str | Path) -> Spec:
    """A W&B sweep config from a YAML file; a paper table (configs/tables/) holds it under `sweep:`."""
    path = Path(path)
    if not path.is_file():
        raise FLUserError(f"sweep spec {path}: no such file")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise FLUserError(f"sweep spec {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if isinstance(doc, dict) and "sweep" in doc:
        doc = doc["sweep"]
    if not isinstance(doc, dict):
        raise FLUserError(f"sweep spec {path}: expected a W&B sweep config (method, parameters, command)")
    method = doc.get("method")
    if method not in SEARCH_METHODS:
        raise FLUserError(f"sweep spec {path}: method must be one of {', '.join(SEARCH_METHODS)}, got {method!r}")
    params = doc.get("parameters")
    if not isinstance(params, dict) or not params:
        raise FLUserError(f"sweep spec {path}: empty grid: `parameters` must name at least one CLI option")
    for key, p in params.items():
        if not isinstance(p, dict):
            raise FLUserError(f"sweep spec {path}: parameter {key} must be a mapping such as {{values: [...]}}")
        if "values" in p and (not isinstance(p["values"], list) or not p["values"]):
            raise FLUserError(f"sweep spec {path}: empty grid: parameter {key} has no values")
        if "parameters" in p:
            raise FLUserError(f"sweep spec {path}: nested parameter {key}: name options by their dotted CLI key "
                              f"instead (e.g. model.init_args.rho)")
    if "config" in params and next(iter(params)) != "config":
        # ${args} follows the order of `parameters`; a --config after --data.alpha=... would undo it.
        raise FLUserError(f"sweep spec {path}: a swept `config` must be the first parameter, so that the "
                          f"options after it override the file and not the other way round")
    command = doc.get("command")
    if not isinstance(command, list) or "fl-lightning" not in [str(c) for c in command]:
        raise FLUserError(f"sweep spec {path}: `command` must run fl-lightning, e.g. "
                          f"[${{env}}, fl-lightning, fit, --config, configs/x.yaml, ${{args}}]")
    if "${args_no_hyphens}" in command:
        raise FLUserError(f"sweep spec {path}: use ${{args}} (--key=value) in `command`: jsonargparse does not read "
                          f"${{args_no_hyphens}} (key=value) and would ignore the swept values")
    name = str(doc.get("name") or path.stem)
    if "/" in name or name.startswith("."):
        raise FLUserError(f"sweep spec {path}: name {name!r} must be a plain directory name")
    return Spec(name=name, config=doc, path=path)


def _grid_values(spec: Spec, key: str, p: dict) -> list:
    if "values" in p:
        return list(p["values"])
    if "value" in p:
        return [p["value"]]
    raise FLUserError(f"sweep spec {spec.path}: grid parameter {key} needs `values` (or `value`), "
                      f"not a distribution")


NUMERIC_DISTRIBUTIONS = ("int_uniform", "uniform", "log_uniform_values", "q_uniform", "q_log_uniform_values")
DISTRIBUTIONS = ("categorical", "constant", *NUMERIC_DISTRIBUTIONS, "normal")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def distribution_of(spec: Spec, key: str, p: dict) -> str:
    """The distribution a W&B parameter definition draws from, after checking the definition makes
    sense (the same classes of mistakes W&B's own sweep server refuses): one line naming the
    parameter and what is wrong otherwise."""
    where = f"sweep spec {spec.path}: parameter {key}"
    if "value" in p:
        return "constant"
    dist = p.get("distribution", "categorical" if "values" in p else None)
    lo, hi = p.get("min"), p.get("max")
    if dist is None and lo is not None and hi is not None:
        dist = "int_uniform" if isinstance(lo, int) and isinstance(hi, int) else "uniform"
    if dist not in DISTRIBUTIONS:
        raise FLUserError(f"{where}: distribution {dist!r} is not supported by --local (use values, value, "
                          f"{', '.join(NUMERIC_DISTRIBUTIONS)} or normal)")
    if dist == "categorical":
        _check_categorical(where, p)
    elif dist in NUMERIC_DISTRIBUTIONS:
        _check_range(where, dist, p)
    elif dist == "normal" and not (_number(p.get("mu", 0.0)) and _number(p.get("sigma", 1.0))
                                   and p.get("sigma", 1.0) > 0):
        raise FLUserError(f"{where}: normal needs a number mu and a number sigma > 0, got mu={p.get('mu')!r}, "
                          f"sigma={p.get('sigma')!r}")
    return dist


def _check_categorical(where: str, p: dict) -> None:
    values, probs = p.get("values"), p.get("probabilities")
    if not isinstance(values, list) or not values:
        raise FLUserError(f"{where}: `values` must be a non-empty list")
    if probs is None:
        return
    if not isinstance(probs, list) or len(probs) != len(values) or not all(_number(q) and q >= 0 for q in probs):
        raise FLUserError(f"{where}: `probabilities` must be {len(values)} numbers >= 0, one per value, got {probs!r}")
    if abs(sum(probs) - 1.0) > 1e-6:
        raise FLUserError(f"{where}: `probabilities` must sum to 1, they sum to {sum(probs):g}")


def _check_range(where: str, dist: str, p: dict) -> None:
    lo, hi = p.get("min"), p.get("max")
    if not (_number(lo) and _number(hi)):
        raise FLUserError(f"{where}: {dist} needs numbers min and max, got min={lo!r}, max={hi!r}")
    if dist == "int_uniform" and not (isinstance(lo, int) and isinstance(hi, int)):
        raise FLUserError(f"{where}: int_uniform needs integers min and max, got min={lo!r}, max={hi!r}")
    if lo > hi:
        raise FLUserError(f"{where}: min ({lo}) is greater than max ({hi})")
    if "log" in dist and lo <= 0:
        raise FLUserError(f"{where}: {dist} draws the logarithm of its values: min must be > 0, got {lo}")
    if dist.startswith("q_") and not (_number(p.get("q", 1.0)) and p.get("q", 1.0) > 0):
        raise FLUserError(f"{where}: q must be a number > 0 (values are rounded to multiples of q), "
                          f"got {p.get('q')!r}")


def _sample(spec: Spec, key: str, p: dict, rng: np.random.Generator):
    """One draw from a W&B parameter definition (the distributions W&B's random search supports)."""
    dist = distribution_of(spec, key, p)
    lo, hi = p.get("min"), p.get("max")
    if dist == "constant":
        return p["value"]
    if dist == "categorical":
        return p["values"][int(rng.choice(len(p["values"]), p=p.get("probabilities")))]
    if dist == "int_uniform":
        return int(rng.integers(int(lo), int(hi) + 1))
    if dist == "uniform":
        return float(rng.uniform(lo, hi))
    if dist == "log_uniform_values":
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if dist in ("q_uniform", "q_log_uniform_values"):
        q = p.get("q", 1.0)
        x = rng.uniform(lo, hi) if dist == "q_uniform" else math.exp(rng.uniform(math.log(lo), math.log(hi)))
        return float(round(x / q) * q)
    return float(rng.normal(p.get("mu", 0.0), p.get("sigma", 1.0)))


def expand(spec: Spec, seed: int = 0, count: int | None = None) -> list[dict[str, Any]]:
    """The parameter sets of a grid (the product, in spec order, as W&B's grid search) or of a random
    search (`count` or the spec's `run_cap` draws from a generator seeded with `seed`)."""
    params = spec.config["parameters"]
    method = spec.config["method"]
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise FLUserError(f"--count {count}: the number of runs must be at least 1")
    if method == "grid":
        keys = list(params)
        grid = [dict(zip(keys, combo, strict=True))
                for combo in itertools.product(*(_grid_values(spec, k, params[k]) for k in keys))]
        return grid[:count] if count else grid
    if method == "random":
        cap = spec.config.get("run_cap")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise FLUserError(f"sweep spec {spec.path}: run_cap must be a whole number of runs >= 1, got {cap!r}")
        count = count or cap
        if not count:
            raise FLUserError(f"sweep spec {spec.path}: random search needs a number of runs: `run_cap` in the "
                              f"spec or --count N")
        for key, p in params.items():  # every definition checked before the first draw
            distribution_of(spec, key, p)
        rng = np.random.default_rng(seed)
        return [{k: _sample(spec, k, p, rng) for k, p in params.items()} for _ in range(int(count))]
    raise FLUserError(f"sweep spec {spec.path}: --local runs grid and random searches; bayes needs the W&B "
                      f"sweep server (run without --local)")


# ---------------------------------------------------------------------------------------------
# Commands


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


def run_names(spec: Spec, param_sets: list[dict]) -> list[str]:
    """Readable, unique, stable directory names: `model=FedSOL,alpha=0.1,seed=0` for a grid;
    random runs are numbered (`r000,...`) because their drawn values need not be unique."""
    keys = list(spec.config["parameters"])
    short = short_keys(keys)
    names = []
    for i, params in enumerate(param_sets):
        label = ",".join(f"{short[k]}={display_value(params[k])}" for k in keys)
        label = label.replace("/", "_").replace(" ", "")
        names.append(f"r{i:03d},{label}" if spec.config["method"] == "random" else label)
    if len(set(names)) != len(names):
        names = [f"{i:03d},{n}" for i, n in enumerate(names)]
    return names


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
    takes most of a `--print_config`, and a table has hundreds of commands to check."""
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
    param_sets = expand(spec, seed=seed, count=count)
    if not param_sets:
        raise FLUserError(f"sweep spec {spec.path}: empty grid: no runs to start")
    runs = []
    names_logger: bool | None = None
    for i, (name, params) in enumerate(zip(run_names(spec, param_sets), param_sets, strict=True)):
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


# ---------------------------------------------------------------------------------------------
# Run state on disk


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_record(path: Path) -> dict | None:
    """A local sweep's record of one run (`.sweep/<run>.json`), the one reader of them: fields of
    the wrong type count as absent, so a damaged record never stops a sweep or a report (the run
    directory decides whether a run is done)."""
    record = read_json(path)
    if record is None:
        return None
    kinds = {"params": dict, "index": int, "status": str, "error": str, "exit_code": int, "attempts": int}
    return {k: v for k, v in record.items()
            if k not in kinds or (isinstance(v, kinds[k]) and not isinstance(v, bool))}


def run_state(run_dir: Path) -> str:
    """The run's final outcome (finished, diverged or failed: not run again; outcome.read_outcome,
    the one reader of outcomes), else resume (has a checkpoint), restart (used directory without a
    checkpoint) or new."""
    outcome = read_outcome(run_dir)
    if outcome is not None and outcome.final:
        return outcome.value
    if (run_dir / "checkpoints" / "last.ckpt").exists():
        return "resume"
    if run_dir.exists() and any(run_dir.iterdir()):
        return "restart"
    return "new"


# the states of a run that is over (not run again, counted by `report`): Outcome.final's, by name
FINAL_STATES = tuple(outcome.value for outcome in Outcome if outcome.final)


def error_line(log: Path) -> str:
    """The line that says why a run stopped: the CLI's `error:` line, else a traceback's last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("error:"):
            return line
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------
# Local runner


def available_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def parse_gpus(text: str | None, count: int) -> list[str] | None:
    if text is None:
        return None
    ids = [t.strip() for t in text.split(",") if t.strip()]
    if not ids or not all(t.isdigit() for t in ids):
        raise FLUserError(f"--gpus {text!r}: give GPU indices separated by commas, e.g. --gpus 0,1")
    absent = [t for t in ids if int(t) >= count]
    if absent:
        raise FLUserError(f"--gpus {text}: no GPU {', '.join(absent)} on this machine ({count} visible GPU"
                          f"{'' if count == 1 else 's'}{': 0..' + str(count - 1) if count else ''})")
    return ids


def worker_envs(workers: int, gpus: list[str] | None, cores: int) -> list[dict[str, str]]:
    """One environment per worker: a GPU each (round robin over `gpus`), or on CPU an equal share
    of the cores through the thread limits torch and BLAS read at start-up."""
    envs = []
    for i in range(workers):
        if gpus:
            envs.append({"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]})
        else:
            threads = str(max(1, cores // workers))
            envs.append({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads})
    return envs


def warm_workers(spec: Spec, envs: list[dict[str, str]], root: Path) -> list[WarmWorker]:
    """One warm worker per environment, started now: each imports for several seconds in a process
    of its own, while this one parses every command (which imports the CLI too). Its runs leave the
    pictures other runs draw the same (the partition) in `.sweep/pictures/`."""
    from fl_lightning.analysis.plots import SHARED_PICTURES_ENV  # matplotlib: only once runs start
    common = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_RUN_GROUP": spec.name,
              SHARED_PICTURES_ENV: str((root / spec.name / ".sweep" / "pictures").absolute())}
    workers = [WarmWorker({**common, **env}) for env in envs]
    for worker in workers:
        worker.launch()
    return workers


class LocalSweep:
    def __init__(self, spec: Spec, runs: list[PlannedRun], root: Path, workers: list[WarmWorker]):
        self.spec, self.runs, self.workers = spec, runs, workers
        self.sweep_dir = root / spec.name
        self.meta = self.sweep_dir / ".sweep"
        self.lock = threading.Lock()
        self.procs: dict[int, int] = {}  # worker -> pid of the run it is running
        self.stopping = False
        self.outcomes: dict[str, str] = {}

    def record_path(self, run: PlannedRun) -> Path:
        return self.meta / f"{run.name}.json"

    def write_record(self, run: PlannedRun, **fields) -> dict:
        path = self.record_path(run)
        record = read_record(path) or {}
        record.update(name=run.name, index=run.index, params=run.params, **fields)
        atomic_write_bytes(path, json.dumps(record, indent=1, default=str).encode())  # never half-written
        return record

    def command(self, run: PlannedRun) -> tuple[list[str], str]:
        state = run_state(self.sweep_dir / run.name)
        extra = {"resume": ["--ckpt_path=last"], "restart": ["--overwrite=true"]}.get(state, [])
        return [*run.args, *extra], state

    def dry_run(self) -> None:
        for run in self.runs:
            args, state = self.command(run)
            if state in FINAL_STATES:
                print(f"# {state}: {run.name}")
            else:
                print(shlex.join(["fl-lightning", *args]))

    def _say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)

    def _work(self, worker: int, todo: queue.Queue) -> None:
        warm = self.workers[worker]  # paid the imports once; each run is a process forked from it
        try:
            self._work_with(worker, todo, warm)
        finally:
            warm.close()

    def _work_with(self, worker: int, todo: queue.Queue, warm: WarmWorker) -> None:
        while not self.stopping:
            try:
                run = todo.get_nowait()
            except queue.Empty:
                return
            args, state = self.command(run)
            if state in FINAL_STATES:
                self.outcomes[run.name] = state
                continue
            log = self.meta / f"{run.name}.log"
            attempts = (read_record(self.record_path(run)) or {}).get("attempts", 0) + 1
            self.write_record(run, command=["fl-lightning", *args], status="running", attempts=attempts,
                              worker=worker, started=time.time(), exit_code=None, error=None)
            self._say(f"[worker {worker}] {'resume' if state == 'resume' else 'start'} {run.name}")
            began = time.time()
            with open(log, "a") as out:
                out.write(f"$ {shlex.join(['fl-lightning', *args])}\n")
            pid = warm.start(args, str(log))
            if pid is None:
                code = 1
            else:
                with self.lock:
                    self.procs[worker] = pid
                code = warm.wait()
                with self.lock:
                    self.procs.pop(worker, None)
            if self.stopping:
                return
            self.write_record(run, exit_code=code, ended=time.time())
            final = run_state(self.sweep_dir / run.name)
            if final in FINAL_STATES:
                summary = read_json(self.sweep_dir / run.name / "summary.json") or {}
                acc = summary.get("final_acc")
                detail = f", final acc {acc:.4f}" if isinstance(acc, (int, float)) else ""
                self.write_record(run, status=final, error=error_line(log) if final != "finished" else None)
                self._say(f"[worker {worker}] {final} {run.name} ({time.time() - began:.0f} s{detail})")
            else:
                line = (error_line(log) or f"exit code {code}") if code else "exited without a finished summary.json"
                self.write_record(run, status="crashed", error=line)
                self._say(f"[worker {worker}] FAILED {run.name} (exit {code}): {line}")
            self.outcomes[run.name] = final if final in FINAL_STATES else "crashed"

    def run(self) -> int:
        self.meta.mkdir(parents=True, exist_ok=True)
        (self.sweep_dir / ".sweep" / "spec.yaml").write_text(yaml.safe_dump(self.spec.config, sort_keys=False))
        todo: queue.Queue = queue.Queue()
        for run in self.runs:
            todo.put(run)
        already = sum(run_state(self.sweep_dir / r.name) in FINAL_STATES
                      for r in self.runs)
        print(f"sweep {self.spec.name}: {len(self.runs)} runs ({already} already done) on {len(self.workers)} "
              f"worker{'s' if len(self.workers) != 1 else ''} in {self.sweep_dir}", flush=True)
        began = time.time()
        threads = [threading.Thread(target=self._work, args=(i, todo), daemon=True) for i in range(len(self.workers))]
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=0.5)
        except KeyboardInterrupt:
            self._stop()
            done = sum(v in FINAL_STATES for v in self.outcomes.values())
            print(f"interrupted: {done} runs done; run the same command again to continue (finished runs are "
                  f"skipped, the others resume)", file=sys.stderr, flush=True)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        crashed = sorted(n for n, v in self.outcomes.items() if v == "crashed")
        counts = {s: sum(v == s for v in self.outcomes.values()) for s in (*FINAL_STATES, "crashed")}
        print(f"sweep {self.spec.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
              + f" in {time.time() - began:.0f} s", flush=True)
        for name in crashed:
            print(f"  failed run {name}: see {self.meta / (name + '.log')}", flush=True)
        return 1 if crashed else 0

    def _stop(self) -> None:
        """Stop the running fits (each checkpoints per round, so nothing finished is lost)."""
        self.stopping = True
        with self.lock:
            pids = list(self.procs.values())
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        for pid in filter(_alive, pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """A run forked by a warm worker (not this process's child: its worker reaps it at once)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# W&B online


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


def online(spec: Spec, gpus: list[str] | None, workers: int, count: int | None, project: str | None,
           entity: str | None) -> int:
    from fl_lightning.loggers import wandb_logged_in

    if not wandb_logged_in() or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        raise FLUserError("a W&B sweep needs W&B online (wandb login or WANDB_API_KEY, and WANDB_MODE not offline); "
                          "without it run the sweep here with --local")
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


# ---------------------------------------------------------------------------------------------
# Command line


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
    gpu_count = available_gpus()
    gpus = parse_gpus(opts.gpus, gpu_count)
    if gpus is None and gpu_count:
        gpus = [str(i) for i in range(gpu_count)]
    workers = opts.workers or (len(gpus) if gpus else 1)
    if not opts.local:
        # Every command parses before the sweep is created (bayes: one random draw of its space).
        if spec.config["method"] == "bayes":
            plan(Spec(spec.name, {**spec.config, "method": "random"}, spec.path), Path(opts.root), count=1)
        else:
            plan(spec, Path(opts.root), seed=opts.seed, count=opts.count)
        if opts.dry_run:
            for env, argv in agent_commands("<sweep id>", gpus, workers, opts.count):
                print(f"{' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(argv)}".strip())
            return 0
        return online(spec, gpus, workers, opts.count, opts.project, opts.entity)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if opts.dry_run:
        LocalSweep(spec, plan(spec, Path(opts.root), seed=opts.seed, count=opts.count), Path(opts.root), []).dry_run()
        return 0
    # the workers import while the commands are parsed
    warm = warm_workers(spec, worker_envs(workers, gpus, cores), Path(opts.root))
    try:
        runs = plan(spec, Path(opts.root), seed=opts.seed, count=opts.count)
    except BaseException:
        for worker in warm:
            worker.close()
        raise
    return LocalSweep(spec, runs, Path(opts.root), warm).run()
