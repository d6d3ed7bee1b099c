#!/usr/bin/env bash
# Local sweep throughput: the same runs with 1 worker and with N workers (default 2), and the
# speed-up. The spec is the demo table (configs/tables/demo_mnist5k.yaml) cut to FedAvg and FedSOL x
# seeds 0, 1 and ROUNDS rounds each, so that it takes minutes; a fresh root per worker count.
# Usage: benchmarks/sweep_workers.sh [ROUNDS] [N]     (defaults 2 and 2)
set -euo pipefail
ROUNDS=${1:-2}
N=${2:-2}
PY=${PYTHON:-python}
OUT=${OUT:-runs/bench_sweep_workers}
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" - "$OUT/spec.yaml" "$ROUNDS" <<'PYEOF'
import sys, yaml
doc = yaml.safe_load(open("configs/tables/demo_mnist5k.yaml"))["sweep"]
doc["name"] = "bench"
doc["parameters"] = {"config": {"values": ["configs/methods/fedsol/fedavg.yaml", "configs/methods/fedsol/fedsol.yaml"]},
                     "seed_everything": {"values": [0, 1]}}
doc["command"] = doc["command"][:-1] + [f"--trainer.max_epochs={sys.argv[2]}", "${args}"]
open(sys.argv[1], "w").write(yaml.safe_dump(doc, sort_keys=False))
PYEOF
declare -A WALL
for n in 1 "$N"; do
  start=$(date +%s.%N)
  "$PY" -m fl_lightning.cli sweep "$OUT/spec.yaml" --local --workers "$n" --root "$OUT/workers$n" > "$OUT/workers$n.log" 2>&1
  WALL[$n]=$(echo "$(date +%s.%N) - $start" | bc)
  echo "workers $n: $(printf %.1f "${WALL[$n]}") s for 4 runs of $ROUNDS rounds (load $(cut -d' ' -f1 /proc/loadavg))"
done
echo "speed-up workers $N / 1: $(echo "scale=2; ${WALL[1]} / ${WALL[$N]}" | bc)x"
