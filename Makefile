# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv and installs what it needs
# (the demo only mpdoctor[demo]; the tests everything else on top).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
COLAB_VENV := .venv-colab
DEMO_STAMP := $(VENV)/.mpdoctor-demo-installed
STAMP := $(VENV)/.mpdoctor-installed
COLAB_STAMP := $(COLAB_VENV)/.mpdoctor-installed
PYTEST_ARGS ?=

.PHONY: demo test test-main test-colab lab bench bench-quick env lint checks-doc browser-deps clean

# `make demo` installs what the demo needs and nothing more: mpdoctor with its `demo` extra (the `hf` extra and
# adamw-bf16) over the pinned CPU torch. pip without -q: even that first install fetches torch, and would
# otherwise be minutes of silence.
$(DEMO_STAMP): pyproject.toml constraints.txt Makefile
	@echo "== creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip in $(VENV)"
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "== installing mpdoctor with its demo extra into $(VENV) (torch CPU, transformers, accelerate, peft, adamw-bf16)"
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e ".[demo]"
	touch $@

# `make test` adds the rest to the same venv: the test tools, JupyterLab and Playwright, the training stack, DeepSpeed.
$(STAMP): $(DEMO_STAMP) pyproject.toml constraints.txt Makefile
	@echo "== installing mpdoctor with its test, browser and stack extras into $(VENV) (pytest, JupyterLab, Playwright, Lightning, ...)"
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e ".[test,browser,stack]"
	@echo "== installing DeepSpeed (an sdist: pure Python with DS_BUILD_OPS=0, its CPU op is built on first use)"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --progress-bar off --no-build-isolation --no-deps -c constraints.txt deepspeed
	touch $@

# Colab's stack (IPython 7.34, ipywidgets 7.7.1): the widget and magic tests run here too.
$(COLAB_STAMP): pyproject.toml constraints-colab.txt Makefile
	@echo "== creating $(COLAB_VENV) (Colab's stack) with $(PYTHON)"
	$(PYTHON) -m venv $(COLAB_VENV)
	@echo "== upgrading pip in $(COLAB_VENV)"
	$(COLAB_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "== installing mpdoctor with its test extra on IPython 7.34 / ipywidgets 7.7.1 into $(COLAB_VENV)"
	$(COLAB_VENV)/bin/python -m pip install --progress-bar off -c constraints-colab.txt -e ".[test]"
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/python -m mpdoctor demo

test: test-main test-colab

# The browser suite also drives classic Notebook in the Colab venv, so build it first.
test-main: $(STAMP) $(COLAB_STAMP)
	$(BIN)/ruff check mpdoctor tests bench notebooks
	$(BIN)/lint-imports
	$(BIN)/vulture
	$(BIN)/xenon --max-absolute C mpdoctor
	MPDOCTOR_NO_SKIPS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# In .venv the whole stack is installed, so a skipped test is a failure (MPDOCTOR_NO_SKIPS=1, tests/conftest.py).
# The suite again on Colab's stack, notebooks included (their kernel is IPython 7.34 / ipykernel 6.17);
# the browser, Binder and benchmark tests need the main venv's JupyterLab, and tests/stack and tests/distributed
# the training stack beyond transformers; they run there only.
test-colab: $(COLAB_STAMP)
	$(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider --ignore=tests/stack --ignore=tests/distributed --ignore=tests/test_browser.py \
		--ignore=tests/test_binder.py --ignore=tests/test_bench_smoke.py $(PYTEST_ARGS)

# Jupyter refuses to start as root (containers, CI) unless told it may.
lab: $(STAMP)
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/00_tour.ipynb

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

bench-quick: $(STAMP)
	$(BIN)/python bench/run_all.py --quick

env: $(STAMP)
	$(BIN)/python -m mpdoctor env

# Dead code (vulture, configured in pyproject.toml) and a complexity ceiling: xenon's rank C is a cyclomatic
# complexity of at most 20 for every function, method and class (radon's ranks: A 1-5, B 6-10, C 11-20, D 21-30).
lint: $(STAMP)
	$(BIN)/ruff check mpdoctor tests bench notebooks
	$(BIN)/lint-imports
	$(BIN)/vulture
	$(BIN)/xenon --max-absolute C mpdoctor

# Regenerate docs/checks.md from the check docstrings (a test fails when it is stale).
checks-doc: $(DEMO_STAMP)
	$(BIN)/python -m mpdoctor checks --update-docs

# Debian's Chromium for the real-browser test (browsers cannot be downloaded by Playwright here).
browser-deps:
	@if [ -x /usr/bin/chromium ]; then echo "chromium present"; \
	else apt-get update -q && apt-get install -y -q chromium; fi

clean:
	rm -rf $(VENV) $(COLAB_VENV) .pytest_cache build dist *.egg-info
