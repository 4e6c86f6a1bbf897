"""Every message that crosses a process boundary, in one place (pure: encode/decode only).

Each format carries a version and a history comment at the top of its module:

* :mod:`kv_events`: SGLang's KV-event batches (ZMQ), re-declared field for field.
* :mod:`blocks`: SGLang's chained page hashes, the block ids inside those events.
* :mod:`telemetry`: link telemetry from PrfaaS prefill workers to the router (ZMQ).
* :mod:`handoff`: the emulated engine's PD hand-off between a prefill and a decode
  worker (HTTP): where the KV goes, and that it arrived.

Decoders raise :class:`ValueError` (or msgspec's errors for KV events) on anything
malformed; adapters count such frames and go on.
"""
