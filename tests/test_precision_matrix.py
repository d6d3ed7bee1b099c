"""Every precision through every kind of local step (the precision matrix), on CPU: two tiny rounds of
one method per family in 32-true, 64-true, bf16-mixed and bf16-true give finite results, with the
parameters in the precision's dtype (a float32 tensor inside a float64 run was a crash or a silent
loss of precision: the analyses' subsets, model-heterogeneous client models, FedGen's noise and
heads, FedORGP's prototypes, and the local models' evaluation after every client, on by default).
The analyses and personalised evaluation (fine-tuned copies, Ditto's personal models) run in every
precision too."""

import json
import math

import pytest
from precision_matrix import DTYPE, FAMILIES, PRECISIONS, two_rounds


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_runs_in_a_precision(family, precision):
    result = two_rounds(family, precision)
    assert result["finite"], result
    assert result["acc"] is not None and math.isfinite(result["acc"]) and 0.0 <= result["acc"] <= 1.0
    assert result["dtypes"] == {str(DTYPE[precision])}, result["dtypes"]
    # no local step waits for the device: no tensor value goes to the host in it (FedGen's and the
    # prototype methods' losses read a flag per step, ProximalProjection its projection choice)
    assert result["host_syncs"] == {}, result["host_syncs"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ["FedAvg", "Ditto", "FedORGP"])
def test_the_analyses_run_in_a_precision(family, precision):
    result = two_rounds(family, precision, analyses=True)
    assert result["finite"] and math.isfinite(result["acc"])


def test_every_family_runs_with_clients_in_parallel_on_two_processes_in_every_precision(tmp_path):
    """A subset of the matrix through the CLI on 2 gloo processes (`--federation.parallel clients`,
    tests/precision_parallel_runs.py): every family once, every precision at least twice, analyses
    in three of them. Each run finishes with a finite accuracy and its weights in the precision's
    dtype; the float64 runs equal the one-process runs (to float64 rounding of the reductions)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from precision_parallel_runs import CELLS

    here = Path(__file__).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    float64 = [cell for cell, (_, precision, _) in CELLS.items() if precision == "64-true"]
    for prefix, out, cells in (([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2"], tmp_path / "two", []), ([sys.executable], tmp_path / "one", float64)):
        done = subprocess.run([*prefix, str(here / "precision_parallel_runs.py"), str(out), *cells],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0 and " exit " not in done.stderr, done.stderr[-3000:]

    def weights(root: Path) -> dict:
        return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]

    for cell, (_, precision, _) in CELLS.items():
        summary = json.loads((tmp_path / "two" / cell / "summary.json").read_text())
        assert summary["outcome"] == "finished" and 0.0 <= summary["final_acc"] <= 1.0, (cell, summary)
        two = weights(tmp_path / "two" / cell)
        assert {str(v.dtype) for v in two.values() if v.is_floating_point()} == {str(DTYPE[precision])}, cell
        if cell in float64:
            one = weights(tmp_path / "one" / cell)
            assert set(one) == set(two)
            for key, value in one.items():
                where = f"{cell} {key}"
                torch.testing.assert_close(two[key], value, rtol=1e-9, atol=1e-9, msg=lambda m, w=where: f"{w}: {m}")
