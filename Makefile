# One-command set-up, demo and tests on a CPU machine (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: setup demo test test-fast test-latest pin bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints/cpu.txt constraints/torch-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -c constraints/cpu.txt -e ".[dev]"
	touch $@

demo: setup        ## train the embedded tiny model on the built-in task with Lite PPO
	$(BIN)/rldsl run algorithms/lite_ppo.rl

test: setup        ## the whole suite (slow end-to-end tests included)
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The suite against the newest release of every dependency (only torch pinned to its CPU
# build), in its own venv: drift is found on purpose, not by a fresh clone's `make test`.
# Not part of CI. When it passes, `make pin` records the new versions.
LATEST = .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --upgrade pip
	$(LATEST)/bin/pip install -c constraints/torch-cpu.txt -e ".[dev]"
	$(LATEST)/bin/pip freeze --exclude-editable > $(LATEST)/resolved.txt
	RLDSL_UNPINNED=1 $(LATEST)/bin/python -m pytest -q

# Rewrite constraints/cpu.txt from a fresh resolve of pyproject.toml (after a dependency change).
pin:
	rm -rf .venv-pin
	$(PYTHON) -m venv .venv-pin
	.venv-pin/bin/pip install -c constraints/torch-cpu.txt -e ".[dev]"
	$(PYTHON) constraints/pin.py .venv-pin constraints/cpu.txt
	rm -rf .venv-pin

bench: setup
	$(BIN)/python bench/loss.py --threads 1
	$(BIN)/python bench/logprobs.py
	$(BIN)/python bench/step.py --specs lite_ppo,grpo
	$(BIN)/pip install -c constraints/cpu.txt -e ".[bench]"
	$(BIN)/python bench/vs_trl.py

clean:
	rm -rf $(VENV) $(LATEST) .venv-pin build *.egg-info .pytest_cache
