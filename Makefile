# gr_plugin: `make demo` sets up and runs the main job, `make test` sets up and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-all lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m recipes.infer +kvcache=flexkv

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q --run-slow

lint: setup
	$(PY) -m ruff check gr_plugin recipes tests

bench: setup
	$(PY) -m recipes.bench
