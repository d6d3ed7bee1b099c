"""Tiny 3-round runs of FedAvg, FedSOL, SCAFFOLD and FedORGP whose final states pin the core's
behaviour with augmentation off (test_core_regression.py).

`tests/data/core_v1_reference.pt` was produced by running this file on an earlier core that took
one Trainer batch per local step from DataLoader batches (1 torch thread, as the tests):

    .venv/bin/python tests/core_reference.py tests/data/core_v1_reference.pt

except FedORGP's entry, produced by this file on the current core (client models drawn from the
run seed in a forked RNG, and each local epoch's incomplete last batch dropped, as the
heterogeneous methods' authors do):

    .venv/bin/python tests/core_reference.py tests/data/core_v1_reference.pt FedORGP

The new core (one Trainer batch per client, mini-batches sliced from tensors on the device) must
reproduce it. Only public behaviour is read: the global model's state_dict, SCAFFOLD's per-client
c_i and server c, FedORGP's global prototypes and every client's own model.
"""

from __future__ import annotations

import hashlib
import sys

import lightning as L
import torch

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import SCAFFOLD, FedAvg, FedORGP, FedSOL

ROUNDS = 3
DATA = dict(dataset="digits", num_clients=6, sample_ratio=0.5, local_epochs=2, batch_size=32,
            partition="dirichlet", alpha=0.5, min_size=10, seed=0, partition_seed=0)
OPT = dict(model="mlp", lr=0.05, momentum=0.9, weight_decay=1e-4)


def _cpu(tensors: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _fit(method, dm) -> L.Trainer:
    trainer = L.Trainer(max_epochs=ROUNDS, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(eval_local_models=False)])
    trainer.fit(method, dm)
    return trainer


def client_state(method, client: int) -> dict[str, torch.Tensor] | None:
    """SCAFFOLD's c_i of a client, wherever the core keeps it (the v3 core: the client-state store,
    under "c.")."""
    return method.client_state(client, "c.")


def client_model_state(method, client: int) -> dict[str, torch.Tensor]:
    return _cpu(method.client_models[client].state_dict())


def run(name: str) -> dict[str, torch.Tensor]:
    """Flat {key: tensor} of the run's final state."""
    torch.manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    if name == "FedORGP":
        dm = FederatedDataModule(**{**DATA, "client_test_fraction": 0.25})
        method = FedORGP(model="mlp,fedavg_cnn", feature_dim=8, lr=0.05, server_epochs=2, data_spec=dm.spec)
        trainer = _fit(method, dm)
        # the v3 core keeps server state in `method.server` (state_dict keys "server.*") and the
        # run's best accuracy in the round callback (once buffers best_acc, best_round 0-based)
        out.update({f"module.{k.removeprefix('server.')}": v for k, v in _cpu(method.state_dict()).items()})
        best = trainer.callbacks[0].best
        out["module.best_acc"] = torch.tensor(best.value, dtype=torch.float32)
        out["module.best_round"] = torch.tensor(best.round - 1)
        for c in range(DATA["num_clients"]):
            out.update({f"client{c}.{k}": v for k, v in client_model_state(method, c).items()})
        return out
    dm = FederatedDataModule(**DATA)
    if name == "FedAvg":
        method = FedAvg(data_spec=dm.spec, **OPT)
    elif name == "FedAvgReshaped":  # the resize/to_rgb path of the data module
        dm = FederatedDataModule(**{**DATA, "resize": 10, "to_rgb": True})
        method = FedAvg(data_spec=dm.spec, **OPT)
    elif name == "FedSOL":
        method = FedSOL(rho=1.0, data_spec=dm.spec, **OPT)
    elif name == "SCAFFOLD":
        method = SCAFFOLD(data_spec=dm.spec, **OPT)
    else:
        raise ValueError(name)
    _fit(method, dm)
    out.update({f"model.{k}": v for k, v in _cpu(method.model.state_dict()).items()})
    if name == "SCAFFOLD":
        out.update({f"server_c.{k}": v for k, v in _cpu(method.server["c"]).items()})
        for c in range(DATA["num_clients"]):
            state = client_state(method, c)
            if state is not None:
                out.update({f"client{c}.{k}": v for k, v in _cpu(state).items()})
    return out


RUNS = ("FedAvg", "FedAvgReshaped", "FedSOL", "SCAFFOLD", "FedORGP")
STORED_WHOLE = 10_000  # larger tensors are stored as a digest, to keep the reference file small


def digest(t: torch.Tensor) -> dict:
    """sha256 of the raw bytes (equal iff bit-identical), the float64 sum and 256 evenly spaced
    values (to tell how far apart two tensors are when they are not identical)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    positions = torch.linspace(0, flat.numel() - 1, 256).long()
    return {"sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "sum": float(flat.double().sum()), "positions": positions, "values": flat[positions].clone()}


def stored_form(state: dict[str, torch.Tensor]) -> dict:
    return {k: v if v.numel() <= STORED_WHOLE else digest(v) for k, v in state.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)  # as in tests/conftest.py: reductions are thread-count dependent
    names = sys.argv[2:] or list(RUNS)  # the named entries are (re)made, the others kept
    reference = torch.load(sys.argv[1], weights_only=True) if len(sys.argv) > 2 else {}
    reference.update({name: stored_form(run(name)) for name in names})
    torch.save(reference, sys.argv[1])
