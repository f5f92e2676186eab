#!/usr/bin/env bash
# On a lent GPU (after scripts/device-session.sh has assembled the model): run the paper's sweep,
# or resume it when an earlier call of this warm machine ran out of time, and pack its folder
# into $OUT/sweep.tgz (a call brings back only a few files). Build the report at home:
#   tar -xzf sweep.tgz -C results/compare/smollm2-paper-sweep && elasticfw report results/compare/smollm2-paper-sweep
# Usage: bash scripts/device-session.sh run -- bash scripts/paper-sweep.sh [recipe overrides ...]
set -uo pipefail
S=/tmp/elasticfw-device/sweep
flag=--overwrite
[ -f "$S/sweep.json" ] && flag=--resume
timeout "${SWEEP_TIMEOUT:-540}" python3 -m elasticfw.cli compare recipes/compare/smollm2-paper-sweep.yaml "$@" \
  --output "$S" --no-report $flag > "$OUT/sweep.log" 2>&1
rc=$?
tar -C "$S" -czf "$OUT/sweep.tgz" .
tail -c 1500 "$OUT/sweep.log"
exit $rc
