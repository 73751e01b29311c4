# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
COLAB_VENV := .venv-colab
STAMP := $(VENV)/.mpdoctor-installed
COLAB_STAMP := $(COLAB_VENV)/.mpdoctor-installed
PYTEST_ARGS ?=

.PHONY: demo test test-main test-colab lab bench bench-quick env lint checks-doc browser-deps clean

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,browser]"
	touch $@

# Colab's stack (IPython 7.34, ipywidgets 7.7.1): the widget and magic tests run here too.
$(COLAB_STAMP): pyproject.toml constraints-colab.txt Makefile
	$(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install -q --upgrade pip
	$(COLAB_VENV)/bin/python -m pip install -q -c constraints-colab.txt -e ".[test]"
	touch $@

demo: $(STAMP)
	$(BIN)/python -m mpdoctor demo

test: test-main test-colab

# The browser suite also drives classic Notebook in the Colab venv, so build it first.
test-main: $(STAMP) $(COLAB_STAMP)
	$(BIN)/ruff check mpdoctor tests bench
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The whole suite again on Colab's stack, notebooks included (their kernel is IPython 7.34 / ipykernel 6.17);
# the browser, Binder and benchmark tests need the main venv's JupyterLab and run there only.
test-colab: $(COLAB_STAMP)
	$(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider --ignore=tests/test_browser.py \
		--ignore=tests/test_binder.py --ignore=tests/test_bench_smoke.py $(PYTEST_ARGS)

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/00_tour.ipynb

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

bench-quick: $(STAMP)
	$(BIN)/python bench/run_all.py --quick

env: $(STAMP)
	$(BIN)/python -m mpdoctor env

lint: $(STAMP)
	$(BIN)/ruff check mpdoctor tests bench

checks-doc: $(STAMP)
	$(BIN)/python -m mpdoctor checks --markdown

# Debian's Chromium for the real-browser test (browsers cannot be downloaded by Playwright here).
browser-deps:
	@if [ -x /usr/bin/chromium ]; then echo "chromium present"; \
	else apt-get update -q && apt-get install -y -q chromium; fi

clean:
	rm -rf $(VENV) $(COLAB_VENV) .pytest_cache build *.egg-info
