#!/usr/bin/env bash
# On a lent GPU (after scripts/device-session.sh has assembled the default model): train several
# router recipes side by side on the one GPU, then pack the runs (without checkpoints) into
# $OUT/train.tgz and their logs into $OUT/logs.tgz.
#   bash scripts/device-session.sh run -- bash scripts/train-parallel.sh \
#       "NAME|RECIPE|override override ..." "NAME2|RECIPE2|..." ...
# Each run writes /tmp/elasticfw-device/train/NAME (elasticfw train RECIPE --overwrite --output ...).
# GPU memory is shared: on one H100 (80 GB) two SmolLM2 runs at micro_batch_size 16 and a third
# (three modes, micro_batch_size 8) ran out of memory together (2026-12-07); two at a time fit.
# A call lasts at most 10 minutes, so longer runs span calls while the machine stays warm:
#   DEADLINE=540  stop every run (SIGTERM) 540 s after this script started; each keeps its last
#                 checkpoint (pass train.checkpoint_every=10 or so among the overrides)
#   RESUME=1      continue the named runs that exist from their checkpoints (--resume instead of
#                 --overwrite); names not run before start afresh
set -euo pipefail
T=/tmp/elasticfw-device/train
mkdir -p "$T" "$OUT"
begin=$(date +%s)
first=${1%%|*}; rest=${1#*|}; recipe=${rest%%|*}
python3 -c "from elasticfw.model.loading import load_model; from elasticfw.recipe import load_recipe; \
load_model(load_recipe('$recipe').model)"   # converts the GGUF once
pids=()
for spec in "$@"; do
  name=${spec%%|*}; rest=${spec#*|}; recipe=${rest%%|*}; overrides=${rest#*|}
  [ "$overrides" = "$rest" ] && overrides=""
  mode=--overwrite; [ "${RESUME:-0}" = 1 ] && [ -d "$T/$name" ] && mode=--resume
  limit=()
  if [ -n "${DEADLINE:-}" ]; then limit=(timeout --kill-after=30 "$(( DEADLINE - ($(date +%s) - begin) ))"); fi
  # shellcheck disable=SC2086
  "${limit[@]}" python3 -m elasticfw.cli train "$recipe" $overrides $mode --output "$T/$name" >> "$T/$name.log" 2>&1 &
  pids+=($!)
  # the next run starts once this one has cached the task samples (they are shared)
  until grep -q "training router\|already trained" "$T/$name.log" || ! kill -0 "${pids[-1]}" 2>/dev/null; do sleep 2; done
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
names=(); for spec in "$@"; do names+=("${spec%%|*}"); done
tar -C "$T" -czf "$OUT/train.tgz" --exclude='checkpoints' "${names[@]}" || rc=$?
tar -C "$T" -czf "$OUT/logs.tgz" $(for n in "${names[@]}"; do echo "$n.log"; done) || rc=$?
for n in "${names[@]}"; do echo "== $n"; grep -v "it/s\]\|step/s\]\|s/step\]" "$T/$n.log" | tail -8; done
exit $rc
