"""What the core costs on top of the arithmetic: fl-lightning against a plain PyTorch loop doing
the same math on the same clients and the same batches, one thread, in one run.

The plain side loops over mini-batches sliced from the training tensors before its timer starts, so
it pays for nothing but the model's forward/backward/step, the per-client reset and upload copy,
the weighted average and the global model's evaluation on the test set once a round. (i) also
prints the whole round against the plain round plus that data preparation (the round's clients,
their seeded shuffles, the slicing), which the project's round does inside its own. Times are
CPU time of this process (on a shared machine wall time mostly measures the neighbours); (i) also
prints wall time. In (i) every project round is followed by the plain loop's same round, and the
ratios are the medians of the per-round ratios (a shared machine's speed drifts by 20% between
runs a minute apart); in (ii) and (iii) project and plain runs alternate (`--repeats`). The first
round of every run is dropped as warm-up.

    PYTHONPATH=. python benchmarks/core_overhead.py [--repeats 3] [--only i] [--without SHORTCUT ...]

`--without` switches off one of the local step's speed shortcuts (docs/performance/shortcuts.md)
for the whole run, the same math through the public path it bypasses: run with and without it,
alternating, to measure what it saves.

Regimes (the targets in brackets):
  (i)   overhead-bound, the user's run: `fl-lightning fit` (in this process) with every default of
        configs/settings/mnist5k.yaml left on (divergence statistics and their class-wise heatmap,
        local models evaluated on 300 test digits, the round checkpoint, metrics.csv / clients.csv /
        summary.json, W&B offline) with the `mlp` model, an iid partition and batches of 10: 50
        clients, 10 a round, 400 local steps a round. Time in clients (client start to upload,
        per local step) [<= 1.10x] and the whole round, start to start, mean over rounds (every
        heatmap round included) and median [<= 1.15x]; then where the project's round goes.
  (ii)  compute-bound: the FedAvg CNN on MNIST-5k (Dirichlet 0.1, batch 50), per round, FedAvg and
        FedSOL(head) (its logged cosine over the perturbed tensors, the default, and over every
        tensor), a Trainer with the federated callback only                       [FedAvg <= 1.03x]
  (iii) fixed per-round cost: 1,000 clients, 10 per round, iid, `mlp`: project minus plain [<= 0.05 s]
Each line also prints max |w_project - w_plain| after the last round (the same math check).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from dataclasses import replace

import lightning as L
import torch
import torch.nn.functional as F

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedAvg, FedSOL
from fl_lightning.models import build_model

OPT = dict(lr=0.01, momentum=0.9, weight_decay=1e-5)
MNIST = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
             partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)
MANY = dict(MNIST, num_clients=1000, sample_ratio=0.01, local_epochs=1, partition="iid", min_size=1)
# FedSOL(head) in (ii), by the tensors its logged cos(g_u, g_p) is taken over: the default, the
# perturbed ones (free: g_p is computed there for the perturbation anyway), and every tensor
# (`cosine_scope all`, the paper's Fig. 3: g_p over the body is one more backward through it a
# step, which the plain loop, logging nothing, does not do). The training is the same.
FEDSOL_COSINE = {"fedsol": "perturbed", "fedsol_cosine_all": "all"}


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


def bare_trainer(rounds: int, callbacks: list) -> L.Trainer:
    """A Trainer of `rounds` rounds on one CPU with `callbacks` and nothing else (no logger,
    checkpoint, progress bar or model summary)."""
    return L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks)


def project(setting: dict, model: str, method: str, rounds: int, memory_format: str = "auto"):
    torch.manual_seed(0)
    dm = FederatedDataModule(**setting)
    module = (FedAvg(model=model, data_spec=dm.spec, memory_format=memory_format, **OPT) if method == "fedavg"
              else FedSOL(model=model, rho=2.0, perturb="head", adaptive="layer", data_spec=dm.spec,
                          cosine_scope=FEDSOL_COSINE[method], memory_format=memory_format, **OPT))
    init = {k: v.clone() for k, v in module.model.state_dict().items()}
    clock = RoundClock()
    clock.watch(module)
    bare_trainer(rounds, [clock, FederatedCallback(eval_local_models=False)]).fit(module, dm)
    return clock.times, clock.client_time, init, module.model.state_dict()


def _epoch_batches(train, work) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A client's mini-batches as a careful plain loop makes them: one gather of the samples per
    local epoch, in that epoch's order, cut into views."""
    batches = []
    for order in work.orders:
        index = torch.from_numpy(order)
        images, labels = train.images[index], train.labels[index]
        batches += zip(images.split(work.batch_size), labels.split(work.batch_size), strict=True)
    return batches


class PlainRounds:
    """The same rounds in plain PyTorch, one call a round; FedSOL(head) with its perturbation by
    functional_call. Its model is built at construction (before a project run seeds the RNG, so
    that run's random numbers are its own) and takes the initial weights with `start`."""

    def __init__(self, setting: dict, model_name: str, method: str,
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.dm = FederatedDataModule(**setting)
        self.dm.setup()
        self.train, self.test = self.dm.train_set.tensors(), self.dm.test_set.tensors()
        if memory_format != torch.contiguous_format:  # the data laid out once, as the weights
            self.train, self.test = (replace(t, images=t.images.contiguous(memory_format=memory_format))
                                     for t in (self.train, self.test))
        self.model = build_model(model_name, self.dm.spec).to(memory_format=memory_format)
        self.teacher = build_model(model_name, self.dm.spec).to(memory_format=memory_format)
        self.teacher.requires_grad_(False).eval()
        self.method, self.lr = method, OPT["lr"]

    def start(self, init: dict) -> None:
        self.model.load_state_dict(init)

    def run_round(self, r: int) -> tuple[float, float, float, int, float]:
        """(CPU s, wall s, CPU s in clients, local steps, CPU s of the data preparation) of round r.
        The data preparation (the round's clients and their seeded shuffles, the project's own
        `plan_round`, and the batches sliced from the tensors) runs before the round's timer."""
        model, teacher, train, test, h = self.model, self.teacher, self.train, self.test, self.dm.hparams
        prep = time.process_time()
        plan = self.dm.plan_round(r)  # the clients and batch indices the project's round uses
        clients = [w.client for w in plan.clients]
        batches = {w.client: _epoch_batches(train, w) for w in plan.clients}
        prep = time.process_time() - prep
        start, wall_start = time.process_time(), time.perf_counter()
        global_w = {k: v.clone() for k, v in model.state_dict().items()}
        teacher.load_state_dict(global_w)
        uploads, sizes, n_steps, in_clients = [], [], 0, 0.0
        for c in clients:
            client_start = time.process_time()
            model.load_state_dict(global_w)
            opt = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=OPT["momentum"],
                                  weight_decay=OPT["weight_decay"])
            for step, (xb, yb) in enumerate(batches[c]):
                opt.zero_grad()
                if self.method == "fedavg" or step == 0:
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
            sizes.append(len(self.dm.client_parts[c]))
            in_clients += time.process_time() - client_start
        total = sum(sizes)
        model.load_state_dict({k: sum(u[k] * (n / total) for u, n in zip(uploads, sizes, strict=True))
                               for k in global_w})
        self.lr *= 0.99
        with torch.no_grad():
            for s in range(0, len(test), h.eval_batch_size):
                logits = model(test.images[s : s + h.eval_batch_size])
                F.cross_entropy(logits, test.labels[s : s + h.eval_batch_size])
                (logits.argmax(1) == test.labels[s : s + h.eval_batch_size]).float().mean()
        return time.process_time() - start, time.perf_counter() - wall_start, in_clients, n_steps, prep


def plain(setting: dict, model_name: str, method: str, rounds: int, init: dict,
          memory_format: torch.memory_format = torch.contiguous_format):
    """(CPU s per round, CPU s in clients per round, steps per round, final weights) of PlainRounds."""
    loop = PlainRounds(setting, model_name, method, memory_format)
    loop.start(init)
    times, client_times, steps = [], [], []
    for r in range(rounds):
        cpu, _, in_clients, n_steps, _ = loop.run_round(r)
        times.append(cpu)
        client_times.append(in_clients)
        steps.append(n_steps)
    return times, client_times, steps, loop.model.state_dict()


# (i): the demo setting as a user runs it, with the mlp on an iid partition and batches of 10
USER_RUN = ["--config", "configs/settings/mnist5k.yaml", "--config", "configs/methods/fedsol/fedavg.yaml",
            "--model.init_args.model", "mlp", "--data.partition", "iid", "--data.batch_size", "10"]
USER_RUN_PLAIN = dict(MNIST, partition="iid", batch_size=10)
PARTS = {  # where the project's round goes: (class, method) timed as the part it names
    "client start (seed, global weights)": ("fl_lightning.federation:FederatedCallback", "on_train_batch_start"),
    "local-model evaluation": ("fl_lightning.methods.shared_model:SharedModelMethod", "local_model_stats"),
    "server step, round log, W&B row": ("fl_lightning.federation:FederatedCallback", "_finish_round"),
    "validation (Lightning's loop)": ("lightning.pytorch.loops.evaluation_loop:_EvaluationLoop", "run"),
    "divergence statistics, heatmap": ("fl_lightning.analysis.callback:AnalysisCallback", "on_train_epoch_end"),
    "metrics.csv, clients.csv, summary": ("fl_lightning.results:ResultsCallback", "on_train_epoch_end"),
    "round checkpoint": ("fl_lightning.checkpointing:RoundCheckpoint", "on_train_epoch_end"),
}


class _UserRunClock:
    """Patches the classes a CLI run builds, in this process: round starts and ends (CPU and wall),
    the time in clients (client start to upload) and the time in each of PARTS, per round. Between
    two of the project's rounds (outside both rounds' clocks) it runs the plain loop's same round,
    so each pair of rounds meets the same machine: on a shared machine the speed drifts by 20%
    between runs a minute apart, more than the effects measured."""

    def __init__(self, plain: PlainRounds):
        self.plain = plain
        self.starts: list[tuple[float, float]] = []
        self.ends: list[tuple[float, float]] = []
        self.plain_rounds: list[tuple[float, float, float, int]] = []  # (CPU, wall, in clients, steps)
        self.parts: list[dict[str, float]] = []
        self.init: dict | None = None
        self.final: dict | None = None
        self._client_started = 0.0
        self._saved: list = []

    def _add(self, name: str, seconds: float) -> None:
        if self.parts:
            self.parts[-1][name] = self.parts[-1].get(name, 0.0) + seconds

    def _wrap(self, cls, attr: str, name: str, before=None) -> None:
        original = getattr(cls, attr)
        self._saved.append((cls, attr, original))

        def timed(*args, **kwargs):
            if before is not None:
                before(*args)
            started = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(name, time.process_time() - started)

        setattr(cls, attr, timed)

    def end_round(self) -> None:
        """The project's round that started last ends now; then the plain loop runs that round."""
        self.ends.append((time.process_time(), time.perf_counter()))
        self.plain_rounds.append(self.plain.run_round(len(self.ends) - 1))

    def __enter__(self):
        import importlib

        from fl_lightning.methods.shared_model import SharedModelMethod

        def round_start(callback, trainer, module):
            if self.starts:
                self.end_round()
            if self.init is None:
                self.init = {k: v.clone() for k, v in module.model.state_dict().items()}
                self.plain.start(self.init)
            self.final = module.model
            self.parts.append({})
            self.starts.append((time.process_time(), time.perf_counter()))

        def client_start(callback, trainer, module, batch, batch_idx):
            self._client_started = time.process_time()

        self._wrap(FederatedCallback, "on_train_epoch_start", "round start", round_start)
        for name, (where, attr) in PARTS.items():
            module, _, cls = where.partition(":")
            owner = getattr(importlib.import_module(module), cls)
            if hasattr(owner, attr):  # (an older checkout may lack one: its time stays in "everything else")
                self._wrap(owner, attr, name, client_start if attr == "on_train_batch_start" else None)
        client_end = SharedModelMethod.client_end
        self._saved.append((SharedModelMethod, "client_end", client_end))

        def timed_end(module):
            upload = client_end(module)
            self._add("clients", time.process_time() - self._client_started)
            return upload

        SharedModelMethod.client_end = timed_end
        return self

    def __exit__(self, *exc):
        for cls, attr, original in reversed(self._saved):
            setattr(cls, attr, original)


def project_user_run(rounds: int):
    """Of `fl-lightning fit` on USER_RUN with every default left on, each round paired with the
    plain loop's same round run right after it: the project's (CPU, wall) seconds of each round,
    start to start (the last one to the CLI's return), the parts of each round, the plain rounds'
    (CPU, wall, in clients, steps), and both final global weights."""
    import contextlib
    import os
    import tempfile

    from fl_lightning.cli import main as fl_lightning

    os.environ.setdefault("WANDB_MODE", "offline")
    plain_loop = PlainRounds(USER_RUN_PLAIN, "mlp", "fedavg")  # built before the run seeds the RNG
    with tempfile.TemporaryDirectory() as run_dir, _UserRunClock(plain_loop) as clock, \
            open(os.devnull, "w") as quiet:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            fl_lightning(["fit", *USER_RUN, "--trainer.max_epochs", str(rounds), "--trainer.default_root_dir", run_dir])
        clock.end_round()
        final = {k: v.clone() for k, v in clock.final.state_dict().items()}
    cpu = [b[0] - a[0] for a, b in zip(clock.starts, clock.ends, strict=True)]
    wall = [b[1] - a[1] for a, b in zip(clock.starts, clock.ends, strict=True)]
    return cpu, wall, clock.parts, clock.plain_rounds, final, plain_loop.model.state_dict()


def user_run(rounds: int, repeats: int) -> None:
    med, mean = statistics.median, statistics.mean
    p_cpu, p_wall, q_cpu, q_wall, p_in, q_in, steps, parts, diff = [], [], [], [], [], [], [], [], 0.0
    q_prep = []
    for _ in range(repeats):
        cpu, wall, run_parts, plain_rounds, p_final, q_final = project_user_run(rounds)
        p_cpu, p_wall, parts = p_cpu + cpu[1:], p_wall + wall[1:], parts + run_parts[1:]
        p_in += [p.get("clients", 0.0) for p in run_parts[1:]]
        q_cpu += [r[0] for r in plain_rounds[1:]]
        q_wall += [r[1] for r in plain_rounds[1:]]
        q_in += [r[2] for r in plain_rounds[1:]]
        steps += [r[3] for r in plain_rounds[1:]]
        q_prep += [r[4] for r in plain_rounds[1:]]
        diff = max(diff, max(float((p_final[k] - q_final[k]).abs().max()) for k in p_final))
    n = med(steps)

    def paired(a, b):  # the median of the per-round ratios project / plain (rounds run side by side)
        return med(x / y for x, y in zip(a, b, strict=True))

    print(f"(i)   the user's run (mlp, MNIST-5k iid, 400 local steps a round, every default on), {len(p_cpu)} "
          f"rounds each side, each project round followed by the plain loop's, max|dw| {diff:.1e}")
    print(f"      in clients, per local step: project {1e3 * med(p_in) / n:.3f} ms, plain {1e3 * med(q_in) / n:.3f} "
          f"ms: paired {paired(p_in, q_in):.3f}x (target <= 1.10)")
    print(f"      whole round, CPU: mean {1e3 * mean(p_cpu):.1f} / {1e3 * mean(q_cpu):.1f} ms = "
          f"{mean(p_cpu) / mean(q_cpu):.3f}x, median {1e3 * med(p_cpu):.1f} / {1e3 * med(q_cpu):.1f} ms, "
          f"paired {paired(p_cpu, q_cpu):.3f}x (target <= 1.15)")
    with_prep = [q + d for q, d in zip(q_cpu, q_prep, strict=True)]
    print(f"      whole round, CPU, the plain loop's data preparation timed too ({1e3 * med(q_prep):.1f} ms a "
          f"round: its clients, seeded shuffles and batch slicing): paired {paired(p_cpu, with_prep):.3f}x")
    print(f"      whole round, wall: mean {1e3 * mean(p_wall):.1f} / {1e3 * mean(q_wall):.1f} ms = "
          f"{mean(p_wall) / mean(q_wall):.3f}x, paired {paired(p_wall, q_wall):.3f}x")
    print("      the project's round (CPU ms, mean over rounds / median):")
    for name in ["clients", *PARTS]:
        values = [p.get(name, 0.0) for p in parts]
        print(f"        {name:38s} {1e3 * mean(values):7.2f} / {1e3 * med(values):7.2f}")
    other = [c - sum(v for k, v in p.items() if k not in ("round start", "client start (seed, global weights)"))
             for c, p in zip(p_cpu, parts, strict=True)]
    print(f"        {'everything else (Lightning loops, ...)':38s} {1e3 * mean(other):7.2f} / {1e3 * med(other):7.2f}")
    beyond = [c - q for c, q in zip(p_cpu, q_cpu, strict=True)]
    print(f"      the project's round beyond the plain one's, paired: median {1e3 * med(beyond):.1f} ms")


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


def _switch_off(shortcuts: list[str]) -> None:
    """The public path in place of each named shortcut (docs/performance/shortcuts.md)."""
    from fl_lightning import compat
    from fl_lightning.methods import local_step

    if "release_gradients" in shortcuts:  # torch's zero_grad, with its profiler annotation
        compat.release_gradients = lambda optimizer: optimizer.zero_grad(set_to_none=True)
    if "step_optimizer" in shortcuts:  # torch's step, with its profiler annotation
        compat.step_optimizer = lambda optimizer: optimizer.step()
    if "direct_step" in shortcuts:  # every step through Lightning's manual_backward and optimizer wrapper
        local_step.lightning_wrappers_idle = lambda *args: False


SHORTCUTS = ("release_gradients", "step_optimizer", "direct_step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=11, help="rounds per run in (i)")
    parser.add_argument("--cnn_rounds", type=int, default=4, help="rounds per run in (ii)")
    parser.add_argument("--many_rounds", type=int, default=15, help="rounds per run in (iii)")
    parser.add_argument("--only", choices=["i", "ii", "iii"], help="run one regime")
    parser.add_argument("--without", action="append", default=[], choices=SHORTCUTS,
                        help="switch a speed shortcut off (repeatable)")
    args = parser.parse_args()
    _switch_off(args.without)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"torch threads: 1; {args.repeats} alternating runs per comparison; shortcuts switched off: "
          f"{', '.join(args.without) or 'none'}")
    if args.only in (None, "i"):
        user_run(args.rounds, args.repeats)
    if args.only in (None, "ii"):
        for method in ("fedavg", *FEDSOL_COSINE):
            (p, q), _, _, diff = compare(MNIST, "fedavg_cnn", method, args.cnn_rounds, args.repeats)
            print(f"(ii)  FedAvg CNN, MNIST-5k, {method}: project {p:.3f} s/round, plain {q:.3f} s/round, "
                  f"ratio {p / q:.3f} (target {'<= 1.03' if method == 'fedavg' else 'none'})  max|dw| {diff:.1e}")
    if args.only in (None, "iii"):
        (p, q), _, _, diff = compare(MANY, "mlp", "fedavg", args.many_rounds, args.repeats)
        print(f"(iii) 1,000 clients, 10 per round, mlp: project {1e3 * p:.1f} ms/round, plain {1e3 * q:.1f} "
              f"ms/round, fixed cost {p - q:.4f} s/round (target <= 0.05)  max|dw| {diff:.1e}")


if __name__ == "__main__":
    main()
