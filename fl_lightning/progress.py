"""Terminal progress that speaks in rounds: a bar per round on a terminal, and only the one-line
round summaries (printed by the federated callback) when output goes to a file or CI log, where
a redrawn bar would write thousands of lines.

On a terminal the round's lines (`round 3/20: global test acc ...`, an analysis's numbers) go
above the bar, not into it: while the bar is up, Lightning's log handler writes through tqdm's
external write mode, which clears the bar, writes the line and redraws the bar. The round's
evaluation (one pass over the global test set) has no bar of its own during fit: a second bar
that appears and vanishes every round only garbles the first."""

from __future__ import annotations

import logging
import os
import shutil
import sys

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
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


class RoundProgressBar(TQDMProgressBar):
    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        # the bars are drawn on stdout (Lightning's choice), the round lines logged to stderr: a bar
        # only where both are the terminal (not into a file that stdout was redirected to)
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            self.disable()
        self._wrapped: list[tuple[logging.StreamHandler, object]] = []

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        if _reported_width(sys.stdout) <= 0:
            # A pseudo-terminal that reports a 0 x 0 size (`script`, some CI and job runners): tqdm
            # would fit the bar into 0 columns and 0 rows and draw nothing. Use the usual fallback.
            bar.dynamic_ncols = None
            bar.ncols, bar.nrows = shutil.get_terminal_size()
        return bar

    def init_validation_tqdm(self):
        if self.trainer.state.fn == "fit":
            return Tqdm(disable=True)  # the round's evaluation: its line says what it found
        return super().init_validation_tqdm()

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the W&B run id: not progress
        return metrics

    def on_train_start(self, trainer, *args) -> None:
        super().on_train_start(trainer, *args)
        if self.is_enabled and not self._wrapped:
            for handler in logging.getLogger(LOG_NAME).handlers:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, _AboveTheBars):
                    self._wrapped.append((handler, handler.stream))
                    handler.setStream(_AboveTheBars(handler.stream, sys.stdout))

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}")

    def _unwrap(self) -> None:
        for handler, stream in self._wrapped:
            handler.setStream(stream)
        self._wrapped = []

    def on_train_end(self, *args) -> None:
        super().on_train_end(*args)
        self._unwrap()

    def on_exception(self, *args) -> None:
        self._unwrap()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._unwrap()
