"""What crosses an encrypted link, and how each host's WireGuard tunnel is set up for it (pure).

A topology link with ``encrypt: true`` puts everything between its two sides' hosts through WireGuard:
Mooncake's KV, SGLang's bootstrap registration, the router's legs to the PrfaaS workers, KV events and
telemetry. The PrfaaS cluster is one side; the PD cluster and the control plane (which talks to every
worker) the other. The tunnel is *transparent*: the hosts keep the addresses the topology gives them,
so no engine, no Mooncake session and no bootstrap address changes; each host routes its traffic to a
peer host's address into the tunnel by policy routing, as ``wg-quick`` does::

    ip rule  not fwmark FWMARK  lookup TABLE       (the tunnel's own UDP carries FWMARK: it skips TABLE)
    TABLE:   PEER/32 dev IFACE src HOST  metric 1  (into the tunnel)
             blackhole PEER/32           metric 100 (fails closed: with the tunnel gone nothing leaves in
                                                     clear; the link fails, and the router routes around it)

A cluster may name the address ranges its hosts take (``clusters.<c>.cidrs``: a datacenter's pod range).
The far side's ranges are then blackholed in TABLE too, beneath the peers' routes, and locked by the
adapter's netfilter filter: an address there that the tunnel does not route yet (a pod recreated at a
new address, before its name resolves again) gets nothing, rather than something in clear.

Hosts are addresses or names. A name (Kubernetes: a pod's stable DNS name, whose address changes when the
pod is recreated) is resolved by the caller's ``resolve`` (I/O stays out of here): the plan carries each
peer's name, for its key and interface, and the address it resolved to, for the tunnel's endpoint and
routes. The holder (``launch --tunnel``) resolves again every few seconds and moves a peer whose address
changed (:func:`moved_peers`).

Keys: each host's private key is derived from the deployment secret and its host (address or name)
(:meth:`~prfaas_sglang.wire.auth.DeploymentKeys.tunnel_private_key`), so every holder of the secret
knows every peer's public key; a host without the secret cannot complete a handshake, and receives
nothing. The I/O (interface, keys, routes) is :mod:`prfaas_sglang.adapters.wireguard`'s.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.topology import Topology

FWMARK = 0x70F5  # the tunnel's UDP packets: routed by the main table, never back into the tunnel
TABLE = 0x70F5  # the routing table holding the peers' routes
RULE_PRIORITY = 9000  # before the main table's rule (32766)
TUNNEL_MTU = 1420  # 1500 less WireGuard's 80 bytes of IPv6-sized overhead
KEEPALIVE_S = 25  # keeps a NAT's mapping of the tunnel's UDP flow


@dataclass(frozen=True)
class Peer:
    host: str  # as the topology names it (an address or a name): its key derives from it
    port: int
    public_key: str  # base64, as ``wg`` takes it
    address: str = ""  # what ``host`` resolved to: the tunnel endpoint, and the one address routed into the tunnel

    def __post_init__(self) -> None:
        if not self.address:
            object.__setattr__(self, "address", self.host)


@dataclass(frozen=True)
class TunnelPlan:
    """One host's tunnel: its interface, its port, and the peer hosts it reaches only through it."""

    host: str
    interface: str
    listen_port: int
    peers: tuple[Peer, ...]
    links: tuple[str, ...]  # the encrypted links it serves ("src->dst"), for logs and errors
    address: str = ""  # what ``host`` resolved to: the source address of what it sends into the tunnel
    locked: tuple[str, ...] = ()  # the far side's address ranges: only the tunnel may carry anything for them

    def __post_init__(self) -> None:
        if not self.address:
            object.__setattr__(self, "address", self.host)

    @property
    def peer_hosts(self) -> tuple[str, ...]:
        """The peers' addresses (what is routed into the tunnel)."""
        return tuple(p.address for p in self.peers)

    def locked_destinations(self) -> tuple[str, ...]:
        """What the netfilter lock covers: the locked ranges, and each peer address outside them (as prefixes)."""
        ranges = [ipaddress.ip_network(r) for r in self.locked]
        alone = [h for h in self.peer_hosts if not any(ipaddress.ip_address(h) in r for r in ranges)]
        return (*self.locked, *alone)


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def moved_peers(old: TunnelPlan, new: TunnelPlan) -> list[tuple[Peer, Peer]]:
    """(before, after) of each peer whose address changed between two resolutions of one host's plan."""
    before = {p.host: p for p in old.peers}
    return [(before[p.host], p) for p in new.peers if p.host in before and before[p.host].address != p.address]


def interface_name(host: str) -> str:
    """``pwg`` + 8 hex digits of the host's address: unique per host on one machine (wireguard-go's control
    socket, ``/var/run/wireguard/<name>.sock``, is shared by every network namespace), 11 characters."""
    return "pwg" + hashlib.blake2b(host.encode(), digest_size=4).hexdigest()


def _sides(topology: Topology, src: str, dst: str) -> tuple[set[str], set[str]]:
    """(PrfaaS side's clusters, the other side's) of a link: the control clusters join the PD side."""
    kinds = topology.cluster_kinds
    prfaas = {c for c in (src, dst) if kinds.get(c) == "prfaas"}
    other = {c for c in (src, dst) if kinds.get(c) != "prfaas"} | {c for c, k in kinds.items() if k == "control"}
    return prfaas, other - prfaas


def _hosts(topology: Topology, clusters: Iterable[str]) -> set[str]:
    clusters = set(clusters)
    return {n.host for n in topology.nodes if n.cluster in clusters and n.host}


def tunnel_clusters(topology: Topology) -> dict[str, int]:
    """Cluster -> tunnel port, for every cluster whose hosts hold a tunnel (either side of an encrypted link; the
    control clusters join the PD side)."""
    out: dict[str, int] = {}
    for link in topology.links:
        if link.encrypt:
            for side in _sides(topology, link.src, link.dst):
                out.update(dict.fromkeys(side, link.tunnel_port))
    return out


def encrypted_peers(topology: Topology, host: str, names: bool = False) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Peer host -> (its link's tunnel port, the links through which ``host`` reaches it encrypted). Raises
    :class:`ConfigError` where one host is on both sides of an encrypted link (nothing to encrypt between
    a host and itself: give each side its own address), two links give one peer different ports, or (unless
    ``names``: the caller resolves them) a host is not an IP address."""
    peers: dict[str, tuple[int, tuple[str, ...]]] = {}
    for i, link in enumerate(topology.links):
        if not link.encrypt:
            continue
        prfaas, other = _sides(topology, link.src, link.dst)
        a, b = _hosts(topology, prfaas), _hosts(topology, other)
        for h in sorted(a | b):
            if not names and not is_address(h):
                raise ConfigError(f"links[{i}].encrypt", f"host {h} is not an IP address (the tunnel routes each "
                                                         "peer's address into itself; a name needs a resolver, as "
                                                         "launch --tunnel has)")
        if shared := a & b:
            raise ConfigError(f"links[{i}].encrypt", f"host {sorted(shared)[0]} is on both sides of the link "
                                                     "(a tunnel joins distinct addresses)")
        far = b if host in a else a if host in b else set()
        for peer in far:
            port, names = peers.get(peer, (link.tunnel_port, ()))
            if port != link.tunnel_port:
                raise ConfigError(f"links[{i}].tunnel_port", f"host {peer} is on two encrypted links with "
                                                             f"ports {port} and {link.tunnel_port}")
            peers[peer] = (port, (*names, f"{link.src}->{link.dst}"))
    return peers


def plan(topology: Topology, host: str, public_key: Callable[[str], str],
         resolve: Callable[[str], str] | None = None) -> TunnelPlan | None:
    """``host``'s tunnel, or None when no encrypted link reaches it. ``public_key(host)``: a host's public key
    (the adapter derives it from the deployment secret). ``resolve(name)``: a host name's address, for
    topologies whose hosts are names (None: every host must be an address). Raises :class:`ConfigError` where
    two hosts resolve to one address (a tunnel joins distinct addresses)."""
    peers = encrypted_peers(topology, host, names=resolve is not None)
    if not peers:
        return None
    ports = {link.tunnel_port for link in topology.links
             if link.encrypt and host in _hosts(topology, set().union(*_sides(topology, link.src, link.dst)))}
    if len(ports) > 1:
        raise ConfigError("links", f"host {host} is on encrypted links with tunnel ports {sorted(ports)}: one port a host")
    names = sorted({n for _, links in peers.values() for n in links})

    def address(h: str) -> str:
        return h if resolve is None or is_address(h) else resolve(h)
    own = address(host)
    resolved = {h: address(h) for h in peers}
    clashes = sorted(h for h, a in resolved.items() if a == own or list(resolved.values()).count(a) > 1)
    if clashes:
        raise ConfigError("links", f"hosts {', '.join(clashes)} resolve to one address ({resolved[clashes[0]]}) "
                                   f"with another host of the tunnel of {host}")
    return TunnelPlan(host, interface_name(host), ports.pop(),
                      tuple(Peer(h, port, public_key(h), resolved[h]) for h, (port, _) in sorted(peers.items())),
                      tuple(names), own, _locked(topology, host, own))


def _locked(topology: Topology, host: str, own: str) -> tuple[str, ...]:
    """The far sides' ``cidrs`` for ``host`` across its encrypted links; ConfigError when one holds ``own`` (the
    host would lock itself out of its own side: one cluster's pod range given for both sides, say)."""
    far: set[str] = set()
    for link in topology.links:
        if link.encrypt:
            prfaas, other = _sides(topology, link.src, link.dst)
            far |= other if host in _hosts(topology, prfaas) else prfaas if host in _hosts(topology, other) else set()
    locked = []
    for cluster in sorted(far):
        for cidr in topology.clusters[cluster].cidrs if cluster in topology.clusters else ():
            if ipaddress.ip_address(own) in ipaddress.ip_network(cidr):
                raise ConfigError(f"clusters.{cluster}.cidrs", f"{cidr} holds {host}'s own address {own}, on the other "
                                                               "side of the encrypted link (give each side's own range)")
            locked.append(cidr)
    return tuple(dict.fromkeys(locked))
