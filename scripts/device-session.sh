#!/usr/bin/env bash
# GPU sessions in one script: install carried wheels, assemble the default model, check, run.
#
# The device machine lacks some packages (pydantic, omegaconf, gguf, datasets, rouge-score, ...)
# and a call carries at most 64 MiB *including this checkout*, less than the default model's
# 98 MB GGUF. So the GGUF travels in numbered pieces, .gguf/p0/part0, .gguf/p1/part1, ... (see
# docs/how-to/run-on-gpu.md, "On a lent machine"), one or more per call, each call within 30 s of
# the last while the machine is warm:
#   call 1, carry [.whl]:              bash scripts/device-session.sh stage-a
#   calls 2.., carry [.gguf/pK]:       bash scripts/device-session.sh stage-a
#   last call, carry [.gguf/pN]:       bash scripts/device-session.sh stage-b -- <command ...>
#   later calls while warm:            bash scripts/device-session.sh run -- <command ...>
#   no default model needed (benchmarks with random weights), carry [.whl]:
#                                      bash scripts/device-session.sh bare -- <command ...>
# stage-a installs carried wheels and keeps carried pieces; stage-b also joins the pieces in order
# and checks the sha256. Every stage re-installs this checkout (no deps, editable), exports
# ELASTICFW_SMOLLM2_GGUF and a cache folder, prints the versions, then runs the command with its
# wall time.
set -euo pipefail
STORE=/tmp/elasticfw-device
SITE=$STORE/site
GGUF=$STORE/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$STORE"
stage=${1:?stage-a | stage-b | run | bare}; shift
[ "${1:-}" = "--" ] && shift

keep_carried() {
  if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  fi
  mkdir -p "$STORE/parts"
  for f in .gguf/*/part*; do [ -f "$f" ] && cp "$f" "$STORE/parts/"; done
  echo "kept GGUF pieces: $(ls "$STORE/parts" | tr '\n' ' ')"
}

case "$stage" in
  stage-a)
    keep_carried
    echo "stage-a: carry the next piece (or stage-b with the last) within 30 s"
    ;;
  stage-b)
    keep_carried
    [ -f "$STORE/parts/part0" ] || { echo "stage-b: piece 0 is gone (the machine went cold): start again" >&2; exit 3; }
    ls "$STORE"/parts/part* | sort -V | xargs cat > "$GGUF.tmp"
    echo "$SHA  $GGUF.tmp" | sha256sum -c - >/dev/null \
      || { echo "GGUF sha256 mismatch: pieces $(ls "$STORE/parts" | tr '\n' ' ') (one missing?)" >&2; exit 3; }
    mv "$GGUF.tmp" "$GGUF"; rm -rf "$STORE/parts"
    echo "stage-b: GGUF assembled, sha256 ok"
    ;;
  bare) keep_carried ;;
  run) [ -f "$GGUF" ] || { echo "run: no GGUF (the machine went cold): stage-a and stage-b again" >&2; exit 3; } ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
[ $# -eq 0 ] && exit 0

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export ELASTICFW_SMOLLM2_GGUF=$GGUF ELASTICFW_CACHE=$STORE/cache
# the device copy's .git is the session's first checkout, not the tree that travelled: the commit comes
# from .whl/COMMIT (written here before the call: scripts/device-carry.sh, or `git rev-parse HEAD > .whl/COMMIT`)
if [ -z "${ELASTICFW_COMMIT:-}" ] && [ -f .whl/COMMIT ]; then ELASTICFW_COMMIT=$(cat .whl/COMMIT); fi
export ELASTICFW_COMMIT=${ELASTICFW_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
python3 - <<'PY'
import torch, transformers, pydantic, datasets, elasticfw
print(f"torch {torch.__version__} cuda {torch.version.cuda} gpus {torch.cuda.device_count()} "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}; transformers {transformers.__version__}; "
      f"pydantic {pydantic.__version__}; datasets {datasets.__version__}")
PY
start=$(date +%s)
rc=0
"$@" || rc=$?
echo "[device-session] command took $(( $(date +%s) - start )) s (exit $rc)"
# a call returns at most 8 files from $OUT (and none more than two folders down): beyond that, the
# files left out are lost with the machine, so more than 8 travel back as one archive, out.tgz
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  files=$(find "$OUT" -type f | wc -l)
  if [ "$files" -gt 8 ]; then
    tar -czf "$STORE/out.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$STORE/out.tgz" "$OUT/out.tgz"
    echo "[device-session] $files files under \$OUT packed into out.tgz (tar -xzf out.tgz here)"
  fi
fi
exit $rc
