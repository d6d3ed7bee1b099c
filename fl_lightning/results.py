"""Results that outlive the dashboard: `<run dir>/metrics.csv` and `<run dir>/summary.json`.

`metrics.csv` has one row per completed round (`round` is 1-based, then every metric logged that
round) and `summary.json` the run's outcome (see `Summary`). Both are rewritten atomically after
every round, before the round's checkpoint, so after a kill they hold at least the checkpointed
rounds; a resumed run drops any row past its checkpoint and writes the replayed rounds again, so a
resumed run's files equal an uninterrupted run's. Sweeps and `fl-lightning report` read them.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.loggers import update_wandb_summary

# The run's accuracy: the global model's on the global test set, or, for model-heterogeneous methods
# (no global model), the clients' own models on their own test sets (hetero_base.py).
ACCURACY_KEYS = ("global/test_acc", "clients/test_acc")


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool | int | float):
        return float(value)
    return None


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a metrics.csv, numbers as floats (`round` as int); empty cells left out."""
    with open(path, newline="") as f:
        rows = []
        for row in csv.DictReader(f):
            parsed = {k: float(v) for k, v in row.items() if v not in ("", None)}
            parsed["round"] = int(parsed["round"])
            rows.append(parsed)
    return rows


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


class ResultsCallback(L.Callback):
    """Writes metrics.csv and summary.json into the run directory (rank 0 only)."""

    def __init__(self, run_dir: str | Path):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, float]] = []
        self.diverged = False
        self._elapsed_before = 0.0  # wall time of the run's earlier processes (resume)
        self._started = time.monotonic()

    # ---- per round -------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self._started = time.monotonic()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module) -> None:
        # Lightning only ever adds to `callback_metrics`, so a key logged in some rounds (the
        # class-wise heatmap's, the spectrum's) would stay there and repeat in every later row,
        # which the loggers never receive and a resumed process would not write. Emptying it at
        # the round's start leaves exactly this round's values (validation runs inside the round).
        trainer.callback_metrics.clear()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        round_number = trainer.current_epoch + 1
        row = {"round": round_number}
        for key, value in sorted(trainer.callback_metrics.items()):
            number = _number(value)
            if number is not None and key not in ("round", "epoch"):
                row[key] = number
        self.rows = [r for r in self.rows if r["round"] < round_number] + [row]
        self.write(trainer, pl_module, finished=False)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        done = bool(self.rows) and self.rows[-1]["round"] >= trainer.max_epochs
        self.write(trainer, pl_module, finished=done)

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        from fl_lightning.federation import FLDivergedError

        if isinstance(exception, FLDivergedError) and not str(exception).startswith("failed"):
            self.diverged = True
        self.write(trainer, pl_module, finished=False)

    # ---- files -----------------------------------------------------------------------------
    def wall_time(self) -> float:
        return self._elapsed_before + time.monotonic() - self._started

    def summary(self, trainer: L.Trainer, pl_module, finished: bool) -> dict[str, Any]:
        key = next((k for k in ACCURACY_KEYS if any(k in r for r in self.rows)), ACCURACY_KEYS[0])
        scored = [r for r in self.rows if key in r and math.isfinite(r[key])]
        final = scored[-1] if scored else None
        best = max(scored, key=lambda r: r[key]) if scored else None  # first of equals
        failed = any(bool(getattr(cb, "_collapse", {}).get("failed_at")) for cb in trainer.callbacks)
        return {
            "method": type(pl_module).__name__,
            "rounds_completed": self.rows[-1]["round"] if self.rows else 0,
            "max_rounds": trainer.max_epochs,
            "finished": finished,
            "accuracy": key,
            "final_acc": final[key] if final else None,
            "final_round": final["round"] if final else None,
            "best_acc": best[key] if best else None,
            "best_round": best["round"] if best else None,
            "wall_time_s": round(self.wall_time(), 3),
            "diverged": self.diverged or any(not math.isfinite(r.get("global/test_loss", 0.0)) for r in self.rows),
            "failed": failed,
            "last": {k: v for k, v in (self.rows[-1] if self.rows else {}).items() if k != "round"},
        }

    def write(self, trainer: L.Trainer, pl_module, finished: bool) -> None:
        if not trainer.is_global_zero:
            return
        columns = ["round", *sorted({k for r in self.rows for k in r} - {"round"})]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
        atomic_write_bytes(self.run_dir / "metrics.csv", text.getvalue().encode())
        summary = self.summary(trainer, pl_module, finished)
        atomic_write_bytes(self.run_dir / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())
        update_wandb_summary(trainer.loggers, summary)

    # ---- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "diverged": self.diverged, "wall_time_s": self.wall_time()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = list(state_dict.get("rows", []))
        self.diverged = bool(state_dict.get("diverged", False))
        self._elapsed_before = float(state_dict.get("wall_time_s", 0.0))
