"""Engine-side code: what runs inside (or instead of) an SGLang server.

``mock/`` is the emulated SGLang worker (``--engine mock``). The formats it
shares with real SGLang and the control plane (KV events, block hashes, the PD
hand-off, link telemetry) live in :mod:`prfaas_sglang.wire`.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ()
