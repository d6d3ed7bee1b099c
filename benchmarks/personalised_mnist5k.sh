#!/usr/bin/env bash
# The one-step personalised baselines against FedAvg-FT on the offline MNIST-5k demo setting
# (50 clients, LDA alpha 0.1, 20% per round, 5 local epochs; per-client test sets drawn to follow
# each client's label distribution). Prints each method's last personalised-evaluation line:
# global = the global model on each client's test set, ft1/ft5 = fine-tuned 1/5 epochs,
# own = the method's own personal model.
# Usage: benchmarks/personalised_mnist5k.sh [ROUNDS]   (default 20)
#        METHODS="FedPer Ditto" benchmarks/personalised_mnist5k.sh 10   (a subset)
set -euo pipefail
ROUNDS=${1:-20}
PY=${PYTHON:-python}
OUT=${OUT:-runs/bench_personalised_mnist5k}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
METHODS=${METHODS:-FedAvg FedPer FedRep Ditto PerFedAvg KNNPer}
for m in $METHODS; do
  extra=()
  # FedRep's local epochs are its head epochs + body epochs (4 + 1 = the setting's 5)
  if [ "$m" = FedRep ]; then extra=(--model.head_epochs 4 --model.body_epochs 1); fi
  "$PY" -m fl_lightning.cli fit --config configs/settings/mnist5k.yaml --model "$m" "${extra[@]}" \
    --trainer.max_epochs "$ROUNDS" --trainer.logger false --trainer.enable_progress_bar false \
    --data.client_test align --personalization.enabled true --personalization.epochs [1,5] \
    --trainer.default_root_dir "$OUT/$m" > "$OUT/$m.log" 2>&1 || echo "$m failed (see $OUT/$m.log)"
  last=$(grep -E "personalised accuracy" "$OUT/$m.log" | tail -1 || true)
  echo "$m | $last"
done
