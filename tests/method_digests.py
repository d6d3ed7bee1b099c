"""Every method's final state after a tiny 2-round run, summarised per tensor (its float64 sum and
8 evenly spaced values), so that a change to the core that moves any method's numbers fails
(tests/test_method_digests.py). Values, not hashes: the same code on another CPU may round a
matrix product differently in the last bit, which a hash could not tell from a real change.

`tests/data/method_digests.json` was made with the v3 core, whose results are those of the core
before it to the bit (checked method by method when it was rebuilt), on 1 torch thread:

    .venv/bin/python tests/method_digests.py tests/data/method_digests.json
"""

from __future__ import annotations

import inspect
import json
import sys

import lightning as L
import torch

from fl_lightning import methods
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods.base import FederatedMethod

DATA = dict(dataset="digits", num_clients=6, sample_ratio=0.5, local_epochs=1, batch_size=32,
            partition="dirichlet", alpha=0.5, min_size=10, seed=0, partition_seed=0)


def method_names() -> list[str]:
    return sorted(n for n in methods.__all__ if inspect.isclass(c := getattr(methods, n))
                  and issubclass(c, FederatedMethod) and not inspect.isabstract(c))


def build(name: str, client_test_fraction: float | None = None):
    """The method and its data module; `client_test_fraction` gives every client a test split
    (model-heterogeneous methods always have one)."""
    cls = getattr(methods, name)
    hetero = issubclass(cls, methods.HeteroMethod)
    data = {**DATA, "client_test_fraction": 0.25} if hetero else dict(DATA)
    if client_test_fraction is not None:
        data["client_test_fraction"] = client_test_fraction
    kw = dict(model="mlp,fedavg_cnn", feature_dim=8) if hetero else dict(model="mlp", momentum=0.9, weight_decay=1e-4)
    if name in ("FML", "FedKD"):
        kw["shared_model"] = "mlp"
    if name == "FedRep":
        kw.update(head_epochs=1, body_epochs=1)
        data["local_epochs"] = 2
    if name == "FedBN":
        kw["model"] = "mlp_bn"
    dm = FederatedDataModule(**data)
    return cls(data_spec=dm.spec, lr=0.05, **kw), dm


def digest(name: str) -> dict[str, list[float]]:
    torch.manual_seed(0)
    method, dm = build(name)
    trainer = L.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(eval_local_models=True, local_eval_samples=100)])
    trainer.fit(method, dm)
    tensors = {f"module.{k}": v for k, v in method.state_dict().items()}
    for client in method.client_states:
        tensors.update({f"client{client}.{k}": v for k, v in method.client_states[client].items()})
    out = {}
    for key in sorted(tensors):
        flat = tensors[key].detach().cpu().double().reshape(-1)
        picks = torch.linspace(0, max(flat.numel() - 1, 0), min(8, flat.numel())).long()
        out[key] = [float(flat.sum()), *flat[picks].tolist()]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = {name: digest(name) for name in method_names()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
