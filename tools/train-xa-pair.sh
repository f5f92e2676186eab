#!/usr/bin/env bash
# On a lent GPU (after tools/device-session.sh has assembled the model): train the Elastic FA-XA
# and XA-SSA routers side by side on one GPU, then pack the runs (without their checkpoints) into $OUT/train.tgz.
# Usage: bash tools/device-session.sh stage-b -- bash tools/train-xa-pair.sh
set -euo pipefail
T=/tmp/elasticfw-device/train
mkdir -p "$T" "$OUT/train"  # logs in $OUT/train
python3 -c "from elasticfw.model.loading import load_model; from elasticfw.recipe import load_recipe; \
load_model(load_recipe('recipes/train/smollm2-fa-xa.yaml').model)"   # converts the GGUF once
python3 -m elasticfw.cli train recipes/train/smollm2-fa-xa.yaml train.evaluate=false --overwrite \
  --output "$T/smollm2-fa-xa" > "$OUT/train/smollm2-fa-xa.log" 2>&1 &
a=$!
# the second run starts once the first has cached the shared task samples
until grep -q "training router" "$OUT/train/smollm2-fa-xa.log" || ! kill -0 $a 2>/dev/null; do sleep 2; done
python3 -m elasticfw.cli train recipes/train/smollm2-xa-ssa.yaml train.evaluate=false --overwrite \
  --output "$T/smollm2-xa-ssa" > "$OUT/train/smollm2-xa-ssa.log" 2>&1 &
b=$!
rc=0; wait $a || rc=$?; wait $b || rc=$?
# one archive: a call brings back only a few files
tar -C "$T" -czf "$OUT/train.tgz" --exclude='step-*' smollm2-fa-xa smollm2-xa-ssa || rc=$?
exit $rc
