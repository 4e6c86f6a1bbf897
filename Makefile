# Make-style entry points. `make test` is the README's test command and what
# .ci/run calls: it builds the environment from nothing, then runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prfaas-env-stamp

.PHONY: env images test test-fast test-sglang test-durations lint check-patches rebase-check docs clean-env

# Every other supported SGLang beside the pinned one, as an overlay ($(VENV)/sglang-<version>,
# scripts/sglang-overlay.sh); `make test-sglang SGLANG=0.5.23` runs the tests that differ by release
# (marker sglang) on it.
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

# The suite (scripts/run-tests.sh): the pinned release's tests on parallel workers (pytest-xdist), a group
# of tests per worker at a time (a file, or the files that share a deployment: tests/conftest.py), longest
# first, more workers than the 2 cores because many tests wait on servers; beside them every other supported
# release's leg (the tests marked sglang: those that differ by release); and beside both, at a higher
# priority (the two run at nice 10), the tests marked `serial` (what other tests' load would skew). It ends with the suite's own report: each phase's
# time, every failed test, the ten slowest and the ten costliest tests. PYTEST_ARGS narrows every phase.
PYTEST_JOBS ?= 4
export PYTEST_JOBS PYTEST_ARGS VENV

test: env
	bash scripts/run-tests.sh all

# One release's leg alone: `make test-sglang SGLANG=0.5.23`.
test-sglang: env
	@test -n "$(SGLANG)" || { echo "make test-sglang SGLANG=<version> (one of prfaas_sglang/_pin.py's supported releases)"; exit 2; }
	bash scripts/run-tests.sh leg $(SGLANG)

# The groups' durations the suite orders its work by (tests/durations.json), from the last run's report.
test-durations:
	$(PY) scripts/test_report.py $(VENV)/test-report --write-durations tests/durations.json

# The inner loop: everything but the tests marked `slow` (real servers, long benchmarks).
test-fast: env
	$(PY) -m pytest -q -n $(PYTEST_JOBS) --dist loadgroup --no-loadscope-reorder -m "not slow and not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Every image of docker/, each checked to import what its roles run (python -m prfaas_sglang.launch.images;
# where no registry can be pulled from, on a Debian base bootstrapped here and the engines' CPU stand-in).
images: env
	$(PY) -m prfaas_sglang.launch.images build

lint: env
	$(VENV)/bin/ruff check .
	$(PY) -m prfaas_sglang.patches lint

check-patches: env
	$(PY) -m prfaas_sglang.patches check

# The same check the scheduled upstream-rebase workflow runs.
rebase-check: env
	PY=$(PY) bash scripts/rebase-check.sh $(or $(SGLANG_VERSION),latest)

# The documentation site, into site/: the reference pages rendered from the code (docs/reference/), then
# mkdocs build --strict (a broken link, a missing page or an unknown anchor fails it).
docs: env
	$(PY) -m prfaas_sglang.docsite write
	$(PY) -m prfaas_sglang.docsite build

clean-env:
	rm -rf $(VENV)
