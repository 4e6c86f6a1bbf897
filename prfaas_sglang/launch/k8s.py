"""Kubernetes manifests for a topology (``python -m prfaas_sglang.launch --emit k8s``), pure.

One directory per topology cluster, kustomize-ready::

    OUT/<cluster>/kustomization.yaml   namespace + the files below
    OUT/<cluster>/namespace.yaml
    OUT/<cluster>/topology.yaml        ConfigMap prfaas-topology: the topology as this cluster sees it
    OUT/<cluster>/<workload>.yaml      StatefulSet + headless Service (+ the router's client Service,
                                       which targets the front beside the router: router/front.py)
    OUT/<cluster>/networkpolicy.yaml   default deny, then what the topology's data paths need

Every link is encrypted here unless the topology says ``encrypt: false`` (:func:`encrypted_by_default`: links
join datacenters, and the KV, bootstrap, legs, events and telemetry crossing them would otherwise travel in clear).
A pod on an encrypted link (``links[].encrypt``) carries a ``tunnel`` container beside its node: the launcher
holding the pod's WireGuard tunnel (``launch --tunnel --node``; NET_ADMIN and ``/dev/net/tun`` from the host),
which resolves its peers' pod names and follows a recreated pod to its new address; the node's own process
waits for it (``PRFAAS_TUNNEL_WAIT_S``), and the cluster's policies admit the tunnel's UDP from the other side.
    OUT/monitoring/...                 ServiceMonitor, a plain Prometheus scrape config, the dashboard

Every node of the topology is a StatefulSet pod, and every process is the launcher
(``python3 -m prfaas_sglang.launch --config /etc/prfaas/topology.yaml --node NAME``): what runs
is exactly what ``launch`` runs elsewhere. Nodes of one role named ``<stem>-0 .. <stem>-(n-1)``
with the same settings become one StatefulSet ``<stem>`` of n replicas (``--node $(POD_NAME)``);
any other node is a StatefulSet of its own (``<name>``, pod ``<name>-0``).

Addresses: in the ConfigMap every node's ``host`` is its pod's stable DNS name
(``<pod>.<workload>.<namespace>.svc.<domain>``, resolvable before the pod is ready since the
headless Services publish not-ready addresses). A process binds that name (its own pod IP), and
peers, peer checks (``PRFAAS_PEER_HOSTS``) and bootstrap hosts all use the same names. A node of
another cluster that lives in another Kubernetes cluster is reached at its
``kubernetes.external_hosts`` entry instead (configuration, not code).

Nothing here performs I/O: :func:`render` returns ``{relative path: text}``; the launcher writes it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace

import yaml

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.launch.command import SGLANG_PD_ZMQ_PORTS
from prfaas_sglang.roles import ROLE_SPECS, Engine, Role
from prfaas_sglang.topology import PORT_KEYS, KubernetesSpec, Node, Topology, dns_label
from prfaas_sglang.transport.tunnel_plan import tunnel_clusters
from prfaas_sglang.transport.wan_defaults import MOONCAKE_RPC_PORTS

CONFIG_MOUNT = "/etc/prfaas/topology.yaml"
SECRET_DIR = "/etc/prfaas/secret"
SECRET_KEY = "deployment-secret"  # the deployment secret (PRFAAS_SECRET_FILE): MAC, worker API and ZMQ keys derive from it
ADMIN_TOKEN_KEY = "admin-token"  # the router's admin API token (PRFAAS_ADMIN_TOKEN)
TOPOLOGY_CONFIGMAP = "prfaas-topology"
DEFAULT_IMAGES = {  # the tags docker/*.Dockerfile's build lines give (push them to your registry; kubernetes.images)
    "prfaas": "prfaas-sglang/prfaas-prefill:0.1.0",
    "pd": "prfaas-sglang/local-pd:0.1.0",
    "control": "prfaas-sglang/control-plane:0.1.0",
}
# What the manifests assume of the cluster, at the head of each kustomization: an API server that keeps a
# NetworkPolicy port range (endPort: beta and on by default from 1.22, GA in 1.25; a 1.20 API server drops it
# without a word, leaving one port of Mooncake's range open) and cluster DNS answering the pods' names.
MIN_KUBERNETES = "1.25"
REQUIREMENTS_NOTE = (f"# Needs Kubernetes >= {MIN_KUBERNETES}: the NetworkPolicies' port ranges (endPort) are dropped silently by\n"
                     "# older API servers. Needs cluster DNS (e.g. CoreDNS) resolving <pod>.<service>.<namespace>.svc.<domain>:\n"
                     "# the topology's hosts are those names. Create the deployment secret first (docs/kubernetes.md).\n")

# Every port a topology node may have (topology.PORT_KEYS), as a container port name (<= 15 chars).
PORT_NAMES = {key: {"port": "http", "switch_port": "role-switch"}.get(key, key.removesuffix("_port").replace("_", "-"))
              for key in PORT_KEYS}
LABEL_APP = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_CLUSTER = "prfaas.io/cluster"
APP = "prfaas-sglang"
_ORDINAL = re.compile(r"(.+)-(\d+)")


@dataclass(frozen=True)
class Workload:
    """One StatefulSet: ``nodes[i]`` runs in pod ``<name>-<i>``."""

    name: str
    cluster: str
    role: Role
    nodes: tuple[Node, ...]
    per_pod_node: bool  # True: ``--node $(POD_NAME)`` (pod names are node names); False: one literal node

    def pod(self, index: int) -> str:
        return f"{self.name}-{index}"

    @property
    def ports(self) -> dict[str, int]:
        """Port name -> number, as the node's settings (all nodes of a workload share them)."""
        node = self.nodes[0]
        return {PORT_NAMES[key]: getattr(node, key) for key in PORT_NAMES if getattr(node, key) is not None}


def _same_settings(a: Node, b: Node) -> bool:
    return {k: v for k, v in vars(a).items() if k not in ("name", "host")} == \
           {k: v for k, v in vars(b).items() if k not in ("name", "host")}


def workloads(topology: Topology) -> list[Workload]:
    """The topology's nodes grouped into StatefulSets (module docstring). Raises ConfigError for a
    node name that cannot name a pod."""
    out: list[Workload] = []
    taken: set[str] = set()
    by_stem: dict[tuple[str, Role, str], list[tuple[int, Node]]] = {}
    index_in_cluster: dict[str, int] = {}
    for node in topology.nodes:
        i = index_in_cluster[node.cluster] = index_in_cluster.get(node.cluster, -1) + 1
        dns_label(node.name, f"clusters.{node.cluster}.nodes[{i}].name")
        match = _ORDINAL.fullmatch(node.name)
        if match:
            by_stem.setdefault((node.cluster, node.role, match.group(1)), []).append((int(match.group(2)), node))
    grouped: set[str] = set()
    for (cluster, role, stem), members in by_stem.items():
        members.sort(key=lambda m: m[0])
        nodes = tuple(n for _, n in members)
        if [o for o, _ in members] == list(range(len(members))) and all(_same_settings(nodes[0], n) for n in nodes):
            out.append(Workload(stem, cluster, role, nodes, True))
            grouped.update(n.name for n in nodes)
            taken.add(stem)
    for node in topology.nodes:
        if node.name not in grouped:
            if node.name in taken:
                raise ConfigError("--emit", f"node {node.name!r} has the name of a StatefulSet of other nodes")
            out.append(Workload(node.name, node.cluster, node.role, (node,), False))
    return sorted(out, key=lambda w: (w.cluster, w.name))


def pod_hosts(topology: Topology, loads: list[Workload]) -> dict[str, str]:
    """Node name -> its pod's stable DNS name."""
    spec = topology.kubernetes
    return {node.name: f"{w.pod(i)}.{w.name}.{spec.namespace(w.cluster)}.svc.{spec.cluster_domain}"
            for w in loads for i, node in enumerate(w.nodes)}


def cluster_topology(raw: dict, topology: Topology, cluster: str, hosts: dict[str, str]) -> dict:
    """The topology file ``cluster``'s pods read: ``raw`` (the file as written) with every node's
    host replaced by its pod DNS name, or for another cluster's node by its external host if given."""
    external = topology.kubernetes.external_hosts
    out = copy.deepcopy(raw)
    for cname, craw in out["clusters"].items():
        for node in craw["nodes"]:
            name = node["name"]
            node["host"] = external[name] if cname != cluster and name in external else hosts[name]
    return out


def _labels(w: Workload) -> dict[str, str]:
    return {LABEL_APP: APP, LABEL_COMPONENT: w.role.value, LABEL_INSTANCE: w.name, LABEL_CLUSTER: w.cluster}


def _image(topology: Topology, w: Workload, engine: Engine) -> str:
    kind = topology.cluster_kinds[w.cluster]
    if engine is Engine.MOCK and kind != "control":
        kind = "control"  # the emulated engine needs no GPU image: the control-plane image carries it
    return topology.kubernetes.images.get(kind, DEFAULT_IMAGES[kind])


def container_args(w: Workload, engine: Engine) -> list[str]:
    """The launcher's arguments in ``w``'s pods (``$(POD_NAME)`` is expanded by Kubernetes)."""
    args = ["--config", CONFIG_MOUNT, "--node", "$(POD_NAME)" if w.per_pod_node else w.nodes[0].name]
    if ROLE_SPECS[w.role].is_engine_role:
        args += ["--engine", engine.value]
    return args


def _probe(path: str, period_s: int, failures: int, port: str = "http") -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "timeoutSeconds": 3,
            "failureThreshold": failures}


# Containers' resource requests by what they run, unless ``kubernetes.requests`` says otherwise: an emulated engine
# sleeps through its forwards and a control process routes at a fraction of a core (the local two-cluster
# example then asks 0.7 CPU in all, which a 2-CPU node schedules); an SGLang engine asks its GPUs as well, and
# its host side (tokenizer, scheduler, detokenizer processes) a core or more.
DEFAULT_REQUESTS = {
    "engine-mock": {"cpu": "100m", "memory": "256Mi"},
    "engine-sglang": {"cpu": "2", "memory": "16Gi"},
    "router": {"cpu": "250m", "memory": "256Mi"},
    "kv-index": {"cpu": "100m", "memory": "128Mi"},
    "front": {"cpu": "50m", "memory": "64Mi"},
    "tunnel": {"cpu": "250m", "memory": "64Mi"},  # wireguard-go: about 0.65 of a core at 1 Gbit/s (tunnel.md)
}
TUNNEL_WAIT_S = 120  # how long a node waits for its pod's tunnel container (they start together)
# wireguard-go's control sockets: the node's container asks them (`wg show`) whether its pod's tunnel is up, and
# containers share the pod's network namespace but not their files (the kernel's WireGuard answers over netlink)
WIREGUARD_RUN_MOUNT = {"name": "wireguard-run", "mountPath": "/var/run/wireguard"}


def requests_for(spec: KubernetesSpec, role: str, engine: Engine) -> dict[str, str]:
    """A container's cpu and memory requests: the topology's ``kubernetes.requests[role]`` over the defaults."""
    default = DEFAULT_REQUESTS.get(role) or DEFAULT_REQUESTS["engine-sglang" if engine is Engine.SGLANG else "engine-mock"]
    return {**default, **spec.requests.get(role, {})}


def _container(topology: Topology, w: Workload, engine: Engine) -> dict:
    spec = topology.kubernetes
    engine_role = ROLE_SPECS[w.role].is_engine_role
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "PRFAAS_SECRET_FILE", "value": f"{SECRET_DIR}/{SECRET_KEY}"}]
    if w.role is Role.ROUTER:
        env.append({"name": "PRFAAS_ADMIN_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": spec.secret, "key": ADMIN_TOKEN_KEY, "optional": True}}})
    mounts = [{"name": "topology", "mountPath": CONFIG_MOUNT, "subPath": "topology.yaml", "readOnly": True},
              {"name": "deployment-secret", "mountPath": SECRET_DIR, "readOnly": True}]
    resources: dict = {"requests": requests_for(spec, w.role.value, engine)}
    if engine_role:
        env += [{"name": "MC_MIN_RPC_PORT", "value": str(MOONCAKE_RPC_PORTS[0])},
                {"name": "MC_MAX_RPC_PORT", "value": str(MOONCAKE_RPC_PORTS[1])}]
        if engine is Engine.SGLANG:
            gpus = str(w.nodes[0].tp_size or 1)
            resources = {"requests": {**resources["requests"], spec.gpu_resource: gpus}, "limits": {spec.gpu_resource: gpus}}
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
            if spec.model_claim and topology.model.path:
                mounts.append({"name": "model", "mountPath": topology.model.path, "readOnly": True})
    container = {
        "name": w.role.value,
        "image": _image(topology, w, engine),
        "command": ["python3", "-m", "prfaas_sglang.launch"],
        "args": container_args(w, engine),
        "env": env,
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in w.ports.items()],
        "readinessProbe": _probe("/health", 5, 3),
        # a role_switch: restart node's engine is down while the launcher's supervisor restarts it in
        # the other role: liveness asks the supervisor (alive throughout), readiness the engine
        "livenessProbe": _probe("/health", 10, 6, "role-switch" if "role-switch" in w.ports else "http"),
        "resources": resources,
        "volumeMounts": mounts,
    }
    if engine_role:  # model load (SGLang: minutes) before liveness counts
        container["startupProbe"] = _probe("/health", 10, 180 if engine is Engine.SGLANG else 30)
    if w.cluster in tunnel_clusters(topology):
        env.append({"name": "PRFAAS_TUNNEL_WAIT_S", "value": str(TUNNEL_WAIT_S)})
        mounts.append(WIREGUARD_RUN_MOUNT)  # where it asks wireguard-go whether the tunnel is up
    return container


def _tunnel_container(topology: Topology, w: Workload, engine: Engine) -> dict:
    """The pod's WireGuard tunnel, held by the launcher (``--tunnel``) in the pod's network namespace."""
    node = "$(POD_NAME)" if w.per_pod_node else w.nodes[0].name
    return {
        "name": "tunnel",
        "image": _image(topology, w, engine),
        "command": ["python3", "-m", "prfaas_sglang.launch"],
        "args": ["--config", CONFIG_MOUNT, "--tunnel", "--node", node],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "PRFAAS_SECRET_FILE", "value": f"{SECRET_DIR}/{SECRET_KEY}"},
                {"name": "PRFAAS_TUNNEL_WAIT_S", "value": str(TUNNEL_WAIT_S)}],  # for the peers' names to resolve
        "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
        "resources": {"requests": requests_for(topology.kubernetes, "tunnel", engine)},
        "volumeMounts": [{"name": "topology", "mountPath": CONFIG_MOUNT, "subPath": "topology.yaml", "readOnly": True},
                         {"name": "deployment-secret", "mountPath": SECRET_DIR, "readOnly": True},
                         {"name": "dev-net-tun", "mountPath": "/dev/net/tun"}, WIREGUARD_RUN_MOUNT],
    }


def front_port(topology: Topology, w: Workload) -> int | None:
    """The port of the router pod's front, or None (not a router, or the front is off). Raises
    ConfigError when it is one of the router's own ports."""
    port = topology.kubernetes.router_front_port
    if w.role is not Role.ROUTER or port is None:
        return None
    if port in w.ports.values():
        raise ConfigError("kubernetes.router_front_port", f"{port} is one of router {w.name}'s own ports")
    return port


def _front_container(topology: Topology, w: Workload, port: int) -> dict:
    """The front (router/front.py) beside the router in its pod: it holds the clients' connections
    and resends what the router never answered, so a router container's restart (kubelet) breaks
    none of them. Same image; both bind the pod's IP (the router its pod DNS name, the same address)."""
    return {
        "name": "front",
        "image": _image(topology, w, Engine.MOCK),
        "command": ["python3", "-m", "prfaas_sglang.router.front"],
        "args": ["--router", f"http://$(POD_IP):{w.ports['http']}", "--host", "$(POD_IP)", "--port", str(port),
                 "--retry-window-s", "30"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],  # not every interface
        "ports": [{"name": "client", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": _probe("/front/health", 5, 3, "client"),
        "livenessProbe": _probe("/front/health", 10, 6, "client"),
        "resources": {"requests": requests_for(topology.kubernetes, "front", Engine.MOCK)},
    }


def _volumes(topology: Topology, w: Workload, engine: Engine) -> list[dict]:
    spec = topology.kubernetes
    volumes = [{"name": "topology", "configMap": {"name": TOPOLOGY_CONFIGMAP}},
               {"name": "deployment-secret", "secret": {"secretName": spec.secret, "defaultMode": 0o400,
                                                       "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}}]
    if w.cluster in tunnel_clusters(topology):
        volumes += [{"name": "dev-net-tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}},
                    {"name": "wireguard-run", "emptyDir": {}}]
    if ROLE_SPECS[w.role].is_engine_role and engine is Engine.SGLANG:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}})
        if spec.model_claim and topology.model.path:
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": spec.model_claim, "readOnly": True}})
    return volumes


def workload_manifests(topology: Topology, w: Workload, engine: Engine) -> list[dict]:
    """StatefulSet and headless Service of ``w`` (the router also gets its client Service)."""
    ns, labels = topology.kubernetes.namespace(w.cluster), _labels(w)
    selector = {LABEL_APP: APP, LABEL_INSTANCE: w.name}
    service_ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in w.ports.items()]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(w.ports["http"]), "prometheus.io/path": "/metrics"}
    front = front_port(topology, w)
    containers = [_container(topology, w, engine)] + ([_front_container(topology, w, front)] if front else [])
    if w.cluster in tunnel_clusters(topology):
        containers.append(_tunnel_container(topology, w, engine))
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": w.name, "namespace": ns, "labels": labels},
           "spec": {"serviceName": w.name, "replicas": len(w.nodes), "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": selector},
                    "template": {"metadata": {"labels": labels, "annotations": annotations},
                                 "spec": {"terminationGracePeriodSeconds": 30,
                                          "containers": containers,
                                          "volumes": _volumes(topology, w, engine)}}}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": w.name, "namespace": ns, "labels": labels},
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector,
                         "ports": service_ports}}
    out = [sts, headless]
    if w.role in (Role.ROUTER, Role.KV_INDEX):  # a stable address for clients (router: its front) and consumers (kv-index)
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": f"{w.name}-api", "namespace": ns, "labels": labels},
                    "spec": {"type": "ClusterIP", "selector": selector,
                             "ports": [{"name": "http", "port": w.ports["http"], "targetPort": "client" if front else "http",
                                        "protocol": "TCP"}]}})
    return out


def _peers(topology: Topology, loads: list[Workload], roles: set[Role], clusters: set[str] | None = None) -> list[dict]:
    """NetworkPolicy ``from`` entries admitting the pods of ``roles`` in ``clusters`` (None: anywhere in the
    topology): by namespace and component label, or by ``peer_cidrs`` for a cluster in another Kubernetes
    cluster."""
    spec = topology.kubernetes
    out: list[dict] = []
    by_cluster: dict[str, set[str]] = {}
    for w in loads:
        if w.role in roles and (clusters is None or w.cluster in clusters):
            by_cluster.setdefault(w.cluster, set()).add(w.role.value)
    for cluster, components in sorted(by_cluster.items()):
        if cluster in spec.peer_cidrs:
            out += [{"ipBlock": {"cidr": cidr}} for cidr in spec.peer_cidrs[cluster]]
            continue
        out.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.namespace(cluster)}},
                    "podSelector": {"matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In",
                                                          "values": sorted(components)}]}})
    return out


ENGINE_ROLES = {r for r, s in ROLE_SPECS.items() if s.is_engine_role}
CONTROL_ROLES = {Role.ROUTER, Role.KV_INDEX}


def linked_clusters(topology: Topology, cluster: str) -> set[str]:
    """``cluster`` and the clusters its KV may cross to or from: the other end of each of its pairs
    (``Topology.pairs``: a link, or the one PrfaaS cluster of a one-pair topology without one)."""
    out = {cluster}
    for pair in topology.pairs():
        if cluster in (pair.pd, pair.prfaas):
            out |= {pair.pd, pair.prfaas} - {None}
    return out


def network_policies(topology: Topology, loads: list[Workload], cluster: str, engine: Engine) -> list[dict]:
    """Default-deny ingress for ``cluster``'s namespace, then per workload what the data paths need:
    clients -> router; router -> worker HTTP and role switches; engines -> engine HTTP (hand-offs),
    bootstrap and Mooncake ports (and, for SGLang, its PD control channel's ZMQ ports), from the
    engines of this cluster and of the clusters a link joins it to only (a fleet's KV crosses its
    links and nothing else); router and kv-index -> KV-event and telemetry publishers; Prometheus ->
    every /metrics port. Egress is left open."""
    spec = topology.kubernetes
    ns = spec.namespace(cluster)
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.monitoring_namespace}}}]
    out = [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-ingress", "namespace": ns},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}]
    tunnel_port = tunnel_clusters(topology).get(cluster)  # None: this cluster's pods hold no tunnel
    routers, control, engines = (_peers(topology, loads, {Role.ROUTER}), _peers(topology, loads, CONTROL_ROLES),
                                 _peers(topology, loads, ENGINE_ROLES, linked_clusters(topology, cluster)))
    for w in (w for w in loads if w.cluster == cluster):
        ports = w.ports
        rules: list[dict] = []
        if w.role is Role.ROUTER:
            rules.append({"ports": [{"port": ports["http"], "protocol": "TCP"}]})  # clients: anywhere
            if (front := front_port(topology, w)) is not None:
                rules.append({"ports": [{"port": front, "protocol": "TCP"}]})  # and its front
        elif w.role is Role.KV_INDEX:
            rules.append({"from": routers + control, "ports": [{"port": ports["http"], "protocol": "TCP"}]})
        else:
            rules.append({"from": routers + engines, "ports": [{"port": ports["http"], "protocol": "TCP"}]})
            if "bootstrap" in ports:
                rules.append({"from": engines, "ports": [{"port": ports["bootstrap"], "protocol": "TCP"}]})
            rules.append({"from": engines, "ports": [{"port": MOONCAKE_RPC_PORTS[0], "endPort": MOONCAKE_RPC_PORTS[1],
                                                      "protocol": "TCP"}]})
            if engine is Engine.SGLANG:
                rules.append({"from": engines, "ports": [{"port": SGLANG_PD_ZMQ_PORTS[0], "endPort": SGLANG_PD_ZMQ_PORTS[1],
                                                          "protocol": "TCP"}]})
            streams = [{"port": ports[k], "protocol": "TCP"} for k in ("kv-events", "telemetry") if k in ports]
            if streams:
                rules.append({"from": control, "ports": streams})
            if "role-switch" in ports:
                rules.append({"from": routers, "ports": [{"port": ports["role-switch"], "protocol": "TCP"}]})
        rules.append({"from": monitoring, "ports": [{"port": ports["http"], "protocol": "TCP"}]})
        if tunnel_port is not None:  # the link's traffic, encrypted
            rules.append({"from": routers + control + engines, "ports": [{"port": tunnel_port, "protocol": "UDP"}]})
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": f"{w.name}-ingress", "namespace": ns, "labels": _labels(w)},
                    "spec": {"podSelector": {"matchLabels": {LABEL_APP: APP, LABEL_INSTANCE: w.name}},
                             "policyTypes": ["Ingress"], "ingress": rules}})
    return out


def monitoring_manifests(topology: Topology, loads: list[Workload]) -> dict[str, list[dict]]:
    """A ServiceMonitor per namespace (Prometheus Operator) and a plain scrape config."""
    spec = topology.kubernetes
    namespaces = sorted({spec.namespace(w.cluster) for w in loads})
    monitors = [{"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                 "metadata": {"name": f"prfaas-{ns}", "namespace": spec.monitoring_namespace, "labels": {LABEL_APP: APP}},
                 "spec": {"namespaceSelector": {"matchNames": [ns]},
                          "selector": {"matchLabels": {LABEL_APP: APP}},
                          "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}
                for ns in namespaces]
    scrape = {"scrape_configs": [{
        "job_name": "prfaas-sglang",
        "scrape_interval": "15s",
        "metrics_path": "/metrics",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": namespaces}}],
        "relabel_configs": [
            {"source_labels": [f"__meta_kubernetes_pod_label_{_meta(LABEL_APP)}"], "regex": APP, "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "http", "action": "keep"},
            {"source_labels": [f"__meta_kubernetes_pod_label_{_meta(LABEL_COMPONENT)}"], "target_label": "role"},
            {"source_labels": [f"__meta_kubernetes_pod_label_{_meta(LABEL_CLUSTER)}"], "target_label": "prfaas_cluster"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ]}]}
    return {"servicemonitor.yaml": monitors, "prometheus-scrape.yaml": [scrape]}


def _meta(label: str) -> str:
    """A pod label as Prometheus's Kubernetes discovery names it (``/``, ``.``, ``-`` -> ``_``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _check(topology: Topology, raw: dict, engine: Engine) -> None:
    if engine is Engine.SGLANG:
        for cname, craw in raw["clusters"].items():
            for j, node in enumerate(craw["nodes"]):
                path = node.get("model_path") or raw.get("model", {}).get("path")
                if ROLE_SPECS[topology.node(node["name"]).role].is_engine_role and path and not str(path).startswith("/"):
                    where = f"clusters.{cname}.nodes[{j}].model_path" if node.get("model_path") else "model.path"
                    raise ConfigError(where, f"{path} is relative to the topology file; on Kubernetes give the "
                                             "path inside the image or the kubernetes.model_claim volume")
    for name, host in topology.kubernetes.external_hosts.items():
        if not host or any(c in host for c in "/ "):
            raise ConfigError(f"kubernetes.external_hosts.{name}", f"not a host name or address: {host!r}")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # plain YAML: no &anchors for repeated label maps
        return True


def _dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def encrypted_by_default(raw: dict, topology: Topology) -> tuple[dict, Topology]:
    """``raw`` and ``topology`` with ``encrypt: true`` on every link that does not set ``encrypt`` (the
    manifests' default; ``encrypt: false`` opts a link out, e.g. where pods may not hold NET_ADMIN)."""
    unset = [i for i, link in enumerate(raw.get("links") or []) if isinstance(link, dict) and "encrypt" not in link]
    if not unset:
        return raw, topology
    raw = copy.deepcopy(raw)
    links = list(topology.links)
    for i in unset:
        raw["links"][i]["encrypt"] = True
        links[i] = replace(links[i], encrypt=True)
    return raw, replace(topology, links=tuple(links))


def render(raw: dict, topology: Topology, engine: Engine, dashboard_json: str | None = None) -> dict[str, str]:
    """Every manifest file for ``topology`` (``raw``: the same file as loaded YAML), as
    ``{relative path: text}``; every link encrypted unless it says ``encrypt: false``
    (:func:`encrypted_by_default`). Raises :class:`ConfigError` naming the field that cannot deploy."""
    raw, topology = encrypted_by_default(raw, topology)
    _check(topology, raw, engine)
    loads = workloads(topology)
    hosts = pod_hosts(topology, loads)
    spec: KubernetesSpec = topology.kubernetes
    files: dict[str, str] = {}
    for cluster in topology.cluster_kinds:
        ns = spec.namespace(cluster)
        mine = [w for w in loads if w.cluster == cluster]
        view = yaml.safe_dump(cluster_topology(raw, topology, cluster, hosts), sort_keys=False)
        files[f"{cluster}/namespace.yaml"] = _dump([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}])
        files[f"{cluster}/topology.yaml"] = _dump([{"apiVersion": "v1", "kind": "ConfigMap",
                                                    "metadata": {"name": TOPOLOGY_CONFIGMAP, "namespace": ns},
                                                    "data": {"topology.yaml": view}}])
        for w in mine:
            files[f"{cluster}/{w.name}.yaml"] = _dump(workload_manifests(topology, w, engine))
        files[f"{cluster}/networkpolicy.yaml"] = _dump(network_policies(topology, loads, cluster, engine))
        resources = ["namespace.yaml", "topology.yaml", *(f"{w.name}.yaml" for w in mine), "networkpolicy.yaml"]
        files[f"{cluster}/kustomization.yaml"] = REQUIREMENTS_NOTE + yaml.safe_dump(
            {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": ns,
             "resources": resources}, sort_keys=False)
    for name, docs in monitoring_manifests(topology, loads).items():
        files[f"monitoring/{name}"] = _dump(docs)
    if dashboard_json is not None:
        files["monitoring/prfaas-dashboard.json"] = dashboard_json
        files["monitoring/grafana-dashboard.yaml"] = _dump([{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "prfaas-dashboard", "namespace": spec.monitoring_namespace,
                         "labels": {"grafana_dashboard": "1"}},  # the Grafana sidecar's default label
            "data": {"prfaas-dashboard.json": dashboard_json}}])
    return files
