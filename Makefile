# Set-up and entry points for CPU-only machines. `make run` and `make test` need only `python3`
# on the PATH: they create ./.venv with it (Debian's python3 refuses pip outside a venv, PEP 668),
# install into it, then run. `make ... PYTHON=/path/to/python3.11` picks another interpreter.
PYTHON ?= python3
VENV ?= .venv
PY = $(VENV)/bin/python

# The install is keyed to the interpreter: its version and the hash of its real path. Another
# python3 (a pyenv switch, an upgrade) recreates the venv instead of reusing a broken one.
INTERPRETER := $(shell $(PYTHON) -c 'import hashlib, os, sys; assert sys.version_info >= (3, 11); print(sys.version.split()[0] + "-" + hashlib.sha1(os.path.realpath(sys.executable).encode()).hexdigest()[:10])' 2>/dev/null)
STAMP = $(VENV)/.installed-$(INTERPRETER)

.PHONY: install run test test-latest docs bench outputs examples main-job-doc diagnose-doc clean-venv

$(STAMP): requirements-cpu.lock pyproject.toml
	@test -n "$(INTERPRETER)" || { echo "make: '$(PYTHON)' is not a working Python 3.11+; install python3 or run e.g. 'make $(MAKECMDGOALS) PYTHON=/usr/bin/python3.11'" >&2; exit 1; }
	@if [ "$$(cat $(VENV)/.interpreter 2>/dev/null)" != "$(INTERPRETER)" ]; then \
	  rm -rf $(VENV); \
	  echo "creating $(VENV) with $(PYTHON) ($(INTERPRETER))"; \
	  $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	    echo "make: '$(PYTHON) -m venv' failed. On Debian/Ubuntu install the venv module first: 'sudo apt install python3-venv', then rerun make." >&2; exit 1; }; \
	  echo "$(INTERPRETER)" > $(VENV)/.interpreter; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-cpu.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

run: $(STAMP)
	$(PY) -m laplace_debiased

# The suite on TEST_WORKERS pytest-xdist processes: each module is one work unit (its fixtures
# are built once), modules with slow tests start first, and each worker gets its share of the
# cores as torch threads (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

# The suite against the newest releases of torch, laplace-torch and curvlinops that resolve within
# pyproject.toml's ranges, in its own venv LATEST_VENV; everything else at the pins of
# requirements-cpu.lock (--no-deps). torchvision, which laplace-torch declares but never imports, is
# removed, as in the pinned stack. PyPI's Linux torch wheel is the CUDA build (several GB of NVIDIA
# libraries; it runs on a CPU too); pip options for that first install go in LATEST_PIP_ARGS.
LATEST_VENV ?= .venv-latest
LATEST_PIP_ARGS ?=
test-latest:
	@test -n "$(INTERPRETER)" || { echo "make: '$(PYTHON)' is not a working Python 3.11+; run e.g. 'make test-latest PYTHON=/usr/bin/python3.11'" >&2; exit 1; }
	@test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV) || { rm -rf $(LATEST_VENV); \
	  echo "make: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: 'sudo apt install python3-venv'" >&2; exit 1; }
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade $(LATEST_PIP_ARGS) torch laplace-torch curvlinops-for-pytorch -e .
	grep -vE '^(laplace-torch|curvlinops-for-pytorch)==' requirements-cpu.lock > $(LATEST_VENV)/rest-of-lock.txt
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r $(LATEST_VENV)/rest-of-lock.txt
	$(LATEST_VENV)/bin/python -m pip uninstall -q -y torchvision
	@$(LATEST_VENV)/bin/python -c 'from importlib.metadata import version; print("testing with", *(f"{p} {version(p)}" for p in ("torch", "laplace-torch", "curvlinops-for-pytorch")), sep="\n  ")'
	$(LATEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

clean-venv:
	rm -rf $(VENV) $(DOCS_VENV) $(LATEST_VENV)

# The documentation site (mkdocs-material + mkdocstrings, docs/ and mkdocs.yml) into site/, with
# --strict: a broken link or anchor, a docstring mkdocstrings cannot parse, or a public name
# missing from the API reference fails the build. Its tools live in their own venv, pinned in
# requirements-docs.lock and installed with --no-deps (no torch needed: the API is read from source).
DOCS_VENV ?= .venv-docs
DOCS_STAMP = $(DOCS_VENV)/.installed-$(INTERPRETER)

$(DOCS_STAMP): requirements-docs.lock
	@test -n "$(INTERPRETER)" || { echo "make: '$(PYTHON)' is not a working Python 3.11+; run e.g. 'make docs PYTHON=/usr/bin/python3.11'" >&2; exit 1; }
	rm -rf $(DOCS_VENV)
	$(PYTHON) -m venv $(DOCS_VENV) || { rm -rf $(DOCS_VENV); echo "make: '$(PYTHON) -m venv' failed; on Debian/Ubuntu: 'sudo apt install python3-venv'" >&2; exit 1; }
	$(DOCS_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-docs.lock
	@touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

# Every committed output that the docs include or quote, regenerated with the current code: the
# examples' (examples), the main job's report excerpt (main-job-doc) and the bias diagnosis
# (diagnose-doc). tests/test_example_outputs.py checks that the pages and the examples' docstrings
# quote only numbers these files hold. The last digits depend on the CPU; commit what this prints.
outputs: examples main-job-doc diagnose-doc

# Runs every example with one thread and writes the command and its printed table to
# docs/tutorials/output/NAME.txt, which the example pages include and the quick-start page quotes
# (tests/test_example_outputs.py checks the quotes).
# calibration_report.py runs in a scratch folder with --out calibration_report (the relative path
# it prints), and its report (Markdown and figures) is copied to docs/tutorials/output/.
EXAMPLES_SCRATCH ?= /tmp/laplace-debiased-examples
examples: $(STAMP)
	@rm -rf $(EXAMPLES_SCRATCH) && mkdir -p $(EXAMPLES_SCRATCH)
	@for f in examples/*.py; do echo "$$f"; name=$$(basename $$f .py); out=$(CURDIR)/docs/tutorials/output/$$name.txt; \
	  args=$$([ $$name = calibration_report ] && echo "--out calibration_report"); \
	  echo "\$$ OMP_NUM_THREADS=1 python $$f $$args" | sed 's/ *$$//' > $$out; \
	  (cd $(EXAMPLES_SCRATCH) && OMP_NUM_THREADS=1 $(CURDIR)/$(PY) $(CURDIR)/$$f $$args >> $$out) || exit 1; done
	cp $(EXAMPLES_SCRATCH)/calibration_report/report/report.md $(EXAMPLES_SCRATCH)/calibration_report/report/*.png \
	  docs/tutorials/output/calibration_report/

# Runs the main job with one thread and writes the command and two sections of its report (MAP vs
# LA at the chosen δ; tracking the full batch over the grid) to docs/getting-started/output/main-job.md,
# which the main-job page includes. It starts from an empty MAIN_JOB_OUT: resuming a folder of an
# earlier checkout would keep that code's rows.
MAIN_JOB_OUT ?= /tmp/laplace-debiased-main-job
main-job-doc: $(STAMP)
	rm -rf $(MAIN_JOB_OUT)
	OMP_NUM_THREADS=1 $(PY) -m laplace_debiased --out $(MAIN_JOB_OUT) --threads 1
	@mkdir -p docs/getting-started/output
	@{ echo "Written by \`make main-job-doc\` (\`OMP_NUM_THREADS=1 python -m laplace_debiased --threads 1\`)."; echo; \
	  awk '/^## /{keep=($$0=="## MAP vs LA at the chosen δ" || $$0=="## Batch size: where debiasing helps" || $$0=="## Tracking the full batch over the whole grid")} keep && !/^!\[/' \
	  $(MAIN_JOB_OUT)/report/report.md | sed 's/^## /### /'; } > docs/getting-started/output/main-job.md
	cp $(MAIN_JOB_OUT)/report/tracking_by_delta.png docs/getting-started/output/

# Runs the bias diagnosis with its defaults (the main job's digits CNN) and one thread, and writes
# its report (Markdown and figures) to docs/guide/output/diagnose/, which the diagnostics guide
# quotes. The JSON of the measurements stays in the scratch folder.
DIAGNOSE_OUT ?= /tmp/laplace-debiased-diagnose
diagnose-doc: $(STAMP)
	rm -rf $(DIAGNOSE_OUT)
	OMP_NUM_THREADS=1 $(PY) -m laplace_debiased diagnose --out $(DIAGNOSE_OUT) --threads 1 --quiet
	@rm -rf docs/guide/output/diagnose && mkdir -p docs/guide/output/diagnose
	cp $(DIAGNOSE_OUT)/README.md $(DIAGNOSE_OUT)/*.png docs/guide/output/diagnose/

# Benchmarks (not tests) need real CIFAR-10. Give its folder with CIFAR10_DIR=DIR (holding
# cifar-10-batches-bin/ or cifar-10-batches-py/), or CIFAR10_SOURCE=DIR holding the project's
# build_cifar10.py and its JPEG tars (default: ../shared/data, when it exists), which builds the
# binary layout once into CIFAR10_DIR.
CIFAR10_DIR ?= $(HOME)/.cache/laplace-debiased/data
CIFAR10_SOURCE ?= $(wildcard ../shared/data)
bench: $(STAMP)
	@if [ ! -d "$(CIFAR10_DIR)/cifar-10-batches-bin" ] && [ ! -d "$(CIFAR10_DIR)/cifar-10-batches-py" ]; then \
	  if [ -f "$(CIFAR10_SOURCE)/build_cifar10.py" ]; then \
	    $(PY) "$(CIFAR10_SOURCE)/build_cifar10.py" "$(CIFAR10_DIR)" || exit 1; \
	  else \
	    echo "make bench: no CIFAR-10 under CIFAR10_DIR=$(CIFAR10_DIR) and no CIFAR10_SOURCE with build_cifar10.py." >&2; \
	    echo "  Download the official 'CIFAR-10 binary version' from https://www.cs.toronto.edu/~kriz/cifar.html," >&2; \
	    echo "  unpack it into DIR (giving DIR/cifar-10-batches-bin/), then run: make bench CIFAR10_DIR=DIR" >&2; \
	    exit 2; \
	  fi; \
	fi
	LAPLACE_DEBIASED_DATA=$(CIFAR10_DIR) $(PY) benchmarks/sweep_speed.py
	LAPLACE_DEBIASED_DATA=$(CIFAR10_DIR) $(PY) benchmarks/cg_figure5.py
	LAPLACE_DEBIASED_DATA=$(CIFAR10_DIR) $(PY) benchmarks/cifar10_laplace.py
