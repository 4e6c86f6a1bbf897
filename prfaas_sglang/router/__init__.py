"""The global scheduler: ``policy`` (where a request goes), ``threshold`` (how ``t`` moves),
``longterm`` (the PD split), ``calibration`` (the cost model, calibrated online), ``link``,
``workers``, ``service``, ``fleet``, ``metrics`` and ``openapi`` are pure; the HTTP front end is
``server`` (the request path, handler to legs), ``loops`` (its background loops) and ``app`` (the
aiohttp app that joins them), ``admin`` its admin API, ``conversion`` turns a PD worker from prefill
to decode or back, ``front`` keeps clients' connections across a router restart, and ``__main__`` is
the entry point (``python -m prfaas_sglang.router``)."""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("__main__", "admin", "app", "conversion", "front", "loops", "server")
