"""Cross-cluster KV transport (Mooncake TCP over WAN links).

Today: the WAN defaults the launcher sets. The transport issue adds the
scheduler-side/worker-side transfer split and link telemetry here.
"""
