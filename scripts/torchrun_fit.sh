#!/usr/bin/env bash
# A fit whose round's clients train in parallel on every GPU of one or several nodes, launched by
# torchrun (Lightning reads the ranks from torchrun's environment).
#
#   One node, 4 GPUs:
#     scripts/torchrun_fit.sh 4 --config configs/settings/fedsol_cifar10.yaml --config configs/methods/fedsol/fedsol.yaml
#   Two nodes, 4 GPUs each: run this on both nodes, with the first node's address:
#     NNODES=2 MASTER=node01:29500 scripts/torchrun_fit.sh 4 --config configs/settings/fedsol_cifar10.yaml \
#         --config configs/methods/fedsol/fedsol.yaml
#   CPU only (gloo), e.g. 2 processes on a laptop:
#     scripts/torchrun_fit.sh 2 --config configs/settings/mnist5k.yaml --trainer.accelerator cpu
#
# Everything after the process count goes to `fl-lightning fit`. Resume an interrupted run with
# the same command plus `--ckpt_path last`, on the same or a different number of processes.
set -euo pipefail
NPROC=${1:?usage: scripts/torchrun_fit.sh PROCESSES_PER_NODE [fl-lightning fit arguments]}
shift
NNODES=${NNODES:-1}
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "${MASTER:-localhost:29500}" \
  -m fl_lightning.cli fit --trainer.strategy ddp --trainer.devices "$NPROC" --trainer.num_nodes "$NNODES" "$@"
