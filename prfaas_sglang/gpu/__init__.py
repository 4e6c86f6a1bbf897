"""Real SGLang on a lent GPU machine: the carry bundle, the tiny hybrid model, the end-to-end check.

``bundle`` (pure: what goes in, what is dropped, how a bundle is verified), ``wheels`` (reading
wheels from PyPI or a local wheelhouse), ``trace`` (what the SGLang server imports, run in a
subprocess), ``builder`` (``bench gpu-bundle``), ``tiny_model`` (the tiny hybrid model), ``e2e`` and
``checks`` (``bench gpu-e2e`` and its seven checks), ``netlink`` (a shaped namespace through
pyroute2), ``profile`` (``bench profile``), ``predict`` (``bench predict``), and ``cli`` (the four
commands' flags and output, registered with ``python -m prfaas_sglang.bench``).
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ("bundle",)
