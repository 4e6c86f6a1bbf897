"""``launch --emit k8s``: manifests that validate, commands the launcher parses, ports the roles
really open, policies that admit only the topology's data paths, refusals that name the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.launch import grafana, k8s
from prfaas_sglang.launch.__main__ import build_parser, make_command
from prfaas_sglang.roles import Engine
from prfaas_sglang.topology import load_topology, parse_topology

REPO = Path(__file__).resolve().parents[2]
CASES = [("paper-case-study.yaml", Engine.SGLANG), ("paper-case-study.yaml", Engine.MOCK),
         ("local-two-cluster.yaml", Engine.MOCK), ("switchable", Engine.SGLANG), ("encrypted", Engine.MOCK)]
K8S_VERSIONS = ("1.25.0", "1.30.0", "1.33.0", "1.37.0")  # the oldest: k8s.MIN_KUBERNETES


def _switchable() -> dict:
    """Every PD node ``role_switch: restart`` (the launcher's supervisor)."""
    from prfaas_sglang.demo.cluster import local_topology

    doc = local_topology(pd_prefill=2, pd_decode=2, role_switch="restart")
    doc["model"] = {"path": "/models/m"}
    fixed = iter(range(20000, 21000))  # its free ports, renumbered: none in SGLang's random ZMQ range
    for cluster in doc["clusters"].values():
        for node in cluster["nodes"]:
            for key in k8s.PORT_NAMES:
                if key in node:
                    node[key] = next(fixed)
    return doc


def _encrypted() -> dict:
    """The local two-cluster example with its PrfaaS link encrypted."""
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    raw["links"][0]["encrypt"] = True
    return raw


RAW = {"switchable": _switchable, "encrypted": _encrypted}


def topology_of(name: str):
    if name in RAW:
        return parse_topology(RAW[name]())
    return load_topology(REPO / "launch" / name)


def emit(name: str, engine: Engine, raw: dict | None = None) -> dict[str, str]:
    path = REPO / "launch" / (name if name not in RAW else "local-two-cluster.yaml")
    raw = raw if raw is not None else RAW[name]() if name in RAW else yaml.safe_load(path.read_text())
    return k8s.render(raw, parse_topology(raw, str(path), path.parent), engine, grafana.build_json())


def docs(files: dict[str, str], suffix: str = ".yaml") -> list[tuple[str, dict]]:
    return [(rel, d) for rel, text in files.items() if rel.endswith(suffix) and not rel.endswith("kustomization.yaml")
            and "prometheus-scrape" not in rel for d in yaml.safe_load_all(text)]


@pytest.mark.slow
@pytest.mark.parametrize("name,engine", CASES)
def test_manifests_validate_against_kubernetes_schemas(name, engine):
    files = emit(name, engine)
    kinds = set()
    for _rel, doc in docs(files):
        kinds.add(doc["kind"])
        if doc["kind"] == "ServiceMonitor":  # a CRD (Prometheus Operator): not in the core schemas
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]["endpoints"][0]["port"] == "http"
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error
    assert {"Namespace", "ConfigMap", "StatefulSet", "Service", "NetworkPolicy", "ServiceMonitor"} <= kinds
    for rel, text in files.items():  # kustomize-ready: every listed resource exists
        if rel.endswith("kustomization.yaml"):
            # what it assumes of the cluster, said where kubectl apply -k reads: the oldest schema checked, and DNS
            assert f"Needs Kubernetes >= {k8s.MIN_KUBERNETES}" in text and "cluster DNS" in text
            assert min(K8S_VERSIONS, key=lambda v: tuple(map(int, v.split(".")))) == k8s.MIN_KUBERNETES + ".0"
            kust = yaml.safe_load(text)
            cluster = rel.split("/")[0]
            assert all(f"{cluster}/{r}" in files for r in kust["resources"]), kust
    assert "&id" not in "".join(files.values())  # plain YAML, no anchors


def _pods(files: dict[str, str]):
    """(cluster, pod name, StatefulSet, container, headless Service) for every pod the manifests make."""
    services = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for _, d in docs(files) if d["kind"] == "Service"}
    for rel, d in docs(files):
        if d["kind"] != "StatefulSet":
            continue
        for i in range(d["spec"]["replicas"]):
            yield (rel.split("/")[0], f"{d['metadata']['name']}-{i}", d, d["spec"]["template"]["spec"]["containers"][0],
                   services[(d["metadata"]["namespace"], d["spec"]["serviceName"])])


def listening_ports(command) -> dict[str, int]:
    """Ports the launched process opens, read from the launcher's own command (argv, environment, notes)."""
    argv, out = list(command.argv), {}
    flags = {"--port": "http", "--bootstrap-port": "bootstrap", "--disaggregation-bootstrap-port": "bootstrap",
             "--kv-events-port": "kv-events", "--telemetry-port": "telemetry"}
    for i, arg in enumerate(argv[:-1]):
        if arg in flags:
            out[flags[arg]] = int(argv[i + 1])
        if arg == "--kv-events-config":
            out["kv-events"] = int(json.loads(argv[i + 1])["endpoint"].rsplit(":", 1)[1])
    if "PRFAAS_TELEMETRY_PORT" in command.env:
        out["telemetry"] = int(command.env["PRFAAS_TELEMETRY_PORT"])
    for note in command.notes:
        m = re.match(r"role supervisor on \S+:(\d+):", note)
        if m:
            out["role-switch"] = int(m.group(1))
    return out


@pytest.mark.parametrize("name,engine", CASES)
def test_every_container_command_parses_and_every_port_is_one_the_role_opens(name, engine, tmp_path, monkeypatch):
    files = emit(name, engine)
    monkeypatch.setenv("PRFAAS_SKIP_PATCH_VERIFY", "1")
    seen = 0
    for cluster, pod, sts, container, service in _pods(files):
        config = tmp_path / cluster / "topology.yaml"  # the ConfigMap's file, as the pod mounts it
        if not config.exists():
            config.parent.mkdir(parents=True)
            cm = yaml.safe_load(files[f"{cluster}/topology.yaml"])
            config.write_text(cm["data"]["topology.yaml"])
        assert container["command"] == ["python3", "-m", "prfaas_sglang.launch"]
        argv = [a.replace("$(POD_NAME)", pod).replace(k8s.CONFIG_MOUNT, str(config)) for a in container["args"]]
        args, unknown = build_parser().parse_known_args([*argv, "--dry-run"])
        assert unknown == []
        command = make_command(args, (), unknown)
        ports = listening_ports(command)
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared == ports, (pod, declared, ports)
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in ports
        # the process binds its own pod's DNS name, which peers use too
        host = command.node.host
        assert host.startswith(f"{pod}.{sts['spec']['serviceName']}.{sts['metadata']['namespace']}.svc.")
        if "sglang.launch_server" in command.argv:
            assert "--enable-metrics" in command.argv  # the dashboard's per-worker panels
        seen += 1
    assert seen == len(topology_of(name).nodes)  # one pod per node, no more, no less


def _policies(files, cluster):
    return {d["metadata"]["name"]: d for _, d in docs(files) if d["kind"] == "NetworkPolicy"
            and d["metadata"]["namespace"] == cluster}


def _allowed(policy: dict, port: int) -> list[dict]:
    """The ``from`` entries admitted to ``port`` (``[{}]``: anyone)."""
    out = []
    for rule in policy["spec"]["ingress"]:
        for p in rule["ports"]:
            if p["port"] <= port <= p.get("endPort", p["port"]):
                out += rule.get("from", [{}])
    return out


def _components(entries: list[dict]) -> set[tuple[str, str]]:
    return {(e["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], c)
            for e in entries if "podSelector" in e for expr in e["podSelector"]["matchExpressions"] for c in expr["values"]}


def test_pods_on_an_encrypted_link_carry_their_tunnel_and_their_policies_admit_its_udp_only_from_the_other_side():
    """Every link is encrypted in the manifests unless it says ``encrypt: false``."""
    files = emit("encrypted", Engine.MOCK)
    pods = list(_pods(files))
    assert {cluster for cluster, *_ in pods} == set(topology_of("encrypted").cluster_kinds)  # every cluster holds one
    for _cluster, _pod, sts, container, _ in pods:
        spec = sts["spec"]["template"]["spec"]
        tunnel = next(c for c in spec["containers"] if c["name"] == "tunnel")
        args, unknown = build_parser().parse_known_args(tunnel["args"])
        assert args.tunnel and unknown == [] and tunnel["securityContext"]["capabilities"]["add"] == ["NET_ADMIN"]
        assert {"name": "dev-net-tun", "mountPath": "/dev/net/tun"} in tunnel["volumeMounts"]
        assert {"name": "dev-net-tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}} in spec["volumes"]
        assert {"name": "PRFAAS_TUNNEL_WAIT_S", "value": str(k8s.TUNNEL_WAIT_S)} in container["env"]  # the node waits
        assert k8s.WIREGUARD_RUN_MOUNT in container["volumeMounts"] and k8s.WIREGUARD_RUN_MOUNT in tunnel["volumeMounts"]
    for _, policy in docs(files):
        if policy["kind"] == "NetworkPolicy" and "ingress" in policy["spec"]:
            udp = [r for r in policy["spec"]["ingress"] if r["ports"][0]["protocol"] == "UDP"]
            assert [r["ports"] for r in udp] == [[{"port": 51820, "protocol": "UDP"}]], policy["metadata"]["name"]
            assert all("from" in r and r["from"] for r in udp)  # from the deployment's pods, not anywhere
    # the default: the example's link does not say, and is encrypted as if it said so
    assert emit("local-two-cluster.yaml", Engine.MOCK) == files
    opted_out = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    opted_out["links"][0]["encrypt"] = False
    plain = emit("local-two-cluster.yaml", Engine.MOCK, opted_out)
    assert "tunnel" not in "".join(c["name"] for *_, sts, _, _ in _pods(plain) for c in sts["spec"]["template"]["spec"]["containers"])
    assert "UDP" not in "".join(plain.values()) and "NET_ADMIN" not in "".join(plain.values())


def test_network_policies_admit_only_the_topologys_paths():
    files = emit("local-two-cluster.yaml", Engine.MOCK)
    pd, prfaas, control = _policies(files, "pd-a"), _policies(files, "prfaas-b"), _policies(files, "control")
    for policies in (pd, prfaas, control):
        assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    # PrfaaS -> PD-D: Mooncake's port range on the decode pod, from engine pods only
    decode = pd["pd-decode-ingress"]
    mooncake = _components(_allowed(decode, 15500))
    assert ("prfaas-b", "prfaas") in mooncake and ("control", "router") not in mooncake
    assert _allowed(decode, 5559) and _components(_allowed(decode, 5559)) == {("control", "router"), ("control", "kv-index")}
    # the PrfaaS bootstrap port: decode pods of the PD cluster may register, the router may not
    boot = _components(_allowed(prfaas["prfaas-ingress"], 8998))
    assert ("pd-a", "pd-decode") in boot and ("control", "router") not in boot
    # nothing on a port no rule names (e.g. the decode pod's 8999 is the PD-P's bootstrap, not its own)
    assert _allowed(decode, 8999) == []
    # clients reach the router from anywhere; Prometheus reaches every /metrics port
    assert _allowed(control["router-ingress"], 8000)[0] == {} or {} in _allowed(control["router-ingress"], 8000)
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in _allowed(decode, 30300)
    assert _components(_allowed(control["kv-index-ingress"], 8001)) == {("control", "router"), ("control", "kv-index")}


def test_sglangs_pd_control_channel_is_admitted_between_engine_pods_only_for_sglang():
    """SGLang's prefill and decode push transfer status to each other over ZMQ on a random port in
    49152-65535 (advertised through the bootstrap server); the emulated engine uses HTTP instead."""
    sglang = _policies(emit("paper-case-study.yaml", Engine.SGLANG), "pd-h20")["pd-d-ingress"]
    assert ("prfaas-h200", "prfaas") in _components(_allowed(sglang, 50000))
    assert ("control", "router") not in _components(_allowed(sglang, 50000))
    mock = _policies(emit("paper-case-study.yaml", Engine.MOCK), "pd-h20")["pd-d-ingress"]
    assert _allowed(mock, 50000) == []


def test_clusters_in_other_kubernetes_clusters_by_external_hosts_and_cidrs():
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    raw["kubernetes"] = {"namespaces": {"pd-a": "pd", "prfaas-b": "prfaas", "control": "pd"},
                         "external_hosts": {"prfaas-0": "prfaas-0.gw.example.net", "pd-decode-0": "10.2.0.20"},
                         "peer_cidrs": {"prfaas-b": ["10.1.0.0/16"]},
                         "images": {"control": "registry.example.net/cp:1"}}
    files = emit("local-two-cluster.yaml", Engine.MOCK, raw)
    pd_view = yaml.safe_load(yaml.safe_load(files["pd-a/topology.yaml"])["data"]["topology.yaml"])
    hosts = {n["name"]: n["host"] for c in pd_view["clusters"].values() for n in c["nodes"]}
    assert hosts["prfaas-0"] == "prfaas-0.gw.example.net"  # another cluster's node: its external host
    assert hosts["pd-decode-0"] == "pd-decode-0.pd-decode.pd.svc.cluster.local"  # its own: the pod's DNS name
    prfaas_view = yaml.safe_load(yaml.safe_load(files["prfaas-b/topology.yaml"])["data"]["topology.yaml"])
    assert {n["name"]: n["host"] for c in prfaas_view["clusters"].values() for n in c["nodes"]}["pd-decode-0"] == "10.2.0.20"
    decode = _policies(files, "pd")["pd-decode-ingress"]
    assert {"ipBlock": {"cidr": "10.1.0.0/16"}} in _allowed(decode, 15000)  # PrfaaS by CIDR, not namespace
    assert {d["metadata"].get("namespace", d["metadata"]["name"]) for _, d in docs(files)} == {"pd", "prfaas", "monitoring"}
    images = {c["image"] for _, _, _, c, _ in _pods(files)}
    assert images == {"registry.example.net/cp:1"}  # emulated engines and control plane: the control image


@pytest.mark.parametrize("section,path", [
    ({"namespaces": {"nope": "x"}}, "kubernetes.namespaces.nope"),
    ({"namespaces": {"pd-a": "Bad_NS"}}, "kubernetes.namespaces.pd-a"),
    ({"peer_cidrs": {"pd-a": ["10.0.0.0/33"]}}, "kubernetes.peer_cidrs.pd-a[0]"),
    ({"external_hosts": {"ghost": "h"}}, "kubernetes.external_hosts.ghost"),
    ({"images": {"gpu": "x"}}, "kubernetes.images.gpu"),
    ({"secrets": "x"}, "kubernetes.secrets"),
    ({"router_front_port": 70000}, "kubernetes.router_front_port"),
    ({"router_front_port": "8099"}, "kubernetes.router_front_port"),
    ({"requests": {"pd-decoder": {"cpu": "1"}}}, "kubernetes.requests.pd-decoder"),
    ({"requests": {"router": {"cpu": "lots"}}}, "kubernetes.requests.router.cpu"),
    ({"requests": {"router": {"gpu": "1"}}}, "kubernetes.requests.router.gpu"),
])
def test_bad_kubernetes_fields_are_refused_with_their_path(section, path):
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    raw["kubernetes"] = section
    with pytest.raises(ConfigError) as err:
        parse_topology(raw)
    assert err.value.field == path


def test_undeployable_topologies_are_refused_with_their_path():
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    with pytest.raises(ConfigError) as err:  # a model path relative to the topology file means nothing in a pod
        emit("local-two-cluster.yaml", Engine.SGLANG, raw)
    assert err.value.field == "model.path"
    raw["clusters"]["pd-a"]["nodes"][0]["name"] = "PD_Prefill"
    with pytest.raises(ConfigError) as err:
        emit("local-two-cluster.yaml", Engine.MOCK, raw)
    assert err.value.field == "clusters.pd-a.nodes[0].name"


def test_the_router_pod_has_its_front_and_the_client_service_goes_through_it():
    """Clients keep their connections when kubelet restarts the router container: the router pod
    runs the front (router/front.py) beside it, the client Service targets the front, and the
    front's command parses. ``router_front_port: null`` leaves the router alone; a port of the
    router's own is refused."""
    from prfaas_sglang.router import front as front_cli

    files = emit("local-two-cluster.yaml", Engine.MOCK)
    found = {d["kind"] + "/" + d["metadata"]["name"]: d for _, d in docs(files)}
    pod = found["StatefulSet/router"]["spec"]["template"]["spec"]
    router, front = pod["containers"][:2]  # then the tunnel (the link encrypted by default)
    assert front["name"] == "front" and front["command"] == ["python3", "-m", "prfaas_sglang.router.front"]
    args = dict(zip(front["args"][::2], front["args"][1::2], strict=True))
    router_port = next(p["containerPort"] for p in router["ports"] if p["name"] == "http")
    assert args["--router"] == f"http://$(POD_IP):{router_port}" and args["--port"] == "8099" and args["--host"] == "$(POD_IP)"
    assert front["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    with pytest.raises(SystemExit) as parsed:  # the front's own parser accepts them, $(POD_IP) expanded
        front_cli.main([a.replace("$(POD_IP)", "10.0.0.7") for a in front["args"]] + ["--help"])
    assert parsed.value.code == 0
    assert found["Service/router-api"]["spec"]["ports"][0]["targetPort"] == "client"
    assert front["ports"] == [{"name": "client", "containerPort": 8099, "protocol": "TCP"}]
    assert {} in _allowed(_policies(files, "control")["router-ingress"], 8099)  # clients: anywhere, as to the router
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    raw["kubernetes"] = {"router_front_port": None}
    found = {d["kind"] + "/" + d["metadata"]["name"]: d for _, d in docs(emit("local-two-cluster.yaml", Engine.MOCK, raw))}
    assert [c["name"] for c in found["StatefulSet/router"]["spec"]["template"]["spec"]["containers"]] == ["router", "tunnel"]
    assert found["Service/router-api"]["spec"]["ports"][0]["targetPort"] == "http"
    raw["kubernetes"] = {"router_front_port": router_port}
    with pytest.raises(ConfigError) as err:
        emit("local-two-cluster.yaml", Engine.MOCK, raw)
    assert err.value.field == "kubernetes.router_front_port"


def test_a_restarting_node_stays_alive_for_kubernetes_while_its_engine_restarts():
    files = emit("switchable", Engine.SGLANG)
    containers = {c["name"]: c for _, _, _, c, _ in _pods(files)}
    for role in ("pd-prefill", "pd-decode"):
        assert containers[role]["livenessProbe"]["httpGet"]["port"] == "role-switch"  # the supervisor
        assert containers[role]["readinessProbe"]["httpGet"]["port"] == "http"  # the engine: out of the Service meanwhile
    assert containers["prfaas"]["livenessProbe"]["httpGet"]["port"] == "http"
    decode = containers["pd-decode"]  # the last pd-decode StatefulSet (its nodes' ports differ: one per node)
    policy = next(p for p in _policies(files, "pd").values()
                  if p["spec"]["podSelector"].get("matchLabels", {}).get(k8s.LABEL_INSTANCE, "").startswith("pd-decode")
                  and any(r["ports"][0]["port"] == decode["ports"][-1]["containerPort"] for r in p["spec"]["ingress"]))
    switch = _allowed(policy, decode["ports"][-1]["containerPort"])
    assert _components(switch) == {("control", "router")}  # only the router converts


def test_statefulsets_group_ordinal_nodes_and_keep_others_apart():
    topology = load_topology(REPO / "launch" / "paper-case-study.yaml")
    loads = {w.name: w for w in k8s.workloads(topology)}
    assert (len(loads["prfaas"].nodes), len(loads["pd-p"].nodes), len(loads["pd-d"].nodes)) == (4, 3, 5)
    assert loads["pd-d"].per_pod_node and k8s.container_args(loads["pd-d"], Engine.SGLANG)[3] == "$(POD_NAME)"
    assert not loads["router"].per_pod_node and k8s.container_args(loads["router"], Engine.SGLANG)[3] == "router"
    raw = yaml.safe_load((REPO / "launch" / "paper-case-study.yaml").read_text())
    raw["clusters"]["pd-h20"]["nodes"][4]["tp_size"] = 4  # pd-d-1 differs: pd-d-* no longer one StatefulSet
    loads = {w.name for w in k8s.workloads(parse_topology(raw))}
    assert {"pd-d-0", "pd-d-1", "pd-d-4"} <= loads and "pd-d" not in loads


def _cpu_millis(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def test_the_emulated_example_fits_a_two_cpu_node_and_requests_follow_the_topology():
    """Requests sized by what each container runs: the local two-cluster example with emulated engines asks well
    under the 2 CPUs of a small node (at 500m a pod, two of its pods stayed Pending there); an operator's
    ``kubernetes.requests`` replaces a role's defaults."""
    cpu = lambda files: {c["name"]: _cpu_millis(c["resources"]["requests"]["cpu"])  # noqa: E731
                         for _, _, sts, _, _ in _pods(files) for c in sts["spec"]["template"]["spec"]["containers"]}
    emulated = cpu(emit("local-two-cluster.yaml", Engine.MOCK))
    assert sum(emulated.values()) <= 1000, emulated
    assert emulated["router"] > emulated["pd-decode"] and "front" in emulated
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    raw["kubernetes"] = {"requests": {"pd-decode": {"cpu": "1500m", "memory": "2Gi"}}}
    files = emit("local-two-cluster.yaml", Engine.MOCK, raw)
    decode = next(c for _, _, _, c, _ in _pods(files) if c["name"] == "pd-decode")
    assert decode["resources"]["requests"] == {"cpu": "1500m", "memory": "2Gi"}
    assert cpu(files)["pd-prefill"] == emulated["pd-prefill"]


def test_sglang_pods_request_gpus_and_mount_the_secret_not_embed_it():
    files = emit("paper-case-study.yaml", Engine.SGLANG)
    for _, _pod, sts, container, _ in _pods(files):
        env = {e["name"]: e for e in container["env"]}
        assert env["PRFAAS_SECRET_FILE"]["value"] == "/etc/prfaas/secret/deployment-secret"
        secret = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "deployment-secret")
        assert secret["secret"]["secretName"] == "prfaas-deployment" and secret["secret"]["defaultMode"] == 0o400
        if container["name"] in ("prfaas", "pd-prefill", "pd-decode"):
            assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "8" and "cpu" in container["resources"]["requests"]
            assert container["image"].startswith("prfaas-sglang/" + ("prfaas-prefill" if container["name"] == "prfaas" else "local-pd"))
        if container["name"] == "router":
            assert env["PRFAAS_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    assert not any(kind == "Secret" for _, d in docs(files) for kind in [d["kind"]])  # referenced, never embedded


def test_cli_writes_the_tree_and_refuses_node_flags(tmp_path):
    out = tmp_path / "k8s"
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.launch", "--emit", "k8s", "--config",
                           str(REPO / "launch" / "paper-case-study.yaml"), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (out / "pd-h20" / "kustomization.yaml").is_file() and (out / "monitoring" / "prfaas-dashboard.json").is_file()
    assert json.loads((out / "monitoring" / "prfaas-dashboard.json").read_text())["uid"] == "prfaas-pd"
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.launch", "--emit", "k8s", "--config",
                           str(REPO / "launch" / "paper-case-study.yaml"), "--node", "router"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --node")


def test_a_fleet_gets_manifests_whose_policies_admit_kv_over_its_links_only(tmp_path):
    """multi-cluster.yaml without the h100 -> east link: east's engines admit KV from h200 and from
    themselves, not from h100 nor from the other region; h100 admits west's decode pods only."""
    raw = yaml.safe_load((REPO / "launch" / "multi-cluster.yaml").read_text())
    raw["links"] = [link for link in raw["links"] if (link["from"], link["to"]) != ("prfaas-h100", "pd-east")]
    files = emit("multi-cluster.yaml", Engine.SGLANG, raw)
    east, h100 = _policies(files, "pd-east"), _policies(files, "prfaas-h100")
    mooncake = {cluster for cluster, _ in _components(_allowed(east["east-d-ingress"], 15500))}
    assert mooncake == {"pd-east", "prfaas-h200"}
    boot = {cluster for cluster, _ in _components(_allowed(h100["prfaas-h100-ingress"], 8998))}
    assert boot == {"pd-west", "prfaas-h100"}
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.launch", "--emit", "k8s", "--config",
                           str(REPO / "launch" / "multi-cluster.yaml"), "--out", str(tmp_path / "k8s")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in (tmp_path / "k8s").iterdir()} >= {"pd-east", "pd-west", "prfaas-h200", "prfaas-h100", "control"}


def test_a_fleet_topology_the_router_could_not_schedule_gets_no_manifests(tmp_path):
    raw = yaml.safe_load((REPO / "launch" / "multi-cluster.yaml").read_text())
    raw["links"] = [link for link in raw["links"] if link["to"] != "pd-west"]
    bad = tmp_path / "fleet.yaml"
    bad.write_text(yaml.safe_dump(raw))
    out = tmp_path / "k8s"
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.launch", "--emit", "k8s", "--config", str(bad),
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "clusters.pd-west" in proc.stderr, proc.stderr
    assert not out.exists()


def test_the_local_clusters_dns_names_every_service_and_every_statefulset_pod():
    """scripts/k8s_local_dns.py, which feeds dnsmasq in the one-node cluster of scripts/k8s-local.sh, answers
    the names the emitted manifests use: a Service's (its cluster IP, or its endpoints when headless) and a
    StatefulSet pod's ``<pod>.<service>.<namespace>.svc.<domain>``, not-ready pods included (the manifests
    publish them, so a process can bind its own name before it is ready)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_local_dns", Path(__file__).parents[2] / "scripts" / "k8s_local_dns.py")
    dns = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dns)
    services = [{"metadata": {"namespace": "control", "name": "router-api"}, "spec": {"clusterIP": "10.96.0.7"}},
                {"metadata": {"namespace": "pd-a", "name": "pd-decode"}, "spec": {"clusterIP": "None"}}]
    endpoints = [{"metadata": {"namespace": "pd-a", "name": "pd-decode"}, "subsets": [
        {"addresses": [{"ip": "10.88.0.5", "hostname": "pd-decode-0"}],
         "notReadyAddresses": [{"ip": "10.88.0.6", "hostname": "pd-decode-1"}]}]}]
    assert dns.records(services, endpoints, "cluster.local") == [
        ("10.88.0.5", "pd-decode-0.pd-decode.pd-a.svc.cluster.local"),
        ("10.88.0.5", "pd-decode.pd-a.svc.cluster.local"),
        ("10.88.0.6", "pd-decode-1.pd-decode.pd-a.svc.cluster.local"),
        ("10.88.0.6", "pd-decode.pd-a.svc.cluster.local"),
        ("10.96.0.7", "router-api.control.svc.cluster.local")]
