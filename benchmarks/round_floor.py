"""The fixed per-round costs any Lightning-based implementation with fl-lightning's defaults pays,
each measured alone (CPU ms, one thread, medians), against which benchmarks/core_overhead.py's
(i) ratio is read (issue 22): an empty Lightning round (10 batches, dataloaders reloaded, a 2-batch
validation loop), a W&B offline history row of 40 scalars, the same with a 10-row `wandb.Table`
(the per-round clients table), and serialising the `mlp` model's checkpoint. Their sum, over the
plain loop's round in (i), is the floor of that ratio with every default on.

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
    def __init__(self):
        self.starts: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.process_time())


def empty_lightning_round(rounds: int = 40) -> float:
    clock = RoundStarts()
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[clock])
    trainer.fit(EmptyRounds())
    return statistics.median(b - a for a, b in zip(clock.starts[5:], clock.starts[6:], strict=False))


def wandb_rows(rounds: int = 30) -> tuple[float, float]:
    os.environ["WANDB_MODE"], os.environ["WANDB_SILENT"] = "offline", "true"
    import wandb

    columns = ["client", "samples", "local_acc", "local_loss", "drift", "train_loss", "skipped"]
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        run = wandb.init(dir=tmp, project="round-floor")
        run.define_metric("round")
        run.define_metric("*", step_metric="round")
        for r in range(1, rounds + 1):
            for table in (False, True):
                row = {f"group/metric_{i}": float(r + i) for i in range(40)}
                if table:
                    row["clients/table"] = wandb.Table(columns=columns, data=[[c, 80, 0.5, 1.0, 0.1, 0.9, 0]
                                                                              for c in range(10)])
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
    loops = empty_lightning_round()
    scalars, with_table = wandb_rows()
    save = checkpoint_bytes()
    print(f"empty Lightning round (10 batches, reload, 2-batch validation): {1e3 * loops:.2f} ms")
    print(f"W&B offline row, 40 scalars: {1e3 * scalars:.2f} ms; "
          f"with the 10-row clients table: {1e3 * with_table:.2f} ms")
    print(f"checkpoint serialisation (mlp + SGD state): {1e3 * save:.2f} ms")
    print(f"sum: {1e3 * (loops + with_table + save):.1f} ms a round (add the local models' forward passes); "
          f"divide by the plain round of core_overhead.py (i) for the floor of its ratio")


if __name__ == "__main__":
    main()
