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
    register_dataset(name, spec, lambda request: (tensor_dataset(x_train, y_train), tensor_dataset(x_test, y_test)))
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
        on_divergence="stop", federation_kw=None, trainer_class=L.Trainer, **trainer_kw) -> L.Trainer:
    """A short federated fit on CPU; pass a ModelCheckpoint in `callbacks` (checkpointing is then
    switched on) and `ckpt_path` to resume; `federation_kw` goes to the FederatedCallback;
    `trainer_class` e.g. the CLI's FLTrainer (gradient clipping)."""
    federation = FederatedCallback(eval_local_models=eval_local_models, on_divergence=on_divergence,
                                   **(federation_kw or {}))
    kw = dict(
        max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[federation, *callbacks],
    )
    kw.update(trainer_kw)
    trainer = trainer_class(**kw)
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


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


def four_clients() -> FederatedDataModule:
    """40 toy samples over 4 clients, half of them sampled per round, 2 local epochs of batch 5."""
    x, y = toy_data(n=40, size=4, num_classes=3)
    return one_client_module(x, y, num_clients=4, sample_ratio=0.5, batch_size=5, local_epochs=2)


def straight_and_resumed(build, tmp_path, rounds: int = 4, interrupt_after: int = 2):
    """`build(seed)` -> (method, datamodule). Trains one instance for `rounds` rounds straight, and
    another for `interrupt_after` rounds, resumed from its last checkpoint into a third instance
    built with a different seed (so everything must come from the checkpoint). Returns the
    straight, the interrupted and the resumed methods."""
    straight, dm = build(0)
    fit(straight, dm, rounds=rounds)
    first, dm = build(0)
    fit(first, dm, rounds=interrupt_after,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_epochs=1)])
    resumed, dm = build(123)
    fit(resumed, dm, rounds=rounds, ckpt_path=str(tmp_path / "last.ckpt"),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "again", save_last=True, save_top_k=0)])
    return straight, first, resumed


def assert_same_run(straight, resumed) -> None:
    """The same global model and the same per-client states, bit for bit."""
    assert_same_tensors(resumed.model.state_dict(), straight.model.state_dict())
    assert resumed.client_states.keys() == straight.client_states.keys()
    for client in straight.client_states:
        assert_same_tensors(resumed.client_states[client], straight.client_states[client])


def learnable_shard_module(n_train=200, n_test=100, classes=4, clients=4, **kw) -> FederatedDataModule:
    """Class-dependent means (learnable in a few steps), one shard per client, and per-client test
    sets sharded with the training classes."""
    g = torch.Generator().manual_seed(0)
    y_train, y_test = torch.arange(n_train) % classes, torch.arange(n_test) % classes
    x_train = torch.randn(n_train, 1, 4, 4, generator=g) + y_train.view(-1, 1, 1, 1).float()
    x_test = torch.randn(n_test, 1, 4, 4, generator=g) + y_test.view(-1, 1, 1, 1).float()
    name = register_tensors(x_train, y_train, x_test, y_test, num_classes=classes)
    args = dict(dataset=name, num_clients=clients, sample_ratio=1.0, local_epochs=1, batch_size=25,
                partition="shard", shards_per_client=1, client_test="partition")
    args.update(kw)
    return FederatedDataModule(**args)


def reproducible_rows(rows: list[dict]) -> list[dict]:
    """metrics.csv rows without perf/* (a run's own clock: the only columns that differ between
    a run and its exact repetition)."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def server_round(method, uploads):
    """The method's server step on `uploads` (a list or RoundUploads), applied as the round
    callback applies it; the step itself must change nothing (the contract: it returns its
    result), which this checks on the module's state_dict."""
    from fl_lightning.uploads import RoundUploads

    before = {k: v.detach().clone() for k, v in method.state_dict().items()}
    update = method.server_step(uploads if isinstance(uploads, RoundUploads) else RoundUploads(uploads))
    after = method.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), f"server_step changed {key}"
    method.apply_server_update(update)
    return update
