"""Which runs `fl-lightning report` finds below a directory, what labels their rows, and which it counts.

A run is a directory with a summary.json (or a run a local sweep recorded in `.sweep/` that never
made one). Its labels are its sweep parameters (`.sweep/<run>.json`), or for a plain fit the
options whose values differ between the runs' config.yaml files; a label a run lacks but has a
value for in its own config.yaml is filled from it (`fill_labels`). Its setting is the first
--config file it was composed from. Before anything is averaged each finished run is checked
(`screen`): damaged records (`report_records`) and duplicates are left out of every number.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fl_lightning.config_files import expand_layers, flatten_options
from fl_lightning.errors import FLUserError
from fl_lightning.outcome import Outcome, read_outcome
from fl_lightning.report_records import record_damage
from fl_lightning.sweep import FINAL_STATES, SEED_KEYS, display_value, read_json, read_record

# Options that name where and how a run is stored, not what it computes.
BOOKKEEPING_KEYS = ("ckpt_path", "overwrite", "trainer.default_root_dir", "trainer.logger.init_args.name",
                    "trainer.logger.init_args.group", "trainer.logger.init_args.save_dir",
                    "trainer.logger.init_args.version", "trainer.logger.init_args.id")
# Options that change how a run is shown while it runs, never a number: no label of a row.
DISPLAY_KEYS = ("trainer.enable_progress_bar", "trainer.enable_model_summary")
# Labels that name the method and the setting: always a column, and bare in the legend (`FedSOL`).
METHOD_KEYS = ("method", "model.class_path", "setting")
# Where a paper table's relative `config:` files are found when not from the working directory.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    name: str
    path: Path
    params: dict[str, Any]
    summary: dict | None
    record: dict | None
    order: float
    setting: str = "?"  # the setting its config names (see _setting)
    config: dict[str, Any] = field(default_factory=dict)  # its config.yaml, flattened
    damage: str | None = None  # why its records cannot be counted (see record_damage)
    duplicate_of: str | None = None  # the run it repeats (same resolved config and seeds), counted instead

    @property
    def status(self) -> str:
        """The run's outcome as `outcome.read_outcome` reads it (finished, failed, diverged, ...);
        "crashed" for a sweep run whose process failed without a final outcome, else "unfinished"
        (with what its summary says: interrupted, lost, or that it cannot be read)."""
        outcome = read_outcome(self.path)
        if outcome is not None and outcome.final:
            return outcome.value
        if (self.record or {}).get("status") == "crashed":
            return "crashed"
        if outcome is None and (self.path / "summary.json").exists():
            return ("unfinished (its summary.json cannot be read: the same fit command with --ckpt_path last "
                    "writes it again)")
        if outcome in (Outcome.INTERRUPTED, Outcome.LOST):
            return f"unfinished ({outcome.value}: resume with --ckpt_path last)"
        return "unfinished"


@dataclass
class Row:
    params: dict[str, Any]
    runs: list[Run] = field(default_factory=list)

    def done(self) -> list[Run]:
        return [r for r in self.runs if r.status in FINAL_STATES]


def _read_config(run_dir: Path) -> dict[str, Any]:
    cfg = run_dir / "config.yaml"
    try:
        return flatten_options(yaml.safe_load(cfg.read_text()) or {}) if cfg.exists() else {}
    except (yaml.YAMLError, OSError):
        return {}


def find_runs(top: Path) -> dict[Path, dict | None]:
    """Every run below `top` at any depth (a directory with a summary.json), and every run a local
    sweep recorded in a `.sweep/` folder below `top` that never made one, with its record."""
    found: dict[Path, dict | None] = {}
    for summary in sorted(top.rglob("summary.json")):
        if not any(part.startswith(".") for part in summary.relative_to(top).parts[:-1]):
            found[summary.parent] = None
    for meta in sorted(top.rglob(".sweep")):
        for path in sorted(meta.glob("*.json")):
            found[meta.parent / path.stem] = read_record(path)
    return found


def collect(top: Path) -> list[Run]:
    """The runs below `top`, each labelled by its method, the setting where runs of several
    settings are mixed, and its sweep parameters (`.sweep/<run>.json`) or else the options whose
    values differ between the runs' config.yaml files."""
    found = find_runs(top)
    configs = {path: _read_config(path) for path in found}
    written = {path: c for path, c in configs.items() if c}  # a run that never started has no config
    keys = sorted({k for c in written.values() for k in c})
    varying = [k for k in keys if k not in (*BOOKKEEPING_KEYS, *DISPLAY_KEYS, "model.class_path")
               and _varies(k, written)]
    settings = {path: _setting(configs[path], record) for path, record in found.items()}
    mixed_settings = len(set(settings.values())) > 1
    runs = []
    for path, record in found.items():
        summary = read_json(path / "summary.json")
        own = record["params"] if record and "params" in record else {k: configs[path].get(k) for k in varying}
        method = (summary or {}).get("method") or _method(configs[path])
        params = {} if "model.class_path" in own else {"method": method}  # a method column, always one
        if mixed_settings:
            params["setting"] = settings[path]
        params.update(own)
        name = str(path.relative_to(top)) if path != top else path.name
        index = (record or {}).get("index")
        runs.append(Run(name=name, path=path, params=params, summary=summary, record=record,
                        order=index if isinstance(index, int) else math.inf, setting=settings[path],
                        config=configs[path]))
    return sorted(runs, key=lambda r: (r.order, r.name))


def _varies(key: str, configs: dict[Path, dict[str, Any]]) -> bool:
    """Whether `key` tells runs apart. A method's own option (`model.init_args.rho`, which FedAvg's
    config does not have) labels rows only where runs of one method differ in it: between methods
    the method column says it, and a column of FedSOL's defaults beside FedAvg's blanks says nothing."""
    values = [repr(c.get(key)) for c in configs.values()]
    if len(set(values)) < 2:
        return False
    if not key.startswith("model.init_args.") or all(key in c for c in configs.values()):
        return True
    by_method: dict[str, set[str]] = {}
    for config, value in zip(configs.values(), values, strict=True):
        by_method.setdefault(_method(config), set()).add(value)
    return any(len(v) > 1 for v in by_method.values())


def _method(config: dict[str, Any]) -> str:
    return str(config.get("model.class_path") or "").rpartition(".")[2] or "?"


def _setting(config: dict[str, Any], record: dict | None = None) -> str:
    """The setting a run was composed from: the first --config file of a sweep's command (the
    sweep's W&B group is the sweep's name), else its W&B group `<setting>/<method>` (recorded by
    fit, which takes that name from the same first file)."""
    files = _config_files((record or {}).get("command"))
    if files:
        return Path(files[0]).stem
    group = config.get("trainer.logger.init_args.group")
    return str(group).split("/")[0] if group else "?"


def _config_files(command: Any) -> list[str]:
    """The --config files of a recorded command, each file of a `layer:` list in its place."""
    args = [str(a) for a in command] if isinstance(command, list) else []
    files = []
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(args):
            name = args[i + 1]
        else:
            continue
        try:
            files += expand_layers(name)
        except FLUserError:  # moved or deleted since: the name as it was given
            files.append(name)
    return files


@functools.cache
def config_options(file: str) -> dict[str, Any] | None:
    """The options a config file (or a `layer:` list of files) sets, flattened (`model: FedSOL`
    read as `model.class_path`); a relative name is looked up from the working directory, then
    from the package's checkout (a paper table names `configs/...`). None if it cannot be read."""
    path = Path(file)
    if not path.is_file() and not path.is_absolute():
        path = PACKAGE_ROOT / file
    try:
        docs = [yaml.safe_load(Path(f).read_text()) for f in expand_layers(str(path))]
    except (FLUserError, OSError, yaml.YAMLError):
        return None
    options: dict[str, Any] = {}
    for doc in docs:
        if isinstance(doc, dict):
            options.update(flatten_options({**doc, "model": {"class_path": doc["model"]}}
                                   if isinstance(doc.get("model"), str) else doc))
    return options or None


def holds(run: Run, file: str) -> bool:
    """Whether the run's config.yaml holds every option the config file sets, as that file sets it."""
    options = config_options(str(file))
    return options is not None and all(k in run.config and same(run.config[k], v) for k, v in options.items())


def fill_labels(runs: list[Run]) -> None:
    """Each run's value of every label another run has, read from its own config.yaml: a sweep's
    runs beside plain fits would otherwise show blanks for options they did set (and a plain fit
    for the swept method file). A run's `config` is the swept file its config holds (the one that
    sets the most options, if several do); a label the run has no value for stays blank."""
    keys = list(dict.fromkeys(k for r in runs for k in r.params))
    files = list(dict.fromkeys(str(r.params["config"]) for r in runs if "config" in r.params))
    for run in runs:
        for key in keys:
            if key in run.params or key in ("method", "setting"):
                continue
            if key == "config":
                held = sorted((f for f in files if holds(run, f)), key=lambda f: -len(config_options(f)))
                if held and (len(held) == 1 or len(config_options(held[0])) > len(config_options(held[1]))):
                    run.params[key] = held[0]
            elif key in run.config:
                run.params[key] = run.config[key]
    if all("model.class_path" in r.params for r in runs):  # the model column is the method column
        for run in runs:
            run.params.pop("method", None)


def group(runs: list[Run]) -> list[Row]:
    rows: dict[str, Row] = {}
    for run in runs:
        key_params = {k: v for k, v in run.params.items() if k not in SEED_KEYS}
        key = repr(sorted((k, display_value(v)) for k, v in key_params.items()))
        rows.setdefault(key, Row(params=key_params)).runs.append(run)
    return list(rows.values())


def _resolved(run: Run) -> str | None:
    """A run's config.yaml, seeds included, without the options that only say where it is stored:
    equal for two runs of the same command (or a copied run directory); None without a config.
    Its setting is part of it: runs the table shows in two settings are never one run's copies."""
    kept = sorted((k, repr(v)) for k, v in run.config.items() if k not in BOOKKEEPING_KEYS)
    return repr((run.setting, kept)) if kept else None


def screen(runs: list[Run]) -> list[Run]:
    """The runs a report counts, in their order: each run's `damage` and `duplicate_of` are set,
    and those runs left out. Of runs with the same resolved config the first by path counts, so
    the same directory gives the same table however its runs were listed."""
    for run in runs:
        run.damage = record_damage(run.path, run.summary)
    first: dict[str, Run] = {}
    for run in sorted((r for r in runs if r.damage is None), key=lambda r: r.name):
        key = _resolved(run)
        if key is not None and key in first:
            run.duplicate_of = first[key].name
        elif key is not None:
            first[key] = run
    return [r for r in runs if r.damage is None and r.duplicate_of is None]


def counted(top: Path, runs: list[Run]) -> list[Run]:
    """The finished runs whose records can be counted, each once (`screen`); one line if none."""
    done = [r for r in runs if r.status in FINAL_STATES]
    if not done:
        raise FLUserError(f"report {top}: no finished runs below it (a run is a directory whose summary.json records "
                          f"its outcome); {len(runs)} run director{'y' if len(runs) == 1 else 'ies'} found")
    kept = screen(done)
    if not kept:
        damaged = "; ".join(f"{r.name}: {r.damage}" for r in done)
        raise FLUserError(f"report {top}: the records of every finished run below it are damaged ({damaged}); "
                          f"a run's fit command again with --ckpt_path last writes them again from its checkpoint")
    return kept


def same(a: Any, b: Any) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return display_value(a) == display_value(b)
