"""What the core costs on top of the arithmetic: fl-lightning against a plain PyTorch loop doing
the same math on the same clients and the same batches, one thread, in one run.

The project side is what the CLI builds (a Trainer with the FederatedCallback; W&B, checkpoints,
the progress bar and local-model evaluation switched off, since they are optional extras). The
plain side loops over mini-batches sliced from the training tensors before its timer starts, so
it pays for nothing but the model's forward/backward/step, the per-client reset and upload copy,
the weighted average and the global evaluation. A round is timed from one round's start to the
next (so the project's between-round work, such as building the next round's loader, is
included); the time in clients runs from a client's start to its upload. Times are CPU time of
this process (on a shared machine wall time mostly measures the neighbours). Project and plain
runs alternate (`--repeats`), and every figure is a median over rounds (the first round of every
run is dropped as warm-up).

    PYTHONPATH=. python benchmarks/core_overhead.py [--repeats 3]

Regimes (issue 10's targets in brackets):
  (i)   overhead-bound: `mlp` on MNIST-5k, FedAvg, per local step (time in clients / steps) [<= 1.3x]
  (ii)  compute-bound: the FedAvg CNN on MNIST-5k, per round, FedAvg and FedSOL(head)   [<= 1.05x]
  (iii) fixed per-round cost: 1,000 clients, 10 per round, iid, `mlp`: project minus plain [<= 0.05 s]
Each line also prints max |w_project - w_plain| after the last round (the same math check).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg, FedSOL
from fl_lightning.models import build_model

OPT = dict(lr=0.01, momentum=0.9, weight_decay=1e-5)
MNIST = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
             partition="dirichlet", alpha=0.1, partition_seed=0, seed=0, eval_batch_size=500)
MANY = dict(MNIST, num_clients=1000, sample_ratio=0.01, local_epochs=1, partition="iid", min_size=1)


class RoundClock(L.Callback):
    """Start-to-start round times, and per round the time spent in clients: from before the
    federated callback starts a client (this callback comes first) to the end of its upload."""

    def __init__(self):
        self.starts: list[float] = []
        self.client_time: list[float] = []
        self._t0 = 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.process_time())
        self.client_time.append(0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.process_time()

    def watch(self, module) -> None:
        client_end = module.client_end

        def timed():
            upload = client_end()
            self.client_time[-1] += time.process_time() - self._t0
            return upload

        module.client_end = timed

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.process_time())

    @property
    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def project(setting: dict, model: str, method: str, rounds: int):
    torch.manual_seed(0)
    dm = FederatedDataModule(**setting)
    module = (FedAvg(model=model, data_spec=dm.spec, **OPT) if method == "fedavg"
              else FedSOL(model=model, rho=2.0, perturb="head", adaptive="layer", data_spec=dm.spec, **OPT))
    init = {k: v.clone() for k, v in module.model.state_dict().items()}
    clock = RoundClock()
    clock.watch(module)
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[clock, FederatedCallback(eval_local_models=False)])
    trainer.fit(module, dm)
    return clock.times, clock.client_time, init, module.model.state_dict()


def plain(setting: dict, model_name: str, method: str, rounds: int, init: dict):
    """The same rounds in plain PyTorch; FedSOL(head) with its perturbation by functional_call."""
    dm = FederatedDataModule(**setting)
    dm.setup()
    train, test = dm.train_set.tensors(), dm.test_set.tensors()
    model = build_model(model_name, dm.spec)
    model.load_state_dict(init)
    teacher = build_model(model_name, dm.spec).requires_grad_(False).eval()
    lr, times, client_times, steps = OPT["lr"], [], [], []
    h = dm.hparams
    for r in range(rounds):
        plan = dm.plan_round(r)  # the clients and batch indices the project's round uses
        clients = [w.client for w in plan.clients]
        batches = {w.client: [(train.images[b], train.labels[b]) for b in w.batches] for w in plan.clients}
        start = time.process_time()
        global_w = {k: v.clone() for k, v in model.state_dict().items()}
        teacher.load_state_dict(global_w)
        uploads, sizes, n_steps, in_clients = [], [], 0, 0.0
        for c in clients:
            client_start = time.process_time()
            model.load_state_dict(global_w)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=OPT["momentum"],
                                  weight_decay=OPT["weight_decay"])
            for step, (xb, yb) in enumerate(batches[c]):
                opt.zero_grad()
                if method == "fedavg" or step == 0:
                    F.cross_entropy(model(xb), yb).backward()
                else:
                    z = model.features(xb)
                    logits = model.head(z)
                    with torch.no_grad():
                        zg = teacher(xb)
                    prox = F.kl_div(F.log_softmax(logits / 3, 1), F.softmax(zg / 3, 1), reduction="batchmean")
                    head = dict(model.head.named_parameters())
                    gp = torch.autograd.grad(prox, list(head.values()), retain_graph=True)
                    gnorm = torch.sqrt(sum((g**2).sum() for g in gp))
                    perturbed = {}
                    for (n, p), g in zip(head.items(), gp, strict=True):
                        d = (p.detach() - global_w[f"head.{n}"]).abs()
                        perturbed[n] = p + 2.0 * d / d.norm().clamp_min(1e-30) * g / (gnorm + 1e-12)
                    out = torch.func.functional_call(model.head, perturbed, (z,))
                    F.cross_entropy(out, yb).backward()
                opt.step()
                n_steps += 1
            uploads.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(len(dm.client_parts[c]))
            in_clients += time.process_time() - client_start
        total = sum(sizes)
        model.load_state_dict({k: sum(u[k] * (n / total) for u, n in zip(uploads, sizes, strict=True))
                               for k in global_w})
        lr *= 0.99
        with torch.no_grad():
            for s in range(0, len(test), h.eval_batch_size):
                logits = model(test.images[s : s + h.eval_batch_size])
                F.cross_entropy(logits, test.labels[s : s + h.eval_batch_size])
                (logits.argmax(1) == test.labels[s : s + h.eval_batch_size]).float().mean()
        times.append(time.process_time() - start)
        client_times.append(in_clients)
        steps.append(n_steps)
    return times, client_times, steps, model.state_dict()


def compare(setting, model, method, rounds, repeats):
    """Medians of (project, plain) per round of: the whole round, the time in clients; the local
    steps per round; and max |w_project - w_plain|."""
    p_times, q_times, p_clients, q_clients, steps, diff = [], [], [], [], [], 0.0
    for _ in range(repeats):
        pt, pc, init, p_final = project(setting, model, method, rounds)
        qt, qc, qs, q_final = plain(setting, model, method, rounds, init)
        p_times, q_times = p_times + pt[1:], q_times + qt[1:]
        p_clients, q_clients, steps = p_clients + pc[1:], q_clients + qc[1:], steps + qs[1:]
        diff = max(diff, max(float((p_final[k] - q_final[k]).abs().max()) for k in p_final))
    med = statistics.median
    return (med(p_times), med(q_times)), (med(p_clients), med(q_clients)), med(steps), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run in (i) and (ii)")
    parser.add_argument("--many_rounds", type=int, default=15, help="rounds per run in (iii)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"torch threads: 1; {args.repeats} alternating runs per comparison; medians over rounds")

    (p, q), (pc, qc), steps, diff = compare(MNIST, "mlp", "fedavg", args.rounds, args.repeats)
    print(f"(i)   mlp, MNIST-5k, FedAvg, per local step (in clients: start, steps, upload): project "
          f"{1e3 * pc / steps:.3f} ms, plain {1e3 * qc / steps:.3f} ms ({steps:.0f} steps/round), ratio "
          f"{pc / qc:.2f} (target <= 1.3); whole round {1e3 * p:.1f} / {1e3 * q:.1f} ms = {p / q:.2f}x  "
          f"max|dw| {diff:.1e}")
    for method in ("fedavg", "fedsol"):
        (p, q), _, _, diff = compare(MNIST, "fedavg_cnn", method, args.rounds, args.repeats)
        print(f"(ii)  FedAvg CNN, MNIST-5k, {method}: project {p:.3f} s/round, plain {q:.3f} s/round, "
              f"ratio {p / q:.3f} (target <= 1.05)  max|dw| {diff:.1e}")
    (p, q), _, _, diff = compare(MANY, "mlp", "fedavg", args.many_rounds, args.repeats)
    print(f"(iii) 1,000 clients, 10 per round, mlp: project {1e3 * p:.1f} ms/round, plain {1e3 * q:.1f} "
          f"ms/round, fixed cost {p - q:.4f} s/round (target <= 0.05)  max|dw| {diff:.1e}")


if __name__ == "__main__":
    main()
