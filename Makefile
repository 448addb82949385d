# Set-up and entry points. Each target installs what it needs into .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-long lint docs install sim-seeds bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch is pinned here (set-up), the project itself asks for a range.
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

# A local job (agents + 4 trainer ranks + 2 hot spares) loses a rank to SIGKILL, then hangs another, and
# recovers both in place.
demo: install
	$(BIN)/python -m gossiprec demo

# Lint (ruff: gossiprec and tests; mypy --strict: the whole gossiprec package), then every test.
lint: install
	$(BIN)/ruff check gossiprec tests
	$(BIN)/mypy

# The documentation site (docs/, mkdocs.yml), built strictly: a broken link, anchor or a missing page fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $${DOCS_SITE:-site}

test: lint docs
	$(BIN)/python -m pytest -q -ra --durations=15

# The tests left out of `make test` (marked long: their path is covered by another test; several minutes).
test-long: install
	$(BIN)/python -m pytest -q -ra -m long

# Thousands of simulator seeds per scenario (not part of CI; tens of minutes).
sim-seeds: install
	for s in crash rack hang straggler partition split oneway flap donor join; do \
	  $(BIN)/python -m gossiprec sim --scenario $$s --nodes 10 --duration 20 --seeds $${SEEDS:-10000} --json || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
