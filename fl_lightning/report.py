"""`fl-lightning report runs/<sweep>`: the table a paper would print, from the run directories.

Each run's numbers come from its `summary.json` (final and best global test accuracy, the
personalised accuracies `personal/*_acc_mean` of the last round, `diverged`, `failed`). Runs that
differ only by their seed (`seed_everything`, `data.seed`, `data.partition_seed`) form one row:
mean ± std over the seeds (numpy's std, ddof 0), in percent, with the number of seeds. As in the
papers, a row whose runs all collapsed to chance reads `10.00 (Failed)` and one whose runs all
diverged `(Diverged)`; partial failures are counted next to the mean. Diverged runs (NaN weights)
are left out of the mean; failed runs keep their chance-level accuracy, as the papers print it.

Row labels are the sweep parameters of each run (recorded by `fl-lightning sweep --local` in
`.sweep/<run>.json`), or for other run directories the options whose values differ between runs
in their `config.yaml`. `--compare configs/tables/<table>.yaml` adds the paper's published numbers
for the matching rows and our difference to them.

A number is only as good as the runs under it, so before anything is averaged each finished run is
checked (`screen`): a run whose metrics.csv is missing, empty, cut short or unparsable, or whose
rows disagree with its summary.json (fewer rounds than it records completed, another last row,
another final or best accuracy), is damaged; a run whose config.yaml, seeds included, equals an
earlier run's (by path) once the options that only say where a run is stored are set aside is a
duplicate of it. Both are named under the table and in the CSV, and left out of every number: the
cells, the seed counts, `--compare`, `--baseline` and the curves.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.comparison import (
    FIGURES,
    accuracy_key,
    curve,
    curves_png,
    difference,
    figure,
    log_report_to_wandb,
)
from fl_lightning.errors import FLUserError, OneLineArgumentParser
from fl_lightning.outcome import Outcome, read_outcome
from fl_lightning.sweep import FINAL_STATES, SEED_KEYS, display_value, read_json, read_record, short_keys
from fl_lightning.wandb_online import wandb_online

# Options that name where and how a run is stored, not what it computes.
BOOKKEEPING_KEYS = ("ckpt_path", "overwrite", "trainer.default_root_dir", "trainer.logger.init_args.name",
                    "trainer.logger.init_args.group", "trainer.logger.init_args.save_dir",
                    "trainer.logger.init_args.version", "trainer.logger.init_args.id")


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


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _read_config(run_dir: Path) -> dict[str, Any]:
    cfg = run_dir / "config.yaml"
    try:
        return flatten(yaml.safe_load(cfg.read_text()) or {}) if cfg.exists() else {}
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
    keys = sorted({k for c in configs.values() for k in c})
    varying = [k for k in keys if k not in BOOKKEEPING_KEYS and k != "model.class_path" and _varies(k, configs)]
    settings = {path: _setting(configs[path]) for path in found}
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


def _setting(config: dict[str, Any]) -> str:
    """The setting a run's config names: its W&B group `<setting>/<method>` (recorded by fit)."""
    group = config.get("trainer.logger.init_args.group")
    return str(group).split("/")[0] if group else "?"


def group(runs: list[Run]) -> list[Row]:
    rows: dict[str, Row] = {}
    for run in runs:
        key_params = {k: v for k, v in run.params.items() if k not in SEED_KEYS}
        key = repr(sorted((k, display_value(v)) for k, v in key_params.items()))
        rows.setdefault(key, Row(params=key_params)).runs.append(run)
    return list(rows.values())


class DamagedRecords(Exception):
    """Why a run's records cannot be counted (one phrase, shown after the run's name)."""


def read_rounds(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics.csv as `results.py` writes them, or DamagedRecords: the writer ends
    every line, gives every row the header's cells and writes only numbers, so a file that breaks
    any of these was cut (a full disk, an interrupted copy) or edited, and a number read from it
    may not be the one the run measured (`0.6519` cut to `0.65` still reads as a number)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DamagedRecords("metrics.csv is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DamagedRecords(f"metrics.csv cannot be read ({getattr(err, 'strerror', None) or err})") from None
    if not text:
        raise DamagedRecords("metrics.csv is empty")
    if not text.endswith("\n"):
        raise DamagedRecords("metrics.csv's last line is cut short (it has no line end)")
    try:
        header, *lines = list(csv.reader(io.StringIO(text)))
    except csv.Error as err:
        raise DamagedRecords(f"metrics.csv is not a CSV file ({err})") from None
    if not header or header[0] != "round":
        raise DamagedRecords("metrics.csv's first line is not its header (round, then the metrics)")
    return [_parse_row(header, cells, number) for number, cells in enumerate(lines, start=2)]


def _parse_row(header: list[str], cells: list[str], number: int) -> dict[str, float]:
    if len(cells) != len(header):
        raise DamagedRecords(f"metrics.csv line {number} has {len(cells)} cells, its header {len(header)}")
    row: dict[str, Any] = {}
    for column, cell in zip(header, cells, strict=True):
        try:
            if cell != "":
                row[column] = float(cell)
        except ValueError:
            raise DamagedRecords(f"metrics.csv line {number}: {column} is {cell!r}, not a number") from None
    if not float(row.get("round", 0.5)).is_integer():
        raise DamagedRecords(f"metrics.csv line {number}: round is {cells[0]!r}, not a round number")
    row["round"] = int(row["round"])
    return row


def record_damage(run: Run) -> str | None:
    """Why the run's records cannot be counted, or None when metrics.csv is whole and says what
    summary.json says: every round it records completed (1, 2, ...), its last row (`last`), and
    the final and best accuracy with their rounds. Fields an older summary lacks are not checked."""
    try:
        rows = read_rounds(run.path / "metrics.csv")
    except DamagedRecords as err:
        return str(err)
    summary = run.summary or {}
    return (_short(summary, rows) or _last_disagrees(summary, rows) or _figure_disagrees(summary, rows, "final")
            or _figure_disagrees(summary, rows, "best"))


def _short(summary: dict, rows: list[dict[str, float]]) -> str | None:
    completed = summary.get("rounds_completed")
    if not isinstance(completed, int) or isinstance(completed, bool):
        return None
    held = [r["round"] for r in rows]
    if held == list(range(1, completed + 1)):
        return None
    if len(held) < completed:
        return (f"metrics.csv is short: it holds {len(held)} round{'s' * (len(held) != 1)}, summary.json "
                f"records {completed} completed")
    return f"metrics.csv's rounds ({', '.join(map(str, held))}) are not the 1 to {completed} summary.json records"


def _equal(a: Any, b: Any) -> bool:
    """Exactly equal (NaN equals NaN): both files are written from the same floats, each as its
    shortest exact text, so a last digit lost is a difference (a tolerance would hide a cut)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _show(v: Any) -> str:
    return "nothing" if v is None else repr(v)


def _last_disagrees(summary: dict, rows: list[dict[str, float]]) -> str | None:
    last = summary.get("last")
    if not isinstance(last, dict):
        return None
    row = {k: v for k, v in (rows[-1] if rows else {}).items() if k != "round"}
    for key in sorted(set(last) | set(row)):
        if not _equal(row.get(key), last.get(key)):
            return (f"metrics.csv's last row has {key} {_show(row.get(key))}, summary.json's last round "
                    f"{_show(last.get(key))}")
    return None


def _figure_disagrees(summary: dict, rows: list[dict[str, float]], which: str) -> str | None:
    """summary.json's `final_acc` (the last finite accuracy) or `best_acc` (the first highest)
    against the one metrics.csv gives, with their rounds."""
    if f"{which}_acc" not in summary:
        return None
    key = accuracy_key(summary)
    finite = [(r[key], r["round"]) for r in rows if key in r and math.isfinite(r[key])]
    found = (finite[-1] if which == "final" else max(finite, key=lambda f: f[0])) if finite else (None, None)
    recorded = (summary.get(f"{which}_acc"), summary.get(f"{which}_round", found[1]))
    if _equal(recorded[0], found[0]) and recorded[1] == found[1]:
        return None
    return (f"summary.json's {which}_acc is {_show(recorded[0])} (round {recorded[1]}), metrics.csv's {key} "
            f"gives {_show(found[0])} (round {found[1]})")


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
        run.damage = record_damage(run)
    first: dict[str, Run] = {}
    for run in sorted((r for r in runs if r.damage is None), key=lambda r: r.name):
        key = _resolved(run)
        if key is not None and key in first:
            run.duplicate_of = first[key].name
        elif key is not None:
            first[key] = run
    return [r for r in runs if r.damage is None and r.duplicate_of is None]


def stats(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=float) * 100.0
    return float(arr.mean()), float(arr.std())


def fmt(pair: tuple[float, float] | None) -> str:
    return "—" if pair is None else f"{pair[0]:.2f} ± {pair[1]:.2f}"


def value(run: Run, metric: str, last_k: int = 10):
    """`final_acc` / `best_acc` from the summary, `last_k_mean` the mean accuracy of its last k
    rounds (metrics.csv), any other key from its last round (`last`)."""
    summary = run.summary or {}
    if metric == "last_k_mean":
        return figure(run.path, summary, "last_k_mean", last_k)
    v = summary.get(metric) if metric in ("final_acc", "best_acc") else (summary.get("last") or {}).get(metric)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def metric_cell(row: Row, metric: str, last_k: int = 10) -> tuple[str, tuple[float, float] | None]:
    """The table cell of one metric with the papers' Failed/Diverged marks."""
    done = row.done()
    kept = [r for r in done if r.status != "diverged"]
    values = [v for v in (value(r, metric, last_k) for r in kept) if v is not None]
    pair = stats(values)
    diverged = sum(r.status == "diverged" for r in done)
    failed = sum(r.status == "failed" for r in done)
    if done and diverged == len(done):
        return "(Diverged)", None
    if kept and failed == len(kept) and pair is not None:
        text = f"{pair[0]:.2f} (Failed)"
    else:
        text = fmt(pair)
        if failed:
            text += f" ({failed}/{len(done)} failed)"
    if pair is not None and len(values) < len(kept):  # runs without this metric: the row's seed count is not its n
        text += f" (n={len(values)})"
    if diverged:
        text += f" ({diverged}/{len(done)} diverged)"
    return text, pair


def personal_keys(runs: list[Run]) -> list[str]:
    keys = {k for r in runs for k in ((r.summary or {}).get("last") or {})
            if k.startswith("personal/") and k.endswith("_acc_mean")}
    return sorted(keys)


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    csv_rows: list[dict[str, Any]]
    notes: list[tuple[str, str]]  # (run, why it is left out), printed under the table and added to the CSV
    compare_headers: list[str] = field(default_factory=list)
    compare_rows: list[list[str]] = field(default_factory=list)
    curves: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # row label -> its runs' curves
    accuracy: str = "global/test_acc"  # the runs' accuracy metric (clients/test_acc: model-heterogeneous)
    settings: list[str] = field(default_factory=list)  # the settings of the finished runs


FIGURE_KEYS = {"final": "final_acc", "best": "best_acc", "last_k_mean": "last_k_mean"}


def build(top: Path, compare: dict | None = None, metric: str = "final", last_k: int = 10,
          baseline: str | None = None) -> Table:
    """The table of the runs below `top`: one row per method and parameter set, mean ± std over
    seeds; with `baseline`, each row's difference from the baseline method's row in `metric`."""
    if not top.is_dir():
        raise FLUserError(f"report {top}: no such directory")
    runs = collect(top)
    done = counted(top, runs)
    rows = [row for row in group(done) if row.done()]
    label_keys = list(dict.fromkeys(k for row in rows for k in row.params))
    short = short_keys(label_keys)
    personal = personal_keys(done)
    extra = [m for m in dict.fromkeys(e.get("metric", (compare or {}).get("metric", "final_acc"))
                                      for e in (compare or {}).get("entries", []))
             if m not in ("final_acc", "best_acc") and m not in personal]
    metrics = ["final_acc", "best_acc", *personal, *extra]
    headers = [short[k] for k in label_keys] + ["final acc", "best acc", "seeds"]
    headers += [k.removesuffix("_acc_mean") for k in personal] + extra
    if metric == "last_k_mean":
        metrics.append("last_k_mean")
        headers.append(f"last-{last_k} mean acc")
    base_rows = _baseline_rows(rows, baseline) if baseline else {}
    if baseline:
        label = {"final": "final acc", "best": "best acc"}.get(metric, f"last-{last_k} mean acc")
        headers.append(f"{label} − {baseline} (95% CI)")
    table = Table(headers=headers, rows=[], csv_rows=[], notes=_notes(runs), accuracy=accuracy_key(done[0].summary),
                  settings=sorted({r.setting for r in done if r.setting != "?"}))
    for row in rows:
        _add_row(table, row, label_keys, short, metrics, last_k)
        if baseline:
            _add_difference(table, row, base_rows.get(_setting_of(row)), FIGURE_KEYS[metric], last_k)
        table.curves[", ".join(display_value(v) for v in row.params.values())] = [
            curve(r.path, r.summary) for r in row.done() if r.status != "diverged"]
    if compare is not None:
        _add_comparison(table, rows, short, compare)
    return table


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


def _method_of(row: Row) -> str:
    return display_value(row.params.get("method", row.params.get("model.class_path", "")))


def _setting_of(row: Row) -> str:
    return str(row.params.get("setting", ""))


def _baseline_rows(rows: list[Row], baseline: str) -> dict[str, Row]:
    """The baseline method's row of each setting; one line if there is none or several."""
    found: dict[str, list[Row]] = {}
    for row in rows:
        if _method_of(row).lower() == baseline.lower():
            found.setdefault(_setting_of(row), []).append(row)
    if not found:
        methods = ", ".join(sorted({_method_of(r) for r in rows}))
        raise FLUserError(f"--baseline {baseline}: no finished run of that method here; methods: {methods}")
    for setting, candidates in found.items():
        if len(candidates) > 1:
            raise FLUserError(f"--baseline {baseline}: {len(candidates)} rows of that method"
                              f"{' in ' + setting if setting else ''} (they differ in other options); "
                              f"report a directory holding one of them")
    return {setting: candidates[0] for setting, candidates in found.items()}


def _seed_values(row: Row, metric: str, last_k: int) -> dict[tuple, float]:
    """A row's figure per run, keyed by the run's seeds (its name where they are unknown)."""
    out = {}
    for run in row.done():
        v = value(run, metric, last_k) if run.status != "diverged" else None
        if v is not None:
            seeds = tuple(run.params.get(k) for k in SEED_KEYS)
            out[seeds if any(s is not None for s in seeds) else (run.name,)] = v
    return out


def _add_difference(table: Table, row: Row, base: Row | None, metric: str, last_k: int) -> None:
    if base is None:
        text, diff = "no baseline run in this setting", None
    elif base is row:
        text, diff = "(baseline)", None
    else:
        diff = difference(_seed_values(row, metric, last_k), _seed_values(base, metric, last_k))
        text = "—" if diff is None else diff.text()
    table.rows[-1].append(text)
    if diff is not None:
        table.csv_rows[-1].update(diff_mean=round(diff.mean, 4), diff_low=_round(diff.low),
                                  diff_high=_round(diff.high), diff_test=diff.test)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _add_row(table: Table, row: Row, label_keys: list[str], short: dict[str, str], metrics: list[str],
             last_k: int) -> None:
    labels = [display_value(row.params[k]) if k in row.params else "" for k in label_keys]
    cells = {m: metric_cell(row, m, last_k) for m in metrics}
    n = len(row.done())
    table.rows.append([*labels, cells["final_acc"][0], cells["best_acc"][0], str(n),
                       *(cells[m][0] for m in metrics[2:])])
    out: dict[str, Any] = {short[k]: v for k, v in zip(label_keys, labels, strict=True)}
    out.update(seeds=n, diverged=sum(r.status == "diverged" for r in row.done()),
               failed=sum(r.status == "failed" for r in row.done()))
    for m in metrics:
        out[f"{m}_mean"], out[f"{m}_std"] = _num(cells[m][1], 0), _num(cells[m][1], 1)
    out["runs"] = " ".join(r.name for r in row.done())
    table.csv_rows.append(out)


def _notes(runs: list[Run]) -> list[tuple[str, str]]:
    """(run, why it is not in the table) for every run left out: unfinished, damaged, duplicate."""
    notes = []
    for run in runs:
        if run.status not in FINAL_STATES:
            error = (run.record or {}).get("error")
            notes.append((run.name, run.status + (f": {error}" if error else "")))
        elif run.damage is not None:
            notes.append((run.name, f"damaged, left out: {run.damage}"))
        elif run.duplicate_of is not None:
            notes.append((run.name, f"duplicate of {run.duplicate_of} (the same config.yaml and seeds), left out"))
    return notes


def _add_comparison(table: Table, rows: list[Row], short: dict[str, str], compare: dict) -> None:
    table.compare_headers = ["paper entry", "metric", "ours", "paper", "ours − paper"]
    for entry in compare.get("entries", []):
        metric = entry.get("metric", compare.get("metric", "final_acc"))
        label = ", ".join(f"{short.get(k, k)}={display_value(v)}" for k, v in (entry.get("match") or {}).items())
        index = match_row(rows, entry)
        ours_text, ours = ("no finished run", None) if index is None else metric_cell(rows[index], metric)
        diff = "—" if ours is None or entry.get("acc") is None else f"{ours[0] - float(entry['acc']):+.2f}"
        table.compare_rows.append([label, metric, ours_text, published_text(entry), diff])


def _num(pair, i):
    return None if pair is None else round(pair[i], 4)


def published_text(entry: dict) -> str:
    acc, std = entry.get("acc"), entry.get("std")
    if entry.get("failed"):
        return f"{acc:.2f} (Failed)" if acc is not None else "(Failed)"
    if acc is None:
        return "—"
    return f"{acc:.2f}" + (f" ± {std:.2f}" if std is not None else "")


def _same(a: Any, b: Any) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return display_value(a) == display_value(b)


def match_row(rows: list[Row], entry: dict) -> int | None:
    """The row whose parameters agree with every key of the published entry's `match`."""
    want = entry.get("match") or {}
    for i, row in enumerate(rows):
        if want and all(k in row.params and _same(row.params[k], v) for k, v in want.items()):
            return i
    return None


def load_compare(path: Path) -> dict:
    """A paper table (configs/tables/<table>.yaml), checked: one line for a file that is not one."""
    if not path.is_file():
        raise FLUserError(f"--compare {path}: no such file")
    expected = "expected a paper table with `published: {metric, entries: [{match: {...}, acc: <number>}, ...]}`"
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise FLUserError(f"--compare {path}: not valid YAML{where} ({problem}); {expected}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise FLUserError(f"--compare {path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise FLUserError(f"--compare {path}: the file holds a {type(doc).__name__}, not a mapping; {expected}")
    published = doc.get("published")
    if not isinstance(published, dict) or not isinstance(published.get("entries"), list):
        raise FLUserError(f"--compare {path}: {expected}")
    if not isinstance(published.get("metric", "final_acc"), str):
        raise FLUserError(f"--compare {path}: published.metric must be a metric name such as final_acc, got "
                          f"{published['metric']!r}")
    for i, entry in enumerate(published["entries"], start=1):
        where = f"--compare {path}: published entry {i}"
        if not isinstance(entry, dict):
            raise FLUserError(f"{where} must be a mapping ({{match: {{...}}, acc: <number>}}), got {entry!r}")
        if not isinstance(entry.get("match") or {}, dict):
            raise FLUserError(f"{where}: match must map sweep parameters to values, got {entry['match']!r}")
        for key in ("acc", "std"):
            number = entry.get(key)
            if number is not None and (isinstance(number, bool) or not isinstance(number, int | float)):
                raise FLUserError(f"{where}: {key} must be a number (percent) or null, got {number!r}")
        if not isinstance(entry.get("metric", ""), str):
            raise FLUserError(f"{where}: metric must be a metric name such as final_acc, got {entry['metric']!r}")
    return {**published, "title": f"{doc.get('paper', '')}: {doc.get('table', '')}".strip(": ")}


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def curves_title(table: Table, top: Path) -> str:
    """`<setting> (<directory>): <accuracy>, mean ± std over seeds` (the settings where several)."""
    where = top.resolve().name
    settings = ", ".join(table.settings)
    what = f"{settings} ({where})" if settings and settings != where else where
    return f"{what}: {table.accuracy}, mean ± std over seeds"


def main(argv: list[str]) -> int:
    p = OneLineArgumentParser(prog="fl-lightning report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="a directory of runs at any depth, e.g. runs, runs/<setting> or runs/<sweep>")
    p.add_argument("--compare", default=None, help="a paper table, configs/tables/<table>.yaml")
    p.add_argument("--csv", default=None, help="where to write the CSV (default: <sweep_dir>/report.csv)")
    p.add_argument("--metric", choices=FIGURES, default="final",
                   help="the figure --baseline compares: the final round's accuracy, the best round's, or the "
                        "mean of the last --last-k rounds (a column of its own)")
    p.add_argument("--last-k", type=int, default=10, help="rounds averaged by --metric last_k_mean (default 10)")
    p.add_argument("--baseline", default=None,
                   help="a method (e.g. FedAvg): each row's difference from its row in --metric, with a 95%% "
                        "confidence interval over seeds (paired t where both ran the same seeds, else Welch's t)")
    p.add_argument("--curves", action="store_true",
                   help="also write curves.png beside the CSV: accuracy against rounds, mean ± std over seeds "
                        "(and, when W&B is online, a report run with the curves as a line plot)")
    opts = p.parse_args(argv)
    if opts.last_k < 1:
        raise FLUserError(f"--last-k must be >= 1 (the number of last rounds to average), got {opts.last_k}")
    compare = load_compare(Path(opts.compare)) if opts.compare else None
    sweep_dir = Path(opts.sweep_dir)
    table = build(sweep_dir, compare, metric=opts.metric, last_k=opts.last_k, baseline=opts.baseline)
    print(markdown(table.headers, table.rows))
    for name, note in table.notes:
        print(f"- {name}: {note}")
    if any(note.startswith("damaged") for _, note in table.notes):
        print("(a damaged run's fit command, run again with --ckpt_path last, writes its records again from its "
              "checkpoint)")
    if compare is not None:
        print(f"\nCompared with {compare['title']}:\n")
        print(markdown(table.compare_headers, table.compare_rows))
    csv_path = Path(opts.csv) if opts.csv else sweep_dir / "report.csv"
    # after the table's rows, a row per run left out: its name under `runs`, why under `note`
    # (empty in the table's rows), so readers of the earlier columns read the table as before
    csv_rows = table.csv_rows + [{"runs": name, "note": note} for name, note in table.notes]
    fields = list(dict.fromkeys(k for row in csv_rows for k in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    writer.writerows(csv_rows)
    try:
        atomic_write_bytes(csv_path, text.getvalue().encode())
    except OSError as err:  # a read-only or full disk: the table above stands; say so in one line
        print(f"error: could not write {csv_path} ({err.strerror or err}); the table above is complete; "
              f"give --csv <a writable path>", file=sys.stderr)
        return 1
    print(f"\n(CSV: {csv_path})")
    if opts.curves:
        png = csv_path.with_name("curves.png")
        try:
            curves_png(table.curves, png, curves_title(table, sweep_dir),
                       ylabel=table.accuracy.replace("/", " ").replace("_", " "))
        except OSError as err:
            print(f"error: could not write {png} ({err.strerror or err}); give --csv <a writable path>",
                  file=sys.stderr)
            return 1
        print(f"(curves: {png})")
        if wandb_online():
            url = log_report_to_wandb(table.curves, png, curves_title(table, sweep_dir), table.headers, table.rows,
                                      sweep_dir)
            print(f"(W&B: {url or 'the report run under ' + str(sweep_dir / 'wandb')})")
    return 0
