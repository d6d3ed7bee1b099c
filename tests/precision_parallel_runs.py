"""The precision matrix with clients in parallel (`--federation.parallel clients`): every family once,
every precision, through the CLI, for tests/test_precision_matrix.py.

    python tests/precision_parallel_runs.py OUT [CELL ...]                 one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/precision_parallel_runs.py OUT

Each cell's run directory is OUT/<cell>; without CELLs, every cell runs.
"""

from __future__ import annotations

import os
import sys

from parallel_runs import TINY

from fl_lightning.cli import main

HETERO = ["--data.client_test_fraction", "0.25", "--model.init_args.model", "mlp,mlp",
          "--model.init_args.feature_dim", "16"]
CONST = ["--model.init_args.constraint", "joint"]
ANALYSES = ["--analysis.every_n_rounds", "1", "--analysis.samples", "64", "--analysis.top_k", "2",
            "--analysis.max_hvps", "6", "--analysis.layer_hvps", "2", "--analysis.surface_points", "3"]
CELLS = {  # name: (method, precision, extra arguments); every family once, every precision
    "FedAvg+CONST@32-true": ("FedAvg", "32-true", CONST),
    "FedProx@32-true": ("FedProx", "32-true", []),
    "SCAFFOLD@64-true": ("SCAFFOLD", "64-true", ANALYSES),
    "Ditto@64-true": ("Ditto", "64-true", []),
    "FedGen@64-true": ("FedGen", "64-true", HETERO),
    "FedSOL@bf16-mixed": ("FedSOL", "bf16-mixed", []),
    "MOON@bf16-mixed": ("MOON", "bf16-mixed", ANALYSES),
    "FedORGP@bf16-mixed": ("FedORGP", "bf16-mixed", HETERO),
    "FedSAM@bf16-true": ("FedSAM", "bf16-true", []),
    "FedDrPlus@bf16-true": ("FedDrPlus", "bf16-true", ANALYSES),
}


def run(out: str, cells: list[str]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launch = ["--trainer.strategy", "ddp", "--trainer.devices", str(world)] if world > 1 else []
    for cell in cells:
        method, precision, extra = CELLS[cell]
        try:
            main(["fit", "--model", method, *TINY, "--trainer.max_epochs", "2", *launch,
                  "--trainer.precision", precision, *extra, "--trainer.default_root_dir", os.path.join(out, cell)])
        except SystemExit as stop:  # the CLI exits non-zero for a refused or failed run: go on with the others
            if stop.code:
                print(f"{cell}: exit {stop.code}", file=sys.stderr)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:] or list(CELLS))
