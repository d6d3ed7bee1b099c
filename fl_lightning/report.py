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
in their `config.yaml`; where runs of both kinds are mixed, each run's value of every label is
read from its own config.yaml (`fill_labels`). The table shows the method and the labels that
differ between its rows, named in the curves' legend (`FedSOL, rho=2`); the labels every row
shares are one line under the table (`All rows: max_epochs=3, ...`), and a swept method file
(`config`) that only repeats the method is left out. The CSV keeps every label as a column.
`--compare configs/tables/<table>.yaml` adds the paper's published numbers for the matching rows
and our difference to them; an entry matches a run by its sweep parameters, or by its config.yaml:
`config: <method file>` matches a run whose config holds every option that file sets.
`--format latex` prints the table as a paper's booktabs table (`report_tables`) and writes it
beside the CSV.

A number is only as good as the runs under it, so before anything is averaged each finished run is
checked (`report_runs.screen`): a run whose metrics.csv is missing, empty, cut short or unparsable, or whose
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

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.comparison import (
    FEW_SEEDS_NOTE,
    FIGURES,
    accuracy_key,
    curve,
    curves_png,
    difference,
    figure,
    load_compare,
    log_report_to_wandb,
)
from fl_lightning.errors import FLUserError, OneLineArgumentParser
from fl_lightning.report_runs import (
    METHOD_KEYS,
    Row,
    Run,
    collect,
    counted,
    fill_labels,
    group,
    holds,
    same,
)
from fl_lightning.report_tables import best_cells, comment, escape, latex, markdown, published_text
from fl_lightning.sweep import FINAL_STATES, SEED_KEYS, display_value, short_keys
from fl_lightning.wandb_online import wandb_online


def stats(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=float) * 100.0
    return float(arr.mean()), float(arr.std())


def fmt(pair: tuple[float, float] | None, n: int = 2) -> str:
    """`mean ± std` over n values; one value as itself and n=1 (its std of 0 measured no spread)."""
    if pair is None:
        return "—"
    return f"{pair[0]:.2f} ± {pair[1]:.2f}" if n > 1 else f"{pair[0]:.2f} (n=1)"


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
        text = fmt(pair, len(values))
        if failed:
            text += f" ({failed}/{len(done)} failed)"
    if pair is not None and 1 < len(values) < len(kept):  # runs without this metric: the row's seeds are not its n
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
    labels: int = 0  # the first columns, which label the rows
    constants: list[str] = field(default_factory=list)  # `key=value` of the labels every row shares
    means: list[dict[int, float]] = field(default_factory=list)  # per row: column -> its accuracy's mean
    groups: list[str] = field(default_factory=list)  # per row: its setting (the best of a column is per setting)
    few_seeds: bool = False  # a --baseline interval over fewer than MIN_SEEDS seeds is in the table


FIGURE_KEYS = {"final": "final_acc", "best": "best_acc", "last_k_mean": "last_k_mean"}


def build(top: Path, compare: dict | None = None, metric: str = "final", last_k: int = 10,
          baseline: str | None = None) -> Table:
    """The table of the runs below `top`: one row per method and parameter set, mean ± std over
    seeds; with `baseline`, each row's difference from the baseline method's row in `metric`."""
    if not top.is_dir():
        raise FLUserError(f"report {top}: no such directory")
    runs = collect(top)
    done = counted(top, runs)
    fill_labels(done)
    rows = [row for row in group(done) if row.done()]
    label_keys = list(dict.fromkeys(k for row in rows for k in row.params))
    short = short_keys(label_keys)
    shown, constant = split_labels(rows, label_keys)
    metrics, columns = _metric_columns(done, compare, metric, last_k)
    base_rows = _baseline_rows(rows, baseline) if baseline else {}
    if baseline:
        label = {"final": "final acc", "best": "best acc"}.get(metric, f"last-{last_k} mean acc")
        columns.append(f"{label} − {baseline} (95% CI)")
    table = Table(headers=[short[k] for k in shown] + columns, rows=[], csv_rows=[], notes=_notes(runs),
                  accuracy=accuracy_key(done[0].summary), labels=len(shown),
                  settings=sorted({r.setting for r in done if r.setting != "?"}),
                  constants=[f"{short[k]}={display_value(rows[0].params[k])}" for k in constant])
    for row in rows:
        _add_row(table, row, label_keys, shown, short, metrics, last_k)
        if baseline:
            _add_difference(table, row, base_rows.get(_setting_of(row)), FIGURE_KEYS[metric], last_k)
        label = _legend(row, shown, short, table.curves)
        table.curves[label] = [curve(r.path, r.summary) for r in row.done() if r.status != "diverged"]
    if compare is not None:
        _add_comparison(table, rows, short, compare)
    return table


def _metric_columns(done: list[Run], compare: dict | None, metric: str, last_k: int) -> tuple[list[str], list[str]]:
    """The metrics of the table's cells, and its columns after the labels: final and best
    accuracy, seeds, the personalised accuracies, the paper table's other metrics, last-k mean."""
    personal = personal_keys(done)
    extra = [m for m in dict.fromkeys(e.get("metric", (compare or {}).get("metric", "final_acc"))
                                      for e in (compare or {}).get("entries", []))
             if m not in ("final_acc", "best_acc") and m not in personal]
    metrics = ["final_acc", "best_acc", *personal, *extra]
    columns = ["final acc", "best acc", "seeds", *(k.removesuffix("_acc_mean") for k in personal), *extra]
    if metric == "last_k_mean":
        metrics.append("last_k_mean")
        columns.append(f"last-{last_k} mean acc")
    return metrics, columns


def split_labels(rows: list[Row], keys: list[str]) -> tuple[list[str], list[str]]:
    """The labels shown as columns (the method, the setting, and what differs between rows) and
    those every row shares (one line under the table). A swept method file whose name is its
    method's (`config=fedavg` beside FedAvg) is neither: the method column says it."""
    shown, constant = [], []
    for key in keys:
        values = {display_value(r.params[key]) if key in r.params else None for r in rows}
        if key in METHOD_KEYS:
            shown.append(key)
        elif key == "config" and all(display_value(r.params.get("config")).lower() == _method_of(r).lower()
                                     for r in rows):
            continue
        else:
            (constant if len(values) == 1 else shown).append(key)
    return shown, constant


def _legend(row: Row, shown: list[str], short: dict[str, str], taken: dict) -> str:
    """The row's line in the curves: what tells it apart, named (`FedSOL, rho=2`); a label the
    row has no value for (FedAvg's rho) is left out unless another line would read the same."""
    def part(key: str, everything: bool) -> str | None:
        v = row.params.get(key)
        if v is None and not everything:
            return None
        return display_value(v) if key in METHOD_KEYS else f"{short[key]}={display_value(v)}"

    label = ", ".join(p for p in (part(k, False) for k in shown) if p is not None)
    return label if label not in taken else ", ".join(part(k, True) for k in shown)


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
        table.few_seeds = table.few_seeds or diff.few_seeds
        table.csv_rows[-1].update(diff_mean=round(diff.mean, 4), diff_low=_round(diff.low),
                                  diff_high=_round(diff.high), diff_test=diff.test, diff_n=diff.n)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _add_row(table: Table, row: Row, label_keys: list[str], shown: list[str], short: dict[str, str],
             metrics: list[str], last_k: int) -> None:
    """The row's cells (the labels shown, then its metrics) and its CSV row (every label)."""
    labels = {k: display_value(row.params[k]) if k in row.params else "" for k in label_keys}
    cells = {m: metric_cell(row, m, last_k) for m in metrics}
    n = len(row.done())
    table.rows.append([*(labels[k] for k in shown), cells["final_acc"][0], cells["best_acc"][0], str(n),
                       *(cells[m][0] for m in metrics[2:])])
    # the accuracies, the best of which is bold in LaTeX (the seeds column sits after the first two metrics)
    table.means.append({table.labels + i + (i >= 2): cells[m][1][0] for i, m in enumerate(metrics)
                        if cells[m][1] is not None and ("acc" in m or m == "last_k_mean")})
    table.groups.append(_setting_of(row))
    out: dict[str, Any] = {short[k]: labels[k] for k in label_keys}
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


def match_row(rows: list[Row], entry: dict) -> int | None:
    """The first row that agrees with every key of the published entry's `match`: by its
    parameters, or, for a key it has none of (a plain fit was not run by a sweep), by the config.yaml
    of every run in it (`config: <file>`: the run's config holds what the file sets)."""
    want = entry.get("match") or {}
    for i, row in enumerate(rows):
        if want and all(_row_agrees(row, k, v) for k, v in want.items()):
            return i
    return None


def _row_agrees(row: Row, key: str, want: Any) -> bool:
    if key in row.params:
        return same(row.params[key], want)
    if key == "config":
        return all(holds(r, str(want)) for r in row.done())
    return all(key in r.config and same(r.config[key], want) for r in row.done())


def curves_title(table: Table, top: Path) -> str:
    """`<setting> (<directory>): <accuracy>, mean ± std over seeds` (the settings where several)."""
    where = top.resolve().name
    settings = ", ".join(table.settings)
    what = f"{settings} ({where})" if settings and settings != where else where
    return f"{what}: {table.accuracy}, mean ± std over seeds"


DAMAGED_HINT = ("(a damaged run's fit command, run again with --ckpt_path last, writes its records again from its "
                "checkpoint)")


def notes_text(table: Table) -> list[str]:
    """The lines under the table after what every row shares: the flag of --baseline intervals
    over too few seeds, and each run left out with why."""
    lines = [FEW_SEEDS_NOTE] if table.few_seeds else []
    lines += [f"- {name}: {note}" for name, note in table.notes]
    if any(note.startswith("damaged") for _, note in table.notes):
        lines.append(DAMAGED_HINT)
    return lines


def markdown_text(table: Table, compare: dict | None) -> str:
    lines = [markdown(table.headers, table.rows)]
    if table.constants:
        lines.append("All rows: " + ", ".join(table.constants))
    lines += notes_text(table)
    if compare is not None:
        lines += ["", f"Compared with {compare['title']}:", "", markdown(table.compare_headers, table.compare_rows)]
    return "\n".join(lines)


def paper_latex(table: Table) -> str:
    """The table as a paper prints it (report.tex): the booktabs tabular, the best of each
    accuracy column in bold, and what every row shares as a comment for the caption."""
    text = latex(table.headers, table.rows, table.labels, best_cells(table.means, table.groups))
    if table.constants:
        text += "\n" + comment(escape("All rows: " + ", ".join(table.constants)))
    return text


def latex_text(table: Table, compare: dict | None) -> str:
    """paper_latex, then everything else as LaTeX comments: the whole output can be pasted."""
    lines = [paper_latex(table), *(comment(line) for line in notes_text(table))]
    if compare is not None:
        lines += [comment(f"Compared with {compare['title']}:"),
                  latex(table.compare_headers, table.compare_rows, labels=2)]
    return "\n".join(lines)


def csv_text(table: Table) -> str:
    # after the table's rows, a row per run left out: its name under `runs`, why under `note`
    # (empty in the table's rows), so readers of the earlier columns read the table as before
    csv_rows = table.csv_rows + [{"runs": name, "note": note} for name, note in table.notes]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(dict.fromkeys(k for row in csv_rows for k in row)))
    writer.writeheader()
    writer.writerows(csv_rows)
    return text.getvalue()


def parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="fl-lightning report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="a directory of runs at any depth, e.g. runs, runs/<setting> or runs/<sweep>")
    p.add_argument("--compare", default=None, help="a paper table, configs/tables/<table>.yaml")
    p.add_argument("--csv", default=None, help="where to write the CSV (default: <sweep_dir>/report.csv)")
    p.add_argument("--format", choices=("markdown", "latex"), default="markdown",
                   help="how the table is printed: markdown, or latex (a booktabs table for a paper, the best of "
                        "each column in bold, also written beside the CSV as report.tex; the rest as %% comments)")
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
    return p


def main(argv: list[str]) -> int:
    opts = parser().parse_args(argv)
    if opts.last_k < 1:
        raise FLUserError(f"--last-k must be >= 1 (the number of last rounds to average), got {opts.last_k}")
    compare = load_compare(Path(opts.compare)) if opts.compare else None
    sweep_dir = Path(opts.sweep_dir)
    table = build(sweep_dir, compare, metric=opts.metric, last_k=opts.last_k, baseline=opts.baseline)
    paper = opts.format == "latex"
    print(latex_text(table, compare) if paper else markdown_text(table, compare))
    say = comment if paper else str
    csv_path = Path(opts.csv) if opts.csv else sweep_dir / "report.csv"
    files = {"CSV": (csv_path, csv_text(table))}
    if paper:
        files["LaTeX"] = (csv_path.with_suffix(".tex"), paper_latex(table) + "\n")
    for path, text in files.values():
        try:
            atomic_write_bytes(path, text.encode())
        except OSError as err:  # a read-only or full disk: the table above stands; say so in one line
            print(f"error: could not write {path} ({err.strerror or err}); the table above is complete; "
                  f"give --csv <a writable path>", file=sys.stderr)
            return 1
    written = "\n".join(f"({what}: {path})" for what, (path, _) in files.items())
    print(comment(written) if paper else "\n" + written)
    return _curves(table, sweep_dir, csv_path, say) if opts.curves else 0


def _curves(table: Table, sweep_dir: Path, csv_path: Path, say) -> int:
    png = csv_path.with_name("curves.png")
    try:
        curves_png(table.curves, png, curves_title(table, sweep_dir),
                   ylabel=table.accuracy.replace("/", " ").replace("_", " "))
    except OSError as err:
        print(f"error: could not write {png} ({err.strerror or err}); give --csv <a writable path>", file=sys.stderr)
        return 1
    print(say(f"(curves: {png})"))
    if wandb_online():
        url = log_report_to_wandb(table.curves, png, curves_title(table, sweep_dir), table.headers, table.rows,
                                  sweep_dir)
        print(say(f"(W&B: {url or 'the report run under ' + str(sweep_dir / 'wandb')})"))
    return 0
