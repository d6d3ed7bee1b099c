"""Bytes a round's checkpoint writes with the client-state store, against the old checkpoint that
held every client's model: FedORGP on 20 HMG3 clients (4-layer CNN, GoogLeNet, MobileNetV2) at
20% participation, MNIST-5k resized to 3x32x32, one local epoch.

    PYTHONPATH=. python benchmarks/checkpoint_bytes.py [--rounds 3]

Per round it prints the checkpoint file's size plus the client-model files the store wrote, and
the size the old format would have had (the checkpoint plus every client's model state). The
first round writes every model once (nothing is on disk yet); after that only the clients that
trained. The target: <= 30% of the old checkpoint per round.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedORGP


class Sizes(L.Callback):
    def __init__(self, ckpt: Path):
        self.ckpt, self.rows, self._mark = ckpt, [], 0

    def on_train_epoch_start(self, trainer, pl_module):
        self._record(pl_module)

    def on_train_end(self, trainer, pl_module):
        self._record(pl_module)

    def _record(self, pl_module):
        written = pl_module.client_model_states.bytes_written
        if self.ckpt.exists() and written:
            models = sum(t.numel() * t.element_size() for m in pl_module.client_models
                         for t in m.state_dict().values())
            size = self.ckpt.stat().st_size
            self.rows.append((size + written - self._mark, size + models))
        self._mark = written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    dm = FederatedDataModule(dataset="mnist5k", num_clients=20, sample_ratio=0.2, local_epochs=1, batch_size=50,
                             partition="dirichlet", alpha=0.1, client_test_fraction=0.25, resize=32, to_rgb=True)
    method = FedORGP(model="HMG3", feature_dim=512, server_epochs=1, data_spec=dm.spec)
    with tempfile.TemporaryDirectory() as root:
        ckpt_dir = Path(root) / "checkpoints"
        sizes = Sizes(ckpt_dir / "last.ckpt")
        trainer = L.Trainer(max_epochs=args.rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu", devices=1, default_root_dir=root,
                            callbacks=[FederatedCallback(eval_local_models=False), sizes,
                                       ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1)])
        trainer.fit(method, dm)
    for r, (new, old) in enumerate(sizes.rows, start=1):
        print(f"round {r}: written {new / 2**20:7.1f} MiB, old full checkpoint {old / 2**20:7.1f} MiB, "
              f"ratio {new / old:.2f}")
    later = sizes.rows[1:]
    if later:
        print(f"rounds 2+: {sum(n for n, _ in later) / sum(o for _, o in later):.2f} of the old checkpoint "
              f"(target <= 0.30)")


if __name__ == "__main__":
    main()
