"""Whole-round time of fl-lightning against a minimal hand-written PyTorch loop doing the same math.

Setting: configs/settings/mnist5k.yaml (MNIST-5k, 50 clients, Dirichlet 0.1, 20% per round, 5 local
epochs, batch 50, FedAvg CNN, SGD 0.01/0.9/1e-5) with the global model evaluated on the 1,000 test
digits every round, local-model evaluation off. Both sides see the same clients and the same
batches in the same order, so besides time the script prints how far apart the two final global
models are (a check that the project does the reference math).

    python benchmarks/round_time.py [--rounds 4] [--methods fedavg fedsol_head fedsol_all]

Prints per-round medians (the first round is dropped as warm-up), project/reference ratios and
FedSOL/FedAvg ratios, all measured in this one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from fl_lightning.data.datamodule import FederatedDataModule, sample_clients
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg, FedSOL
from fl_lightning.models import build_model

SETTING = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
               partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)
OPT = dict(lr=0.01, momentum=0.9, weight_decay=1e-5)
METHODS = {"fedavg": None, "fedsol_head": "head", "fedsol_all": "all"}


class RoundTimer(L.Callback):
    def __init__(self):
        self.times, self._start = [], 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        self.times.append(time.perf_counter() - self._start)


def run_project(method: str, rounds: int):
    torch.manual_seed(0)
    dm = FederatedDataModule(**SETTING)
    perturb = METHODS[method]
    model = (FedAvg(data_spec=dm.spec, **OPT) if perturb is None
             else FedSOL(rho=2.0, perturb=perturb, adaptive="layer", data_spec=dm.spec, **OPT))
    init = {k: v.clone() for k, v in model.model.state_dict().items()}
    timer = RoundTimer()
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[FederatedCallback(eval_local_models=False), timer])
    trainer.fit(model, dm)
    return timer.times, init, model.model.state_dict()


def run_reference(method: str, rounds: int, init: dict):
    """FedAvg / FedSOL in plain PyTorch: in-place perturbation with save-and-restore by copy."""
    dm = FederatedDataModule(**SETTING)
    dm.setup()
    x_train = torch.stack([dm.train_set[i][0] for i in range(len(dm.train_set))])
    y_train = torch.as_tensor(dm.train_set.labels)
    x_test = torch.stack([dm.test_set[i][0] for i in range(len(dm.test_set))])
    y_test = torch.as_tensor(dm.test_set.labels)
    model = build_model("fedavg_cnn", dm.spec)
    model.load_state_dict(init)
    teacher = build_model("fedavg_cnn", dm.spec).requires_grad_(False).eval()
    perturb = METHODS[method]
    lr, times = OPT["lr"], []
    for r in range(rounds):
        start = time.perf_counter()
        global_w = {k: v.clone() for k, v in model.state_dict().items()}
        teacher.load_state_dict(global_w)
        uploads, sizes = [], []
        for c in sample_clients(50, 0.2, 0, r):
            model.load_state_dict(global_w)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=OPT["momentum"],
                                  weight_decay=OPT["weight_decay"])
            idx_all, step = dm.client_parts[c], 0
            for e in range(5):
                order = np.random.default_rng([0, r, c, e]).permutation(idx_all)
                for s in range(0, len(order), 50):
                    idx = torch.as_tensor(order[s : s + 50])
                    xb, yb = x_train[idx], y_train[idx]
                    opt.zero_grad()
                    if perturb is None or step == 0:
                        F.cross_entropy(model(xb), yb).backward()
                    else:
                        names = [n for n, _ in model.named_parameters() if perturb == "all" or n.startswith("head.")]
                        ps = dict(model.named_parameters())
                        with torch.no_grad():
                            zg = teacher(xb)
                        z = model(xb)
                        prox = F.kl_div(F.log_softmax(z / 3, 1), F.softmax(zg / 3, 1), reduction="batchmean")
                        gp = torch.autograd.grad(prox, [ps[n] for n in names])
                        gnorm = torch.sqrt(sum((g**2).sum() for g in gp))
                        saved = {}
                        with torch.no_grad():
                            for n, g in zip(names, gp, strict=True):
                                d = (ps[n] - global_w[n]).abs()
                                saved[n] = ps[n].detach().clone()
                                ps[n].add_(2.0 * d / d.norm().clamp_min(1e-30) * g / (gnorm + 1e-12))
                        F.cross_entropy(model(xb), yb).backward()
                        with torch.no_grad():
                            for n in names:
                                ps[n].copy_(saved[n])
                    opt.step()
                    step += 1
            uploads.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(len(idx_all))
        total = sum(sizes)
        model.load_state_dict({k: sum(u[k] * (n / total) for u, n in zip(uploads, sizes, strict=True))
                               for k in global_w})
        lr *= 0.99
        with torch.no_grad():
            (model(x_test).argmax(1) == y_test).float().mean()
        times.append(time.perf_counter() - start)
    return times, model.state_dict()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}, rounds: {args.rounds} (first dropped)")
    medians = {}
    for method in args.methods:
        project_times, init, project_final = run_project(method, args.rounds)
        reference_times, reference_final = run_reference(method, args.rounds, init)
        p = statistics.median(project_times[1:] or project_times)
        q = statistics.median(reference_times[1:] or reference_times)
        diff = max(float((project_final[k] - reference_final[k]).abs().max()) for k in project_final)
        medians[method] = (p, q)
        print(f"{method:12s} project {p:6.2f} s/round  reference {q:6.2f} s/round  "
              f"project/reference {p / q:5.2f}  max |w_project - w_reference| {diff:.2e}")
    if "fedavg" in medians:
        for method, (p, q) in medians.items():
            if method != "fedavg":
                print(f"{method} / fedavg: project {p / medians['fedavg'][0]:.2f}, "
                      f"reference {q / medians['fedavg'][1]:.2f}")


if __name__ == "__main__":
    main()
