"""Every method the CLI registers, trained with its shipped defaults on the offline demo settings:
does any default leave a method at chance?

Shared-model methods run on the MNIST-5k demo (configs/settings/mnist5k.yaml: 50 clients, LDA
alpha 0.1, 20% per round, 5 local epochs, FedAvg CNN, SGD 0.01 with momentum 0.9), as a user runs
them: `fl-lightning fit --config configs/settings/mnist5k.yaml --model NAME`. Model-heterogeneous
methods run on their own demo (configs/settings/fedorgp_demo_mnist5k_hmg3.yaml: HMG3 models, 20
clients all taking part, 2 classes each, 1 local epoch, each client tested on its own 25% split),
or with `--hetero-on mnist5k` on the MNIST-5k demo with a 25% split per client
(`--data.client_test_fraction 0.25`) and the FedAvg CNN as a one-architecture group. Each run is
its own subprocess with W&B off, into `<out>/<NAME>`; its numbers are read from that run
directory (summary.json, metrics.csv) and output (`<out>/<NAME>.log`).

A method that cannot run on its setting as it is gets the smallest change it needs, printed in the
table's last column: FedRep trains the head for 10 epochs, then the body for 1 (its defaults), so
`--data.local_epochs 11`; FedBN keeps BatchNorm layers local, so `--model.init_args.model mlp_bn`
(the FedAvg CNN has none).

Methods that keep a personal part or model (FedPer, FedRep, FedBN, Ditto, Per-FedAvg, kNN-Per)
are also evaluated as they are meant to be used, each client's own model on a test set drawn from
the global test set with the client's label distribution (`--personalization.enabled true
--personalization.epochs [0] --data.client_test align`, which changes no training): their global
model alone can stay near chance by design (FedPer's global head is never trained).

Columns: the final round's accuracy, the mean over all rounds (how fast it leaves chance), the
best, the final's difference from FedAvg's (global test accuracy only), the chance level of the
method's accuracy, and the personalised accuracy after the last round with its own chance level.
A chance level is the accuracy of always answering the majority class: of the global test set, or
summed over clients on their own test sets, each client answering its most frequent training
class. A method is flagged "AT CHANCE" when its best round, and its personalised accuracy if it
has one, are below their chance levels or within 2 points above them.

A finished run is not run again (delete its directory, or pass --rerun), so an interrupted
benchmark continues where it stopped.

Usage:
    python benchmarks/method_defaults.py [--rounds 15] [--methods FedAvg FedAdagrad ...]
        [--hetero-on own|mnist5k] [--out runs/bench_method_defaults] [--rerun] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fl_lightning import methods  # noqa: E402
from fl_lightning.comparison import DamagedRecords, read_metrics  # noqa: E402
from fl_lightning.methods.base import FederatedMethod, SharedModelMethod  # noqa: E402

SETTINGS = REPO / "configs" / "settings"
DEMO = SETTINGS / "mnist5k.yaml"
HETERO_DEMO = SETTINGS / "fedorgp_demo_mnist5k_hmg3.yaml"
SPLIT = ["--data.client_test_fraction", "0.25"]
PERSONAL_EVAL = ["--personalization.enabled", "true", "--personalization.epochs", "[0]", "--data.client_test", "align"]
CHANCE_MARGIN = 0.02

# what a shared-model method needs beyond the demo to run at all, and why (printed in the table)
CHANGES: dict[str, tuple[list[str], str]] = {
    "FedRep": (["--data.local_epochs", "11"], "local_epochs 11 (head 10 + body 1)"),
    "FedBN": (["--model.init_args.model", "mlp_bn"], "model mlp_bn (needs BatchNorm)"),
}


def registered_methods() -> list[str]:
    """Every concrete method class the CLI takes by name (`--model NAME`)."""
    return sorted(n for n in methods.__all__ if inspect.isclass(c := getattr(methods, n))
                  and issubclass(c, FederatedMethod) and not inspect.isabstract(c))


def is_hetero(name: str) -> bool:
    return issubclass(getattr(methods, name), methods.HeteroMethod)


def is_personal(name: str) -> bool:
    """A shared-model method whose clients keep a part of the model or a model of their own."""
    cls = getattr(methods, name)
    return issubclass(cls, SharedModelMethod) and (
        cls.personal_model is not SharedModelMethod.personal_model
        or cls.personal_keys is not SharedModelMethod.personal_keys)


def plan(name: str, hetero_on: str) -> tuple[Path, list[str], str]:
    """The method's setting, the options it adds, and the note the table prints."""
    if is_hetero(name):
        if hetero_on == "own":
            return HETERO_DEMO, [], "own demo (HMG3); per-client accuracy"
        return DEMO, SPLIT, "client_test_fraction 0.25; per-client accuracy"
    extra, note = CHANGES.get(name, ([], ""))
    return DEMO, [*extra, *(PERSONAL_EVAL if is_personal(name) else [])], note


def run_method(name: str, rounds: int, out: Path, hetero_on: str, rerun: bool) -> Path:
    run_dir = out / name
    summary = run_dir / "summary.json"
    if not rerun and summary.exists():
        done = json.loads(summary.read_text())
        if done.get("finished") and done.get("max_rounds") == rounds:
            return run_dir
    setting, extra, _ = plan(name, hetero_on)
    cmd = [sys.executable, "-m", "fl_lightning.cli", "fit", "--config", str(setting), "--model", name, *extra,
           "--trainer.max_epochs", str(rounds), "--trainer.logger", "false",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run_dir), "--overwrite", "true"]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    env.setdefault("OMP_NUM_THREADS", "1")
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"  {name}: exit {code} after {time.time() - start:.0f} s (log {out / f'{name}.log'})", file=sys.stderr)
    return run_dir


def data_module(setting: Path, **overrides):
    from fl_lightning.data.datamodule import FederatedDataModule

    dm = FederatedDataModule(**{**yaml.safe_load(setting.read_text())["data"], **overrides})
    dm.setup()
    return dm


def majority_rate(dm) -> float:
    """Summed over clients: each client answers its most frequent training class on its own test set."""
    train_labels = np.asarray(dm.plain_train_set.labels)
    test_source = dm.plain_train_set if dm.client_test_mode == "split" else dm.test_set
    test_labels = np.asarray(test_source.labels)
    hits = total = 0
    for train, test in zip(dm.client_parts, dm.client_test_parts, strict=True):
        majority = np.bincount(train_labels[train]).argmax()
        hits += int((test_labels[test] == majority).sum())
        total += len(test)
    return hits / total


def chance_levels(hetero_on: str) -> dict[str, float]:
    """The accuracy of always answering the majority class: on the global test set; on the
    model-heterogeneous methods' per-client splits; on the clients' test sets of the personalised
    evaluation (drawn from the global test set)."""
    aligned = data_module(DEMO, client_test="align")
    test_labels = np.asarray(aligned.test_set.labels)
    hetero = data_module(HETERO_DEMO) if hetero_on == "own" else data_module(DEMO, client_test_fraction=0.25)
    return {"global/test_acc": float(np.bincount(test_labels).max() / len(test_labels)),
            "clients/test_acc": majority_rate(hetero), "personal": majority_rate(aligned)}


def personal_accuracy(log: Path) -> float | None:
    """The clients' own models' mean accuracy from the personalised evaluation's line in the
    run's output (`... personalised accuracy (...): global a+-s, ft0 a+-s, own a+-s`)."""
    try:
        lines = [ln for ln in log.read_text().splitlines() if "personalised accuracy" in ln]
    except OSError:
        return None
    found = re.search(r"\bown ([0-9.]+)\+-", lines[-1]) if lines else None
    return float(found.group(1)) if found else None


def result(run_dir: Path) -> dict:
    """Outcome, final / mean / best accuracy (fractions) from a run directory."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {"outcome": "no summary"}
    key = summary.get("accuracy") or "global/test_acc"
    try:
        rows = read_metrics(run_dir / "metrics.csv")
    except DamagedRecords:
        rows = []
    curve = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return {"outcome": summary.get("outcome", "?"), "key": key, "rounds": summary.get("rounds_completed"),
            "final": curve[-1] if curve else None, "mean": float(np.mean(curve)) if curve else None,
            "best": max(curve) if curve else None,
            "personal": personal_accuracy(run_dir.parent / f"{run_dir.name}.log")}


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def at_chance(r: dict, chance: dict[str, float]) -> bool:
    level = chance.get(r.get("key", ""))
    if r.get("best") is None or level is None or r["best"] > level + CHANCE_MARGIN:
        return False
    return r.get("personal") is None or r["personal"] <= chance["personal"] + CHANCE_MARGIN


def table(names: list[str], results: dict[str, dict], chance: dict[str, float], hetero_on: str) -> str:
    base = results.get("FedAvg", {}).get("final")
    lines = ["| method | outcome | final % | mean % | best % | final - FedAvg | chance % | personal % (chance %) | "
             "at chance | beyond the demo |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for name in names:
        r = results[name]
        diff = "-"
        if r.get("final") is not None and base is not None and r.get("key") == "global/test_acc":
            diff = f"{100 * (r['final'] - base):+.1f}"
        personal = "-" if r.get("personal") is None else f"{pct(r['personal'])} ({pct(chance['personal'])})"
        lines.append(f"| {name} | {r.get('outcome', '?')} | {pct(r.get('final'))} | {pct(r.get('mean'))} | "
                     f"{pct(r.get('best'))} | {diff} | {pct(chance.get(r.get('key', '')))} | {personal} | "
                     f"{'AT CHANCE' if at_chance(r, chance) else ''} | {plan(name, hetero_on)[2]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--methods", nargs="+", help="method class names (default: every registered method)")
    parser.add_argument("--hetero-on", choices=("own", "mnist5k"), default="own",
                        help="model-heterogeneous methods on their own demo setting, or on the MNIST-5k demo")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_method_defaults")
    parser.add_argument("--rerun", action="store_true", help="run again methods whose finished run is in --out")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    known = registered_methods()
    unknown = [n for n in args.methods or [] if n not in known]
    if unknown:
        print(f"error: unknown method(s) {', '.join(unknown)}; registered: {', '.join(known)}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    names = ["FedAvg", *[n for n in args.methods or known if n != "FedAvg"]]
    results = {name: result(run_method(name, args.rounds, args.out, args.hetero_on, args.rerun)) for name in names}
    text = table(names, results, chance_levels(args.hetero_on), args.hetero_on)
    hetero = ("their own demo, configs/settings/fedorgp_demo_mnist5k_hmg3.yaml" if args.hetero_on == "own"
              else "the MNIST-5k demo with a 25% test split per client")
    header = (f"{args.rounds} rounds per method with its shipped defaults on configs/settings/mnist5k.yaml "
              f"(model-heterogeneous methods: {hetero}; accuracy on the clients' own test splits)")
    print(header)
    print(text)
    if args.markdown:
        args.markdown.write_text(header + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
