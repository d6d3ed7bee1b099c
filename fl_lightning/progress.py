"""Terminal progress that speaks in rounds: a bar per round on a terminal, and only the one-line
round summaries (printed by the federated callback) when output goes to a file or CI log, where
a redrawn bar would write thousands of lines."""

from __future__ import annotations

import os
import shutil
import sys

from lightning.pytorch.callbacks import TQDMProgressBar


def _reported_width(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class RoundProgressBar(TQDMProgressBar):
    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        if not sys.stderr.isatty():
            self.disable()

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        if _reported_width(sys.stdout) <= 0:
            # A pseudo-terminal that reports a 0 x 0 size (`script`, some CI and job runners): tqdm
            # would fit the bar into 0 columns and 0 rows and draw nothing. Use the usual fallback.
            bar.dynamic_ncols = None
            bar.ncols, bar.nrows = shutil.get_terminal_size()
        return bar

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the W&B run id: not progress
        return metrics

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}")
