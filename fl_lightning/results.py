"""Results that outlive the dashboard: `<run dir>/metrics.csv`, `<run dir>/clients.csv` and
`<run dir>/summary.json`.

`metrics.csv` has one row per completed round (`round` is 1-based, then every metric logged that
round), `clients.csv` one row per client of every completed round (`round`, then
`federation.CLIENT_COLUMNS`), and `summary.json` the run's outcome (see `Summary`): `outcome`, as
the round callback decided it or as the exception that ended the run says, is the one field
`report`, `sweep` and the CLI read (through `outcome.read_outcome`). They are written after every
round, before the round's checkpoint (metrics.csv and summary.json rewritten atomically,
clients.csv appended), so after a kill they hold at least the checkpointed rounds; a resumed run
drops any row past its checkpoint and writes the replayed rounds again, so a resumed run's files
equal an uninterrupted run's. A run whose checkpoint holds its last round, resumed, completes its
records and does nothing else.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.comparison import read_metrics  # noqa: F401 - the reader of what this module writes
from fl_lightning.federation import CLIENT_COLUMNS, federation_before, federation_of
from fl_lightning.loggers import FLWandbLogger, update_wandb_summary
from fl_lightning.outcome import Outcome, outcome_of_exception


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool | int | float):
        return float(value)
    return None


# The W&B run's clients table: every CLIENTS_TABLE_EVERY_N_ROUNDS rounds and when the run ends,
# holding the clients of the rounds since the previous one (clients.csv's rows, `round` first). A
# W&B table is an artifact of its own, with a fixed cost to build and write (benchmarks/round_floor.py
# measures it): one a round would be a share of a small model's round worth saving.
CLIENTS_TABLE_EVERY_N_ROUNDS = 10


def clients_table_to_wandb(trainer, rows: list[dict[str, float]], round_number: int | None = None) -> None:
    """Rows of clients.csv (each a round report's client row with its `round`) as the W&B table
    `clients/table`, in the history row of `round_number`; None: in the row being filled (the last
    round's, when the run ends), else in the last row's round."""
    targets = [lg for lg in trainer.loggers if isinstance(lg, FLWandbLogger)]
    if not targets or not rows:
        return
    import wandb

    data = [[r.get(k) for k in CLIENT_FILE_COLUMNS] for r in rows]
    for logger in targets:
        values: dict[str, Any] = {"clients/table": wandb.Table(columns=list(CLIENT_FILE_COLUMNS), data=data)}
        if round_number is not None or not logger.filling_round():
            values["round"] = float(round_number if round_number is not None else rows[-1]["round"])
        logger.add_to_round(values)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def _csv_text(columns: list[str], rows: list[dict[str, float]], header: bool = True) -> str:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    return text.getvalue()


CLIENT_FILE_COLUMNS = ["round", *CLIENT_COLUMNS]


class RoundRows:
    """metrics.csv's rows, one per completed round (`round`, then the round's metrics), kept so
    that a round costs the same at round 1,000 as at round 10. The CSV lines of earlier rows are
    kept rather than rendered again each round, and the checkpoint gets the rows as one float64
    matrix rather than a list of dicts: rendering every row and pickling the dicts each round
    would make a round's cost grow with the run's length (benchmarks/long_run.py). The file and
    the rows a resumed run reads back are the same, byte for byte."""

    def __init__(self, rows: list[dict[str, float]] = ()):
        self.rows: list[dict[str, float]] = []
        self.columns: list[str] = []  # the metrics any row has, sorted (what follows `round`)
        self._lines: list[str] = []  # the CSV lines of rows[:len(_lines)] under these columns
        self._values = torch.empty(0, 0, dtype=torch.float64)  # rows x columns; row i is rows[i]
        self._present = torch.empty(0, 0, dtype=torch.bool)  # an empty cell (not logged) vs a NaN
        self._rounds = torch.empty(0, dtype=torch.int64)  # one tensor: torch.save visits each item of a list
        for row in rows:
            self.put(row)

    def put(self, row: dict[str, float]) -> None:
        """The row of round row["round"]; rows of that round or later go (a replayed round)."""
        kept = len(self.rows)
        while kept and self.rows[kept - 1]["round"] >= row["round"]:
            kept -= 1
        del self.rows[kept:], self._lines[kept:]
        self.rows.append(row)
        start = kept
        new = row.keys() - {"round"} - set(self.columns)
        if new:  # the file gets a new column: every line changes, the matrix is filled again
            self.columns = sorted({*self.columns, *new})
            self._lines.clear()
            self._values = torch.empty(0, len(self.columns), dtype=torch.float64)
            self._present = torch.empty(0, len(self.columns), dtype=torch.bool)
            self._rounds = torch.empty(0, dtype=torch.int64)
            start = 0
        for i in range(start, len(self.rows)):
            if i == len(self._rounds):  # full: twice the room, so rows are copied O(1) times each
                more = (max(16, i), len(self.columns))
                self._values = torch.cat([self._values, torch.full(more, math.nan, dtype=torch.float64)])
                self._present = torch.cat([self._present, torch.zeros(more, dtype=torch.bool)])
                self._rounds = torch.cat([self._rounds, torch.zeros(more[0], dtype=torch.int64)])
            filled = self.rows[i]
            self._rounds[i] = filled["round"]
            self._values[i] = torch.tensor([filled.get(c, math.nan) for c in self.columns], dtype=torch.float64)
            self._present[i] = torch.tensor([c in filled for c in self.columns], dtype=torch.bool)

    def csv_text(self) -> str:
        columns = ["round", *self.columns]
        for row in self.rows[len(self._lines):]:
            self._lines.append(_csv_text(columns, [row], header=False))
        return _csv_text(columns, []) + "".join(self._lines)

    def state(self) -> dict[str, Any]:
        n = len(self.rows)
        return {"rounds": self._rounds[:n].clone(), "columns": list(self.columns),
                "values": self._values[:n].clone(), "present": self._present[:n].clone()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RoundRows:
        """What `state` saved; also the list of dicts that earlier versions saved (`rows`)."""
        if "rounds" not in state:
            return cls(state.get("rows", []))
        columns = state["columns"]
        rows = [{"round": rnd, **{c: v for c, v, here in zip(columns, values, present, strict=True) if here}}
                for rnd, values, present in zip(state["rounds"].tolist(), state["values"].tolist(),
                                                state["present"].tolist(), strict=True)]
        return cls(rows)


class ResultsCallback(L.Callback):
    """Writes metrics.csv, clients.csv and summary.json into the run directory (rank 0 only)."""

    def __init__(self, run_dir: str | Path):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.table = RoundRows()
        self.ended: Outcome | None = None  # an outcome an exception decided (signal, crash, lost)
        self.ended_reason = ""
        self._elapsed_before = 0.0  # wall time of the run's earlier processes (resume)
        self._started = time.monotonic()
        self._lock = threading.Lock()  # the CLI's process watchdog may record a lost process
        self._unsent_clients: list[dict[str, Any]] = []  # clients.csv rows the W&B run has not got yet

    @property
    def rows(self) -> list[dict[str, float]]:
        """metrics.csv's rows (read only: `table.put` adds one)."""
        return self.table.rows

    @rows.setter
    def rows(self, rows: list[dict[str, float]]) -> None:
        self.table = RoundRows(rows)

    # ---- per round -------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        federation_before(trainer, self)
        self._started = time.monotonic()
        if trainer.is_global_zero:
            self._truncate_clients_file(self.rows[-1]["round"] if self.rows else 0)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module) -> None:
        # Lightning only ever adds to `callback_metrics`, so a key logged in some rounds (the
        # class-wise heatmap's, the spectrum's) would stay there and repeat in every later row,
        # which the loggers never receive and a resumed process would not write. Emptying it at
        # the round's start leaves exactly this round's values (validation runs inside the round).
        trainer.callback_metrics.clear()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        report = federation_of(trainer).round_report
        if report.completed:
            row = {"round": report.round}
            for key, value in sorted(trainer.callback_metrics.items()):
                number = _number(value)
                if number is not None and key not in ("round", "epoch"):
                    row[key] = number
            with self._lock:
                self.table.put(row)
            if trainer.is_global_zero:
                rows = [{"round": report.round, **c} for c in report.clients]
                self._append_clients(rows)
                self._unsent_clients += rows
                if (report.round % CLIENTS_TABLE_EVERY_N_ROUNDS == 0 or report.round >= trainer.max_epochs
                        or trainer.should_stop):
                    self._send_clients_table(trainer, report.round)
        self.write(trainer, pl_module)

    def _send_clients_table(self, trainer, round_number: int | None = None) -> None:
        rows, self._unsent_clients = self._unsent_clients, []
        clients_table_to_wandb(trainer, rows, round_number)

    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        # also when the restored checkpoint holds the last round (nothing trains): the records
        # of a run killed after its last checkpoint are completed here
        self._send_clients_table(trainer)  # a run stopped by another callback (EarlyStopping)
        self.write(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        record = federation_of(trainer).record
        if record.outcome.final:
            return  # a signal (or any error) after the run's end changes nothing
        self.ended, self.ended_reason = outcome_of_exception(exception)
        self._send_clients_table(trainer)  # the clients the W&B run has not got yet (rank 0 collects them)
        try:
            self.write(trainer, pl_module)
        except OSError:
            pass  # the disk that refused the round's write refuses this one too; the CLI says so

    # ---- files -----------------------------------------------------------------------------
    def wall_time(self) -> float:
        return self._elapsed_before + time.monotonic() - self._started

    def summary(self, trainer: L.Trainer, pl_module) -> dict[str, Any]:
        federation = federation_of(trainer)
        record, best = federation.record, federation.best
        key = pl_module.accuracy_key
        final = next((r for r in reversed(self.rows) if key in r and math.isfinite(r[key])), None)
        outcome = self.ended or record.outcome
        reason = self.ended_reason if self.ended else record.reason
        rounds = self.rows[-1]["round"] if self.rows else 0
        return {
            "method": type(pl_module).__name__,
            "outcome": outcome.value,
            "reason": reason,
            "rounds_completed": rounds,
            "max_rounds": trainer.max_epochs,
            "finished": rounds >= trainer.max_epochs and outcome.final,
            "accuracy": key,
            "final_acc": final[key] if final else None,
            "final_round": final["round"] if final else None,
            "best_acc": best.value if best.round is not None else None,
            "best_round": best.round,
            "wall_time_s": round(self.wall_time(), 3),
            "diverged": outcome is Outcome.DIVERGED or Outcome.DIVERGED.value in record.marks,
            "failed": outcome is Outcome.FAILED or Outcome.FAILED.value in record.marks,
            "last": {k: v for k, v in (self.rows[-1] if self.rows else {}).items() if k != "round"},
        }

    def write(self, trainer: L.Trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        with self._lock:
            # Not forced to disk each round (durable=False): the round checkpoint, written after
            # these and forced to disk, holds their rows, and a resumed run rewrites them from it.
            atomic_write_bytes(self.run_dir / "metrics.csv", self.table.csv_text().encode(), durable=False)
            summary = self.summary(trainer, pl_module)
            atomic_write_bytes(self.run_dir / "summary.json", (json.dumps(summary, indent=1) + "\n").encode(),
                               durable=False)
        update_wandb_summary(trainer.loggers, summary)

    def record_lost(self, trainer: L.Trainer, pl_module, reason: str) -> None:
        """The CLI's watchdog found a process of the run dead: the summary says so before the
        process ends (called from another thread)."""
        self.ended, self.ended_reason = Outcome.LOST, reason
        self.write(trainer, pl_module)

    def _clients_path(self) -> Path:
        return self.run_dir / "clients.csv"

    def _append_clients(self, rows: list[dict[str, Any]]) -> None:
        """Appends a round's client rows (each with its `round`) to clients.csv."""
        path = self._clients_path()
        new = not path.exists()
        cells = [{k: r.get(k, "") for k in CLIENT_FILE_COLUMNS} for r in rows]
        with open(path, "a", newline="") as f:
            f.write(_csv_text(CLIENT_FILE_COLUMNS, cells, header=new))
            f.flush()
            os.fsync(f.fileno())

    def _truncate_clients_file(self, last_round: int) -> None:
        """A resumed run replays the rounds after its checkpoint: their rows go (and a row cut
        short by a kill), atomically."""
        path = self._clients_path()
        if not path.exists():
            return
        lines = path.read_text().splitlines(keepends=True)
        kept = [lines[0]] if lines and lines[0].startswith("round,") else []
        for line in lines[len(kept):]:
            head = line.split(",", 1)[0]
            if line.endswith("\n") and head.isdigit() and int(head) <= last_round:
                kept.append(line)
        if kept != lines:
            atomic_write_bytes(path, "".join(kept).encode())

    # ---- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**self.table.state(), "wall_time_s": self.wall_time()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.table = RoundRows.from_state(state_dict)
        self._elapsed_before = float(state_dict.get("wall_time_s", 0.0))
