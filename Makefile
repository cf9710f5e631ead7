# Two entry points, each sets itself up into .venv on a fresh machine:
#   make demo   -- the numerics demo (fp16 overflow found, explained and fixed), CPU only
#   make test   -- installs everything (torch pinned to the local CPU wheel) and runs lint + tests (the tests that
#                  read the machine twice: as they find it, and with its kernel log and cgroups hidden); as root with
#                  apt-get (CI) it also installs Chromium, which the `numerics show` page test opens (else it skips)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned for the test environment only; users may run any torch >= 2.4.
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint browser bench bench-comm clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.runtime
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/torchdoctor demo

lint: $(VENV)/.test
	$(BIN)/ruff check src tests benchmarks

# The page `numerics show` writes is opened in headless Chromium by its test: installed here where this runs as root
# with apt-get (as CI does); anywhere else, or when apt-get cannot install it, that test skips and says why.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium (apt-get) for the numerics page test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
	       >/dev/null 2>&1; } \
	  || echo "chromium could not be installed: the numerics page test will skip"; \
	fi

# The tests that read the machine (marker `machine`: kernel log, cgroups, memory) run a second time as on a
# machine that lets a process read neither the kernel log nor its cgroup files, so both branches run everywhere.
# Two workers, a test file each at a time (a file's module fixtures are made once): on 2 cores the suite took 13.5 min
# instead of 20 in one process (its tests start real processes; one compute thread each, tests/conftest.py).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

test: lint browser
	$(PYTEST)
	TORCHDOCTOR_UNREADABLE=kernel-log,cgroup $(PYTEST) -m machine

bench: $(VENV)/.test
	$(BIN)/python benchmarks/numerics_overhead.py

bench-comm: $(VENV)/.runtime
	$(BIN)/python benchmarks/comm_bandwidth.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
