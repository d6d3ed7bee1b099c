"""Comparing methods as papers do, with an interval (`fl-lightning report --metric/--baseline/--curves`).

- A run's figure (`figure`): its final or best global test accuracy (summary.json), or the mean of
  its last k rounds (metrics.csv), a less noisy figure than the last round alone.
- A row's difference from the baseline row (`difference`): mean and 95% confidence interval of
  row - baseline over seeds. Paired (Student's t on the per-seed differences, n - 1 degrees of
  freedom) when every seed of the row also ran for the baseline, as when a sweep gives every method
  the same seeds; otherwise Welch's t (unequal variances, Welch-Satterthwaite degrees of freedom).
  Fewer than two values on a side give no interval; an interval over fewer than `MIN_SEEDS` says
  so in its cell: the spread of one or two values is no estimate of the seeds' spread (with two,
  the t quantile alone is 12.7), so neither its width nor its sign can be trusted.
- A paper table (`load_compare`, `configs/tables/<table>.yaml`): the published numbers that
  `--compare` prints ours against.
- Learning curves (`curves_png`): global test accuracy against rounds, one line per row with a
  band of ± one std over its seeds.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.errors import FLUserError

FIGURES = ("final", "best", "last_k_mean")
MIN_SEEDS = 3  # an interval over fewer seeds is flagged (see the module docstring)
FEW_SEEDS_NOTE = ("(an interval over fewer than 3 seeds estimates the spread from one or two values: neither its "
                  "width nor its sign can be trusted; run 3 or more seeds)")


class DamagedRecords(Exception):
    """Why a run's records cannot be counted (one phrase, shown after the run's name)."""


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a metrics.csv (or clients.csv) as `results.py` writes them, numbers as floats
    (`round` as int), empty cells left out; or DamagedRecords: the writer ends every line, gives
    every row the header's cells and writes only numbers, so a file that breaks any of these was cut
    (a full disk, an interrupted copy) or edited, and a number read from it may not be the one the
    run measured (`0.6519` cut to `0.65` still reads as a number). (Here rather than in results.py,
    so that `report` reads runs without Lightning.)"""
    path = Path(path)
    name = path.name
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DamagedRecords(f"{name} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DamagedRecords(f"{name} cannot be read ({getattr(err, 'strerror', None) or err})") from None
    if not text:
        raise DamagedRecords(f"{name} is empty")
    if not text.endswith("\n"):
        raise DamagedRecords(f"{name}'s last line is cut short (it has no line end)")
    try:
        header, *lines = list(csv.reader(io.StringIO(text)))
    except csv.Error as err:
        raise DamagedRecords(f"{name} is not a CSV file ({err})") from None
    if not header or header[0] != "round":
        raise DamagedRecords(f"{name}'s first line is not its header (round, then the metrics)")
    return [_parse_row(name, header, cells, number) for number, cells in enumerate(lines, start=2)]


def _parse_row(name: str, header: list[str], cells: list[str], number: int) -> dict[str, float]:
    if len(cells) != len(header):
        raise DamagedRecords(f"{name} line {number} has {len(cells)} cells, its header {len(header)}")
    row: dict[str, Any] = {}
    for column, cell in zip(header, cells, strict=True):
        try:
            if cell != "":
                row[column] = float(cell)
        except ValueError:
            raise DamagedRecords(f"{name} line {number}: {column} is {cell!r}, not a number") from None
    if not float(row.get("round", 0.5)).is_integer():
        raise DamagedRecords(f"{name} line {number}: round is {cells[0]!r}, not a round number")
    row["round"] = int(row["round"])
    return row


def accuracy_key(summary: dict | None) -> str:
    return str((summary or {}).get("accuracy") or "global/test_acc")


def curve(run_dir: Path, summary: dict | None) -> dict[int, float]:
    """round -> the run's accuracy (a fraction) from its metrics.csv; empty when unreadable."""
    key = accuracy_key(summary)
    try:
        rows = read_metrics(run_dir / "metrics.csv")
    except DamagedRecords:
        return {}
    return {int(r["round"]): float(r[key]) for r in rows if key in r and math.isfinite(float(r[key]))}


def figure(run_dir: Path, summary: dict | None, which: str, last_k: int) -> float | None:
    """The run's figure as a fraction: `final`, `best` (summary.json) or `last_k_mean`."""
    summary = summary or {}
    if which in ("final", "best"):
        v = summary.get(f"{which}_acc")
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
    values = [v for _, v in sorted(curve(run_dir, summary).items())][-last_k:]
    return float(np.mean(values)) if values else None


@dataclass
class Difference:
    mean: float  # percentage points
    low: float | None
    high: float | None
    test: str  # "paired t", "Welch t" or "no CI (n < 2)"
    n: int

    @property
    def few_seeds(self) -> bool:
        """An interval over too few seeds to be read (see the module docstring)."""
        return self.low is not None and self.n < MIN_SEEDS

    def text(self) -> str:
        if self.low is None:
            return f"{self.mean:+.2f} ({self.test})"
        flag = f": fewer than {MIN_SEEDS} seeds, not to be trusted" if self.few_seeds else ""
        return f"{self.mean:+.2f} [{self.low:+.2f}, {self.high:+.2f}] ({self.test}, n={self.n}{flag})"


def difference(row: dict[tuple, float], base: dict[tuple, float], level: float = 0.95) -> Difference | None:
    """row - base in percentage points with its `level` confidence interval; `row`/`base` map a
    run's seeds to its figure (a fraction). None when a side has no value."""
    from scipy import stats

    if not row or not base:
        return None
    a, b = 100 * np.asarray(list(row.values())), 100 * np.asarray(list(base.values()))
    q = 0.5 + level / 2
    if set(row) <= set(base) and len(row) >= 2:  # the same seeds: paired
        d = 100 * np.asarray([row[s] - base[s] for s in row])
        half = stats.t.ppf(q, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
        return Difference(float(d.mean()), float(d.mean() - half), float(d.mean() + half), "paired t", len(d))
    mean = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return Difference(mean, None, None, "no CI (n < 2)", min(len(a), len(b)))
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Difference(mean, mean, mean, "Welch t", min(len(a), len(b)))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(q, df) * se
    return Difference(mean, mean - half, mean + half, "Welch t", min(len(a), len(b)))


def mean_curve(runs: list[dict[int, float]]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The rounds any of `runs` reached, and the mean and std (ddof 0) over the runs at each, in %."""
    rounds = sorted(set().union(*runs)) if runs else []
    values = [[100 * c[r] for c in runs if r in c] for r in rounds]
    return rounds, np.array([np.mean(v) for v in values]), np.array([np.std(v) for v in values])


def log_report_to_wandb(curves: dict[str, list[dict[int, float]]], png: Path, title: str, headers: list[str],
                        rows: list[list[str]], top: Path, project: str = "fl-lightning") -> str:
    """The report as a W&B run of its own (job_type report, named `report/<directory>`, its files under
    `<directory>/wandb/`): the learning curves as a native line plot (the mean over seeds, one line
    per row; `report/curves`), the PNG with its ± std bands, and the table. Returns the run's URL
    (empty offline)."""
    import wandb

    run = wandb.init(project=project, job_type="report", name=f"report/{top.resolve().name}", dir=str(top),
                     config={"directory": str(top.resolve())}, reinit="create_new")
    try:
        lines = [(label, *mean_curve(runs)) for label, runs in curves.items()]
        lines = [(label, rounds, mean) for label, rounds, mean, _ in lines if rounds]
        payload: dict = {"report/table": wandb.Table(columns=headers, data=rows),
                         "report/curves_png": wandb.Image(str(png))}
        if lines:
            payload["report/curves"] = wandb.plot.line_series(
                xs=[rounds for _, rounds, _ in lines], ys=[mean.tolist() for _, _, mean in lines],
                keys=[label for label, _, _ in lines], title=title, xname="round")
        run.log(payload)
        return run.url or ""
    finally:
        run.finish()
        wandb.teardown()  # the run's file is complete when report returns (see lightning_cli.finish_wandb)


def curves_png(curves: dict[str, list[dict[int, float]]], path: Path, title: str,
               ylabel: str = "global test accuracy") -> None:
    """One line per label (mean over its runs' curves, in %) with a ± one std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, runs in curves.items():
        rounds, mean, std = mean_curve(runs)
        if not rounds:
            continue
        (line,) = ax.plot(rounds, mean, label=f"{label} (n={len(runs)})")
        ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{ylabel} (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


COMPARE_EXPECTED = "expected a paper table with `published: {metric, entries: [{match: {...}, acc: <number>}, ...]}`"


def load_compare(path: Path) -> dict:
    """A paper table (configs/tables/<table>.yaml), checked: one line for a file that is not one."""
    if not path.is_file():
        raise FLUserError(f"--compare {path}: no such file")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise FLUserError(f"--compare {path}: not valid YAML{where} ({problem}); {COMPARE_EXPECTED}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise FLUserError(f"--compare {path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise FLUserError(f"--compare {path}: the file holds a {type(doc).__name__}, not a mapping; "
                          f"{COMPARE_EXPECTED}")
    published = doc.get("published")
    if not isinstance(published, dict) or not isinstance(published.get("entries"), list):
        raise FLUserError(f"--compare {path}: {COMPARE_EXPECTED}")
    if not isinstance(published.get("metric", "final_acc"), str):
        raise FLUserError(f"--compare {path}: published.metric must be a metric name such as final_acc, got "
                          f"{published['metric']!r}")
    for i, entry in enumerate(published["entries"], start=1):
        _check_entry(entry, f"--compare {path}: published entry {i}")
    return {**published, "title": f"{doc.get('paper', '')}: {doc.get('table', '')}".strip(": ")}


def _check_entry(entry, where: str) -> None:
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
