"""Publishing a round's values: one function every part of a round uses (the round callback, the
methods' evaluation, the analyses), in a module of its own below all of them, so that a method
never imports the round driver (`federation.py`) to log."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fl_lightning import compat


def log_round_metrics(trainer, metrics: Mapping[str, float | torch.Tensor], mean_over_processes: bool = False,
                      progress_bar: tuple[str, ...] = ()) -> None:
    """Publishes a round's scalars, already aggregated over the round: into
    `trainer.callback_metrics` (what metrics.csv, the progress bar and monitoring callbacks read)
    and to every logger, in the round's row; the keys in `progress_bar` also on the progress bar.
    Lightning's `self.log` would aggregate each value over steps and processes first, a cost per
    key that a small model's round, with its 30-odd values, notices. With
    `mean_over_processes` every process contributes and the mean is published (one all_reduce);
    every process must then call it with the same keys. A tensor value keeps its dtype in
    `callback_metrics` unless averaged (the global evaluation's float32 accuracy and float64 loss)."""
    values = {k: float(v) for k, v in metrics.items()}
    if mean_over_processes and values:
        keys = sorted(values)
        mean = trainer.strategy.reduce(torch.tensor([values[k] for k in keys], dtype=torch.float64,
                                                    device=trainer.strategy.root_device), reduce_op="mean")
        values = dict(zip(keys, mean.cpu().tolist(), strict=True))
        metrics = values
    trainer.callback_metrics.update({k: v.detach().cpu() if torch.is_tensor(v) else torch.tensor(values[k])
                                     for k, v in metrics.items()})
    if progress_bar:
        compat.progress_bar_metrics(trainer).update({k: values[k] for k in progress_bar})
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({**values, "epoch": trainer.current_epoch}, step=trainer.global_step)
