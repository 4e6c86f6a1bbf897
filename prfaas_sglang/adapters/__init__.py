"""I/O adapters shared by several processes (sockets, event loops); the policy they feed is elsewhere.

* :mod:`zmq`: a publisher with SGLang's KV-event framing, and the one subscriber
  every consumer (router, kv-index) uses for KV events and link telemetry.
* :mod:`http_auth`: SGLang's ``--api-key`` rule as aiohttp middleware, for every HTTP server of
  ours that a deployment secret protects.
* :mod:`http_sync`: the package's one synchronous HTTP client (on ``requests``).
* :mod:`netns`: network namespaces claimed by name (the local link, the WAN emulator).
* :mod:`prom`: our counters in a real SGLang worker's ``/metrics`` (prometheus_client, SGLang's
  multiprocess mode).
* :mod:`sockopts`: socket options on this process's Mooncake connections: a reset on close,
  keepalive, lane pacing.
* :mod:`tcpinfo`: the kernel's TCP_INFO for this process's connections, read with ``ss``.
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ()
