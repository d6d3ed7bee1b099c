"""Every method the CLI registers, trained with its shipped defaults on the offline MNIST-5k demo
setting (configs/settings/mnist5k.yaml: 50 clients, LDA alpha 0.1, 20% per round, 5 local epochs,
FedAvg CNN, SGD 0.01 with momentum 0.9): does any default leave a method at chance?

Each method runs as a user runs it, `fl-lightning fit --config configs/settings/mnist5k.yaml
--model NAME`, in its own subprocess with W&B off, into `<out>/<NAME>`; its numbers are read from
that run directory (summary.json, metrics.csv). A method that cannot run on the setting as it is
gets the smallest change it needs, printed in the table's last column:

- model-heterogeneous methods evaluate every client's own model on the client's own test split:
  `--data.client_test_fraction 0.25` (their accuracy is `clients/test_acc`, not the global test
  set's), with the setting's FedAvg CNN as a one-architecture model group;
- FedRep trains the head for 10 epochs, then the body for 1 (its defaults), so
  `--data.local_epochs 11`;
- FedBN keeps BatchNorm layers local: `--model.init_args.model mlp_bn` (the FedAvg CNN has none).

Methods that keep a personal part or model (FedPer, FedRep, FedBN, Ditto, Per-FedAvg, kNN-Per)
are also evaluated as they are meant to be used, each client's own model on a test set drawn
from the global test set with the client's label distribution (`--personalization.enabled true
--personalization.epochs [0] --data.client_test align`; this changes no training): their global
model alone can stay near chance by design (FedPer's global head is never trained).

Columns: the final round's accuracy, the mean over all rounds (how fast it leaves chance), the
best, the final's difference from FedAvg's, the chance level of the method's accuracy, and the
personalised accuracy after the last round with its own chance level. A chance level is the
accuracy of always answering the majority class: of the global test set, or summed over clients
on their own test sets with each client answering its most frequent training class. A method is
flagged "AT CHANCE" when its best round, and its personalised accuracy if it has one, are within
2 points of their chance levels.

A finished run is not run again (delete its directory, or pass --rerun), so an interrupted
benchmark continues where it stopped.

Usage:
    python benchmarks/method_defaults.py [--rounds 15] [--methods FedAvg FedAdagrad ...]
        [--out runs/bench_method_defaults] [--rerun] [--markdown table.md]
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
from fl_lightning.comparison import read_metrics  # noqa: E402
from fl_lightning.methods.base import FederatedMethod, SharedModelMethod  # noqa: E402

SETTING = REPO / "configs" / "settings" / "mnist5k.yaml"
HETERO_TEST_FRACTION = 0.25
CHANCE_MARGIN = 0.02

# what a method needs beyond the setting to run at all, and why (printed in the table)
CHANGES: dict[str, tuple[list[str], str]] = {
    "FedRep": (["--data.local_epochs", "11"], "local_epochs 11 (head 10 + body 1)"),
    "FedBN": (["--model.init_args.model", "mlp_bn"], "model mlp_bn (needs BatchNorm)"),
}
HETERO_CHANGE = (["--data.client_test_fraction", str(HETERO_TEST_FRACTION)],
                 "client_test_fraction 0.25; per-client accuracy")
PERSONAL_EVAL = ["--personalization.enabled", "true", "--personalization.epochs", "[0]", "--data.client_test", "align"]


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


def changes_for(name: str) -> tuple[list[str], str]:
    if is_hetero(name):
        return HETERO_CHANGE
    return CHANGES.get(name, ([], ""))


def run_method(name: str, rounds: int, out: Path, rerun: bool) -> Path:
    run_dir = out / name
    summary = run_dir / "summary.json"
    if not rerun and summary.exists():
        done = json.loads(summary.read_text())
        if done.get("finished") and done.get("max_rounds") == rounds:
            return run_dir
    extra, _ = changes_for(name)
    if is_personal(name):
        extra = [*extra, *PERSONAL_EVAL]
    cmd = [sys.executable, "-m", "fl_lightning.cli", "fit", "--config", str(SETTING), "--model", name, *extra,
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


def chance_levels() -> dict[str, float]:
    """The accuracy of always answering the majority class: on the global test set; on the
    clients' own splits of their data (model-heterogeneous methods); on the clients' test sets
    drawn from the global test set (personalised evaluation)."""
    from fl_lightning.data.datamodule import FederatedDataModule

    data = yaml.safe_load(SETTING.read_text())["data"]
    split = FederatedDataModule(**{**data, "client_test_fraction": HETERO_TEST_FRACTION})
    split.setup()
    aligned = FederatedDataModule(**{**data, "client_test": "align"})
    aligned.setup()
    test_labels = np.asarray(aligned.test_set.labels)
    return {"global/test_acc": float(np.bincount(test_labels).max() / len(test_labels)),
            "clients/test_acc": majority_rate(split), "personal": majority_rate(aligned)}


def result(run_dir: Path) -> dict:
    """Outcome, final / mean / best accuracy (fractions) from a run directory."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {"outcome": "no summary"}
    key = summary.get("accuracy") or "global/test_acc"
    try:
        rows = read_metrics(run_dir / "metrics.csv")
    except (OSError, ValueError, KeyError):
        rows = []
    curve = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return {"outcome": summary.get("outcome", "?"), "key": key, "rounds": summary.get("rounds_completed"),
            "final": curve[-1] if curve else None, "mean": float(np.mean(curve)) if curve else None,
            "best": max(curve) if curve else None, "seconds": summary.get("wall_time_s"),
            "personal": personal_accuracy(run_dir.parent / f"{run_dir.name}.log")}


def personal_accuracy(log: Path) -> float | None:
    """The clients' own models' mean accuracy from the personalised evaluation's line in the
    run's output (`... personalised accuracy (...): global a+-s, ft0 a+-s, own a+-s`)."""
    try:
        lines = [ln for ln in log.read_text().splitlines() if "personalised accuracy" in ln]
    except OSError:
        return None
    found = re.search(r"\bown ([0-9.]+)\+-", lines[-1]) if lines else None
    return float(found.group(1)) if found else None


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def at_chance(r: dict, chance: dict[str, float]) -> bool:
    level = chance.get(r.get("key", ""))
    if r.get("best") is None or level is None or r["best"] > level + CHANCE_MARGIN:
        return False
    return r.get("personal") is None or r["personal"] <= chance["personal"] + CHANCE_MARGIN


def table(names: list[str], results: dict[str, dict], chance: dict[str, float]) -> str:
    base = results.get("FedAvg", {}).get("final")
    lines = ["| method | outcome | final % | mean % | best % | final - FedAvg | chance % | personal % (chance %) | "
             "at chance | beyond the setting |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for name in names:
        r = results[name]
        diff = "-"
        if r.get("final") is not None and base is not None and r.get("key") == "global/test_acc":
            diff = f"{100 * (r['final'] - base):+.1f}"
        personal = "-" if r.get("personal") is None else f"{pct(r['personal'])} ({pct(chance['personal'])})"
        lines.append(f"| {name} | {r.get('outcome', '?')} | {pct(r.get('final'))} | {pct(r.get('mean'))} | "
                     f"{pct(r.get('best'))} | {diff} | {pct(chance.get(r.get('key', '')))} | {personal} | "
                     f"{'AT CHANCE' if at_chance(r, chance) else ''} | {changes_for(name)[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--methods", nargs="+", help="method class names (default: every registered method)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_method_defaults")
    parser.add_argument("--rerun", action="store_true", help="run again methods whose finished run is in --out")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    known = registered_methods()
    names = args.methods or known
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"error: unknown method(s) {', '.join(unknown)}; registered: {', '.join(known)}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    if "FedAvg" not in names:
        names = ["FedAvg", *names]
    else:
        names = ["FedAvg", *[n for n in names if n != "FedAvg"]]
    results = {}
    for name in names:
        results[name] = result(run_method(name, args.rounds, args.out, args.rerun))
    text = table(names, results, chance_levels())
    header = (f"{args.rounds} rounds of configs/settings/mnist5k.yaml per method, shipped defaults; "
              f"accuracy: global test set (model-heterogeneous methods: clients' own test splits)")
    print(header)
    print(text)
    if args.markdown:
        args.markdown.write_text(header + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
