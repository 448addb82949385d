# Set-up and entry points. Each target installs what it needs into .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test install sim-seeds bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch is pinned here (set-up), the project itself asks for a range.
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python -m gossiprec demo

test: install
	$(BIN)/python -m pytest -q -ra

# Thousands of simulator seeds per scenario (not part of CI; tens of minutes).
sim-seeds: install
	$(BIN)/python -m gossiprec sim-seeds --seeds 10000

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
