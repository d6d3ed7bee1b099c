"""Terminal progress that speaks in rounds: a bar per round on a terminal, and only the one-line
round summaries (printed by the federated callback) when output goes to a file or CI log, where
a redrawn bar would write thousands of lines.

On a terminal the round's lines (`round 3/20: global test acc ...`, an analysis's numbers) go
above the bar, not into it: while the bar is up, Lightning's log handler writes through tqdm's
external write mode, which clears the bar, writes the line and redraws the bar. The round's
evaluation (one pass over the global test set) has no bar of its own during fit: a second bar
that appears and vanishes every round only garbles the first."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import weakref

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf
from lightning.pytorch.utilities import rank_zero_info
from tqdm import tqdm

LOG_NAME = "lightning.pytorch"  # the logger Lightning's rank_zero_info lines (and so the round lines) go to


def _reported_width(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class _AboveTheBars:
    """A log handler's stream that writes each line above the progress bars drawn on `bars`."""

    def __init__(self, stream, bars):
        self.stream, self.bars = stream, bars

    def write(self, text: str) -> int:
        with tqdm.external_write_mode(file=self.bars):
            written = self.stream.write(text)
            self.stream.flush()
        return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def on_terminal() -> bool:
    """Bars are drawn on stdout (Lightning's choice) and lines logged to stderr: a bar only where
    both are the terminal (not into a file that stdout was redirected to)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def _size() -> dict:
    """tqdm's size options: follow the terminal's size, or, on a pseudo-terminal that reports a
    0 x 0 size (`script`, some CI and job runners), where tqdm would fit a bar into 0 columns and
    0 rows and draw nothing, the usual fallback size."""
    if _reported_width(sys.stdout) > 0:
        return {"dynamic_ncols": True}
    columns, rows = shutil.get_terminal_size()
    return {"dynamic_ncols": False, "ncols": columns, "nrows": rows}


# The bars this process has open: closed (`close_bars`) before an `error:` line is printed, so that
# the line starts a line of its own, not the bar's (`...test_acc=0.100]^Cerror: interrupted ...`).
_open_bars: weakref.WeakSet = weakref.WeakSet()


def close_bars() -> None:
    for bar in list(_open_bars):
        bar.close()  # a bar that is not left clears its line; the cursor is at its start
    _open_bars.clear()


class RoundProgressBar(TQDMProgressBar):
    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        if not on_terminal():
            self.disable()
        self._wrapped: list[tuple[logging.StreamHandler, object]] = []

    def _round(self) -> str:
        return f"Round {self.trainer.current_epoch + 1}/{self.trainer.max_epochs}"

    def init_train_tqdm(self):
        # Drawn first with its round and its total: Lightning's bar is drawn as `Training: 0/?` and
        # then `Epoch 0:` before it has either. Not left on the screen when the fit ends: the round
        # lines above it are the record, and the run's last line follows them.
        bar = Tqdm(desc=self._round(), total=convert_inf(self.total_train_batches), position=2 * self.process_position,
                   disable=self.is_disabled, leave=False, file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT,
                   **_size())
        _open_bars.add(bar)
        return bar

    def init_validation_tqdm(self):
        if self.trainer.state.fn == "fit":
            return Tqdm(disable=True)  # the round's evaluation: its line says what it found
        bar = super().init_validation_tqdm()
        _open_bars.add(bar)
        return bar

    def init_test_tqdm(self):
        bar = super().init_test_tqdm()
        _open_bars.add(bar)
        return bar

    def get_metrics(self, trainer, pl_module):
        # Lightning's adds only `v_num`, the W&B run's id: not progress, and asking the logger for it
        # would make the round wait for the W&B run's start (which runs beside it)
        return dict(trainer.progress_bar_metrics)

    def on_train_start(self, trainer, *args) -> None:
        super().on_train_start(trainer, *args)
        if self.is_enabled and not self._wrapped:
            for handler in logging.getLogger(LOG_NAME).handlers:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, _AboveTheBars):
                    self._wrapped.append((handler, handler.stream))
                    handler.setStream(_AboveTheBars(handler.stream, sys.stdout))

    def on_train_epoch_start(self, trainer, *args) -> None:
        # Lightning's would draw the bar once under the previous round's name and once as `Epoch N`
        bar = self.train_progress_bar
        bar.set_description(self._round(), refresh=False)
        bar.reset(total=convert_inf(self.total_train_batches))
        bar.initial = 0

    def _unwrap(self) -> None:
        for handler, stream in self._wrapped:
            handler.setStream(stream)
        self._wrapped = []

    def on_train_end(self, *args) -> None:
        super().on_train_end(*args)
        self._unwrap()

    def on_exception(self, *args) -> None:
        close_bars()  # the run's `error:` line follows
        self._unwrap()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._unwrap()


class StageBars:
    """Progress of a long computation in stages (`fl-lightning analyze`): on a terminal a bar per
    stage, removed when the stage ends; elsewhere one line as each stage starts, so that a file or
    CI log gets a few lines, not a redrawn bar.

    `stage(name, total, unit)` is a context manager yielding `advance(n=1)`; `bound=True` says that
    `total` is a budget the stage may stop short of (Lanczos stops once its eigenvalues converged)."""

    UNITS = {"hvp": "Hessian-vector products", "pt": "points"}

    def __init__(self, label: str, bars: bool | None = None):
        self.label = label
        self.bars = on_terminal() if bars is None else bars

    @contextlib.contextmanager
    def stage(self, name: str, total: int, unit: str, bound: bool = False):
        if not self.bars:
            rank_zero_info(f"{self.label}: {name}, {'up to ' if bound else ''}{total} {self.UNITS.get(unit, unit)}")
            yield _ignore
            return
        bar = tqdm(total=total, desc=f"{self.label}: {name}", unit=unit, leave=False, file=sys.stdout, smoothing=0,
                   **_size())
        _open_bars.add(bar)
        try:
            yield bar.update
        finally:
            bar.close()
            _open_bars.discard(bar)


def _ignore(n: int = 1) -> None:
    return None
