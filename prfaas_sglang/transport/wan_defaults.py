"""Mooncake TCP settings for KV that crosses the WAN link, per role and scaled to the link (pure data).

The PrfaaS -> PD path is the only cross-cluster KV leg. Mooncake's settings are per
process, so the launcher gives them by role (:func:`mooncake_env`):

* ``prfaas`` (the sender on the WAN leg): the whole profile below, with SGLang's probe of
  blacklisted decode sessions on, so a peer that was unreachable for a while takes KV again;
* ``pd-decode`` (receives from the PrfaaS cluster and from PD-P): the stall bound, which
  both ends of a connection enforce, keepalive, and the contiguous KV allocation;
* ``pd-prefill`` (in-cluster PD-P -> PD-D): nothing; SGLang's defaults, or RDMA where the
  deployment has it.

An operator's own value in the environment always wins. Measured with
``python -m prfaas_sglang.bench transport`` on an emulated 1 Gbit/s, 20 ms RTT link
(BENCHMARKS.md, "KV transport over an emulated WAN link"): large requests matter most
(a lane carries one request at a time and waits an RTT for its acknowledgement), and
4 lanes beat 16 once requests are large (16 BBR flows overflow the bottleneck queue).
The profile assumes the host's TCP buffer limit (``net.ipv4.tcp_wmem`` max, 4 MiB): raised to
32 MiB, the four lanes gain nothing and finish further apart (64 MiB lossy 0.884 against
0.881-0.904; ``bench transport --tcp-buffer-mib``). One lane with large buffers comes within 2% of
one warm TCP flow, but waits an RTT per request, and SGLang sends one per layer.

History: the first profile (issue #5) set 16 lanes and a flat ``MC_TRANSFER_TIMEOUT=300``
for every TCP role; a stalled transfer then took Mooncake's 30 s progress timeout to fail,
and the in-cluster leg got WAN settings too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prfaas_sglang.roles import Role

# Mooncake's MC_MIN_RPC_PORT..MC_MAX_RPC_PORT defaults: it draws its handshake and TCP data ports
# from this range (the launcher's bind shim, the k8s NetworkPolicy and the TCP-state reader use it).
MOONCAKE_RPC_PORTS = (15000, 17000)

SLICE_BYTES = 1 << 20
STALL_FLOOR_S = 5  # a live connection makes progress well within this on any link the profile is for
MAX_BATCH_BYTES = 1 << 30  # the largest synchronous batch SGLang sends (one chunk's KV), for the total timeout
TRANSFER_TIMEOUT_FLOOR_S = 30  # Mooncake's own default
SESSION_PROBE_INTERVAL_S = 2  # a peer back on the link takes new KV within about this (SGLang's probe: 30 s)
# TCP keepalive on WAN lanes (PRFAAS_KV_KEEPALIVE, idle_s,interval_s,probes): an idle lane is probed
# after 60 s, well inside the idle timeouts of cloud NATs and load balancers (240-350 s), and a lane
# whose peer is gone ends within 2 minutes
KEEPALIVE = "60,10,6"
# The PrfaaS worker's KV staging buffer (MiB, on the KV's device): four 64 MiB chunks' worth of scattered
# runs in flight at once; beyond that, runs go unstaged (transport/kv_stager.py)
STAGING_MIB = 256
# The decode's KV reserve (tokens; hooks/decode_stage.py caps it at an eighth of the pool): room for a few
# scattered prompts' KV in flight at once; a prompt that does not fit goes to its own pages as before
DECODE_STAGING_TOKENS = 65536


@dataclass(frozen=True)
class EnvDefault:
    name: str
    value: str
    why: str


@dataclass(frozen=True)
class WanLink:
    """The cross-cluster link as the topology states it; None where it does not."""

    rate_bps: float | None = None
    rtt_s: float | None = None
    layerwise: bool = False  # links[].layerwise: the PrfaaS worker streams its KV by layer


MOONCAKE_DEFAULT_LANES, MOONCAKE_MAX_LANES = 4, 16


def lanes_per_peer(env: Mapping[str, str]) -> int:
    """The TCP lanes per peer a Mooncake 0.3.13 engine started with ``env`` opens, read as it reads them
    (``parseBoundedTcpSetting``): ``MC_TCP_LANES_PER_PEER``, else the deprecated
    ``MC_TCP_MAX_CONNECTIONS_PER_PEER``; decimal digits only, in 1..16, anything else the default 4."""
    text = env.get("MC_TCP_LANES_PER_PEER", env.get("MC_TCP_MAX_CONNECTIONS_PER_PEER"))
    if text and text.isascii() and text.isdigit() and 1 <= int(text) <= MOONCAKE_MAX_LANES:
        return int(text)
    return MOONCAKE_DEFAULT_LANES


def stall_timeout_s(link: WanLink) -> int:
    """Seconds without progress after which a transfer fails: a slice's time at the link rate,
    20 times over, plus four RTTs, and never under :data:`STALL_FLOOR_S`."""
    slice_s = SLICE_BYTES * 8 / link.rate_bps if link.rate_bps else 0.0
    return max(STALL_FLOOR_S, math.ceil(20 * slice_s + 4 * (link.rtt_s or 0.0)))


def transfer_timeout_s(link: WanLink) -> int:
    """The synchronous call's total bound (Mooncake adds 1 ns per byte, i.e. assumes 1 GB/s): four
    times the largest batch's time at the link rate. Stalls fail earlier, on :func:`stall_timeout_s`."""
    if not link.rate_bps:
        return 300
    return max(TRANSFER_TIMEOUT_FLOOR_S, math.ceil(4 * MAX_BATCH_BYTES * 8 / link.rate_bps))


def lane_pacing(link: WanLink) -> tuple[EnvDefault, ...]:
    """``PRFAAS_KV_LANE_PACING`` for a link whose rate and RTT the topology states; nothing otherwise."""
    if not link.rate_bps or link.rtt_s is None:
        return ()
    return (EnvDefault("PRFAAS_KV_LANE_PACING", f"{link.rate_bps:.0f},{link.rtt_s:g}",
                       "a batch of equal large writes, one per lane, is paced evenly across the lanes so they end "
                       "together (4 BBR lanes without it ended 40-70 ms apart at 64 MiB, 1 Gbit/s, 20 ms)"),)


def sender_profile(link: WanLink) -> tuple[EnvDefault, ...]:
    return (
        EnvDefault("MC_TCP_ENABLE_CONNECTION_POOL", "1",
                   "persistent per-peer lanes; without them every request pays a connect (236 vs ~1400 MB/s measured)"),
        EnvDefault("MC_TCP_LANES_PER_PEER", "4",
                   "with large requests 4 lanes fill a 1 Gbit/s, 20 ms link; 16 BBR flows overflow its queue "
                   "(0.51 vs 0.85 of the rate measured)"),
        EnvDefault("MC_TCP_SLICE_SIZE", str(SLICE_BYTES),
                   "1 MiB socket writes instead of 64 KiB: about 2x on a lossy link under BBR"),
        EnvDefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(stall_timeout_s(link)),
                   "a stalled or black-holed transfer fails within this bound (Mooncake: 30 s), scaled to the link"),
        EnvDefault("MC_TRANSFER_TIMEOUT", str(transfer_timeout_s(link)),
                   "the default 30 s (+1 ns/byte) fails a large KV batch at WAN speed while data still flows"),
        EnvDefault("MC_TCP_ADMISSION_TIMEOUT_MS", "60000",
                   "pending admissions expire after 1 s by default; a burst to one peer then fails with -1"),
        EnvDefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "8192",
                   "default 1024 rejects bursts at once ('lane queue-full')"),
        EnvDefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "8192",
                   "default 1024; same failure mode as the queue limit"),
        EnvDefault("PRFAAS_KV_ASYNC_SEND", "1",
                   "each chunk's KV as asynchronous writes, waited for (sleeping) before the last chunk's aux, "
                   "instead of one busy-waiting synchronous batch per chunk (the kv-send hooks)"),
        EnvDefault("PRFAAS_KV_STAGING_MIB", str(STAGING_MIB),
                   "a chunk's scattered prefill pages gathered into a staging buffer and sent as one write per "
                   "destination run, not one per run contiguous on both sides (the kv-send hooks' KvStager)"),
        EnvDefault("PRFAAS_KV_KEEPALIVE", KEEPALIVE,
                   "TCP keepalive on the Mooncake lanes (Mooncake sets none): an idle lane keeps its NAT entry "
                   "instead of stalling the next transfer (the kv-lane-keepalive hook)"),
        EnvDefault("SGLANG_ENABLE_FAILED_SESSION_PROBE", "1",
                   "SGLang blacklists a decode peer's session after one failed transfer and, with this off "
                   "(its default), only a re-registration (a restarted decode) clears it: one stall on the "
                   "WAN would fail every later request to that peer"),
        EnvDefault("SGLANG_FAILED_SESSION_PROBE_INTERVAL_S", str(SESSION_PROBE_INTERVAL_S),
                   "a blacklisted session is probed this often (SGLang: 30 s) and taken back once it answers"),
        *lane_pacing(link),
        *layerwise(link),
    )


def layerwise(link: WanLink) -> tuple[EnvDefault, ...]:
    """``PRFAAS_KV_LAYERWISE`` for a link the topology marks ``layerwise``; nothing otherwise."""
    if not link.layerwise:
        return ()
    return (EnvDefault("PRFAAS_KV_LAYERWISE", "1",
                       "each layer's KV leaves as the forward writes it, so most of the transfer overlaps the "
                       "prefill (links[].layerwise; the router's estimate counts the overlap, plan/overlap.py)"),)


def receiver_profile(link: WanLink) -> tuple[EnvDefault, ...]:
    return (
        EnvDefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(stall_timeout_s(link)),
                   "the receiving end of a WAN transfer gives up on a stall within the same bound as the sender"),
        EnvDefault("PRFAAS_DECODE_CONTIGUOUS_KV", "1",
                   "each prompt's KV in one run of free slots where there is one: SGLang's sender then writes one "
                   "request per layer, not one per hole finished decodes left (page size 1: ~190 requests per "
                   "layer per transfer -> ~10 on the conversation trace, bench kv-runs)"),
        EnvDefault("PRFAAS_DECODE_STAGING_TOKENS", str(DECODE_STAGING_TOKENS),
                   "a run of KV pages set aside: a prompt whose pages are scattered (no free run held it) receives "
                   "its KV there in one run and has it copied home once landed (the decode-staging hooks)"),
        EnvDefault("PRFAAS_KV_KEEPALIVE", KEEPALIVE,
                   "TCP keepalive on the Mooncake connections: a lane the sender closed while the link was dark "
                   "(its reset lost) is otherwise held open, idle, until the process ends (the kv-lane-keepalive hook)"),
    )


def mooncake_env(role: Role, link: WanLink | None = None) -> tuple[EnvDefault, ...]:
    """The ``MC_*`` (and SGLang's Mooncake-session) settings a TCP KV process of ``role`` gets
    (``MC_FORCE_TCP`` aside)."""
    link = link or WanLink()
    if role is Role.PRFAAS:
        return sender_profile(link)
    if role is Role.PD_DECODE:
        return receiver_profile(link)
    return ()


# The sender profile for a link the topology does not describe (kept for readers of the old name).
MOONCAKE_TCP_WAN_DEFAULTS: tuple[EnvDefault, ...] = sender_profile(WanLink())
