# kvpush: `make demo` runs the main job, `make test` runs every check.
# Both build .venv themselves on a fresh machine.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpush-installed
# vLLM pins its own versions of nearly everything: it gets a venv of its own, which the
# vLLM end-to-end test (tests/test_vllm_e2e.py) starts servers from.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvpush-installed
# Debian packages that tests need: iproute2 for the two-host (network namespace) test,
# libibverbs1 and libnuma1 for Mooncake's CPU build, which the benchmark compares against.
DEB_PACKAGES := iproute2 libibverbs1 libnuma1

.PHONY: all demo test lint typecheck pytest pytest-vllm pytest-rest venv vllm-venv clean bench-full test-dp

all: test

$(STAMP): pyproject.toml scripts/setup-venv
	PYTHON=$(PYTHON) VENV=$(VENV) DEB_PACKAGES="$(DEB_PACKAGES)" bash scripts/setup-venv
	touch $@

venv: $(STAMP)

$(VLLM_STAMP): scripts/setup-vllm-venv
	PYTHON=$(PYTHON) VLLM_VENV=$(VLLM_VENV) bash scripts/setup-vllm-venv
	touch $@

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvpush demo

lint: $(STAMP)
	$(BIN)/ruff format --check src tests tools scripts
	$(BIN)/ruff check src tests tools
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# Two pytest runs side by side: the tests that start vLLM servers (marker `vllm`), one
# after another as before (a pair takes ~6 GB and most of a core to start), and the rest
# beside them; each prints its output whole when it ends (-O), and either failing fails
# the target. The slowest tests of each are listed at the end.
PYTEST_ARGS := -p no:cacheprovider --durations=15

pytest: $(STAMP) $(VLLM_STAMP)
	$(MAKE) --no-print-directory -j2 -O pytest-vllm pytest-rest

pytest-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/pytest $(PYTEST_ARGS) -m vllm

pytest-rest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS) -m "not vllm"

test: lint typecheck pytest

# vLLM at data parallelism 2 (tests/test_vllm_e2e_dp.py) alone; make test runs it too.
test-dp: $(STAMP) $(VLLM_STAMP)
	$(BIN)/pytest -m dp tests/test_vllm_e2e_dp.py

bench-full: $(STAMP)
	$(BIN)/kvpush bench --json runs/bench.json --plot docs/bench.png

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .grimp_cache
