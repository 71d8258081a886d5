# Two entry points: `make train` (the default job) and `make test` (the whole suite).
# Both create .venv on first use; torch is pinned to the local CPU wheel when absent,
# because an unpinned torch would pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.moetrain-installed
TORCH_PIN ?= torch==2.13.0
CONFIG ?= configs/tiny_moe.toml
ARGS ?=

.PHONY: setup train test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# Resume is on so that a second `make train` continues (or just reports) the same run
# instead of refusing to overwrite its checkpoints.
train: $(STAMP)
	$(BIN)/moetrain train --config $(CONFIG) --checkpoint.resume auto $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
