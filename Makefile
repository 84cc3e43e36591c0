# fedora_jax: `make run` installs everything and runs FEDORA on rotated MNIST;
# `make test` installs everything, lints and type-checks the library, and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

VERIFY_STAMP := $(VENV)/.installed-verify

.PHONY: install run lint test test-quick test-slow verify clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: install
	$(PY) -m experiments.main --dataset=rmnist $(ARGS)

# ruff over the library, its scripts and the tests, mypy over the library, as configured
# in pyproject.toml.
lint: install
	$(VENV)/bin/ruff check fedora_jax experiments verification scripts benchmarks tests
	$(VENV)/bin/mypy fedora_jax

# Two workers: most of the suite's time is single-threaded XLA compilation. The tiers
# (tests/conftest.py): test-quick, the first check after a change, about 2 minutes on 2
# cores; test, everything but the heavy modules, under 10; test-slow, the heavy modules
# (whole programs run many times: every algorithm on every engine path, several devices
# and processes, resumed runs, sweeps). CI runs test, then test-slow.
test: install lint
	$(PY) -m pytest -q -n 2 -m "not heavy" tests

test-quick: install
	$(PY) -m pytest -q -n 2 -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -n 2 -m heavy tests

# One round of each covered algorithm beside its reference implementation (PyTorch,
# from ../shared/references); says what is missing and passes where they are absent.
# Then the harness's tests that need PyTorch (make test, without it, skips them).
$(VERIFY_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,verify]'
	touch $(VERIFY_STAMP)

verify: $(VERIFY_STAMP)
	$(PY) -m verification.verify
	$(PY) -m pytest -q tests/test_verification.py tests/test_verification_long.py

# Check (b), by hand: twenty rounds of each covered algorithm beside PFLlib's on MNIST
# pathological with FedAvgCNN, curves and table in results/verification/long/ (then
# `ARGS=--render` puts the table into docs/verification.md). Minutes an algorithm on CPUs.
.PHONY: verify-long
verify-long: $(VERIFY_STAMP)
	$(PY) -m verification.long $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
