"""A fleet of clusters on one box (I/O): every PrfaaS cluster in its own network namespace, every PD
cluster on an address of its own, each PrfaaS -> PD link shaped on its own.

    PrfaaS cluster i   namespace prfaas-bw<tag_i>, its engines on the namespace's address; its veth's
                       egress is an ``htb`` tree: a class per link (i, j) at that link's rate, chosen
                       by the destination address (PD cluster j's), and an unshaped default class
    PD cluster j       10.215.<T>.<j+1> on the root namespace's loopback (PD-P -> PD-D stays local)
    router             the root namespace: it reaches every engine

So KV from PrfaaS cluster i to PD cluster j crosses exactly the link (i, j) of the topology, at its
own capacity, whatever i sends to other PD clusters meanwhile; the router tells the links apart by
the decode peers each transfer goes to (telemetry v5). Needs root and iproute2; this kernel has no
``netem``, so links have a rate and no delay.

:func:`local_fleet` turns a fleet topology (``launch/multi-cluster.yaml``: hosts of a real
inventory) into this box's: addresses and free ports, at most ``nodes_per_role`` nodes of each role
per cluster, the emulation's speedup and KV scale, link rates on the wire.
"""

from __future__ import annotations

import copy
import subprocess
from dataclasses import dataclass, field

from prfaas_sglang.adapters.netns import claim_tag
from prfaas_sglang.demo.cluster import PortPicker
from prfaas_sglang.demo.netns import TAGS, Netns
from prfaas_sglang.errors import ConfigError

DEFAULT_CLASS_MBIT = 10_000  # what is not KV toward a PD cluster (answers, telemetry): not shaped
HTB_BURST_BYTES = 65_536  # as the one-pair link's tbf bucket
SITE_PREFIX = "prfaas-fl"  # the namespace name that claims a 10.215.<T>.0/24 for the PD clusters' addresses


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@dataclass
class FleetNet:
    """The namespaces and addresses of one fleet (removed on exit). ``pd_sites``: PD cluster names;
    ``prfaas_sites``: PrfaaS cluster names; ``links_mbit[(prfaas, pd)]``: each link's rate on the wire."""

    pd_sites: list[str]
    prfaas_sites: list[str]
    links_mbit: dict[tuple[str, str], float]
    tag: int | None = None
    nets: dict[str, Netns] = field(default_factory=dict)
    _entered: list = field(default_factory=list)

    def pd_address(self, site: str) -> str:
        return f"10.215.{self.tag}.{self.pd_sites.index(site) + 1}"

    def prfaas_address(self, site: str) -> str:
        return self.nets[site].inner_ip

    def namespaces(self) -> list[str]:
        """The namespaces this fleet holds (its site claim and one per PrfaaS cluster), all removed on exit."""
        return [f"{SITE_PREFIX}{self.tag}", *(net.ns for net in self.nets.values())]

    def __enter__(self) -> FleetNet:
        self.tag = claim_tag(SITE_PREFIX, TAGS)
        if self.tag is None:
            raise RuntimeError(f"no free fleet tag in {TAGS.start}..{TAGS.stop - 1}")
        try:
            for site in self.pd_sites:
                _sh("ip", "addr", "add", f"{self.pd_address(site)}/32", "dev", "lo")
            for site in self.prfaas_sites:
                net = Netns().__enter__()
                self._entered.append(net)
                self.nets[site] = net
                _sh(*net.wrap, "ip", "route", "add", f"10.215.{self.tag}.0/24", "via", net.outer_ip)
                self._shape(site, net)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _shape(self, site: str, net: Netns) -> None:
        tc = (*net.wrap, "tc")
        _sh(*tc, "qdisc", "add", "dev", net.inner, "root", "handle", "1:", "htb", "default", "99")
        _sh(*tc, "class", "add", "dev", net.inner, "parent", "1:", "classid", "1:99", "htb",
            "rate", f"{DEFAULT_CLASS_MBIT}mbit")
        for k, pd in enumerate(self.pd_sites):
            rate = self.links_mbit.get((site, pd))
            if rate is None:
                continue  # no link: nothing of this cluster's KV goes there (the router never pairs them)
            self.set_rate(site, pd, rate, verb="add")
            _sh(*tc, "filter", "add", "dev", net.inner, "protocol", "ip", "parent", "1:", "prio", "1", "u32",
                "match", "ip", "dst", f"{self.pd_address(pd)}/32", "flowid", f"1:{10 + k}")

    def set_rate(self, prfaas: str, pd: str, rate_mbit: float, verb: str = "change") -> None:
        """Link ``prfaas -> pd`` at ``rate_mbit`` on the wire (``change``: in place, never unshaped meanwhile)."""
        net, k = self.nets[prfaas], self.pd_sites.index(pd)
        _sh(*net.wrap, "tc", "class", verb, "dev", net.inner, "parent", "1:", "classid", f"1:{10 + k}", "htb",
            "rate", f"{rate_mbit}mbit", "ceil", f"{rate_mbit}mbit", "burst", f"{HTB_BURST_BYTES}b",
            "cburst", f"{HTB_BURST_BYTES}b")

    def sent_bytes(self, prfaas: str, pd: str) -> int:
        """Bytes the link ``prfaas -> pd`` has carried (its htb class's counter)."""
        net, k = self.nets[prfaas], self.pd_sites.index(pd)
        out = subprocess.run([*net.wrap, "tc", "-s", "class", "show", "dev", net.inner, "classid", f"1:{10 + k}"],
                             capture_output=True, text=True).stdout
        words = out.split()
        return int(words[words.index("Sent") + 1]) if "Sent" in words else 0

    def __exit__(self, *exc) -> None:
        for net in reversed(self._entered):
            net.__exit__(None, None, None)
        self._entered.clear()
        if self.tag is not None:
            for site in self.pd_sites:
                subprocess.run(["ip", "addr", "del", f"10.215.{self.tag}.{self.pd_sites.index(site) + 1}/32", "dev", "lo"],
                               capture_output=True)
            subprocess.run(["ip", "netns", "del", f"{SITE_PREFIX}{self.tag}"], capture_output=True)


def fleet_sites(doc: dict) -> tuple[list[str], list[str]]:
    """(PrfaaS clusters, PD clusters) of a topology document, in file order."""
    kinds = {name: c.get("kind") for name, c in doc["clusters"].items()}
    return [n for n, k in kinds.items() if k == "prfaas"], [n for n, k in kinds.items() if k == "pd"]


def links_mbit(doc: dict, speedup: float, kv_scale: float) -> dict[tuple[str, str], float]:
    """Each PrfaaS -> PD link's rate on the wire: its capacity x ``kv_scale`` x ``speedup`` (the emulated
    engines ship ``kv_scale`` of the KV, ``speedup`` times faster)."""
    prfaas, pd = fleet_sites(doc)
    out = {}
    for link in doc.get("links", []):
        ends = {link["from"], link["to"]}
        src = next((p for p in prfaas if p in ends), None)
        dst = next((p for p in pd if p in ends), None)
        if src is not None and dst is not None:
            out[(src, dst)] = link["bandwidth_gbps"] * 1e3 * kv_scale * speedup
    return out


def local_fleet(doc: dict, net: FleetNet, *, speedup: float, kv_scale: float, nodes_per_role: int | None = 1,
                scheduler: dict | None = None, model: dict | None = None) -> dict:
    """``doc`` (a fleet topology) as this box runs it: each cluster's first ``nodes_per_role`` nodes of a
    role (None: all), on ``net``'s addresses and free ports, KV events and telemetry where the roles
    publish them, a router on 127.0.0.1, the emulation section, each link at its rate on the wire
    (:func:`links_mbit`: an emulated deployment's link is described as the router observes it). ``scheduler`` / ``model`` replace
    those sections' keys. Raises ConfigError for a document that is not a fleet of PrfaaS and PD clusters."""
    out = copy.deepcopy(doc)
    prfaas, pd = fleet_sites(out)
    if not prfaas or not pd:
        raise ConfigError("clusters", "a fleet needs PrfaaS and PD clusters")
    pick = PortPicker()
    for name, cluster in out["clusters"].items():
        if cluster.get("kind") == "control":
            continue
        host = net.prfaas_address(name) if name in prfaas else net.pd_address(name)
        kept, seen = [], {}
        for node in cluster["nodes"]:
            seen[node["role"]] = seen.get(node["role"], 0) + 1
            if nodes_per_role is None or seen[node["role"]] <= nodes_per_role:
                kept.append(_local_node(node, host, pick))
        cluster["nodes"] = kept
    out["clusters"] = {n: c for n, c in out["clusters"].items() if c.get("kind") != "control"}
    router_port = pick("127.0.0.1")
    out["clusters"]["control"] = {"kind": "control", "nodes": [{"name": "router", "role": "router", "host": "127.0.0.1",
                                                                "port": router_port}]}
    out["emulation"] = {"speedup": speedup, "kv_scale": kv_scale}
    wire = links_mbit(doc, speedup, kv_scale)
    for link in out.get("links", []):  # what the router's model and telemetry see: the rate on the wire
        ends = {link["from"], link["to"]}
        rate = next((r for (p, d), r in wire.items() if {p, d} == ends), None)
        if rate is not None:
            link["bandwidth_gbps"] = rate / 1e3
    out["scheduler"] = {**out.get("scheduler", {}), **(scheduler or {})}
    out["model"] = {k: v for k, v in {**out.get("model", {}), **(model or {})}.items() if k != "path"}
    return out


def _local_node(node: dict, host: str, pick: PortPicker) -> dict:
    role = node["role"]
    local = {"name": node["name"], "role": role, "host": host, "port": pick(host)}
    if role != "pd-decode":
        local["bootstrap_port"] = pick(host)
        local["kv_events_port"] = pick(host)
    if role == "prfaas":
        local["telemetry_port"] = pick(host)
    return local
