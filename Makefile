# pstore developer entry points. `make help` lists them.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: help install dev demo lint test test-rust test-python bench bench-full

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: ## build and install the wheel with the test tools and the torch extra (and, as root, libfuse3 for the power-loss test)
	@if [ "$$(id -u)" = 0 ] && ! ldconfig -p | grep -q 'libfuse3\.so\.3'; then \
		apt-get update -qq && apt-get install -y -qq libfuse3-3; fi
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet ".[test,torch]"

dev: ## build the extension into the source tree (editable install) with the test tools
	$(PIP) install --quiet -e ".[test,torch]"

demo: install ## the main job: train a recommender on the embedded store (fetches MovieLens-100k from PyPI's recbole wheel)
	$(PYTHON) -P -m pstore demo --fetch

lint: ## cargo fmt, clippy, ruff, mypy (strict, pyproject.toml), and the native stub check
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	$(PYTHON) -m ruff check pstore tests benches examples
	$(PYTHON) -m ruff format --check pstore tests benches examples
	$(PYTHON) -m mypy
	$(PYTHON) -P -m mypy.stubtest pstore._native

test-rust: ## Rust unit and integration tests of the core (no Python)
	cargo test --quiet

test-python: ## the pytest suite against the installed package
	cd tests && $(PYTHON) -m pytest -q -p no:cacheprovider

test: install lint test-rust test-python ## everything CI runs: install, lint, Rust tests, pytest

bench: ## peer benchmarks, quick mode (a few minutes)
	$(PIP) install --quiet ".[bench]"
	$(PYTHON) benches/run.py --quick

bench-full: ## peer benchmarks at full size
	$(PIP) install --quiet ".[bench]"
	$(PYTHON) benches/run.py --full
