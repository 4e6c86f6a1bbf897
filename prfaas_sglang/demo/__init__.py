"""The one-command local deployment: ``python -m prfaas_sglang.demo`` (``__main__``).

``cluster`` brings a local deployment up and down (the demo's, the benchmarks', the tests' and the
GPU harness's); ``netns`` a network namespace whose link is shaped; ``workloads`` the request
streams (pure); ``client`` the streaming client that measures what a user sees.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ()
