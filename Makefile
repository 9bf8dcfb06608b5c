# The two commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check lint types docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

## Bring the whole system up on this machine and serve the default model.
run: $(STAMP)
	$(BIN)/llmgw up

## Lint, type-check, build the docs strictly and run the whole test suite.
test: $(STAMP) lint types docs
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .

types: $(STAMP)
	$(BIN)/mypy

## The docs site, into .llmgw/site; strict: a broken link or a missing page fails.
## The reference pages are generated from the code (docs/gen_ref.py). Not --quiet:
## it hides the warnings that --strict counts, and a broken build passes.
docs: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .llmgw .llmgw-test .mypy_cache .ruff_cache
