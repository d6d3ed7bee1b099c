"""Start-up that is fl-lightning's own: from launching the demo `fit` to its first round starting,
minus what `python -c "import lightning.pytorch"` alone takes (the floor of any CLI on Lightning).

Both are separate processes, timed from outside, interleaved over `--repeats`, medians; one
thread each (OMP_NUM_THREADS=1), W&B offline, as a user starts the demo:

    fl-lightning fit --config configs/settings/mnist5k.yaml --config configs/methods/fedsol/fedavg.yaml

The fit is started through a small launcher (`LAUNCHER` below) that runs the CLI's own `main` and,
when the round callback starts round 1 (`FederatedCallback.on_train_epoch_start`), prints a line
and ends the process: the time to that line is the start-up, and nothing of the round is in it.
The launcher also stamps the stages of the start-up (perf_counter, in the process), each the first
time it runs: the imports it needs beyond Lightning (fl-lightning's modules with jsonargparse, W&B,
matplotlib; imported by the launcher one after the other so that each is a stage of its own,
whatever imports it first in a run), the CLI's parsing (jsonargparse reads the chosen
classes' signatures and checks every value's type), building the data module, method and Trainer,
loading and partitioning the data, the W&B run's start (offline), the partition the analyses log at
fit start, and Lightning's set-up up to the round. The W&B run and the partition picture are made in
threads of their own while round 1 starts: their stages are what the fit waits for before the round,
and what their threads do meanwhile slows the stages it overlaps (on one core, it shares it). W&B's
import stays on the path: the CLI's parsing needs it (jsonargparse reads `wandb.init`'s signature
to offer the W&B logger's options). A stage's time is its own: stages inside another are subtracted
from it. Each stage is also given in CPU seconds (the process's, all its threads): on a machine
shared with other work the wall-clock seconds grow with the load, the CPU seconds much less.

fl-lightning's modules are byte-compiled first (into their `__pycache__`), as `pip install` does and
as Python does at a checkout's first run: where bytecode may not be written (PYTHONDONTWRITEBYTECODE)
and none is cached, every start would compile them from source, which a user's start does not do.

    taskset -c 1 env PYTHONPATH=. python benchmarks/startup.py [--repeats 5] [-- extra fit options]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = ["fit", "--config", "configs/settings/mnist5k.yaml", "--config", "configs/methods/fedsol/fedavg.yaml"]
MARK = "first round starts"

LAUNCHER = r'''
import json, os, sys, time
T0 = time.perf_counter()
stamps = {}  # stage -> [seconds of its own, CPU seconds of its own]
stack = []

def clocks():
    return (time.perf_counter(), time.process_time())

def enter(name):
    stack.append([name, clocks(), [0.0, 0.0]])

def leave():
    name, started, inner = stack.pop()
    took = [now - then for now, then in zip(clocks(), started)]
    own = stamps.setdefault(name, [0.0, 0.0])
    for i in (0, 1):
        own[i] += took[i] - inner[i]
        if stack:
            stack[-1][2][i] += took[i]

def stage(name, fn, once=True):
    done = []
    def timed(*args, **kwargs):
        if once and done:
            return fn(*args, **kwargs)
        done.append(1)
        enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            leave()
    return timed

enter("import lightning.pytorch")
import lightning.pytorch
leave()
enter("import W&B")
import wandb
leave()
enter("import matplotlib (figures)")
import matplotlib.figure, matplotlib.backends.backend_agg
leave()
enter("import fl-lightning (and jsonargparse)")
from fl_lightning import cli
from fl_lightning import lightning_cli, cli_parsing, loggers
from fl_lightning.analysis import callback as analysis
from fl_lightning.data import datamodule
from fl_lightning import federation
import lightning.pytorch.trainer.trainer as trainer_module
leave()

P = cli_parsing.FLCLIParsing
P.parse_arguments = stage("parse the command line and configs", P.parse_arguments)
P.instantiate_classes = stage("build the data module, method and Trainer", P.instantiate_classes)
D = datamodule.FederatedDataModule
D.setup = stage("load and partition the data", D.setup)
A = analysis.AnalysisCallback
A.log_partition = stage("the partition (analyses at fit start)", A.log_partition)
L = loggers.FLWandbLogger
L.experiment = property(stage("start the W&B run (offline)", L.experiment.fget))
T = trainer_module.Trainer
T.fit = stage("Lightning's set-up to the first round", T.fit)

def first_round(self, trainer, module):
    while stack:
        leave()
    total, cpu = time.perf_counter() - T0, time.process_time()
    stamps["everything else"] = [total - sum(v[0] for v in stamps.values()), cpu - sum(v[1] for v in stamps.values())]
    print("''' + MARK + r'''", json.dumps({"total": total, "cpu": cpu, "stages": {k: v[0] for k, v in stamps.items()},
                                        "cpu_stages": {k: v[1] for k, v in stamps.items()}}), flush=True)
    os._exit(0)

federation.FederatedCallback.on_train_epoch_start = first_round
cli.main(sys.argv[1:])
'''


def seconds_to(command: list[str], marker: str, env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=env)
    for line in process.stdout:
        if line.startswith(marker):
            seen = time.perf_counter() - started
            process.stdout.close()
            process.wait()
            return seen, line[len(marker):].strip()
    process.wait()
    raise RuntimeError(f"{command[:3]} never printed {marker!r} (exit {process.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("extra", nargs="*", help="more fit options (after --)")
    args = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if not compileall.compile_dir(REPO / "fl_lightning", quiet=1):
        raise RuntimeError("fl_lightning's modules could not be byte-compiled")
    lightning_only = [sys.executable, "-c",
                      "import time, lightning.pytorch; print('imported', time.process_time(), flush=True)"]
    imports, fits, stages, cpu_stages, import_cpu, fit_cpu = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        fit = [sys.executable, "-c", LAUNCHER, *DEMO, "--trainer.default_root_dir", str(Path(tmp) / "run"),
               "--overwrite", "true", *args.extra]
        for repeat in range(args.repeats):  # interleaved, the order alternating
            for which in ((0, 1) if repeat % 2 == 0 else (1, 0)):
                if which == 0:
                    seconds, cpu = seconds_to(lightning_only, "imported", env)
                    imports.append(seconds)
                    import_cpu.append(float(cpu))
                else:
                    seconds, report = seconds_to(fit, MARK, env)
                    fits.append(seconds)
                    stamped = json.loads(report)
                    stages.append(stamped["stages"])
                    cpu_stages.append(stamped["cpu_stages"])
                    fit_cpu.append(stamped["cpu"])
            print(f"  repeat {repeat + 1}: import lightning.pytorch {imports[-1]:.2f} s, fit to round 1 "
                  f"{fits[-1]:.2f} s", flush=True)
    med = statistics.median
    ours = med(f - i for f, i in zip(fits, imports, strict=True))
    print(f"`python -c 'import lightning.pytorch'`       median {med(imports):6.2f} s (min {min(imports):.2f})")
    print(f"demo fit, launch to the first round's start  median {med(fits):6.2f} s (min {min(fits):.2f})")
    print(f"start-up beyond importing Lightning          median {ours:6.2f} s (paired; target <= 1 s: "
          f"{'met' if ours <= 1 else 'NOT met'})")
    print(f"the same in CPU seconds of the two processes (the fit's threads included; W&B's service, a process of "
          f"its own, not): median {med(f - i for f, i in zip(fit_cpu, import_cpu, strict=True)):.2f} s")
    print("where the start-up goes (seconds inside the fit's process, medians; a stage's own time):")
    print(f"  {'stage':48s} {'wall':>6s} {'CPU':>6s}")
    for name in stages[0]:
        print(f"  {name:48s} {med(s.get(name, 0.0) for s in stages):6.2f} "
              f"{med(s.get(name, 0.0) for s in cpu_stages):6.2f}")


if __name__ == "__main__":
    main()
