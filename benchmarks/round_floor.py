"""The fixed per-round costs any Lightning-based implementation with fl-lightning's defaults pays,
each measured alone (CPU ms, one thread, medians), against which benchmarks/core_overhead.py's
(i) ratio is read: an empty Lightning round (10 batches, the training DataLoader
rebuilt every round, a 2-batch validation loop whose DataLoader is kept, as the project does; and
rebuilt too, Lightning's way with `reload_dataloaders_every_n_epochs=1`), a W&B offline history
row of 40 scalars, the clients table of 10 rounds of 10 clients that every 10th row also carries,
and serialising the `mlp` model's checkpoint. Their sum, over the plain loop's round in (i), is
the floor of that ratio's median with every default on.

    PYTHONPATH=. python benchmarks/round_floor.py
"""

from __future__ import annotations

import io
import logging
import os
import statistics
import tempfile
import time
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader

from fl_lightning import compat
from fl_lightning.data.datasets import DataSpec
from fl_lightning.models import build_model


class EmptyRounds(L.LightningModule):
    """Manual optimization, a step that does nothing: what Lightning's loops cost on their own."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return None

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(list(range(10)), batch_size=None)  # 10 clients a round

    def val_dataloader(self):
        return DataLoader(list(range(2)), batch_size=None)


class RoundStarts(L.Callback):
    def __init__(self, keep_validation_data: bool):
        self.starts: list[float] = []
        self.keep_validation_data = keep_validation_data

    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.process_time())
        if self.keep_validation_data:
            compat.keep_validation_data(trainer)


def empty_lightning_round(keep_validation_data: bool, rounds: int = 40) -> float:
    clock = RoundStarts(keep_validation_data)
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[clock])
    trainer.fit(EmptyRounds())
    return statistics.median(b - a for a, b in zip(clock.starts[5:], clock.starts[6:], strict=False))


def wandb_rows(rounds: int = 30) -> tuple[float, float]:
    """A row of 40 scalars; one that also carries the clients table of 10 rounds of 10 clients."""
    os.environ["WANDB_MODE"], os.environ["WANDB_SILENT"] = "offline", "true"
    import wandb

    columns = ["round", "client", "samples", "local_acc", "local_loss", "drift", "train_loss", "skipped"]
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        run = wandb.init(dir=tmp, project="round-floor")
        run.define_metric("round")
        run.define_metric("*", step_metric="round")
        for r in range(1, rounds + 1):
            for table in (False, True):
                row = {f"group/metric_{i}": float(r + i) for i in range(40)}
                if table:
                    row["clients/table"] = wandb.Table(columns=columns, data=[[r - k, c, 80, 0.5, 1.0, 0.1, 0.9, 0]
                                                                              for k in range(10) for c in range(10)])
                started = time.process_time()
                run.log(row)
                times[table].append(time.process_time() - started)
        run.finish()
    return statistics.median(times[False][3:]), statistics.median(times[True][3:])


def checkpoint_bytes(repeats: int = 40) -> float:
    model = build_model("mlp", DataSpec(10, 1, 28))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    times = []
    for _ in range(repeats):
        started = time.process_time()
        torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO())
        times.append(time.process_time() - started)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    kept, reloaded = empty_lightning_round(True), empty_lightning_round(False)
    scalars, with_table = wandb_rows()
    save = checkpoint_bytes()
    print(f"empty Lightning round (10 batches, 2-batch validation): {1e3 * kept:.2f} ms with the validation "
          f"DataLoader kept (the project), {1e3 * reloaded:.2f} ms with it rebuilt every round")
    print(f"W&B offline row, 40 scalars: {1e3 * scalars:.2f} ms; every 10th with the clients table of 10 "
          f"rounds: {1e3 * with_table:.2f} ms ({1e3 * (with_table - scalars) / 10:.2f} ms a round on average)")
    print(f"checkpoint serialisation (mlp + SGD state): {1e3 * save:.2f} ms")
    print(f"sum: {1e3 * (kept + scalars + save):.1f} ms a (median) round (add the local models' forward passes); "
          f"divide by the plain round of core_overhead.py (i) for the floor of its ratio")


if __name__ == "__main__":
    main()
