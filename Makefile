# One-command set-up, demo and tests on a CPU machine (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
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

bench: setup
	$(BIN)/python bench/loss.py --threads 1
	$(BIN)/python bench/logprobs.py
	$(BIN)/python bench/step.py --specs lite_ppo,grpo
	$(BIN)/pip install -c constraints/cpu.txt -e ".[bench]"
	$(BIN)/python bench/vs_trl.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
