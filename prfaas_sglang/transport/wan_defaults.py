"""Mooncake TCP settings for KV that crosses a WAN link (pure data).

The launcher sets these for every process that uses the TCP KV transport,
unless the variable is already in the environment (the operator's value wins).
Starting points from measurements on an emulated 1 Gbit/s, 20 ms RTT link with
Mooncake 0.3.13.post1 (shared/notes/mooncake-tcp.md); the WAN transport issue
tunes them with its own benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvDefault:
    name: str
    value: str
    why: str


# MC_FORCE_TCP is not a default: the TCP transport requires it, so the
# launcher always sets it (see launch.command).
MOONCAKE_TCP_WAN_DEFAULTS: tuple[EnvDefault, ...] = (
    EnvDefault(
        "MC_TCP_ENABLE_CONNECTION_POOL",
        "1",
        "persistent per-peer lanes; without them every request pays a connect (236 vs ~1400 MB/s measured)",
    ),
    EnvDefault(
        "MC_TCP_LANES_PER_PEER",
        "16",
        "one request per lane and an ack per request: more lanes fill a long fat pipe "
        "(0.1% loss, CUBIC: 3 -> 52 MB/s measured)",
    ),
    EnvDefault(
        "MC_TCP_SLICE_SIZE",
        "1048576",
        "1 MiB socket writes instead of 64 KiB: about 2x on a lossy link under BBR",
    ),
    EnvDefault(
        "MC_TRANSFER_TIMEOUT",
        "300",
        "the default 30 s (+1 ns/byte) fails a large KV transfer at WAN speed while data still flows",
    ),
    EnvDefault(
        "MC_TCP_ADMISSION_TIMEOUT_MS",
        "60000",
        "pending admissions expire after 1 s by default; a burst to one peer then fails with -1",
    ),
    EnvDefault(
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
        "8192",
        "default 1024 rejects bursts at once ('lane queue-full')",
    ),
    EnvDefault(
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
        "8192",
        "default 1024; same failure mode as the queue limit",
    ),
)
