"""Runtime hooks installed into SGLang by :mod:`prfaas_sglang.plugin`, and the backends it registers.

Each module here is an adapter: it receives SGLang objects and calls logic elsewhere in the
package (pure where it can be). The hook modules import sglang lazily (inside functions) so that
importing them never pulls SGLang in; those that subclass SGLang's classes (``hybrid_cache``,
``decode_radix``, ``cache_import*``, and ``cache_backend`` through them) import it at module level.

* ``role_contract``: a server whose settings contradict its PrfaaS role does not start;
* ``kv_telemetry``: link telemetry from a PrfaaS prefill worker, each KV batch metered;
* ``kv_send_hook``: a PrfaaS prefill manager sends its KV through the asynchronous sender
  (``transport/kv_sender``); ``layerwise_hook``: each layer's KV streamed once the forward wrote it;
* ``lane_keepalive``: TCP keepalive on a WAN worker's Mooncake connections;
* ``deployment_auth``: a worker of a deployment with a secret demands its API key, hands KV only
  to peers, and refuses ids outside the vocabulary;
* ``receiver_sends``: a decode receiver's sends to a prefill never block its scheduler;
* ``contiguous_alloc``, ``decode_stage``: a decode worker takes a prompt's KV in one run of pages,
  or receives it in a reserve run and copies it home;
* ``http_metrics``: SGLang's HTTP metrics behind an included router, in multiprocess mode;
* ``hybrid_cache``: SGLang's radix caches with state-aware KV events and a PrfaaS worker's
  admission, and the event publisher that carries the state events; ``decode_radix``: the
  decode-side radix cache for hybrid models (patch 0001's seam); ``cache_backend``: the
  ``prfaas-hybrid`` backend that chooses among them, registered with the publisher;
* ``cache_move_hook``: cache moves' HTTP routes and scheduler-side agent; ``cache_import``: a
  cached prefix exported from, or imported into, the scheduler's tree and pools, on the tree the
  upstream adapter names (``cache_import_radix``: 0.5.15's per-kind trees; ``cache_import_unified``:
  0.5.23's unified tree).

Nothing here tells SGLang releases apart: what differs is decided, or read, by the upstream adapter
(:mod:`prfaas_sglang._compat`, :mod:`prfaas_sglang._compat.accessors`).
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ()
