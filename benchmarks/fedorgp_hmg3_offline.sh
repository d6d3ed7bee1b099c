#!/usr/bin/env bash
# FedORGP and its baselines on offline data with the HMG3 model group (4-layer CNN, GoogLeNet,
# MobileNetV2): scikit-learn's 8x8 digits upsampled to 3x32x32, 20 clients all participating,
# pathological 2 classes per client (75/25 per-client train/test), ROUNDS rounds, 1 local epoch,
# batch 32, SGD lr 0.01, K = 512. Prints each method's final and best client test accuracy.
# Usage: benchmarks/fedorgp_hmg3_offline.sh [ROUNDS] [DATASET]   (defaults: 5 digits)
#        METHODS="fedorgp fedgen" benchmarks/fedorgp_hmg3_offline.sh ...   (a subset)
set -euo pipefail
ROUNDS=${1:-5}
DATASET=${2:-digits}
PY=${PYTHON:-python}
OUT=${OUT:-runs/bench_fedorgp_hmg3}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
METHODS=${METHODS:-fedorgp fedorgp_wo_or fedproto fedtgp lgfedavg fedgh fml fedkd fedgen}
for m in $METHODS; do
  "$PY" -m fl_lightning.cli fit --config configs/settings/fedorgp_demo_mnist5k_hmg3.yaml \
    --config "configs/methods/fedorgp/${m}.yaml" \
    --data.dataset "$DATASET" --trainer.max_epochs "$ROUNDS" --trainer.logger false \
    --trainer.enable_progress_bar false --trainer.default_root_dir "$OUT/$m" > "$OUT/$m.log" 2>&1 || echo "$m failed (see $OUT/$m.log)"
  last=$(grep -E "round [0-9]+/[0-9]+: client" "$OUT/$m.log" | tail -1 || true)
  echo "$m | $last"
done
