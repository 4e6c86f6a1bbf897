"""The router's view of its workers, built from a topology file (pure apart from reading it).

Engine nodes of the topology become :class:`WorkerRecord`: URL, cluster
(prfaas | pd), role (prefill | decode), bootstrap address, KV-event endpoint.
The router keeps its own live estimates on each record (health, queued prefill
seconds, running decodes) and hands the policy immutable snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.launch.roles import ROLE_SPECS
from prfaas_sglang.launch.topology import Topology
from prfaas_sglang.router.policy import PD, PRFAAS, Link, WorkerState


@dataclass
class WorkerRecord:
    name: str
    url: str
    cluster: str
    role: str
    host: str
    bootstrap_port: int | None
    events_endpoint: str | None
    telemetry_endpoint: str | None = None
    healthy: bool = True
    draining: bool = False
    queue_s: float = 0.0
    running: int = 0
    failures: int = 0

    def snapshot(self) -> WorkerState:
        return WorkerState(self.name, self.cluster, self.role, self.healthy, self.draining, self.queue_s, self.running)


def workers_from_topology(topology: Topology) -> dict[str, WorkerRecord]:
    records: dict[str, WorkerRecord] = {}
    for node in topology.nodes:
        spec = ROLE_SPECS[node.role]
        if not spec.is_engine_role:
            continue
        if node.port is None:
            raise ConfigError(f"nodes.{node.name}.port", "the router needs every engine node's port")
        role = "prefill" if spec.disaggregation_mode == "prefill" else "decode"
        if role == "prefill" and node.bootstrap_port is None:
            raise ConfigError(f"nodes.{node.name}.bootstrap_port", "the router needs every prefill node's bootstrap port")
        host = node.host or "127.0.0.1"
        events = f"tcp://{host}:{node.kv_events_port}" if node.kv_events_port is not None else None
        telemetry = f"tcp://{host}:{node.telemetry_port}" if node.telemetry_port is not None else None
        records[node.name] = WorkerRecord(node.name, f"http://{host}:{node.port}", spec.cluster_kind, role, host,
                                          node.bootstrap_port, events, telemetry)
    if not any(r.role == "decode" for r in records.values()):
        raise ConfigError("clusters", "the topology has no pd-decode node")
    if not any(r.role == "prefill" for r in records.values()):
        raise ConfigError("clusters", "the topology has no prefill node")
    return records


def link_from_topology(topology: Topology) -> Link:
    """The PrfaaS -> PD link's capacity (the first link between a prfaas and a pd cluster)."""
    for link in topology.links:
        kinds = {topology.cluster_kinds.get(link.src), topology.cluster_kinds.get(link.dst)}
        if kinds == {PRFAAS, PD}:
            return Link(capacity_bps=link.bandwidth_gbps * 1e9, rtt_s=(link.rtt_ms or 0.0) / 1e3)
    return Link(capacity_bps=100e9)
