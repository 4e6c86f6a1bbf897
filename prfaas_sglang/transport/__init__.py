"""Cross-cluster KV transport (Mooncake TCP over WAN links).

* ``wan_defaults``: the Mooncake TCP settings the launcher sets for cross-cluster roles (pure);
* ``meter``: a sender's view of its KV egress, the link telemetry it publishes (pure; wire format
  in ``prfaas_sglang.wire.telemetry``); ``tcpstate``: the kernel's TCP_INFO of the KV connections,
  and congestion from it (pure);
* ``kv_sender``: the asynchronous KV sender a PrfaaS prefill worker runs (a thread in front of
  Mooncake's engine; the emulated engine runs it too, and ``hooks/kv_send_hook`` attaches it inside
  SGLang), over ``kv_send``, its ledger and coalescing (pure);
* ``kv_stager``: the sender's staging buffer (a destination run's scattered pages gathered into one
  write, on the KV's device), over ``kv_stage``, its grouping and arena (pure);
* ``lane_pacing``: equal pacing of the lanes of one coalesced batch (pure);
* ``layerwise``: layer-wise streaming's per-layer plan and ledger (pure; the hooks are
  ``hooks/layerwise_hook``);
* ``tunnel_plan``: what an encrypted link puts through WireGuard, and each host's tunnel (pure; the
  interface and routes are ``adapters/wireguard``'s);
* ``linkem``: an emulated WAN link between two network namespaces (a fixture of the tests and
  benchmarks).
"""

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("kv_sender", "kv_stager", "linkem")
