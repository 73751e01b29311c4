# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv and installs what it needs
# (the demo only mpdoctor[demo]; the tests everything else on top). `make test` then runs the extra corners of
# the support matrix (docs/support-matrix.md), each in its own venv: Colab's stack, the oldest and the newest
# releases mpdoctor claims. What each corner runs and leaves out is said in tests/corners.py.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
COLAB_VENV := .venv-colab
DEMO_STAMP := $(VENV)/.mpdoctor-demo-installed
STAMP := $(VENV)/.mpdoctor-installed
COLAB_STAMP := $(COLAB_VENV)/.mpdoctor-installed
LAB_STAMP := $(VENV)/.mpdoctor-lab-installed
PYTEST_ARGS ?=
# Each suite runs on every core, up to 4 (pytest-xdist; a file's tests stay on one worker, so its module
# fixtures are built once), with one torch thread per worker so that the workers do not fight over the cores.
# TEST_WORKERS=0 runs a suite in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
RUN_TESTS := PYTHONDONTWRITEBYTECODE= $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=1)
# The corners' interpreters: the lowest and the highest Python mpdoctor claims (pyenv's, where it is).
CORNER_PYTHON_oldest ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python) python3.10)
CORNER_PYTHON_newest ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13.*/bin/python) python3.13)
CORNERS := main kernels corpus colab oldest newest
# What a corner installs beside mpdoctor[test], for the tests only it collects (tests/corners.py, CORNER_ONLY):
# timm's EMA, whose torchvision must match the corner's torch.
CORNER_EXTRAS_newest := timm torchvision
# A corner's venv needs this much free disk (here and in pip's temporary directory) before it is built: a disk
# that fills mid-install leaves pip's "No space left on device" after minutes of downloads, and a half-built venv.
# Two corners may be built at once (make test), each about 6 GB with pip's unpacked wheels beside it.
CORNER_FREE_GB ?= 14
# $(call need_free_gb,GB,WHAT): stop with a clear message unless GB are free where the venv and pip's temporary
# files go.
define need_free_gb
for dir in . "$${TMPDIR:-/tmp}"; do \
	free=$$(df -Pk "$$dir" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(1) ]; then \
		echo "== $(2); $$free GB are free on $$dir, $(1) GB are needed. Free some space (or set CORNER_FREE_GB) and run make test again."; \
		exit 1; \
	fi; \
done
endef

# The test venvs' installs do not byte-compile what they install: compiling every module is most of an install's
# CPU (the colab venv: 113 s with it, 55 s without; 99 s of user time against 32). The suites compile what they
# import instead, once, on first import: they run with bytecode writing on (PYTHONDONTWRITEBYTECODE emptied, as
# some machines set it; without .pyc files every test process would compile torch again). The demo's and the
# lab's installs compile as usual: a user's later runs must not pay for it. When `make test` is what creates .venv,
# its demo install does not compile either (DEMO_PIP_INSTALL below): that compile is every module of torch and
# transformers, 42 s against 17 s here, while the demo later compiles only what it imports, once.
PIP_INSTALL ?= --no-compile
DEMO_PIP_INSTALL ?=

.PHONY: demo test test-main test-kernels test-corpus test-colab test-oldest test-newest lab bench bench-quick env lint checks-doc browser-deps clean

# `make demo` installs what the demo needs and nothing more: mpdoctor with its `demo` extra (the `hf` extra and
# adamw-bf16) over the pinned CPU torch. pip without -q: even that first install fetches torch, and would
# otherwise be minutes of silence.
$(DEMO_STAMP): pyproject.toml constraints.txt Makefile
	@echo "== creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip in $(VENV)"
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "== installing mpdoctor with its demo extra into $(VENV) (torch CPU, transformers, accelerate, peft, adamw-bf16)"
	$(BIN)/python -m pip install $(strip $(DEMO_PIP_INSTALL) --progress-bar off) -c constraints.txt -e ".[demo]"
	touch $@

# `make test` adds the rest to the same venv: the test tools, JupyterLab and Playwright, the training stack, DeepSpeed.
$(STAMP): $(DEMO_STAMP) pyproject.toml constraints.txt Makefile
	@echo "== installing mpdoctor with its test, browser and stack extras into $(VENV) (pytest, JupyterLab, Playwright, Lightning, ...)"
	$(BIN)/python -m pip install $(PIP_INSTALL) --progress-bar off -c constraints.txt -e ".[test,browser,stack]"
	@echo "== installing DeepSpeed (an sdist: pure Python with DS_BUILD_OPS=0, its CPU op is built on first use)"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install $(PIP_INSTALL) --progress-bar off --no-build-isolation --no-deps -c constraints.txt deepspeed
	touch $@

# Colab's stack (IPython 7.34, ipywidgets 7.7.1): the widget and magic tests run here too.
$(COLAB_STAMP): pyproject.toml constraints-colab.txt Makefile
	@echo "== creating $(COLAB_VENV) (Colab's stack) with $(PYTHON)"
	$(PYTHON) -m venv $(COLAB_VENV)
	@echo "== upgrading pip in $(COLAB_VENV)"
	$(COLAB_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "== installing mpdoctor with its test extra on IPython 7.34 / ipywidgets 7.7.1 into $(COLAB_VENV)"
	$(COLAB_VENV)/bin/python -m pip install $(PIP_INSTALL) --progress-bar off -c constraints-colab.txt -e ".[test]"
	touch $@

# A version corner (oldest, newest): torch alone first, then mpdoctor[test] within the corner's constraints
# (resolving torch with the old floors in one go backtracked for over ten minutes). Any torch but the pinned
# one is the registry's CUDA build (about 2.5 GB with its nvidia wheels, cached by pip after the first run);
# it runs on the CPU.
.venv-%/.mpdoctor-installed: constraints-%.txt pyproject.toml Makefile
	@$(call need_free_gb,$(CORNER_FREE_GB),.venv-$*: torch's CUDA build and its nvidia wheels unpack to about 6 GB)
	@echo "== creating .venv-$* (the $* corner of the support matrix) with $(CORNER_PYTHON_$*)"
	$(CORNER_PYTHON_$*) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --upgrade pip
	@echo "== installing torch alone into .venv-$*"
	.venv-$*/bin/python -m pip install $(PIP_INSTALL) --progress-bar off -c constraints-$*.txt torch
	@echo "== installing mpdoctor with its test extra into .venv-$*"
	.venv-$*/bin/python -m pip install $(PIP_INSTALL) --progress-bar off -c constraints-$*.txt -e ".[test]"
	$(if $(CORNER_EXTRAS_$*),.venv-$*/bin/python -m pip install $(PIP_INSTALL) --progress-bar off -c constraints-$*.txt $(CORNER_EXTRAS_$*))
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/python -m mpdoctor demo

# The venvs are built first, two at a time (pip spends most of an install on one core: unpacking wheels), each
# install's output kept together; then every corner runs, also after one fails (a failure in one must not hide
# the others; a venv that failed to build fails its corner, with pip's error, when the corner retries it); then
# the failures.
VENV_STAMPS := $(STAMP) $(COLAB_STAMP) $(foreach c,$(filter-out main kernels corpus colab,$(CORNERS)),.venv-$(c)/.mpdoctor-installed)
INSTALL_JOBS ?= 2

test:
	@echo "== make test: building the venvs, $(INSTALL_JOBS) at a time (each install's log shows when it ends)"
	@$(MAKE) --no-print-directory -k -j$(INSTALL_JOBS) --output-sync=target DEMO_PIP_INSTALL="$(PIP_INSTALL)" $(VENV_STAMPS) || \
		echo "== make test: a venv failed to build; its corner retries it below"
	@failed=""; for corner in $(CORNERS); do \
		$(MAKE) --no-print-directory test-$$corner || failed="$$failed $$corner"; \
	done; \
	if [ -n "$$failed" ]; then echo "== make test: failed in:$$failed"; exit 1; fi; \
	echo "== make test: every corner passed ($(CORNERS))"

# The browser suite also drives classic Notebook in the Colab venv, so build it first.
test-main: $(STAMP) $(COLAB_STAMP)
	$(BIN)/ruff check mpdoctor tests bench notebooks
	$(BIN)/lint-imports
	$(BIN)/vulture
	$(BIN)/xenon --max-absolute C mpdoctor
	$(RUN_TESTS) MPDOCTOR_NO_SKIPS=1 $(BIN)/python -m pytest $(PARALLEL) $(PYTEST_ARGS)

# The numerics-sensitive tests (KERNELS in tests/corners.py) again in .venv under forced CPU kernels, whatever this
# CPU has: torch's ATen capability and oneDNN's ISA held to the same level, lowest first. A test that holds only on
# the kernels of the machine it was written on (AVX512-BF16, AMX) fails here, not on a user's machine.
KERNEL_CAPABILITIES := default:SSE41 avx2:AVX2
# The levels run side by side, each on its share of the cores (in one process each on two cores: one two-worker run
# after the other took 74 s here, side by side 60 s), each level's output printed whole when it ends.
KERNEL_WORKERS := $(shell echo $$(( $(TEST_WORKERS) / $(words $(KERNEL_CAPABILITIES)) )))
KERNEL_PARALLEL := $(if $(filter 0 1,$(KERNEL_WORKERS)),,-n $(KERNEL_WORKERS) --dist loadfile)
test-kernels: $(STAMP)
	@logs=$$(mktemp -d); \
	for pair in $(KERNEL_CAPABILITIES); do \
		cap=$${pair%%:*}; isa=$${pair##*:}; \
		( PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=$$cap ONEDNN_MAX_CPU_ISA=$$isa \
			MPDOCTOR_CORNER=kernels MPDOCTOR_NO_SKIPS=1 $(BIN)/python -m pytest -p no:cacheprovider $(KERNEL_PARALLEL) \
			$(PYTEST_ARGS) > $$logs/$$cap.log 2>&1; echo $$? > $$logs/$$cap.rc ) & \
	done; \
	wait; failed=""; \
	for pair in $(KERNEL_CAPABILITIES); do \
		cap=$${pair%%:*}; isa=$${pair##*:}; \
		echo "== kernels: ATEN_CPU_CAPABILITY=$$cap ONEDNN_MAX_CPU_ISA=$$isa"; \
		cat $$logs/$$cap.log; \
		[ "$$(cat $$logs/$$cap.rc 2>/dev/null)" = 0 ] || failed="$$failed $$cap"; \
	done; \
	rm -rf $$logs; \
	if [ -n "$$failed" ]; then echo "== kernels: failed under:$$failed"; exit 1; fi

# The project's field corpus as a ratchet: every harness runs, and a case named or cured in
# docs/field-corpus-counts.json that is not now, or a healthy recipe that alarms, fails the run
# (tests/corpus_ratchet.py; --record writes a better run as the record). The corpus is not in the repository: the
# developers and CI keep it beside the clone (../shared/field-corpus); a clone without it prints NOT RUN and claims
# nothing, and under CI (CI=true) its absence fails (docs/field-corpus.md).
test-corpus: $(STAMP)
	$(BIN)/python tests/corpus_ratchet.py

# In .venv the whole stack is installed, so a skipped test is a failure (MPDOCTOR_NO_SKIPS=1, tests/conftest.py).
# On Colab's stack, the test files that reach what it changes (IPython 7.34, ipywidgets 7.7.1, ipykernel 6.17:
# shells, widgets, renderers, the magic, the notebooks), less what needs the main venv's stack
# (MPDOCTOR_CORNER=colab: tests/corners.py selects and names them).
test-colab: $(COLAB_STAMP)
	$(RUN_TESTS) MPDOCTOR_CORNER=colab $(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider $(PARALLEL) $(PYTEST_ARGS)

# The oldest and the newest releases mpdoctor claims: what tests/corners.py says each must prove.
test-oldest test-newest: test-%: .venv-%/.mpdoctor-installed
	$(RUN_TESTS) MPDOCTOR_CORNER=$* MPDOCTOR_NO_SKIPS=1 .venv-$*/bin/python -m pytest -p no:cacheprovider $(PARALLEL) $(PYTEST_ARGS)

# `make lab` installs what the notebooks import (the demo's stack, JupyterLab, bitsandbytes and torchao for
# notebooks 07 and 10), not the test stack.
$(LAB_STAMP): $(DEMO_STAMP) pyproject.toml constraints.txt Makefile
	@echo "== installing JupyterLab and the notebooks' libraries into $(VENV)"
	$(BIN)/python -m pip install --progress-bar off -c constraints.txt -e ".[lab]"
	touch $@

# Jupyter refuses to start as root (containers, CI) unless told it may.
lab: $(LAB_STAMP)
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
	rm -rf $(VENV) $(COLAB_VENV) .venv-oldest .venv-newest .pytest_cache build dist *.egg-info
