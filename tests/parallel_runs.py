"""Runs several tiny fits in one (possibly torchrun-launched) job, for tests/test_parallel.py.

    python tests/parallel_runs.py OUT METHOD[,METHOD...] [extra CLI args]
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/parallel_runs.py OUT ...

Under torchrun every run uses `--trainer.strategy ddp` with as many devices as processes (so
`--federation.parallel clients`, the default); without it, one process, no strategy: the plain
path the parallel runs must reproduce. Each method's run directory is OUT/<method>.
"""

from __future__ import annotations

import os
import sys

from fl_lightning.cli import main

TINY = ["--seed_everything", "0", "--data.dataset", "digits", "--model.init_args.model", "mlp",
        "--data.num_clients", "10", "--data.sample_ratio", "0.5", "--data.local_epochs", "1", "--data.batch_size", "10",
        "--data.partition", "dirichlet", "--data.alpha", "0.1", "--data.min_size", "5",
        "--federation.local_eval_samples", "200", "--trainer.max_epochs", "3", "--trainer.logger", "false",
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false"]


def run(out: str, methods: list[str], extra: list[str]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launch = ["--trainer.strategy", "ddp", "--trainer.devices", str(world)] if world > 1 else []
    for method in methods:
        main(["fit", "--model", method, *TINY, *launch, *extra,
              "--trainer.default_root_dir", os.path.join(out, method)])


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
