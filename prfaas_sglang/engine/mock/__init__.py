"""The emulated SGLang worker (``--engine mock``): SGLang's HTTP surface and PD protocol,
profile-driven timing, a real prefix cache, real KV bytes over Mooncake TCP, and
SGLang's KV events over ZMQ. For GPU-less runs and scale tests.

Start one: ``python -m prfaas_sglang.launch --role pd-decode --engine mock --profile kimi-linear-1t-hybrid@h20x8``.

``engine`` holds a worker's state and request flows, ``sglang_http`` its HTTP surface (aiohttp),
``kv_transport`` its KV bytes over Mooncake TCP (a PrfaaS worker's through
``transport/kv_sender``), ``__main__`` its entry point; pure: ``scheduler`` (chunked prefill and
decode arithmetic), ``prefix_cache``, ``timing`` (how long it takes, from the planner's profiles)
and ``truth`` (what it really takes, apart from the cost model).
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("__main__", "engine", "kv_transport", "sglang_http")
