"""The kernel's view of the KV connections: TCP_INFO per connection, and congestion from it (pure).

Mooncake's Python API reports only done or failed, never how a transfer is going. The
kernel knows: for every connection it keeps the smoothed and minimum RTT, the congestion
window, bytes acknowledged and retransmitted, and its own delivery-rate estimate (what
``ss -ti`` prints, from ``inet_diag``). Mooncake's data connections are persistent lanes,
so their counters add up across transfers.

:func:`parse_ss` reads ``ss -tinpH`` text; :class:`TcpCongestion` turns successive
snapshots into per-interval figures for the connections to the PD cluster:

    goodput_bps       bytes newly acknowledged / interval (what the link delivered)
    retrans_fraction  bytes retransmitted / bytes sent in the interval
    rtt_ms            the largest smoothed RTT among connections with data in flight
    min_rtt_ms        the path's propagation RTT (the smallest minrtt seen)
    backlogged        some connection had unsent or unacknowledged data at both ends of the interval

and a congestion flag with hysteresis: raised when the queue grows (RTT above
``rtt_factor`` x the path's minimum plus ``rtt_margin_ms``) or loss shows
(``retrans_fraction`` above ``loss_fraction``) while data is waiting; cleared after
``clear_after`` quiet intervals. While backlogged, goodput is the link's capacity as this
sender sees it, a figure that moves within one interval of a rate change, in the middle
of a transfer. Times are arguments; nothing here reads a clock or a socket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from prfaas_sglang.transport.wan_defaults import MOONCAKE_RPC_PORTS
from prfaas_sglang.wire.telemetry import TcpView


@dataclass(frozen=True)
class TcpConn:
    local: str  # "ip:port"
    remote: str
    pid: int | None  # from ``ss -p`` (slow: it scans every process's fds)
    inode: int | None = None  # from ``ss -e``; match it against /proc/self/fd to find one's own sockets
    rtt_ms: float | None = None
    min_rtt_ms: float | None = None
    cwnd: int | None = None
    bytes_sent: int = 0
    bytes_acked: int = 0
    bytes_retrans: int = 0
    delivery_rate_bps: float | None = None
    notsent_bytes: int = 0
    unacked: int = 0

    @property
    def remote_ip(self) -> str:
        return self.remote.rsplit(":", 1)[0].strip("[]")

    @property
    def remote_port(self) -> int:
        return int(self.remote.rsplit(":", 1)[1])


_PID = re.compile(r"pid=(\d+)")
_INODE = re.compile(r"\bino:(\d+)")
_KV = re.compile(r"([a-z_]+):([0-9.]+)(?:/([0-9.]+))?")
_RATE = re.compile(r"\b(delivery_rate|pacing_rate|send) ([0-9.]+)([KMG]?)bps")
_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_ss(text: str) -> list[TcpConn]:
    """Connections from ``ss -tinpH`` (or ``-tinH``) output: a header line per connection
    (``Recv-Q Send-Q local remote [users:(...)]``), then an indented line of TCP_INFO fields.
    Lines it does not understand are skipped."""
    conns: list[TcpConn] = []
    head: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            parts = line.split()
            if parts and not parts[0].isdigit():
                parts = parts[1:]  # a State column (no ``state`` filter given)
            head = parts if len(parts) >= 4 and parts[0].isdigit() and parts[1].isdigit() else None
            continue
        if head is None:
            continue
        fields = {m.group(1): (m.group(2), m.group(3)) for m in _KV.finditer(line)}
        rates = {m.group(1): float(m.group(2)) * _SCALE[m.group(3)] for m in _RATE.finditer(line)}
        pid = _PID.search(" ".join(head[4:]))
        inode = _INODE.search(" ".join(head[4:]))

        def num(key: str, cast=int, default=None, fields=fields):
            value = fields.get(key)
            try:
                return cast(value[0]) if value else default
            except ValueError:
                return default

        conns.append(TcpConn(
            local=head[2], remote=head[3], pid=int(pid.group(1)) if pid else None,
            inode=int(inode.group(1)) if inode else None,
            rtt_ms=num("rtt", float), min_rtt_ms=num("minrtt", float), cwnd=num("cwnd"),
            bytes_sent=num("bytes_sent", default=0), bytes_acked=num("bytes_acked", default=0),
            bytes_retrans=num("bytes_retrans", default=0), delivery_rate_bps=rates.get("delivery_rate"),
            notsent_bytes=num("notsent", default=0), unacked=num("unacked", default=0)))
        head = None
    return conns


@dataclass(frozen=True)
class TcpInterval:
    """One interval's figures over the selected connections (see the module docstring)."""

    interval_s: float
    connections: int
    goodput_bps: float
    retrans_fraction: float | None  # None: nothing was sent
    rtt_ms: float | None
    min_rtt_ms: float | None
    delivery_rate_bps: float | None  # the kernel's estimate, summed over connections with data in flight
    backlogged: bool
    congested: bool

    def view(self) -> TcpView:
        """This interval as telemetry v3 carries it (every field of ``TcpView``, taken from here)."""
        return TcpView(**{f.name: getattr(self, f.name) for f in fields(TcpView)})


@dataclass
class TcpCongestion:
    rtt_factor: float = 1.5
    rtt_margin_ms: float = 5.0
    loss_fraction: float = 0.01
    clear_after: int = 4
    _last: dict[tuple[str, str], TcpConn] = field(default_factory=dict)
    _last_s: float | None = None
    _min_rtt_ms: float | None = None
    _congested: bool = False
    _quiet: int = 0

    def update(self, conns: list[TcpConn], now_s: float) -> TcpInterval | None:
        """Fold in one snapshot; None for the first (nothing to difference yet). A connection seen
        for the first time contributes from its next snapshot on; one that went away, nothing."""
        current = {(c.local, c.remote): c for c in conns}
        previous, last_s = self._last, self._last_s
        self._last, self._last_s = current, now_s
        for c in conns:
            if c.min_rtt_ms:
                self._min_rtt_ms = c.min_rtt_ms if self._min_rtt_ms is None else min(self._min_rtt_ms, c.min_rtt_ms)
        if last_s is None or now_s <= last_s:
            return None
        dt = now_s - last_s
        acked = sent = retrans = 0
        busy_now = [c for c in conns if c.notsent_bytes > 0 or c.unacked > 0]
        busy_before = [c for c in previous.values() if c.notsent_bytes > 0 or c.unacked > 0]
        for key, c in current.items():
            before = previous.get(key)
            if before is None:
                continue
            acked += max(c.bytes_acked - before.bytes_acked, 0)
            sent += max(c.bytes_sent - before.bytes_sent, 0)
            retrans += max(c.bytes_retrans - before.bytes_retrans, 0)
        rtts = [c.rtt_ms for c in busy_now if c.rtt_ms is not None]
        rates = [c.delivery_rate_bps for c in busy_now if c.delivery_rate_bps is not None]
        rtt = max(rtts) if rtts else None
        loss = retrans / sent if sent else None
        backlogged = bool(busy_now) and bool(busy_before)
        queueing = rtt is not None and self._min_rtt_ms is not None and rtt > self._min_rtt_ms * self.rtt_factor + self.rtt_margin_ms
        lossy = loss is not None and loss > self.loss_fraction
        if backlogged and (queueing or lossy):
            self._congested, self._quiet = True, 0
        elif self._congested:
            self._quiet += 1
            if self._quiet >= self.clear_after:
                self._congested = False
        return TcpInterval(dt, len(conns), acked * 8 / dt, loss, rtt, self._min_rtt_ms,
                           sum(rates) if rates else None, backlogged, self._congested)


def kv_connections(conns: list[TcpConn], inodes: set[int], peer_ips: set[str] | None = None,
                   port_range: tuple[int, int] = MOONCAKE_RPC_PORTS) -> list[TcpConn]:
    """The connections among ``conns`` whose socket inode is in ``inodes`` (one process's sockets)
    that go to Mooncake ports (RPC and data ports are drawn from ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT``,
    15000..17000 by default), optionally only to ``peer_ips``."""
    lo, hi = port_range
    return [c for c in conns if c.inode in inodes and lo <= c.remote_port <= hi
            and (peer_ips is None or c.remote_ip in peer_ips)]
