"""What is deployed is what is tested: the manifests of ``launch --emit k8s --engine mock`` for
launch/local-two-cluster.yaml, run here as Kubernetes would run them (each pod's container
command, arguments and environment, the ConfigMap's topology, the Secret's files), with pod DNS
names and ports mapped onto loopback. The deployment serves requests on both clusters, every port
a Service or probe names is open, and a real Prometheus scraping every pod accepts every query of
the dashboard and answers each with data."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from prfaas_sglang.adapters import http_sync
from prfaas_sglang.bench.prometheus import NoDataError, Prometheus, QueryError, ScrapeTarget
from prfaas_sglang.demo.cluster import PortPicker, ProcessGroup
from prfaas_sglang.launch import grafana, k8s
from prfaas_sglang.roles import Engine
from prfaas_sglang.topology import parse_topology

REPO = Path(__file__).resolve().parents[2]
VOCAB = 4096  # prfaas-tiny-chatml's


def _pods(files: dict[str, str]):
    for rel, text in sorted(files.items()):
        for doc in yaml.safe_load_all(text) if rel.endswith(".yaml") and "/" in rel else ():
            if isinstance(doc, dict) and doc.get("kind") == "StatefulSet":
                for i in range(doc["spec"]["replicas"]):
                    yield rel.split("/")[0], f"{doc['metadata']['name']}-{i}", doc["spec"]["template"]["spec"]["containers"][0]


def _loopback(view: dict, ports: dict[tuple[str, str], int]) -> dict:
    """The ConfigMap's topology with every host on loopback and every port a free one (one mapping
    for the whole deployment, so clusters still agree on each other's addresses). Its links are not
    encrypted: a tunnel joins distinct addresses, and loopback is one (the tunnel containers run in
    scripts/k8s-local.sh's real cluster and tests/transport/test_tunnel.py)."""
    for link in view.get("links", []):
        link["encrypt"] = False
    for cluster in view["clusters"].values():
        for node in cluster["nodes"]:
            node["host"] = "127.0.0.1"
            for key in k8s.PORT_NAMES:
                if key in node:
                    node[key] = ports[(node["name"], key)]
    return view


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k8s")
    raw = yaml.safe_load((REPO / "launch" / "local-two-cluster.yaml").read_text())
    topology = parse_topology(raw, "local-two-cluster.yaml", REPO / "launch")
    files = k8s.render(raw, topology, Engine.MOCK, grafana.build_json())
    pick = PortPicker()
    ports = {(n["name"], key): pick() for c in raw["clusters"].values() for n in c["nodes"] for key in k8s.PORT_NAMES if key in n}
    # the Secret, as docs/kubernetes.md creates it
    secret_dir = tmp / "secret"
    secret_dir.mkdir()
    (secret_dir / k8s.SECRET_KEY).write_bytes(secrets.token_bytes(32))
    os.chmod(secret_dir / k8s.SECRET_KEY, 0o400)
    admin_token = secrets.token_hex(16)
    group = ProcessGroup(tmp / "logs")
    pods: dict[str, dict] = {}
    prometheus = None
    try:
        for cluster, pod, container in _pods(files):
            config = tmp / cluster / "topology.yaml"
            if not config.exists():  # the ConfigMap's file, as mounted at /etc/prfaas/topology.yaml
                config.parent.mkdir()
                view = yaml.safe_load(yaml.safe_load(files[f"{cluster}/topology.yaml"])["data"]["topology.yaml"])
                config.write_text(yaml.safe_dump(_loopback(view, ports)))
            env = {}
            for e in container["env"]:
                if e["name"] == "POD_NAME":
                    env[e["name"]] = pod
                elif e["name"] == "PRFAAS_SECRET_FILE":
                    env[e["name"]] = str(secret_dir / k8s.SECRET_KEY)
                elif e["name"] == "PRFAAS_ADMIN_TOKEN":
                    env[e["name"]] = admin_token
                else:
                    env[e["name"]] = e["value"]
            assert container["command"] == ["python3", "-m", "prfaas_sglang.launch"]
            argv = [sys.executable, "-m", "prfaas_sglang.launch"] + [
                a.replace("$(POD_NAME)", pod).replace(k8s.CONFIG_MOUNT, str(config)) for a in container["args"]]
            node = argv[argv.index("--node") + 1]
            group.start(pod, argv, env=env)
            url = f"http://127.0.0.1:{ports[(node, 'port')]}"
            pods[pod] = {"node": node, "container": container, "url": url}
        # before the pods are healthy: Prometheus's first scrape comes ~5 s after its start
        started_s = time.time()
        prometheus = Prometheus.start([ScrapeTarget(pod.rsplit("-", 1)[0], pod, info["url"]) for pod, info in pods.items()],
                                      tmp / "prometheus", scrape_interval_s=0.5)
        for pod, info in pods.items():  # all at once, as StatefulSets start: router and kv-index wait for workers
            group.wait_healthy(info["url"] + "/health", next(p for p in group.procs if p.name == pod))
        yield {"pods": pods, "ports": ports, "router": pods["router-0"]["url"], "files": files, "group": group,
               "prometheus": prometheus, "started_s": started_s}
    finally:
        if prometheus is not None:
            prometheus.stop()
        group.stop()


def _wait_routable(url: str, n: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = http_sync.get(url + "/status", timeout_s=5).json()["workers"]
        if sum(bool(w["healthy"] and w["page_size"]) for w in workers.values()) >= n:
            return
        time.sleep(0.3)
    raise AssertionError(f"router never saw {n} routable workers: {workers}")


@pytest.mark.slow
def test_the_deployed_manifests_serve_requests_on_both_clusters(deployment):
    url = deployment["router"]
    _wait_routable(url, 3)
    threshold = http_sync.get(url + "/status", timeout_s=5).json()["threshold_tokens"]
    routes = []
    for k, n in enumerate((300, 900, int(threshold) + 4096, int(threshold) + 8192)):
        ids = [(7919 * (k * 100_000 + i)) % VOCAB for i in range(n)]
        resp = http_sync.post(url + "/generate", json_body={"input_ids": ids, "sampling_params": {"max_new_tokens": 4},
                                                           "stream": k % 2 == 1}, timeout_s=120)
        assert resp.status == 200, resp.text[:300]
        routes.append(resp.headers["x-prfaas-route"].split("/")[0])
    assert routes == ["pd", "pd", "prfaas", "prfaas"]  # short ones local, long ones over the PrfaaS -> PD-D path
    resp = http_sync.post(url + "/v1/chat/completions", json_body={"model": "tiny-hybrid", "max_tokens": 4,
                                                                  "messages": [{"role": "user", "content": "hello there"}]},
                          timeout_s=60)
    assert resp.status == 200, resp.text[:300]


def test_every_port_a_service_or_probe_names_is_open(deployment):
    checked = 0
    for pod, info in deployment["pods"].items():
        for port in info["container"]["ports"]:
            key = next(k for k, name in k8s.PORT_NAMES.items() if name == port["name"])
            with socket.create_connection(("127.0.0.1", deployment["ports"][(info["node"], key)]), timeout=2):
                checked += 1
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in info["container"]:
                get = info["container"][probe]["httpGet"]
                assert http_sync.get(info["url"] + get["path"], timeout_s=5).status == 200, (pod, probe)
    assert checked >= 10


def test_prometheus_answers_every_dashboard_query_with_data(deployment):
    prometheus = deployment["prometheus"]
    test_the_deployed_manifests_serve_requests_on_both_clusters(deployment)  # some traffic first (histograms)
    prometheus.wait_scraped(time.time(), scrapes=2)  # every pod up, and two samples of each series since: rates
    queries = grafana.queries()
    assert len(queries) >= 20, "the dashboard lost its queries"
    results = prometheus.require_data(queries)  # QueryError: rejected; NoDataError: a metric nothing exports
    workers = {pod for pod, info in deployment["pods"].items() if info["node"] not in ("router", "kv-index")}
    running = next(q for q in queries if "sglang:num_running_reqs" in q)
    assert {s.labels["pod"] for s in results[running]} == workers  # the per-worker panels: one line per pod


@pytest.mark.parametrize("bad, error", [
    ("sum by (pod) (rate(prfaas:kv_bytes_sent_totl[1m]))", NoDataError),  # a metric no pod exports
    ("max by (pod) (sglang:token_usage{pod=\"no-such-pod\"})", NoDataError),  # a label value none has
    ("sum by (pod) (rate(prfaas:kv_bytes_sent_total[1m])", QueryError),  # unbalanced: a parse error
    ("rate(prfaas_router_routed_total)", QueryError),  # an instant vector where a range is due
])
def test_the_query_check_fails_on_an_unexported_metric_or_a_rejected_query(deployment, bad, error):
    prometheus = deployment["prometheus"]
    prometheus.wait_scraped(deployment["started_s"], scrapes=1)
    good = "max(prfaas_router_threshold_tokens)"
    with pytest.raises(error) as raised:
        prometheus.require_data([good, bad])
    if error is NoDataError:
        assert raised.value.exprs == [bad]
    else:
        assert raised.value.expr == bad and raised.value.error_type == "bad_data", raised.value
