"""Channels-last against the default memory layout (`--model.memory_format`), one thread, CPU time.

(a) `--only steps`: the local step (forward, backward, SGD with momentum) of every convolutional
    architecture on a batch of 50 (MNIST-sized 1x28x28 for the FedAvg CNN and LeNet-5, 3x32x32 for
    the others), in both layouts, interleaved; the ratio of the best of each is what the table
    `fl_lightning.models.CHANNELS_LAST_ON_CPU` ("auto" on a CPU) follows.
(b) `--only rounds`: the FedAvg CNN on the demo setting (MNIST-5k, Dirichlet 0.1, 10 of 50 clients,
    5 local epochs of batches of 50), per round, a Trainer with the federated callback only (as in
    core_overhead.py (ii)): fl-lightning channels-last, fl-lightning contiguous, and the plain
    PyTorch loop of core_overhead.py on the same clients and batches, in the default layout (the
    loop as one writes it) and channels-last. The variants run interleaved (their order rotates
    every repeat); the first round of every run is dropped; medians of the rounds.

    taskset -c 1 env PYTHONPATH=. python benchmarks/channels_last.py [--repeats 3] [--rounds 4]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from core_overhead import MNIST, plain, project

from fl_lightning.data.datasets import DataSpec
from fl_lightning.models import MODELS, build_model

LAYOUTS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
FULLY_CONNECTED = ("mlp", "mlp_bn")
SMALL = ("fedavg_cnn", "lenet5", "lenet5_nobias")  # on MNIST-sized images; the others on CIFAR's


def step_time(name: str, memory_format: torch.memory_format, steps: int) -> float:
    spec = DataSpec(10, 1, 28) if name in SMALL else DataSpec(10, 3, 32)
    torch.manual_seed(0)
    model = build_model(name, spec).to(memory_format=memory_format)
    x = torch.randn(50, spec.in_channels, spec.image_size, spec.image_size).contiguous(memory_format=memory_format)
    y = torch.randint(0, spec.num_classes, (50,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def one_step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(2):
        one_step()
    started = time.process_time()
    for _ in range(steps):
        one_step()
    return (time.process_time() - started) / steps


def steps_table(repeats: int) -> None:
    print("(a) local step, batch of 50, best of the interleaved repeats (CPU ms):")
    for name in MODELS:
        if name in FULLY_CONNECTED:
            continue
        steps = 20 if name in SMALL + ("cnn4",) else 3
        best = {layout: float("inf") for layout in LAYOUTS}
        for _ in range(repeats):
            for layout, memory_format in LAYOUTS.items():
                best[layout] = min(best[layout], step_time(name, memory_format, steps))
        print(f"    {name:22s} channels-last {1e3 * best['channels_last']:8.1f}  contiguous "
              f"{1e3 * best['contiguous']:8.1f}  ratio {best['channels_last'] / best['contiguous']:.3f}", flush=True)


def rounds_table(repeats: int, rounds: int) -> None:
    variants = {
        "fl-lightning channels-last": lambda: project(MNIST, "fedavg_cnn", "fedavg", rounds, "channels_last"),
        "fl-lightning contiguous": lambda: project(MNIST, "fedavg_cnn", "fedavg", rounds, "contiguous"),
        "plain loop contiguous": None,
        "plain loop channels-last": None,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    init, finals = None, {}
    order = list(variants)
    for repeat in range(repeats):
        for name in order[repeat % len(order):] + order[: repeat % len(order)]:
            if name.startswith("fl-lightning"):
                round_times, _, start, final = variants[name]()
                init = init or start
            else:
                if init is None:  # the plain loop starts from the project's initial weights
                    _, _, init, _ = project(MNIST, "fedavg_cnn", "fedavg", 1)
                layout = LAYOUTS[name.rpartition(" ")[2].replace("-", "_")]
                round_times, _, _, final = plain(MNIST, "fedavg_cnn", "fedavg", rounds, init, layout)
            times[name] += round_times[1:]
            finals[name] = final
            print(f"    ... {name}: {', '.join(f'{t:.2f}' for t in round_times[1:])} s", flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"(b) FedAvg CNN on the demo setting, CPU s a round, median of {len(times[order[0]])} rounds per variant:")
    for name in variants:
        print(f"    {name:28s} {med[name]:.3f}")
    base = finals["fl-lightning contiguous"]
    for name in variants:
        diff = max(float((finals[name][k] - base[k]).abs().max()) for k in base)
        print(f"    max |w - w(fl-lightning contiguous)| after {rounds} rounds, {name}: {diff:.1e}")
    project_cl, project_default = med["fl-lightning channels-last"], med["fl-lightning contiguous"]
    loop, loop_cl = med["plain loop contiguous"], med["plain loop channels-last"]
    print(f"    fl-lightning channels-last / contiguous:            {project_cl / project_default:.3f}")
    print(f"    fl-lightning contiguous / plain loop contiguous:    {project_default / loop:.3f}")
    print(f"    fl-lightning channels-last / plain loop contiguous: {project_cl / loop:.3f}")
    print(f"    fl-lightning channels-last / plain loop channels-last: {project_cl / loop_cl:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run in (b) (the first is dropped)")
    parser.add_argument("--only", choices=["steps", "rounds"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats")
    if args.only in (None, "steps"):
        steps_table(args.repeats)
    if args.only in (None, "rounds"):
        rounds_table(args.repeats, args.rounds)


if __name__ == "__main__":
    main()
