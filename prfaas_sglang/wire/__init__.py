"""Every message that crosses a process boundary, in one place (pure: encode/decode only).

Our own formats carry a version (``"v"`` in JSON, a version field in msgpack) and a history
comment at the top of their module; upstream's (SGLang's, W3C's) are re-declared as they are:

* :mod:`kv_events`: SGLang's KV-event batches (ZMQ), re-declared field for field, plus our
  backwards-compatible extension for hybrid-model state (versioned).
* :mod:`blocks`: SGLang's chained page hashes, the block ids inside those events.
* :mod:`telemetry`: link telemetry from PrfaaS prefill workers to the router (ZMQ, JSON, versioned).
* :mod:`handoff`: the emulated engine's PD hand-off between a prefill and a decode
  worker (HTTP, JSON, versioned): where the KV goes, and that it arrived.
* :mod:`cache_move`: moving a cached prefix between clusters' prefill workers, the router's
  request and the workers' exchange (HTTP, JSON, versioned).
* :mod:`prefix_transfer`: the moved prefix itself, its KV and state (msgpack, versioned).
* :mod:`kv_snapshot`: the kv-index service's ``GET /snapshot``, for a restarting router (JSON, versioned).
* :mod:`server_info`: a worker's ``/server_info`` (SGLang's, unversioned) read into the facts the
  router and the kv-index use, and our versioned ``prfaas_cache_move`` section in it.
* :mod:`role_switch`: ``POST /pd_role_switch``, upstream's body (SGLang 0.5.23; no version of ours).
* :mod:`auth`: keys derived from the deployment secret and the hand-off signature header (versioned).
* :mod:`token_ids`: token ids checked and split in their JSON text, without parsing every one.
* :mod:`server_timing`: the ``Server-Timing`` header the router writes (W3C), parsed.
* :mod:`_json`: the helpers the JSON formats share (a versioned dataclass's ``decode``).

Decoders raise :class:`ValueError` or a subclass of it (``PrefixTransferError``, ``AuthError``,
``server_info.FactsError``; msgspec's errors for KV events) on anything malformed; adapters
count such frames and go on.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ()
