"""Cross-cluster KV transport (Mooncake TCP over WAN links).

``wan_defaults``: the Mooncake TCP settings the launcher sets for cross-cluster
roles; ``meter``: a sender's view of its KV egress (the link telemetry it
publishes, wire format in ``prfaas_sglang.wire.telemetry``).
"""
