# Make-style entry points. `make test` is the README's test command and what
# .ci/run calls: it builds the environment from nothing, then runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prfaas-env-stamp

.PHONY: env test test-fast test-sglang lint check-patches rebase-check readme clean-env aiperf-env

# Every other supported SGLang beside the pinned one, as an overlay ($(VENV)/sglang-<version>,
# scripts/sglang-overlay.sh); `make test-sglang SGLANG=0.5.23` runs every test that touches SGLang's
# own code (marker sglang) on it.
# `make env` builds an overlay for every supported release but the pin (prfaas_sglang/_pin.py).
SGLANG ?=
OVERLAY := $(VENV)/sglang-$(SGLANG)
OTHER_RELEASES := $(shell python3 prfaas_sglang/_pin.py --others)

env: $(STAMP) $(foreach v,$(OTHER_RELEASES),$(VENV)/sglang-$(v)/.complete)

$(VENV)/sglang-%/.complete: $(STAMP) scripts/sglang-overlay.sh requirements/sglang-%.txt
	rm -f $@ && VENV=$(VENV) bash scripts/sglang-overlay.sh $*

$(STAMP): requirements/cpu-test.txt pyproject.toml scripts/setup-env.sh prfaas_sglang/_pin.py patches/series $(wildcard patches/*.patch)
	VENV=$(VENV) bash scripts/setup-env.sh
	touch $(STAMP)

# The suite runs on parallel workers (pytest-xdist), a test file per worker at a time (its module-scoped
# deployments stay shared), more workers than the 2 cores because most tests wait on servers. Tests
# marked `serial` measure what other tests' load would skew: they run after, alone. Exit status 5 (no
# test selected: a PYTEST_ARGS path without serial tests, say) is not a failure.
PYTEST_JOBS ?= 4
PYTEST := $(PY) -m pytest -q
NONE_SELECTED_OK := || [ $$? -eq 5 ]

# Then the leg of every other supported release (`make test-sglang SGLANG=<v>`): the tests that touch
# SGLang's own code, on that release's overlay.
test: env
	$(PYTEST) -n $(PYTEST_JOBS) --dist loadfile -m "not serial" --durations=30 $(PYTEST_ARGS) $(NONE_SELECTED_OK)
	$(PYTEST) -m serial --durations=10 $(PYTEST_ARGS) $(NONE_SELECTED_OK)
	$(foreach v,$(OTHER_RELEASES),$(MAKE) --no-print-directory test-sglang SGLANG=$(v) &&) true

test-sglang: env
	@test -n "$(SGLANG)" || { echo "make test-sglang SGLANG=<version> (one of prfaas_sglang/_pin.py's supported releases)"; exit 2; }
	@echo "== the sglang $(SGLANG) leg: tests marked sglang, on $(OVERLAY)"
	PYTHONPATH=$(OVERLAY) $(PYTEST) -n $(PYTEST_JOBS) --dist loadfile -m "sglang and not gpu and not serial" -rs --durations=10 $(PYTEST_ARGS) $(NONE_SELECTED_OK)
	PYTHONPATH=$(OVERLAY) $(PYTEST) -m "sglang and not gpu and serial" -rs --durations=10 $(PYTEST_ARGS) $(NONE_SELECTED_OK)

# The inner loop: everything but the tests marked `slow` (real servers, long benchmarks).
test-fast: env
	$(PYTEST) -n $(PYTEST_JOBS) --dist loadfile -m "not slow and not serial" $(PYTEST_ARGS) $(NONE_SELECTED_OK)

lint: env
	$(VENV)/bin/ruff check .
	$(PY) -m prfaas_sglang.patches lint

check-patches: env
	$(PY) -m prfaas_sglang.patches check

# The same check the scheduled upstream-rebase workflow runs.
rebase-check: env
	PY=$(PY) bash scripts/rebase-check.sh $(or $(SGLANG_VERSION),latest)

readme: env
	$(PY) -m prfaas_sglang.patches readme --write

# AIPerf (the independent client of `bench aiperf-check`) pins packages SGLang's environment
# cannot take (orjson, pyzmq, ...): it gets its own.
aiperf-env:
	python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install -q aiperf==0.13.0

clean-env:
	rm -rf $(VENV)
