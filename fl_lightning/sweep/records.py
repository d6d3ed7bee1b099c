"""A local sweep's records of its runs on disk (`<root>/<sweep>/.sweep/<run>.json`: each run's
command, parameters, status, exit code, error line and log), read by the runner, by `report` (to
say why a run is missing from its table) and by the run naming (to find a run recorded under
another name than the one it would be given now)."""

from __future__ import annotations

import json
from pathlib import Path

from fl_lightning.sweep.spec import canonical


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


def recorded_names(sweep_dir: Path) -> dict[str, list[str]]:
    """The names under which the sweep in `sweep_dir` recorded its runs (`.sweep/<name>.json`), by
    their canonical parameters: how a sweep finds its runs again when it names new runs otherwise
    than the version that started them."""
    found: dict[str, list[str]] = {}
    for path in sorted((sweep_dir / ".sweep").glob("*.json")):
        record = read_record(path)
        if record is not None and "params" in record:
            found.setdefault(canonical(record["params"]), []).append(path.stem)
    return found
