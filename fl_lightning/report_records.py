"""Whether a finished run's records can be counted (`fl-lightning report`).

A run's metrics.csv (one row per completed round) and its summary.json are written together after
every round. A run is damaged when metrics.csv is missing, empty, cut short or unparsable, or when
its rows disagree with its summary.json (fewer rounds than it records completed, another last row,
another final or best accuracy): a number read from it may not be the one the run measured, so
`report` names such a run and leaves it out of every number.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["DamagedRecords", "record_damage"]

from fl_lightning.comparison import DamagedRecords, accuracy_key, read_metrics


def record_damage(run_dir: Path, summary: dict | None) -> str | None:
    """Why the run's records cannot be counted, or None when metrics.csv is whole and says what
    summary.json says: every round it records completed (1, 2, ...), its last row (`last`), and
    the final and best accuracy with their rounds. Fields an older summary lacks are not checked."""
    try:
        rows = read_metrics(run_dir / "metrics.csv")
    except DamagedRecords as err:
        return str(err)
    summary = summary or {}
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
