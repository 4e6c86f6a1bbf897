"""Equal pacing of the lanes of one coalesced batch (pure).

Why: a batch that fits in one write per lane (a 64 MiB chunk as four 16 MiB writes) ends when its
slowest lane does. Four BBR flows started together overrun the bottleneck queue (on 1 Gbit/s, 20 ms,
``bench transport``: 12-13% of a 64 MiB transfer's segments dropped there), unevenly, so they do not
share the link equally; when the others end, the one left behind takes several BBR probe cycles
(8 RTTs each) to claim the freed rate. The lanes' last writes ended 33-115 ms apart. Capping each
lane at an equal share of the link plus headroom (``SO_MAX_PACING_RATE``) keeps the queue from
overflowing (at 1.1 times the share 2-3% dropped; at 1.05, :data:`HEADROOM`, none in most transfers)
and the lanes level: they end 11-32 ms apart (12-14 ms median at 1.05), and the batch gets 0.01-0.05
more of the link.

When it would hurt, nothing is capped:
* writes queued behind those in flight: Mooncake's per-peer FIFO hands the next write to whichever
  lane frees first, and an uncapped lane that ran ahead takes more of the queue (capping all lanes
  alike lost 0.06 at 256 MiB, where a lane that stalled could not be made up for);
* writes of unequal size, or started apart: equal rates would not end them together;
* small writes: a lane idles an RTT for each write's acknowledgement, and capped lanes cannot
  cover each other's idle time (1 MiB writes: 0.69 -> 0.60 capped);
* one write: nothing to keep level.

``LanePacing.cap`` is the whole policy; the sender applies its answer to every lane.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Each lane may run this much over its equal share. At 0.1 the caps added up to 1.1 times the link, and
# the bottleneck queue filled and dropped the excess (a median of 621 segments per 64 MiB transfer); at
# 0.05 it mostly did not fill within a transfer (median 0), and the lanes ended 12-14 ms apart instead of 23
# (bench transport, 2026-11-26). 1.2 lost the gain.
HEADROOM = 0.05
MIN_WRITE_RTTS = 4  # a write paced only if it lasts at least this many RTTs at its share
MAX_SIZE_RATIO = 1.1  # largest / smallest write in flight
UNLIMITED = None


@dataclass(frozen=True)
class LanePacing:
    """The WAN link as the topology states it: ``rate_bps`` (bits per second), ``rtt_s``."""

    rate_bps: float
    rtt_s: float
    headroom: float = HEADROOM

    def __post_init__(self):
        if not (math.isfinite(self.rate_bps) and self.rate_bps > 0):
            raise ValueError(f"rate_bps must be a positive number, not {self.rate_bps!r}")
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ValueError(f"rtt_s must be a number >= 0, not {self.rtt_s!r}")
        if not 0 <= self.headroom <= 1:
            raise ValueError(f"headroom must be in 0..1, not {self.headroom!r}")

    @classmethod
    def parse(cls, text: str) -> LanePacing:
        """``"rate_bps,rtt_s[,headroom]"`` (``PRFAAS_KV_LANE_PACING``, e.g. ``"1e9,0.02"``; ``headroom``
        in 0..1, :data:`HEADROOM` when left out). Raises ValueError naming what is wrong."""
        form = "'rate_bps,rtt_s[,headroom]'"
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (2, 3):
            raise ValueError(f"{text!r}: expected {form}")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"{text!r}: expected numbers {form}") from None
        try:
            return cls(*numbers)
        except ValueError as err:
            raise ValueError(f"{text!r}: {err} (expected {form})") from None

    def cap(self, writes: Sequence[tuple[int, float]], queued: bool) -> int | None:
        """Each lane's pacing cap in bytes per second for the writes now in flight, ``(length_bytes,
        started_s)`` each, with ``queued`` whether any write waits behind them (in this process, to any
        peer: all share the link); None: no cap."""
        if queued or len(writes) < 2:
            return UNLIMITED
        lengths = [n for n, _ in writes]
        starts = [t for _, t in writes]
        share_bytes_per_s = self.rate_bps / 8 / len(writes)
        if max(lengths) > MAX_SIZE_RATIO * min(lengths) or max(starts) - min(starts) > self.rtt_s:
            return UNLIMITED
        if min(lengths) < MIN_WRITE_RTTS * self.rtt_s * share_bytes_per_s:
            return UNLIMITED
        return round(share_bytes_per_s * (1 + self.headroom))
