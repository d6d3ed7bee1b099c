"""The first command to run on a machine with GPUs (scripts/gpu_check.sh): two tiny rounds of one
method of every family through the CLI, on the CPU, then on `cuda` in 32-true, 16-mixed and
bf16-mixed, then on two GPUs with clients in parallel (`--federation.parallel clients`), checking
that every run ends with finite results and that 2 GPUs agree with 1 (the GPU runs in 32-true use
deterministic algorithms where torch has them). Prints a pass/fail table with the time per local
step (the rounds' wall time over the local steps, rank 0's on 2 GPUs) and the seconds per run
(start-up included). On a GPU it then times the FedAvg CNN demo's local step in both memory layouts
(`--model.memory_format channels_last` and `contiguous`, in 32-true and bf16-mixed): whether
channels-last, the "auto" choice on CUDA, is the faster there; and (on the CPU too with --engines)
the local step's time with the sequential and the vectorised engine (`--federation.engine`),
FedAvg and FedSOL. On a machine without a GPU it runs the CPU part, says so, and exits 0.

    bash scripts/gpu_check.sh [--families FedAvg SCAFFOLD ...] [--root /tmp/gpu_check] [--engines]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
S, M = REPO / "configs" / "settings", REPO / "configs" / "methods"
TINY = ["--config", str(S / "mnist5k.yaml"), "--data.dataset", "digits", "--data.num_clients", "8",
        "--data.min_size", "5", "--federation.eval_local_models", "false", "--trainer.max_epochs", "2",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--analysis.partition", "false"]
HETERO = ["--model.init_args.model", "mlp,fedavg_cnn", "--data.client_test_fraction", "0.25"]
FAMILIES = {  # one method per kind of local step
    "FedAvg": [M / "fedsol" / "fedavg.yaml"],
    "FedProx": [M / "fedsol" / "fedprox.yaml"],
    "SCAFFOLD": [M / "fedsol" / "scaffold.yaml"],
    "FedSAM": [M / "fedsol" / "fedsam.yaml"],
    "FedSOL": [M / "fedsol" / "fedsol.yaml"],
    "MOON": [M / "fedsol" / "moon.yaml"],
    "FedDr+": [M / "feddr_cifar100" / "feddr_plus.yaml"],
    "Ditto": [M / "feddr_cifar100" / "ditto.yaml"],
    "FedORGP": [M / "fedorgp" / "fedorgp.yaml"],
    "FedGen": [M / "fedorgp" / "fedgen.yaml"],
    "FedAvg+CONST": [M / "fedsol" / "fedavg.yaml", M / "fedconst" / "const.yaml"],
}


def command(family: str, root: Path, accelerator: str, precision: str, devices: int,
            extra: tuple[str, ...] = ()) -> list[str]:
    args = [sys.executable, "-m", "fl_lightning.cli", "fit", *TINY]
    args[6:6] = [a for f in FAMILIES[family] for a in ("--config", str(f))]  # after the setting
    args += HETERO if family in ("FedORGP", "FedGen") else ["--model.init_args.model", "mlp"]
    args += ["--trainer.accelerator", accelerator, "--trainer.precision", precision,
             "--trainer.devices", str(devices), "--trainer.default_root_dir", str(root)]
    if devices > 1:
        args += ["--trainer.strategy", "ddp", "--federation.parallel", "clients"]
    if accelerator == "gpu" and precision == "32-true":  # compared across 1 and 2 GPUs
        args += ["--trainer.deterministic", "warn"]
    return args + list(extra)


def ms_per_step(root: Path) -> float:
    """The rounds' wall time (perf/round_seconds: local training and the server step) over the
    local steps this process took (the checkpoint's global_step), in milliseconds."""
    import torch

    with open(root / "metrics.csv", newline="") as f:
        seconds = sum(float(r["perf/round_seconds"]) for r in csv.DictReader(f) if r.get("perf/round_seconds"))
    steps = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    return 1000.0 * seconds / steps if steps else math.nan


def run(family: str, root: Path, accelerator: str, precision: str,
        devices: int = 1, extra: tuple[str, ...] = ()) -> tuple[str, float, float, float]:
    """(pass/FAIL: reason, final accuracy, ms per local step, seconds)."""
    start = time.perf_counter()
    env = {**os.environ, "WANDB_MODE": "offline", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS
    done = subprocess.run(command(family, root, accelerator, precision, devices, extra), cwd=REPO,
                          capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return f"FAIL: exit {done.returncode}: {lines[-1] if lines else ''}", math.nan, math.nan, seconds
    summary = json.loads((root / "summary.json").read_text())
    acc = summary.get("final_acc")
    if not (summary.get("finished") and isinstance(acc, float) and math.isfinite(acc)):
        return f"FAIL: outcome {summary.get('outcome')}, final accuracy {acc}", math.nan, math.nan, seconds
    return "pass", acc, ms_per_step(root), seconds


# ---- the memory layouts (`--model.memory_format`) on the GPU -------------------------------------
LAYOUT_RUN = ["--config", str(S / "mnist5k.yaml"), "--config", str(M / "fedsol" / "fedavg.yaml"),
              "--model.init_args.model", "fedavg_cnn", "--federation.eval_local_models", "false",
              "--trainer.max_epochs", "3", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
              "--analysis.partition", "false", "--analysis.divergence", "false", "--trainer.accelerator", "gpu",
              "--trainer.devices", "1"]


def layout_times(root: Path, precisions=("32-true", "bf16-mixed"), repeats: int = 2) -> list[tuple[str, str, float]]:
    """(precision, layout, ms per local step) of the FedAvg CNN demo (3 rounds) on one GPU in
    channels-last and in the default layout, the two layouts interleaved, the best of `repeats`:
    what "auto" should choose on this GPU."""
    rows = []
    env = {**os.environ, "WANDB_MODE": "offline"}
    for precision in precisions:
        best = {"channels_last": math.inf, "contiguous": math.inf}
        for repeat in range(repeats):
            for layout in best:
                where = root / "layouts" / f"{precision}_{layout}_{repeat}"
                args = [sys.executable, "-m", "fl_lightning.cli", "fit", *LAYOUT_RUN, "--trainer.precision", precision,
                        "--model.init_args.memory_format", layout, "--trainer.default_root_dir", str(where)]
                done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env)
                if done.returncode == 0:
                    best[layout] = min(best[layout], ms_per_step(where))
                else:
                    lines = [line for line in done.stderr.splitlines() if line.strip()]
                    print(f"layouts: {precision} {layout} failed: {lines[-1] if lines else done.returncode}")
        rows += [(precision, layout, ms) for layout, ms in best.items()]
    return rows


def print_layouts(rows: list[tuple[str, str, float]]) -> None:
    print(f"{'FedAvg CNN on 1 GPU':22s} {'precision':11s} {'layout':14s} {'ms/step':>8s}")
    for precision, layout, ms in rows:
        print(f"{'':22s} {precision:11s} {layout:14s} {ms:8.2f}")
    for precision in dict.fromkeys(p for p, _, _ in rows):
        ms = {layout: t for p, layout, t in rows if p == precision}
        print(f"{precision}: channels-last / contiguous {ms['channels_last'] / ms['contiguous']:.3f} "
              f"(below 1: channels-last, the 'auto' choice on CUDA, is the faster here)")


ENGINE_FAMILIES = ("FedAvg", "FedSOL")  # the vectorised engine's methods, one of each kind of step


def engine_timing(root: Path, accelerator: str) -> int:
    """The local step's time with each engine (`--federation.engine sequential` / `vectorized`),
    every client of a round sampled (8 train together), 32-true on one device: one row per method,
    the sequential/vectorized ratio, and whether the two engines' accuracies agree. Returns the
    number of failed rows."""
    failed = 0
    for family in ENGINE_FAMILIES:
        rows = {}
        for engine in ("sequential", "vectorized"):
            where = root / "engines" / family / f"{accelerator}_{engine}"
            # engine_group 0: the clients stacked on the CPU too, where a convolutional model's
            # would otherwise train one at a time (the engine's own choice there)
            stacked = ("--federation.engine_group", "0") if engine == "vectorized" else ()
            rows[engine] = run(family, where, accelerator, "32-true",
                               extra=("--data.sample_ratio", "1.0", "--federation.engine", engine, *stacked))
        (seq, seq_acc, seq_ms, _), (vec, vec_acc, vec_ms, _) = rows["sequential"], rows["vectorized"]
        result = seq if seq != "pass" else vec
        if result == "pass" and abs(seq_acc - vec_acc) > 1e-3:
            result = f"FAIL: vectorized accuracy {vec_acc:.4f} against sequential {seq_acc:.4f}"
        failed += result != "pass"
        print(f"engines {family:8s} {accelerator:4s} sequential {seq_ms:7.2f} ms/step  vectorized {vec_ms:7.2f} "
              f"ms/step  sequential/vectorized {seq_ms / vec_ms:5.2f}x  {result}", flush=True)
    return failed


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--root", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--engines", action="store_true",
                        help="also time the sequential and vectorised engines on the CPU (always done on a GPU)")
    opts = parser.parse_args(argv)
    root = Path(opts.root or tempfile.mkdtemp(prefix="gpu_check_"))
    count = gpus()
    cells = [("cpu", "32-true", 1)]
    if count:
        cells += [("gpu", p, 1) for p in ("32-true", "16-mixed", "bf16-mixed")]
    if count >= 2:
        cells += [("gpu", "32-true", 2)]
    print(f"{'family':14s} {'device':6s} {'precision':11s} {'n':>2s}  {'result':6s} {'acc':>7s} {'ms/step':>8s} "
          f"{'s/run':>6s}")
    failed = 0
    for family in opts.families:
        one_gpu = None
        for accelerator, precision, devices in cells:
            where = root / family.replace("+", "_") / f"{accelerator}_{precision}_{devices}"
            result, acc, step_ms, seconds = run(family, where, accelerator, precision, devices)
            if accelerator == "gpu" and precision == "32-true":
                if devices == 1:
                    one_gpu = acc
                elif result == "pass" and one_gpu is not None and abs(acc - one_gpu) > 1e-3:
                    result = f"FAIL: 2 GPUs {acc:.4f} against 1 GPU {one_gpu:.4f}"
            failed += result != "pass"
            print(f"{family:14s} {accelerator:6s} {precision:11s} {devices:2d}  {result:6s} {acc:7.4f} {step_ms:8.2f} "
                  f"{seconds:6.1f}", flush=True)
    if count:
        print_layouts(layout_times(root))
    if count or opts.engines:
        failed += engine_timing(root, "gpu" if count else "cpu")
    if not count:
        print("no GPU on this machine (torch.cuda.is_available() is False): ran the CPU part only")
    elif count < 2:
        print("one GPU: the 2-GPU agreement check needs two")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
