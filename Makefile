# Set-up and entry points for CPU-only machines. `make run` and `make test` install first.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
STAMP = .install.stamp

.PHONY: install run test bench

$(STAMP): requirements-cpu.lock pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps -r requirements-cpu.lock
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PYTHON) -m laplace_debiased

test: $(STAMP)
	$(PYTHON) -m pytest -q tests
