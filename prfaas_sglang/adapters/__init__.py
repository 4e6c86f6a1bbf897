"""I/O adapters shared by several processes (sockets, event loops); the policy they feed is elsewhere.

* :mod:`zmq`: a publisher with SGLang's KV-event framing, and the one subscriber
  every consumer (router, kv-index) uses for KV events and link telemetry.
"""
