# make demo: set up .venv and run the demo; make test: set up .venv and run the tests.
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test setup bench bench-full
demo: $(STAMP)
	$(VENV)/bin/python -m vllm_selfspec.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

setup: $(STAMP)

# The benchmark matrix (benchmarks/run.py); the bench extra adds vLLM's suffix method.
bench: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	$(VENV)/bin/python benchmarks/run.py --mode quick

bench-full: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	$(VENV)/bin/python benchmarks/run.py --mode full

$(STAMP): pyproject.toml scripts/setup.sh patches/cpu_install.py
	bash scripts/setup.sh
	touch $@
