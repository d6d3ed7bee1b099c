"""Shared helpers for tests: tiny in-memory datasets and short federated fits.

Methods are tested through a real `Trainer.fit` (manual optimization needs a trainer for
`optimizers()`, `manual_backward` and `log`); with one client holding B samples, batch size B and
one local epoch, a one-round fit is exactly one local step followed by aggregation of a single
upload, so the global model after the fit equals the client's model after one step.
"""

from __future__ import annotations

import itertools

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.data.datasets import DataSpec, register_dataset, tensor_dataset
from fl_lightning.federation import FederatedCallback

_counter = itertools.count()


def register_tensors(x_train, y_train, x_test=None, y_test=None, num_classes=None) -> str:
    """Registers an in-memory dataset and returns its name."""
    x_test = x_train if x_test is None else x_test
    y_test = y_train if y_test is None else y_test
    name = f"toy{next(_counter)}"
    spec = DataSpec(int(num_classes or int(y_train.max()) + 1), x_train.shape[1], x_train.shape[-1])
    register_dataset(name, spec, lambda seed: (tensor_dataset(x_train, y_train), tensor_dataset(x_test, y_test)))
    return name


def toy_data(n=12, channels=1, size=8, num_classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, size, size, generator=g)
    y = torch.arange(n) % num_classes
    return x, y


def one_client_module(x, y, num_classes=None, **kw) -> FederatedDataModule:
    """One client owning all of (x, y); with batch_size=len(y) and one local epoch a round is one step."""
    name = register_tensors(x, y, num_classes=num_classes)
    args = dict(dataset=name, num_clients=1, sample_ratio=1.0, local_epochs=1, batch_size=len(y),
                partition="iid", min_size=1)
    args.update(kw)
    return FederatedDataModule(**args)


def fixed_parts_module(x, y, parts, num_classes=None, **kw) -> FederatedDataModule:
    """Clients owning exactly the given index lists of (x, y) (e.g. of different sizes, so that
    they take different numbers of local steps)."""
    name = register_tensors(x, y, num_classes=num_classes)
    args = dict(dataset=name, num_clients=len(parts), sample_ratio=1.0, local_epochs=1, batch_size=len(y),
                partition="iid", min_size=1)
    args.update(kw)
    dm = FederatedDataModule(**args)
    dm.setup()
    dm.client_parts = [np.asarray(p, dtype=np.int64) for p in parts]
    return dm


def fit(method, datamodule, rounds: int = 1, callbacks=(), eval_local_models=False, ckpt_path=None,
        on_divergence="stop", federation_kw=None, **trainer_kw) -> L.Trainer:
    """A short federated fit on CPU; pass a ModelCheckpoint in `callbacks` (checkpointing is then
    switched on) and `ckpt_path` to resume; `federation_kw` goes to the FederatedCallback."""
    federation = FederatedCallback(eval_local_models=eval_local_models, on_divergence=on_divergence,
                                   **(federation_kw or {}))
    kw = dict(
        max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[federation, *callbacks],
    )
    kw.update(trainer_kw)
    trainer = L.Trainer(**kw)
    trainer.fit(method, datamodule, ckpt_path=ckpt_path)
    return trainer


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def tiny_spec(x, num_classes) -> DataSpec:
    return DataSpec(num_classes, x.shape[1], x.shape[-1])


def reference_sgd(w0: dict[str, torch.Tensor], grad_fn, steps: int, lr: float, momentum: float,
                  weight_decay: float) -> dict[str, torch.Tensor]:
    """`steps` steps of torch's SGD (heavy ball from a zero buffer, coupled weight decay) written
    out by hand; `grad_fn(w)` returns the method's gradient at the leaf tensors `w` (a dict)."""
    w = {k: v.detach().clone() for k, v in w0.items()}
    buf: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        leaves = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        grads = grad_fn(leaves)
        for k in w:
            d = grads[k].detach() + weight_decay * w[k]
            buf[k] = d if k not in buf else momentum * buf[k] + d
            w[k] = w[k] - lr * buf[k]
    return w
