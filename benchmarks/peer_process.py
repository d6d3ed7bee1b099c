"""Whole process and first round: `fl-lightning fit` on the demo setting, as a user runs it, against
each peer codebase (the official FedSOL code, FL-bench) doing the same FedAvg work in a process of
its own, each timed from outside: launch to exit, and launch to the end of round 1's evaluation (the
moment its "round 1/R: global test acc" line appears on the process's output, read line by line).

    PYTHONPATH=. python benchmarks/peer_process.py --fedsol ../FedSOL \\
        --flbench ../FL-bench --deps ../flbench-deps [--rounds 5] [--repeats 2]

peer_fedsol.py and peer_flbench.py compare the rounds, both sides in one process; this script adds
what a user meets before and around them: Python's start-up, the imports, building the run, the
data and the model, writing the results. The work is theirs (their docstrings):
- fl-lightning: `fl-lightning fit --config configs/settings/mnist5k.yaml --trainer.max_epochs R`
  (every default on: W&B offline, the round checkpoint, divergence statistics and their heatmap,
  the results files); against FL-bench also `--model.init_args.lr_decay 1.0
  --federation.eval_local_models false`, as FL-bench has no per-round decay and evaluates no local
  model on the global test digits;
- the peer: benchmarks/peer_servers.py as a process that imports torch, numpy and the peer's
  modules only (never Lightning or fl_lightning, which a user of the peer would not import; it
  prints whether either got imported), loads the work from a file and runs the peer's server for R
  rounds. This script writes that file beforehand: the MNIST-5k digits, the partition, every
  round's clients and batch orders, the 300 local-evaluation digits, and the initial weights of
  the user's run (read from a one-round fit in this process). The peer builds the FedAvg CNN in
  plain torch (checked here to give fl-lightning's logits from the same weights).
Both processes run with one thread (OMP_NUM_THREADS=1) and unbuffered output (so that the round
line is seen when printed), on the cores this script is pinned to. The sides alternate (fl-lightning,
peer, for each peer, then `python -c "import lightning.pytorch"` and `python -c "import torch"`)
`--repeats` times; medians of wall seconds, and of the CPU seconds of the process and the children
it waited for (W&B's service process among them). The same work is checked: the round-R global test
accuracy of each side and the largest difference of the final global weights (the project's from
its checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
from peer_fedsol import SETTING, USER_RUN, _PairedRounds, describe_work, user_fit
from peer_servers import FedAvgCNN, flbench_modules

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.models import build_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIRST_ROUND = re.compile(r"round 1/\d+: global test acc")
PEERS = {"fedsol": "the official FedSOL code", "flbench": "FL-bench"}
SAME_WORK = {"fedsol": [], "flbench": ["--model.init_args.lr_decay", "1.0", "--federation.eval_local_models", "false"]}
IMPORTS = {"lightning": "import lightning.pytorch", "torch": "import torch"}
TICKS = os.sysconf("SC_CLK_TCK")


class _Initial:
    """Keeps the global model's weights at the start of a fit (a peer for _PairedRounds that does
    no work)."""

    init: dict

    def start(self, init: dict) -> None:
        self.init = {k: v.detach().contiguous().clone() for k, v in init.items()}

    def run_round(self, round_idx: int) -> float:
        return 0.0


def initial_weights() -> dict:
    """The initial global weights of the user's run (its seed, its model), from a one-round fit."""
    initial = _Initial()
    sys.stdout.flush()
    sys.stderr.flush()
    shown = {fd: os.dup(fd) for fd in (1, 2)}
    with warnings.catch_warnings(), open(os.devnull, "w") as quiet:
        warnings.simplefilter("ignore")
        for fd in shown:  # the run's progress lines, whichever stream object writes them
            os.dup2(quiet.fileno(), fd)
        try:
            user_fit(1, _PairedRounds(initial))
        except SystemExit as stop:  # the command's own `error:` line went to the silenced stderr
            if stop.code:
                raise SystemExit(f"error: `fl-lightning {' '.join(USER_RUN)}` failed (exit {stop.code}); "
                                 "run it by hand to see why") from None
        finally:
            sys.__stdout__.flush()
            sys.__stderr__.flush()
            for fd, saved in shown.items():
                os.dup2(saved, fd)
                os.close(saved)
    return initial.init


def check_model(init: dict) -> None:
    """The peer's plain-torch CNN gives fl-lightning's logits from the same weights."""
    dm = FederatedDataModule(**SETTING)
    dm.setup()
    ours, theirs = build_model("fedavg_cnn", dm.spec), FedAvgCNN(dm.spec.in_channels, dm.spec.num_classes,
                                                                  dm.spec.image_size)
    ours.load_state_dict(init)
    theirs.load_state_dict(init)
    x = dm.test_set.tensors().images[:200]
    with torch.no_grad():
        diff = float((ours(x) - theirs(x)).abs().max())
    if diff > 1e-5:
        raise SystemExit(f"error: the peer's FedAvg CNN differs from fl-lightning's (max |logit diff| {diff:.1e})")


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of a running process and the children it has waited for (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICKS  # utime, stime, cutime, cstime


def timed(cmd: list[str], env: dict) -> dict:
    """Runs `cmd`: wall and CPU seconds to its exit and to its first-round line, and its output."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    first = first_cpu = None
    lines = []
    for line in proc.stdout:
        if first is None and FIRST_ROUND.match(line):
            first = time.perf_counter() - started
            with contextlib.suppress(OSError):
                first_cpu = _cpu_seconds(proc.pid)
        lines.append(line)
    _, status, usage = os.wait4(proc.pid, 0)
    whole = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} exited with {proc.returncode}:\n{''.join(lines[-15:])}")
    return {"whole": whole, "whole_cpu": usage.ru_utime + usage.ru_stime, "first": first, "first_cpu": first_cpu,
            "lines": lines}


def project_run(rounds: int, peer: str, run_dir: str, env: dict) -> dict:
    """`fl-lightning fit` on the demo setting, its round-R accuracy and final global weights."""
    cli = os.path.join(os.path.dirname(sys.executable), "fl-lightning")
    result = timed([cli, "fit", "--config", "configs/settings/mnist5k.yaml", "--trainer.max_epochs", str(rounds),
                    *SAME_WORK[peer], "--trainer.default_root_dir", run_dir], env)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        row = [r for r in csv.DictReader(f) if r["round"] == str(rounds)][0]
    result["acc"] = float(row["global/test_acc"])
    state = torch.load(os.path.join(run_dir, "checkpoints", "last.ckpt"), map_location="cpu", weights_only=False)
    result["weights"] = {k[len("model."):]: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    return result


def peer_run(peer: str, args, work: str, out: str, env: dict) -> dict:
    """The peer's process (peer_servers.py), its round-R accuracy and final global weights."""
    cmd = [sys.executable, os.path.join(HERE, "peer_servers.py"), peer, "--work", work, "--out", out,
           "--checkout", getattr(args, peer)]
    if peer == "flbench" and args.deps:
        cmd += ["--deps", args.deps]
    result = timed(cmd, env)
    last = [line for line in result["lines"] if line.startswith(f"round {args.rounds}/")][-1]
    result["acc"] = float(last.split("acc")[1])
    if not any(line.startswith("imported Lightning: False, fl_lightning: False") for line in result["lines"]):
        raise SystemExit(f"error: the {PEERS[peer]} process imported Lightning or fl_lightning")
    result["weights"] = torch.load(out, weights_only=True)
    return result


def report(peer: str, ours: list[dict], theirs: list[dict], rounds: int) -> None:
    med = statistics.median

    def m(runs, key):
        return med(r[key] for r in runs)

    diff = max(max(float((o["weights"][k] - t["weights"][k]).abs().max()) for k in t["weights"])
               for o, t in zip(ours, theirs, strict=True))
    print(f"  against {PEERS[peer]}{' (no lr decay, no local-model evaluation on either side)' * (peer == 'flbench')}:")
    print(f"    whole process: fl-lightning {m(ours, 'whole'):.2f} s, {PEERS[peer]} {m(theirs, 'whole'):.2f} s: "
          f"{m(ours, 'whole') / m(theirs, 'whole'):.3f}x (CPU {m(ours, 'whole_cpu'):.2f} s against "
          f"{m(theirs, 'whole_cpu'):.2f} s: {m(ours, 'whole_cpu') / m(theirs, 'whole_cpu'):.3f}x)")
    print(f"    first round:   fl-lightning {m(ours, 'first'):.2f} s, {PEERS[peer]} {m(theirs, 'first'):.2f} s "
          f"(CPU {m(ours, 'first_cpu'):.2f} s against {m(theirs, 'first_cpu'):.2f} s)")
    accs = [", ".join(f"{r['acc']:.4f}" for r in runs) for runs in (ours, theirs)]
    print(f"    round {rounds} global test acc: fl-lightning {accs[0]}, {PEERS[peer]} {accs[1]}; "
          f"final weights max|dw| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fedsol", help="a checkout of github.com/Lee-Gihun/FedSOL")
    parser.add_argument("--flbench", help="a checkout of github.com/KarhouTam/FL-bench")
    parser.add_argument("--deps", help="FL-bench's extra packages (peer_flbench.py)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    peers = [p for p in PEERS if getattr(args, p)]
    if not peers:
        parser.error("give --fedsol CHECKOUT, --flbench CHECKOUT (with --deps DIR), or both")
    if args.fedsol and not os.path.isfile(os.path.join(args.fedsol, "algorithms", "BaseServer.py")):
        parser.error(f"--fedsol {args.fedsol}: no algorithms/BaseServer.py there; "
                     "clone https://github.com/Lee-Gihun/FedSOL and pass its directory")
    if args.flbench and not os.path.isfile(os.path.join(args.flbench, "src", "server", "fedavg.py")):
        parser.error(f"--flbench {args.flbench}: no src/server/fedavg.py there; "
                     "clone https://github.com/KarhouTam/FL-bench and pass its directory")
    if args.flbench:
        try:
            flbench_modules(args.flbench, args.deps)
        except ImportError as error:
            parser.error(f"FL-bench's modules need {error.name}, which is not installed: pip install --target DIR "
                         "omegaconf hydra-core rich nvidia-ml-py, then pass --deps DIR")
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    project_env = dict(env, WANDB_MODE="offline", PYTHONPATH=os.environ.get("PYTHONPATH", ROOT))
    os.chdir(ROOT)  # the setting's config path is relative to the checkout
    init = initial_weights()
    check_model(init)
    runs = {p: ([], []) for p in peers}
    imports = {k: [] for k in IMPORTS}
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "work.pt")
        describe_work(args.rounds, init).save(work)
        for repeat in range(args.repeats):
            for peer in peers:
                runs[peer][0].append(project_run(args.rounds, peer, os.path.join(tmp, f"{peer}{repeat}"),
                                                 project_env))
                runs[peer][1].append(peer_run(peer, args, work, os.path.join(tmp, f"{peer}{repeat}.pt"), env))
            for name, code in IMPORTS.items():
                imports[name].append(timed([sys.executable, "-c", code], project_env)["whole"])
    print(f"FedAvg CNN, MNIST-5k demo setting, {args.rounds} rounds, each side a process of its own, 1 thread, "
          f"{args.repeats} interleaved repeats, medians of wall seconds")
    for peer in peers:
        report(peer, *runs[peer], args.rounds)
    lightning, torch_ = (statistics.median(imports[k]) for k in IMPORTS)
    print(f"  python -c \"import lightning.pytorch\" {lightning:.2f} s, python -c \"import torch\" {torch_:.2f} s: "
          f"{lightning - torch_:+.2f} s")


if __name__ == "__main__":
    main()
