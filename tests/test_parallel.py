"""A round's clients in parallel processes (`--federation.parallel clients`, fl_lightning/parallel.py).

The multi-process runs are real: torchrun starts 2 or 3 CPU processes (gloo) that run the CLI.
Every comparison is against the plain one-process run, which never touches the parallel code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fl_test_utils import reproducible_rows

from fl_lightning.client_store import read_client_states
from fl_lightning.parallel import assign_clients
from fl_lightning.results import read_metrics

HERE = Path(__file__).parent
RUNS = HERE / "parallel_runs.py"
SHARED_MODEL_METHODS = ["FedAvg", "FedSOL", "SCAFFOLD", "FedDyn", "MOON", "FedExP", "FedNova"]
HETERO_METHODS = ["FedORGP", "FedGen"]  # per-client models, prototypes, a server-side generator
HETERO = ["--data.client_test_fraction", "0.25", "--model.init_args.model", "mlp,mlp",
          "--model.init_args.feature_dim", "16"]
RTOL = 1e-6  # the stated tolerance; on CPU the runs are in fact bit-identical (asserted separately)


def launch(out: Path, methods: list[str], processes: int, *extra: str, timeout: int = 900) -> None:
    """Runs the methods' tiny fits on `processes` processes (torchrun when > 1); a deadlock fails
    by the timeout instead of hanging the suite."""
    prefix = [sys.executable]
    if processes > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([*prefix, str(RUNS), str(out), ",".join(methods), *extra], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def checkpoint(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def assert_same_tensors(a, b, where: str, exact: list[bool]) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys differ"
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}", exact)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=RTOL * 1e-2, msg=lambda m: f"{where}: {m}")
        exact.append(torch.equal(a, b))
    elif a is not None:
        assert a == b, where


def assert_same_run(one: Path, other: Path, exact: list[bool]) -> None:
    a, b = checkpoint(one), checkpoint(other)
    # the global model and the server state (`server.*`: SCAFFOLD's c, prototypes, the generator)
    assert_same_tensors(a["state_dict"], b["state_dict"], "state_dict", exact)
    # every client's persistent state (c_i, g_i, MOON's previous model, a heterogeneous client's
    # own model), whichever process held it
    assert_same_tensors(read_client_states(a["fl_client_states"], one / "checkpoints" / "client_states"),
                        read_client_states(b["fl_client_states"], other / "checkpoints" / "client_states"),
                        "client states", exact)
    # perf/* is each run's own clock; everything else must agree
    rows_a, rows_b = (reproducible_rows(read_metrics(root / "metrics.csv")) for root in (one, other))
    assert [r["round"] for r in rows_a] == [r["round"] for r in rows_b] == [1.0, 2.0, 3.0]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert set(ra) == set(rb)
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=RTOL, abs=1e-9), f"{other}: {key}"


def test_one_two_and_three_processes_train_the_same_models(tmp_path):
    """FedAvg, FedSOL, SCAFFOLD, FedDyn, MOON, FedExP, FedNova, FedORGP and FedGen, 3 rounds, 5
    clients a round with dirichlet(0.1) sizes: 2 processes train 3 + 2 clients, 3 processes
    2 + 2 + 1, so ranks run different numbers of clients and local steps (which must not
    deadlock). The global model, the server state, every client's state (and own model) and
    every logged per-round metric equal the plain one-process run's. One thread per process, as
    CPU matmuls round differently with different thread counts."""
    for processes in (1, 2, 3):
        launch(tmp_path / f"p{processes}", SHARED_MODEL_METHODS, processes)
        launch(tmp_path / f"p{processes}", HETERO_METHODS, processes, *HETERO)
    exact: list[bool] = []
    for method in SHARED_MODEL_METHODS + HETERO_METHODS:
        for processes in (2, 3):
            assert_same_run(tmp_path / "p1" / method, tmp_path / f"p{processes}" / method, exact)
    assert all(exact), "within tolerance, but no longer bit-identical on CPU"


def test_the_vectorised_engine_on_two_processes_trains_the_models_of_one_sequential_process(tmp_path):
    """FedSOL with `--federation.engine vectorized` on 2 gloo processes: each process trains its
    share of the round's clients stacked (3 and 2 of them), and the model, client states and
    logged metrics equal one process with the sequential engine, to float32 rounding."""
    methods = ["FedSOL"]
    launch(tmp_path / "sequential", methods, 1)
    launch(tmp_path / "vectorized", methods, 2, "--federation.engine", "vectorized")
    for method in methods:
        assert_same_run(tmp_path / "sequential" / method, tmp_path / "vectorized" / method, [])


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_resume_on_a_different_number_of_processes_equals_the_uninterrupted_run(tmp_path, first, second):
    """SCAFFOLD (per-client control variates in the client-state store): 2 rounds on `first`
    processes, then `--ckpt_path last` to round 3 on `second` processes. (The class-wise heatmap,
    drawn at a run's last round, is off: the first part's last round is 2.)"""
    no_heatmap = ("--analysis.heatmap_every_n_rounds", "0")
    launch(tmp_path / "straight", ["SCAFFOLD"], 1, *no_heatmap)
    launch(tmp_path / "split", ["SCAFFOLD"], first, "--trainer.max_epochs", "2", *no_heatmap)
    saved = checkpoint(tmp_path / "split" / "SCAFFOLD")["fl_client_states"]["manifest"]
    # every client that trained in rounds 1-2 is named exactly once, whichever process wrote it
    names = [record[0] for record in saved.values()]
    assert len(set(names)) == len(names) > 0
    assert all((tmp_path / "split" / "SCAFFOLD" / "checkpoints" / "client_states" / n).exists() for n in names)
    launch(tmp_path / "split", ["SCAFFOLD"], second, "--trainer.max_epochs", "3", "--ckpt_path", "last", *no_heatmap)
    assert_same_run(tmp_path / "straight" / "SCAFFOLD", tmp_path / "split" / "SCAFFOLD", [])


def test_clients_are_balanced_by_local_steps_and_every_rank_gets_one():
    assert assign_clients([10, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert assign_clients([5, 5, 5, 5], 3) == [[0, 3], [1], [2]]
    for steps in ([3, 1, 4, 1, 5, 9, 2, 6], [1] * 7, [100, 1, 1]):
        for world in (1, 2, 3):
            shares = assign_clients(steps, world)
            assert sorted(p for s in shares for p in s) == list(range(len(steps)))
            assert all(shares) and shares == assign_clients(steps, world)
            loads = [sum(steps[p] for p in s) for s in shares]
            # greedy longest-first: no rank exceeds the lightest by more than the largest client
            assert max(loads) - min(loads) <= max(steps)


@pytest.mark.parametrize("extra,message", [
    (["--model", "FedAvg", "--data.sample_ratio", "0.1"],
     "error: --federation.parallel clients: 2 processes but only 1 clients per round; use at most 1 processes "
     "(--trainer.devices x --trainer.num_nodes) or sample more clients (--data.sample_ratio)"),
    # once, not once per process: refused before any process is launched
    (["--model", "FedProto", "--model.init_args.feature_dim", "8", "--data.client_test_fraction", "0.25",
      "--federation.parallel", "batch"],
     "error: model-heterogeneous methods split over processes by client, not by batch: set "
     "--federation.parallel clients (or --trainer.devices 1)"),
])
def test_impossible_client_parallelism_is_one_line_and_exit_2_before_any_launch(tmp_path, extra, message):
    from parallel_runs import TINY

    args = [*TINY[:TINY.index("--model.init_args.model")], *TINY[TINY.index("--model.init_args.model") + 2:]]
    proc = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *args, *extra, "--trainer.strategy", "ddp",
                           "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [message]
    assert "Initializing distributed" not in proc.stderr  # refused before any process was launched
