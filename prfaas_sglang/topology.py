"""Deployment topology files (YAML): clusters, nodes, roles, links, and the scheduler's model.

Validation is strict and names the bad field by its path
(``clusters.pd-a.nodes[1].role``), suggesting the nearest known key for a
typo. Parsing is pure (``parse_topology(dict)``); ``load_topology(path)`` adds
the file read. Example files: ``launch/*.yaml``. The scheduler's model of the
deployment (cost profiles, threshold) is built from a topology by
:mod:`prfaas_sglang.runtime`, and only there.

Schema (version 1; every field marked optional may be left out)::

    version: 1
    model:                       # defaults for every engine node
      path: /models/x            # --model-path
      served_name: my-model      # optional: the name clients ask for (default: what the workers report)
      tokenizer: DIR | NAME      # optional: the router's tokenizer (default: path); a shipped name
                                 #   (prfaas-tiny-chatml) or a directory; none: ids only
      cost_model: NAME | PATH    # optional: the planner's model config (default kimi-linear-1t-hybrid);
                                 #   a shipped name, a file, or the config inline as a mapping
      extra_args: [...]          # passed to sglang.launch_server
    clusters:
      <name>:
        kind: prfaas | pd | control
        kv_transport: tcp | rdma   # engine clusters; default per role (tcp)
        accelerator: h200x8        # optional, engine clusters: the planner's accelerator class
        profile: measured.yaml     #   ... or a measured profile instead (default: h200x8 / h20x8)
        entry_share: 0.6           # optional, pd clusters: the share of all arrivals that enter here (a
                                   #   region's users; decoded here). Every pd cluster or none; none: one
                                   #   global entry, the scheduler chooses where each request decodes
        cidrs: [10.20.0.0/16]      # optional: the address ranges its hosts (pods) take. Across an encrypted
                                   #   link, the far side's tunnels send nothing for them outside the tunnel:
                                   #   an address there not yet resolved (a pod just recreated) is dropped
        nodes:
          - name: <unique>
            role: prfaas | pd-prefill | pd-decode | router | kv-index
            host: 127.0.0.1
            port: 30000
            bootstrap_port: 8998     # prefill roles
            kv_events_port: 5557     # engine roles: ZMQ KV-event publisher
            telemetry_port: 5560     # prefill roles: ZMQ link telemetry (emulated engine, transport)
            role_switch: in-place    # optional, pd-prefill / pd-decode: the long-term scheduler may turn it into
                                     #   the other PD role. in-place: the worker's own /pd_role_switch (emulated
                                     #   engine; SGLang >= 0.5.23); restart: the launcher supervises the engine
                                     #   and restarts it in the other role (SGLang 0.5.15). Needs bootstrap_port.
            switch_port: 30100       # role_switch restart: the launcher's supervisor serves /pd_role_switch here
            tp_size: 1
            model_path: ...          # overrides model.path; ./ and ../ are relative to the file
            extra_args: [...]        # appended after model.extra_args
    links:
      - {from: <cluster>, to: <cluster>, bandwidth_gbps: 100, rtt_ms: 5}
        # layerwise: true  -> the PrfaaS workers stream each layer's KV as the prefill writes it
        #                     (PRFAAS_KV_LAYERWISE) and the router's TTFT estimate counts the overlap
        # encrypt: true    -> everything between the two sides' hosts crosses a WireGuard tunnel
        #                     (transport/tunnel_plan.py; `launch --tunnel`)
        # tunnel_port: 51820 -> the tunnel's UDP port on both sides (encrypt)
    scheduler:                   # optional: what the global scheduler assumes until it measures
      workload: {kind: lognormal, mu: 9.9, sigma: 1.0, min_tokens: 128, max_tokens: 131072}
                                 #   prior of incremental lengths (the planner's workload schema)
      output_tokens: 1024        # L_out
      slo_tokens_per_s: 40       # decode SLO (sets BS_max and T_decode)
      ttft_slo_s: 10             # TTFT SLO: the router refuses early (503 + Retry-After) what would miss it
      decode_batch: 64           # optional: BS_max instead of the profile's
      threshold_tokens: 19400    # optional: the operator's baseline t instead of the planner's
      threshold_step_tokens: 128 # search grid
    emulation:                   # optional: emulated engines (--engine mock) run this scaled
      speedup: 20                #   durations / speedup
      kv_scale: 0.01             #   KV bytes shipped = S_kv(l) * kv_scale
    kubernetes:                  # optional: only `launch --emit k8s` reads it (launch/k8s.py)
      namespaces: {<cluster>: ns}  # default: the cluster's name
      images: {prfaas: IMG, pd: IMG, control: IMG}  # default: the images docker/*.Dockerfile build
      secret: prfaas-deployment  # Secret with keys deployment-secret (PRFAAS_SECRET_FILE) and admin-token
      gpu_resource: nvidia.com/gpu
      model_claim: models        # a PersistentVolumeClaim (the model directory) mounted read-only at model.path
      external_hosts: {<node>: dns-or-ip}  # how nodes of other clusters reach this node (another
                                 #   Kubernetes cluster); default: its pod's DNS name in-cluster
      peer_cidrs: {<cluster>: [10.2.0.0/16]}  # NetworkPolicies admit a cluster living in another
                                 #   Kubernetes cluster by these CIDRs (default: by namespace)
      cluster_domain: cluster.local
      monitoring_namespace: monitoring  # Prometheus's namespace (admitted to every /metrics port)
      router_front_port: 8099    # the router pod's front (router/front.py), which the router's client
                                 #   Service targets, so clients keep their connections when the
                                 #   router container restarts; null: clients reach the router directly
      requests: {<role>: {cpu: 250m, memory: 256Mi}}  # per role (or front): the containers' resource
                                 #   requests (default: launch/k8s.py DEFAULT_REQUESTS)
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from prfaas_sglang.configcheck import check_keys as _check_keys
from prfaas_sglang.configcheck import mapping as _mapping
from prfaas_sglang.configcheck import number
from prfaas_sglang.configcheck import opt_str as _opt_str
from prfaas_sglang.configcheck import port as _opt_port
from prfaas_sglang.configcheck import str_list as _str_list
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.roles import ROLE_SPECS, KvTransport, Role, parse_role

SUPPORTED_VERSIONS = (1,)
CLUSTER_KINDS = ("prfaas", "pd", "control")
SWITCH_MODES = ("in-place", "restart")


@dataclass(frozen=True)
class Node:
    name: str
    cluster: str
    role: Role
    host: str | None = None
    port: int | None = None
    bootstrap_port: int | None = None
    kv_events_port: int | None = None
    telemetry_port: int | None = None
    role_switch: str | None = None  # in-place | restart (SWITCH_MODES); None: the role is fixed
    switch_port: int | None = None  # restart: the launcher's supervisor's port
    tp_size: int | None = None
    model_path: str | None = None
    kv_transport: KvTransport | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Link:
    src: str
    dst: str
    bandwidth_gbps: float
    rtt_ms: float | None = None
    layerwise: bool = False  # the PrfaaS side streams KV by layer (plan/overlap.py)
    encrypt: bool = False  # WireGuard between the two sides' hosts (transport/tunnel_plan.py)
    tunnel_port: int = 51820  # the tunnel's UDP port on every host of the link


@dataclass(frozen=True)
class ModelSpec:
    """``model:``: what the engines serve, and what the scheduler assumes of it."""

    path: str | None = None
    served_name: str | None = None
    tokenizer: str | None = None  # None: model.path (when given); resolved by the router
    cost_model: str | dict | None = None  # the planner's model config; None: the runtime's default
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    kind: str  # prfaas | pd | control
    kv_transport: KvTransport | None = None
    accelerator: str | None = None  # the planner's accelerator class
    profile: str | None = None  # or a measured profile file
    entry_share: float | None = None  # pd: the share of arrivals entering here; None: one global entry
    cidrs: tuple[str, ...] = ()  # the address ranges its hosts take (tunnels lock them: transport/tunnel_plan.py)


@dataclass(frozen=True)
class SchedulerSpec:
    """``scheduler:``; ``workload`` is validated by the runtime model (it may read a trace)."""

    workload: dict | None = None
    output_tokens: int | None = None
    slo_tokens_per_s: float | None = None
    ttft_slo_s: float | None = None
    decode_batch: int | None = None
    threshold_tokens: float | None = None
    threshold_step_tokens: float | None = None


@dataclass(frozen=True)
class Emulation:
    """How emulated engines scale time and KV bytes (``emulation:``)."""

    speedup: float = 1.0
    kv_scale: float = 1.0


@dataclass(frozen=True)
class KubernetesSpec:
    """``kubernetes:``: how ``launch --emit k8s`` maps the topology onto Kubernetes (all optional)."""

    namespaces: dict[str, str] = field(default_factory=dict)  # cluster -> namespace (default: its name)
    images: dict[str, str] = field(default_factory=dict)  # prfaas | pd | control -> image
    secret: str = "prfaas-deployment"
    gpu_resource: str = "nvidia.com/gpu"
    model_claim: str | None = None
    external_hosts: dict[str, str] = field(default_factory=dict)  # node -> address other clusters use
    peer_cidrs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # cluster -> CIDRs
    cluster_domain: str = "cluster.local"
    monitoring_namespace: str = "monitoring"
    router_front_port: int | None = 8099  # None: no front in the router pod
    # role (or "front") -> {"cpu": ..., "memory": ...}: a container's resource requests, over launch/k8s.py's
    # defaults (sized for what the role runs: an emulated engine or a control process takes a fraction of a core)
    requests: dict[str, dict[str, str]] = field(default_factory=dict)

    def namespace(self, cluster: str) -> str:
        return self.namespaces.get(cluster, cluster)


@dataclass(frozen=True, order=True)
class SitePair:
    """The global scheduler's unit: a PD cluster with one PrfaaS cluster linked to it (the link its KV
    crosses), or a PD cluster on its own (``prfaas`` None: it prefills everything itself)."""

    pd: str
    prfaas: str | None = None

    def __str__(self) -> str:
        return f"{self.prfaas}->{self.pd}" if self.prfaas is not None else self.pd


@dataclass(frozen=True)
class Topology:
    version: int
    nodes: tuple[Node, ...]
    links: tuple[Link, ...] = ()
    cluster_kinds: dict[str, str] = field(default_factory=dict)
    model: ModelSpec = field(default_factory=ModelSpec)
    clusters: dict[str, ClusterSpec] = field(default_factory=dict)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    emulation: Emulation | None = None
    base_dir: Path | None = None  # the file's directory: relative paths resolve against it
    kubernetes: KubernetesSpec = field(default_factory=KubernetesSpec)

    def nodes_of(self, *roles: Role) -> list[Node]:
        return [n for n in self.nodes if n.role in roles]

    def routers(self) -> list[Node]:
        return self.nodes_of(Role.ROUTER)

    def sites(self, kind: str) -> list[str]:
        """The clusters of ``kind`` (prfaas | pd) that have engine nodes, in file order."""
        engines = {n.cluster for n in self.nodes if ROLE_SPECS[n.role].cluster_kind == kind}
        return [name for name, k in self.cluster_kinds.items() if k == kind and name in engines]

    @property
    def is_fleet(self) -> bool:
        """More than one PrfaaS or more than one PD cluster (the paper's architecture beyond its case study)."""
        return len(self.sites("prfaas")) > 1 or len(self.sites("pd")) > 1

    def link_between(self, prfaas: str, pd: str) -> Link | None:
        """The link that moves KV from ``prfaas`` to ``pd`` (declared in either direction), or None."""
        return next((link for link in self.links if {link.src, link.dst} == {prfaas, pd}), None)

    def pairs(self) -> tuple[SitePair, ...]:
        """Every (PD cluster, PrfaaS cluster linked to it), in file order; a PD cluster with no such link
        pairs with the one PrfaaS cluster of a one-pair topology (the link then defaults), else with none."""
        prfaas, out = self.sites("prfaas"), []
        for pd in self.sites("pd"):
            linked = [p for p in prfaas if self.link_between(p, pd) is not None]
            if not linked and len(prfaas) == 1 and not self.is_fleet:
                linked = prfaas
            out += [SitePair(pd, p) for p in linked] or [SitePair(pd)]
        return tuple(out)

    def restricted(self, pair: SitePair) -> Topology:
        """This topology with the pair's clusters (and the control plane) only, and their link only: the
        one-pair deployment a pair is, for the one-pair model (``runtime.from_topology``)."""
        keep = {pair.pd, pair.prfaas} | {name for name, kind in self.cluster_kinds.items() if kind == "control"}
        return replace(self, nodes=tuple(n for n in self.nodes if n.cluster in keep),
                       links=tuple(link for link in self.links if {link.src, link.dst} <= keep),
                       cluster_kinds={k: v for k, v in self.cluster_kinds.items() if k in keep},
                       clusters={k: v for k, v in self.clusters.items() if k in keep})

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise ConfigError("--node", f"no node named {name!r} in the topology (nodes: {known})")


def _transport(value: Any, path: str) -> KvTransport | None:
    if value is None:
        return None
    try:
        return KvTransport(value)
    except ValueError:
        raise ConfigError(path, f"unknown KV transport {value!r} (expected tcp or rdma)") from None


_NODE_KEYS = {"name", "role", "host", "port", "bootstrap_port", "kv_events_port", "telemetry_port", "role_switch",
              "switch_port", "tp_size", "model_path", "extra_args"}
PORT_KEYS = ("port", "bootstrap_port", "kv_events_port", "telemetry_port", "switch_port")


def _role_switch(obj: dict, path: str, role: Role, bootstrap_port: int | None) -> tuple[str | None, int | None]:
    """``role_switch`` and ``switch_port`` of a node, checked: PD roles only, a bootstrap port (served
    whenever the node is prefill), a supervisor port exactly when the switch is a restart."""
    mode = _opt_str(obj, "role_switch", path)
    switch_port = _opt_port(obj, "switch_port", path)
    if mode is None:
        if switch_port is not None:
            raise ConfigError(f"{path}.switch_port", "is for nodes with role_switch: restart")
        return None, None
    if mode not in SWITCH_MODES:
        raise ConfigError(f"{path}.role_switch", f"unknown mode {mode!r} (expected {' or '.join(SWITCH_MODES)})")
    if role not in (Role.PD_PREFILL, Role.PD_DECODE):
        raise ConfigError(f"{path}.role_switch", f"only pd-prefill and pd-decode nodes switch roles, not {role.value}")
    if bootstrap_port is None:
        raise ConfigError(f"{path}.bootstrap_port", "is required with role_switch (the node serves it while it is prefill)")
    if (mode == "restart") != (switch_port is not None):
        raise ConfigError(f"{path}.switch_port", "is required with role_switch: restart, and only then")
    return mode, switch_port


def _parse_node(raw: Any, path: str, cluster: str, kind: str, transport: KvTransport | None, model: dict) -> Node:
    obj = _mapping(raw, path)
    _check_keys(obj, _NODE_KEYS, path)
    name = _opt_str(obj, "name", path)
    if name is None:
        raise ConfigError(f"{path}.name", "is required")
    if "role" not in obj:
        raise ConfigError(f"{path}.role", "is required")
    role = parse_role(str(obj["role"]), f"{path}.role", topology=True)
    spec = ROLE_SPECS[role]
    if spec.cluster_kind != kind:
        raise ConfigError(f"{path}.role", f"role {role.value} cannot run in a {kind} cluster (it belongs in a {spec.cluster_kind} cluster)")
    if transport is not None and spec.is_engine_role and transport not in spec.allowed_kv_transports:
        raise ConfigError(f"{path}.role", f"role {role.value} cannot use the {transport.value} KV transport of its cluster")
    bootstrap_port = _opt_port(obj, "bootstrap_port", path)
    role_switch, switch_port = _role_switch(obj, path, role, bootstrap_port)
    if bootstrap_port is not None and spec.disaggregation_mode != "prefill" and role_switch is None:
        raise ConfigError(f"{path}.bootstrap_port", f"only prefill roles (and switchable PD nodes) serve a bootstrap "
                                                    f"port, not {role.value}")
    kv_events_port = _opt_port(obj, "kv_events_port", path)
    telemetry_port = _opt_port(obj, "telemetry_port", path)
    if telemetry_port is not None and spec.disaggregation_mode != "prefill":
        raise ConfigError(f"{path}.telemetry_port", f"only prefill roles publish link telemetry, not {role.value}")
    if kv_events_port is not None and not spec.is_engine_role:
        raise ConfigError(f"{path}.kv_events_port", f"only engine roles publish KV events, not {role.value}")
    return Node(
        name=name,
        cluster=cluster,
        role=role,
        host=_opt_str(obj, "host", path),
        port=_opt_port(obj, "port", path),
        bootstrap_port=bootstrap_port,
        kv_events_port=kv_events_port,
        telemetry_port=telemetry_port,
        role_switch=role_switch,
        switch_port=switch_port,
        tp_size=number(obj, "tp_size", path, positive=True, integer=True),
        model_path=_opt_str(obj, "model_path", path) or model.get("path"),
        kv_transport=transport if spec.is_engine_role else None,
        extra_args=tuple(model.get("extra_args") or ()) + _str_list(obj, "extra_args", path)
        if spec.is_engine_role
        else _str_list(obj, "extra_args", path),
    )


def _check_unique_endpoints(nodes: list[Node], paths: dict[str, str]) -> None:
    names: set[str] = set()
    endpoints: dict[tuple[str, int], str] = {}
    for node in nodes:
        path = paths[node.name + "@" + node.cluster]
        if node.name in names:
            raise ConfigError(f"{path}.name", f"node name {node.name!r} is used twice")
        names.add(node.name)
        host = node.host or "127.0.0.1"
        for key in PORT_KEYS:
            port = getattr(node, key)
            if port is None:
                continue
            other = endpoints.get((host, port))
            if other is not None:
                raise ConfigError(f"{path}.{key}", f"{host}:{port} is already used by {other}")
            endpoints[(host, port)] = f"{node.name}.{key}"


def parse_topology(data: Any, source: str = "topology", base_dir: Path | None = None) -> Topology:
    """Validate a loaded YAML document; raise :class:`ConfigError` naming the bad field.

    Model paths starting with ``./`` or ``../`` are resolved against ``base_dir``
    (the topology file's directory) when it is given.
    """
    top = _mapping(data, source)
    _check_keys(top, {"version", "model", "clusters", "links", "scheduler", "emulation", "kubernetes"}, "")
    version = top.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError("version", f"must be one of {SUPPORTED_VERSIONS}, got {version!r}")
    model = _mapping(top.get("model", {}), "model")
    model_spec = _parse_model(model)
    clusters = _mapping(top.get("clusters"), "clusters") if "clusters" in top else None
    if not clusters:
        raise ConfigError("clusters", "at least one cluster is required")

    nodes: list[Node] = []
    paths: dict[str, str] = {}
    kinds: dict[str, str] = {}
    specs: dict[str, ClusterSpec] = {}
    for cname, craw in clusters.items():
        cpath = f"clusters.{cname}"
        cluster = _mapping(craw, cpath)
        _check_keys(cluster, {"kind", "kv_transport", "accelerator", "profile", "entry_share", "cidrs", "nodes"}, cpath)
        kind = cluster.get("kind")
        if kind not in CLUSTER_KINDS:
            raise ConfigError(f"{cpath}.kind", f"must be one of {', '.join(CLUSTER_KINDS)}, got {kind!r}")
        kinds[str(cname)] = kind
        transport = _transport(cluster.get("kv_transport"), f"{cpath}.kv_transport")
        if transport is not None and kind == "control":
            raise ConfigError(f"{cpath}.kv_transport", "a control cluster moves no KV")
        accelerator, profile = _opt_str(cluster, "accelerator", cpath), _opt_str(cluster, "profile", cpath)
        if kind == "control" and (accelerator or profile):
            raise ConfigError(f"{cpath}.{'accelerator' if accelerator else 'profile'}", "a control cluster runs no engine")
        if accelerator and profile:
            raise ConfigError(f"{cpath}.profile", "give accelerator or profile, not both")
        if profile and base_dir is not None and profile.startswith(("./", "../")):
            profile = str((base_dir / profile).resolve())
        entry_share = number(cluster, "entry_share", cpath, nonnegative=True, at_most=1.0)
        if entry_share is not None and kind != "pd":
            raise ConfigError(f"{cpath}.entry_share", "only a pd cluster is an entry (its region's users decode there)")
        specs[str(cname)] = ClusterSpec(str(cname), kind, transport, accelerator, profile, entry_share,
                                        _cidrs(cluster.get("cidrs", []), f"{cpath}.cidrs"))
        raw_nodes = cluster.get("nodes")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise ConfigError(f"{cpath}.nodes", "must be a non-empty list")
        for i, raw in enumerate(raw_nodes):
            node = _parse_node(raw, f"{cpath}.nodes[{i}]", str(cname), kind, transport, model)
            if base_dir is not None and node.model_path and node.model_path.startswith(("./", "../")):
                node = replace(node, model_path=str((base_dir / node.model_path).resolve()))
            paths.setdefault(node.name + "@" + node.cluster, f"{cpath}.nodes[{i}]")
            nodes.append(node)
    _check_unique_endpoints(nodes, paths)
    check_entry_shares({name: spec.entry_share for name, spec in specs.items() if spec.kind == "pd"})

    links: list[Link] = []
    raw_links = top.get("links", [])
    if not isinstance(raw_links, list):
        raise ConfigError("links", "must be a list")
    for i, raw in enumerate(raw_links):
        lpath = f"links[{i}]"
        obj = _mapping(raw, lpath)
        _check_keys(obj, {"from", "to", "bandwidth_gbps", "rtt_ms", "layerwise", "encrypt", "tunnel_port"}, lpath)
        for key in ("from", "to"):
            if not isinstance(obj.get(key), str) or obj[key] not in kinds:
                raise ConfigError(f"{lpath}.{key}", f"unknown cluster {obj.get(key)!r} (clusters: {', '.join(kinds)})")
        bandwidth = number(obj, "bandwidth_gbps", lpath, positive=True)
        if bandwidth is None:
            raise ConfigError(f"{lpath}.bandwidth_gbps", "is required")
        flags = {}
        for key in ("layerwise", "encrypt"):
            flags[key] = obj.get(key, False)
            if not isinstance(flags[key], bool):
                raise ConfigError(f"{lpath}.{key}", f"must be true or false, got {flags[key]!r}")
        tunnel_port = obj.get("tunnel_port", Link.tunnel_port)
        if isinstance(tunnel_port, bool) or not isinstance(tunnel_port, int) or not 1 <= tunnel_port <= 65535:
            raise ConfigError(f"{lpath}.tunnel_port", f"must be a port number, got {tunnel_port!r}")
        links.append(Link(obj["from"], obj["to"], bandwidth, number(obj, "rtt_ms", lpath, positive=True),
                          flags["layerwise"], flags["encrypt"], tunnel_port))
    _check_fleet_links(kinds, nodes, links)
    return Topology(version, tuple(nodes), tuple(links), kinds, model_spec, specs,
                    _parse_scheduler(top.get("scheduler", {})), _parse_emulation(top.get("emulation")), base_dir,
                    _parse_kubernetes(top.get("kubernetes", {}), kinds, {n.name for n in nodes}))


def _cidrs(raw: Any, path: str) -> tuple[str, ...]:
    """A list of address ranges (``10.20.0.0/16``, ``fd00::/64``), each as ``ipaddress`` writes it."""
    import ipaddress

    if not isinstance(raw, list):
        raise ConfigError(path, f"must be a list of address ranges (10.20.0.0/16), got {raw!r}")
    out = []
    for i, item in enumerate(raw):
        try:
            if not isinstance(item, str):
                raise TypeError("a string")
            out.append(str(ipaddress.ip_network(item)))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{path}[{i}]", f"not an address range with its host bits zero: {item!r} ({err})") from None
    return tuple(out)


def _check_fleet_links(kinds: dict[str, str], nodes: list[Node], links: list[Link]) -> None:
    """Links between a PrfaaS and a PD cluster are unique, and in a fleet (several clusters of a kind)
    every PrfaaS cluster and every PD cluster is reached by one: KV only crosses declared links, so a
    cluster without one could not be scheduled. ConfigError names the field."""
    seen: dict[frozenset, int] = {}
    for i, link in enumerate(links):
        ends = frozenset((link.src, link.dst))
        if {kinds[link.src], kinds[link.dst]} != {"prfaas", "pd"}:
            continue
        if ends in seen:
            raise ConfigError(f"links[{i}]", f"a second link between {link.src} and {link.dst} (links[{seen[ends]}])")
        seen[ends] = i
    with_engines = {n.cluster for n in nodes if ROLE_SPECS[n.role].cluster_kind in ("prfaas", "pd")}
    sites = {kind: [c for c, k in kinds.items() if k == kind and c in with_engines] for kind in ("prfaas", "pd")}
    if len(sites["prfaas"]) <= 1 and len(sites["pd"]) <= 1:
        return
    linked = {c for ends in seen for c in ends}
    for kind, other in (("pd", "prfaas"), ("prfaas", "pd")):
        for cluster in sites[kind]:
            if sites[other] and cluster not in linked:
                raise ConfigError(f"clusters.{cluster}", f"no link reaches this {kind} cluster from a {other} cluster: "
                                                         "in a fleet, KV crosses only the links the topology declares")


def check_entry_shares(shares: dict[str, float | None]) -> None:
    """Every pd cluster has an ``entry_share`` (summing to 1) or none has; ConfigError names the field."""
    missing = [name for name, share in shares.items() if share is None]
    if missing and len(missing) < len(shares):
        raise ConfigError(f"clusters.{missing[0]}.entry_share",
                          "give every pd cluster an entry_share, or none (one global entry)")
    if not missing and shares:
        for name, share in shares.items():
            if not 0 <= share <= 1:
                raise ConfigError(f"clusters.{name}.entry_share", f"must be in [0, 1], got {share!r}")
        total = sum(shares.values())
        if abs(total - 1.0) > 1e-6:
            raise ConfigError("clusters", f"the pd clusters' entry_share must sum to 1, got {total:g}")


def _parse_model(model: dict) -> ModelSpec:
    _check_keys(model, {"path", "served_name", "tokenizer", "cost_model", "extra_args"}, "model")
    cost = model.get("cost_model")
    if cost is not None and not isinstance(cost, (str, dict)):
        raise ConfigError("model.cost_model", "must be a shipped model name, a path or a mapping")
    return ModelSpec(_opt_str(model, "path", "model"), _opt_str(model, "served_name", "model"),
                     _opt_str(model, "tokenizer", "model"), cost, _str_list(model, "extra_args", "model"))


def _parse_scheduler(raw: Any) -> SchedulerSpec:
    obj = _mapping(raw, "scheduler")
    _check_keys(obj, {"workload", "output_tokens", "slo_tokens_per_s", "ttft_slo_s", "decode_batch",
                      "threshold_tokens", "threshold_step_tokens"}, "scheduler")
    workload = obj.get("workload")
    if workload is not None:
        _mapping(workload, "scheduler.workload")
    return SchedulerSpec(
        workload=workload,
        output_tokens=number(obj, "output_tokens", "scheduler", positive=True, integer=True),
        slo_tokens_per_s=number(obj, "slo_tokens_per_s", "scheduler", positive=True),
        ttft_slo_s=number(obj, "ttft_slo_s", "scheduler", positive=True),
        decode_batch=number(obj, "decode_batch", "scheduler", positive=True, integer=True),
        threshold_tokens=number(obj, "threshold_tokens", "scheduler", positive=True),
        threshold_step_tokens=number(obj, "threshold_step_tokens", "scheduler", positive=True),
    )


def _parse_emulation(raw: Any) -> Emulation | None:
    if raw is None:
        return None
    obj = _mapping(raw, "emulation")
    _check_keys(obj, {"speedup", "kv_scale"}, "emulation")
    kv_scale = number(obj, "kv_scale", "emulation", default=1.0, positive=True, at_most=1.0)
    return Emulation(number(obj, "speedup", "emulation", default=1.0, positive=True), kv_scale)


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
IMAGE_KINDS = ("prfaas", "pd", "control")


def dns_label(value: Any, path: str) -> str:
    """``value`` if it is an RFC 1123 label (a Kubernetes namespace or object name), else ConfigError."""
    if not isinstance(value, str) or not _DNS_LABEL.fullmatch(value):
        raise ConfigError(path, f"must be a DNS label (lower-case letters, digits and '-', at most 63), got {value!r}")
    return value


def _str_map(obj: dict, key: str, path: str, keys: set[str] | tuple[str, ...], what: str) -> dict[str, str]:
    raw = _mapping(obj.get(key, {}), f"{path}.{key}")
    for name, value in raw.items():
        if name not in keys:
            raise ConfigError(f"{path}.{key}.{name}", f"unknown {what} (known: {', '.join(sorted(keys))})")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}.{key}.{name}", "must be a non-empty string")
    return dict(raw)


def _parse_kubernetes(raw: Any, kinds: dict[str, str], node_names: set[str]) -> KubernetesSpec:
    obj = _mapping(raw, "kubernetes")
    path = "kubernetes"
    _check_keys(obj, {"namespaces", "images", "secret", "gpu_resource", "model_claim", "external_hosts", "peer_cidrs",
                      "cluster_domain", "monitoring_namespace", "router_front_port", "requests"}, path)
    front_port = obj.get("router_front_port", KubernetesSpec.router_front_port)
    if front_port is not None and (isinstance(front_port, bool) or not isinstance(front_port, int)
                                   or not 1 <= front_port <= 65535):
        raise ConfigError(f"{path}.router_front_port", f"must be a port number or null, got {front_port!r}")
    namespaces = _str_map(obj, "namespaces", path, set(kinds), "cluster")
    for cluster, ns in namespaces.items():
        dns_label(ns, f"{path}.namespaces.{cluster}")
    cidrs: dict[str, tuple[str, ...]] = {}
    for cluster, values in _mapping(obj.get("peer_cidrs", {}), f"{path}.peer_cidrs").items():
        if cluster not in kinds:
            raise ConfigError(f"{path}.peer_cidrs.{cluster}", f"unknown cluster (clusters: {', '.join(kinds)})")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}.peer_cidrs.{cluster}", "must be a non-empty list of CIDRs")
        for i, cidr in enumerate(values):
            try:
                ipaddress.ip_network(str(cidr))
            except ValueError:
                raise ConfigError(f"{path}.peer_cidrs.{cluster}[{i}]", f"not a CIDR: {cidr!r}") from None
        cidrs[cluster] = tuple(str(c) for c in values)
    defaults = KubernetesSpec()
    secret = dns_label(obj.get("secret", defaults.secret), f"{path}.secret")
    claim = obj.get("model_claim")
    return KubernetesSpec(
        namespaces=namespaces,
        images=_str_map(obj, "images", path, IMAGE_KINDS, "image kind"),
        secret=secret,
        gpu_resource=_opt_str(obj, "gpu_resource", path) or defaults.gpu_resource,
        model_claim=None if claim is None else dns_label(claim, f"{path}.model_claim"),
        external_hosts=_str_map(obj, "external_hosts", path, node_names, "node"),
        peer_cidrs=cidrs,
        cluster_domain=_opt_str(obj, "cluster_domain", path) or defaults.cluster_domain,
        monitoring_namespace=dns_label(obj.get("monitoring_namespace", defaults.monitoring_namespace),
                                       f"{path}.monitoring_namespace"),
        router_front_port=front_port,
        requests=_parse_requests(obj.get("requests", {}), f"{path}.requests"),
    )


# A Kubernetes quantity as a request takes it: cpu "250m" / "0.5" / "2", memory "256Mi" / "1G" / "1073741824".
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")


def _parse_requests(raw: Any, path: str) -> dict[str, dict[str, str]]:
    """``kubernetes.requests``: role (or ``front``) -> ``{cpu, memory}``, each a Kubernetes quantity."""
    known = {role.value for role in Role} | {"front"}
    out: dict[str, dict[str, str]] = {}
    for role, value in _mapping(raw, path).items():
        if role not in known:
            raise ConfigError(f"{path}.{role}", f"unknown role (roles: {', '.join(sorted(known))})")
        obj = _mapping(value, f"{path}.{role}")
        _check_keys(obj, {"cpu", "memory"}, f"{path}.{role}")
        for key, quantity in obj.items():
            if not isinstance(quantity, (str, int, float)) or isinstance(quantity, bool) or not _QUANTITY.match(str(quantity)):
                raise ConfigError(f"{path}.{role}.{key}", f"not a Kubernetes quantity: {quantity!r} (e.g. 250m, 1Gi)")
        out[role] = {key: str(q) for key, q in obj.items()}
    return out


def load_topology(path: Path) -> Topology:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError("--config", f"cannot read {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError("--config", f"{path} is not valid YAML: {err}") from None
    return parse_topology(data, str(path), Path(path).resolve().parent)
