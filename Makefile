# make demo: set up .venv and run the demo; make test: set up .venv and run the tests.
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test setup
demo: $(STAMP)
	$(VENV)/bin/python -m vllm_selfspec.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh patches/cpu_install.py
	bash scripts/setup.sh
	touch $@
