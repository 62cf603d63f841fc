# storch developer tasks.  `make test` and `make demo` bootstrap .venv on first use.
#
# torch is installed first, pinned, so that pip finds the CPU wheel and never
# resolves an unpinned `torch` to the multi-GB CUDA build.

PYTHON ?= python3
TORCH ?= torch==2.13.0

VENV := .venv
VENV_PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

SC_VENV := .venv-storchastic
SC_PY := $(SC_VENV)/bin/python
SC_STAMP := $(SC_VENV)/.installed

.PHONY: venv docs docs-serve test test-seeds fuzz demo bench bench-quick bench-sbn bench-storchastic bench-gsb bench-gsb-extra bench-memory clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --upgrade "pip>=25.1"  # 25.1: `pip show storch` prints its SPDX licence
	$(VENV_PY) -m pip install "$(TORCH)"
	$(VENV_PY) -m pip install -e ".[test,demo]"
	touch $@

# The whole suite, then the documentation examples and docstring examples once more on torch's
# portable CPU kernels (ATEN_CPU_CAPABILITY=default) instead of the machine's vector ones: a printed
# figure that depends on the CPU's floating-point path fails here as it would on a user's machine.
test: $(STAMP)
	$(VENV_PY) -m pytest
	ATEN_CPU_CAPABILITY=default $(VENV_PY) -m pytest -p no:cacheprovider tests/test_docs.py tests/docs_output.py storch

# The package as users install it (~2 minutes): sdist and wheel from `python -m build`, the wheel
# without extras in a fresh venv (torch pinned first), then import, the README's example,
# `storch-bench list`, a 20-step storch-bench run, `python -m storch.demo --help` (scripts/wheel_smoke.sh).
.PHONY: smoke
smoke:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" bash scripts/wheel_smoke.sh

DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(VENV_PY) -m pip install -e ".[docs]"
	touch $@

# The documentation site into site/ (--strict: a broken link or reference fails); then the lint of
# its sources and pages (scripts/docs_lint.py: no issue numbers, machine paths or Sphinx roles, code
# lines that fit the page), which fails the build with the file and line of each finding; then,
# when a headless Chromium is installed, every page's screenshot checked for blank or unstyled pages
# and for code blocks or tables cut off at 1280 px (scripts/docs_screenshot.py). Nothing is installed on the system: without a
# browser the screenshot step says how to get one and passes, unless SCREENSHOTS=required (CI).
SCREENSHOTS ?= optional

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV_PY) -m mkdocs build --strict --site-dir site
	$(VENV_PY) scripts/docs_lint.py --site site
	$(VENV_PY) scripts/docs_screenshot.py site site/_screenshots $(if $(filter required,$(SCREENSHOTS)),--require-browser)

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV_PY) -m mkdocs serve

# The tests again at base seeds 0..9 (STORCH_TEST_SEED, see tests/conftest.py), ~3 min: the
# statistical tests must pass from any seed. Not part of `make test`.
test-seeds: $(STAMP)
	$(VENV_PY) scripts/test_seeds.py

# storch's random-graph tester (storch.testing.fuzz) on 3000 seeds (about 6 minutes on 2 cores): random
# stochastic computation graphs, each node's estimator drawn from the catalog's unbiased entries,
# gradients and Hessian-vector products against exact values. Failing graphs are shrunk and written
# as runnable scripts to fuzz-failures/. More: FUZZ_ARGS="--start 3000 --count 10000".
FUZZ_ARGS ?= --count 3000

fuzz: $(STAMP)
	$(VENV_PY) -m storch.testing.fuzz $(FUZZ_ARGS) --out fuzz-failures

demo: $(STAMP)
	$(VENV_PY) -m storch.demo

bench: $(STAMP) $(SC_STAMP)
	$(VENV_PY) benchmarks/run.py

# storch-bench smoke run: sbn-linear on scikit-learn's digits, DisARM, 300 steps (seconds; benchmarks/results/bench-quick).
bench-quick: $(STAMP)
	$(VENV_PY) -m storch.bench --model sbn-linear --data digits --estimator disarm --steps 300 \
		--eval-size 250 --out benchmarks/results/bench-quick --overwrite --no-progress

# Linear SBN 784-[200] on binarized MNIST: storch vs hand-written REINFORCE/RLOO/ARM/DisARM (~1 min).
bench-sbn: $(STAMP)
	$(VENV_PY) benchmarks/sbn_step.py

# Resident memory over 10 000 training steps (must stay flat; about 2 minutes).
bench-memory: $(STAMP)
	$(VENV_PY) benchmarks/memory_soak.py

# The reproductions of the GSB paper's experiments (plots need matplotlib, the `bench` extra).
bench-gsb: $(STAMP)
	$(VENV_PY) -m pip install -e ".[bench]"
	$(VENV_PY) benchmarks/gsb/toy_problems.py
	$(VENV_PY) benchmarks/gsb/bayes_logreg.py

# Companions: truncation beyond the gamma series' radius (~5 min), probes vs exact derivatives (~2 min).
bench-gsb-extra: $(STAMP)
	$(VENV_PY) -m pip install -e ".[bench]"
	$(VENV_PY) benchmarks/gsb/toy_closed_form.py
	$(VENV_PY) benchmarks/gsb/logistic_regression.py

# Storchastic 0.3.7 also imports as `storch`, so it lives in its own venv and process.
$(SC_STAMP):
	test -x $(SC_PY) || $(PYTHON) -m venv $(SC_VENV)
	$(SC_PY) -m pip install "$(TORCH)"
	$(SC_PY) -m pip install storchastic==0.3.7 entmax pyro-ppl
	touch $@

bench-storchastic: $(SC_STAMP)
	$(SC_PY) benchmarks/storchastic_step.py

clean:
	rm -rf $(VENV) $(SC_VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
