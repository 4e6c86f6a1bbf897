# Make-style entry points. `make test` is the README's test command and what
# .ci/run calls: it builds the environment from nothing, then runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prfaas-env-stamp

.PHONY: env test lint check-patches rebase-check readme clean-env aiperf-env

env: $(STAMP)

$(STAMP): requirements/cpu-test.txt pyproject.toml scripts/setup-env.sh prfaas_sglang/_pin.py patches/series $(wildcard patches/*.patch)
	VENV=$(VENV) bash scripts/setup-env.sh
	touch $(STAMP)

test: env
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

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
