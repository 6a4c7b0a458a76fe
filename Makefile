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

# Benchmarks (not tests): real CIFAR-10 from ../shared/data, built once into the cache.
DATA ?= $(HOME)/.cache/laplace-debiased/data
bench: $(STAMP)
	$(PYTHON) ../shared/data/build_cifar10.py $(DATA)
	LAPLACE_DEBIASED_DATA=$(DATA) $(PYTHON) benchmarks/sweep_speed.py
	LAPLACE_DEBIASED_DATA=$(DATA) $(PYTHON) benchmarks/cg_figure5.py
	LAPLACE_DEBIASED_DATA=$(DATA) $(PYTHON) benchmarks/cifar10_laplace.py
