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
## As root, the Debian packages the network test bed needs come first, if missing.
test: $(STAMP) lint types docs
	.ci/system-packages
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30

lint: $(STAMP)
	$(BIN)/ruff check .

types: $(STAMP)
	$(BIN)/mypy

## The docs site, into .llmgw/site; strict: a broken link or a missing page fails.
## The reference pages are generated from the code (docs/gen_ref.py). Not --quiet:
## it hides the warnings that --strict counts, and a broken build passes.
docs: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

## Also this clone's directories in the system dir (LLMGW_SYSTEM_DIR, default
## /var/lib/llmgw), which an agent run as root makes for a work dir its engine
## user cannot reach (worker_agent/system_dir.py system_place): each is found by its
## work-dir note naming a work dir in this clone; other clones' are left alone.
clean:
	rm -rf $(VENV) .llmgw .llmgw-test .mypy_cache .ruff_cache
	@sys="$${LLMGW_SYSTEM_DIR-/var/lib/llmgw}"; top="$$(pwd -P)"; \
	if [ "$$(id -u)" = 0 ] && [ -n "$$sys" ] && [ -d "$$sys" ]; then \
	  for note in "$$sys"/*/work-dir; do \
	    [ -f "$$note" ] && [ ! -L "$$note" ] || continue; \
	    case "$$(head -n 1 "$$note")" in \
	      "$$top" | "$$top"/*) echo "rm -rf $${note%/work-dir}"; rm -rf "$${note%/work-dir}";; \
	    esac; \
	  done; \
	fi
