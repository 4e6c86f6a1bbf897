"""The router's view of its workers: identity from the topology, facts and load from the workers (pure).

A :class:`WorkerRecord` holds what the topology says (URL, cluster, role,
bootstrap and event endpoints), what the worker says about itself
(:class:`WorkerFacts`, parsed from SGLang's ``/server_info`` by ``wire/server_info.py``:
page size, KV pool, context length, served model, KV-event descriptor; :class:`WorkerLoad`
from ``/v1/loads``), and two ledgers the router keeps as it dispatches:

* prefill workers: ``outstanding_prefill_s``, the estimated prefill seconds of
  requests whose prefill leg has not ended (the engines' time unit, the model's
  seconds before the online calibration, which the service applies): the queue
  signal of the threshold controller and the TTFT estimate;
* decode workers: ``reserved_tokens``, the KV (prompt + max new tokens) of
  requests dispatched and not finished, each under a ticket (dispatch order).
  A ``/v1/loads`` answer covers the tickets issued before it was sent. Free KV is
  the reported pool size minus the larger of the reservations and the last
  answer's use corrected by what happened since: plus what was dispatched after
  the answer was sent (``reserved_since_poll_tokens``: a burst between two polls
  counts against the worker it lands on, so it spreads), minus what the answer
  counted and has ended since it arrived (``released_since_poll_tokens``: a worker
  that just finished a burst does not look full until the next poll)::

      tickets  1 .. covers                 | covers+1 .. last
               in the answer's used tokens | dispatched after it was sent
               ended since it arrived: -   | still open: +

:func:`check_facts` refuses facts that contradict the deployment (a page size
that differs inside a cluster, another block-hash scheme, a wrong PD mode, an
emulated engine scaled differently from the topology's ``emulation:``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.roles import ROLE_SPECS
from prfaas_sglang.router.policy import WorkerState
from prfaas_sglang.topology import Emulation, SitePair, Topology
from prfaas_sglang.wire.blocks import HASH_SCHEME
from prfaas_sglang.wire.server_info import FactsError as FactsError
from prfaas_sglang.wire.server_info import KvEventsEndpoint as KvEventsEndpoint
from prfaas_sglang.wire.server_info import WorkerFacts as WorkerFacts
from prfaas_sglang.wire.server_info import opt_int
from prfaas_sglang.wire.server_info import parse_server_info as parse_server_info


@dataclass(frozen=True)
class WorkerLoad:
    running: int
    waiting: int
    used_tokens: int
    max_total_tokens: int | None
    waiting_uncached_tokens: int = 0


def parse_loads(body: Any) -> WorkerLoad:
    """SGLang 0.5.15's ``/v1/loads`` -> the load summed over DP ranks."""
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list) or not loads:
        raise FactsError("/v1/loads must be an object with a non-empty list 'loads'")
    running = waiting = used = uncached = 0
    total: int | None = 0
    for rank in loads:
        if not isinstance(rank, dict):
            raise FactsError("each load must be an object")
        running += opt_int(rank, "num_running_reqs") or 0
        waiting += opt_int(rank, "num_waiting_reqs") or 0
        used += opt_int(rank, "num_used_tokens") or 0
        uncached += opt_int(rank, "num_waiting_uncached_tokens") or 0
        pool = opt_int(rank, "max_total_num_tokens")
        total = None if pool is None or total is None else total + pool
    return WorkerLoad(running, waiting, used, total, uncached)


@dataclass
class WorkerRecord:
    name: str
    url: str
    cluster: str  # prfaas | pd
    role: str  # prefill | decode
    host: str
    bootstrap_port: int | None
    events_endpoint: str | None  # from the topology; else from the facts' kv_events
    telemetry_endpoint: str | None = None
    switch_url: str | None = None  # serves /pd_role_switch: the worker (in-place) or its launcher's supervisor (restart)
    site: str = ""  # its topology cluster (the fleet's unit: a link joins two); "": named by its kind
    healthy: bool = False
    draining: bool = False
    facts: WorkerFacts | None = None
    load: WorkerLoad | None = None
    outstanding_prefill_s: float = 0.0
    reserved_tokens: int = 0
    reserved_since_poll_tokens: int = 0  # of reserved_tokens: dispatched after the last load answer was sent
    released_since_poll_tokens: int = 0  # counted by the last load answer, ended after it arrived
    last_ticket: int = 0  # the last decode reservation's ticket (see reserve)
    load_covers_ticket: int = 0  # the last load answer counts reservations up to this ticket
    prefill_requests: int = 0  # prefill legs dispatched here and not ended
    failures: int = 0
    health_misses: int = 0  # health checks in a row that got no answer in time (see note_health)
    refused: str | None = None  # why the facts were refused (never routed to then)
    epoch: int = 0  # bumped when the worker changes role: a poll begun before then is stale (see poll_is_current)
    _open: dict[int, int] = field(default_factory=dict, repr=False)  # ticket -> reserved decode tokens

    def __post_init__(self) -> None:
        self.site = self.site or self.cluster

    @property
    def reserved_requests(self) -> int:
        """Requests whose decode KV is reserved here (dispatched, not ended)."""
        return len(self._open)

    def poll_is_current(self, epoch: int) -> bool:
        """Whether a poll begun at ``epoch`` (this record's ``epoch`` then) may still be written: a
        ``/v1/loads`` or ``/server_info`` answer that left the worker before a role change describes
        the old role (a prefill worker's cache size read as a decode worker's KV room)."""
        return epoch == self.epoch

    def note_health(self, answer: str, misses_to_down: int) -> None:
        """One health check's outcome: ``"ok"`` (200), ``"down"`` (refused, or any other status), or
        ``"timeout"`` (no answer in time). A worker is taken out at once when down, and after
        ``misses_to_down`` timeouts in a row (a busy SGLang worker answers late, a hung one never);
        until then it keeps its state."""
        if answer == "ok":
            self.healthy, self.health_misses = True, 0
        elif answer == "timeout":
            self.health_misses += 1
            if self.health_misses >= misses_to_down:
                self.healthy = False
        else:
            self.healthy, self.health_misses = False, 0

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.facts is not None and self.refused is None

    @property
    def kv_free_tokens(self) -> int | None:
        """Decode: KV room now; None when the worker has not reported its pool."""
        pool = (self.load.max_total_tokens if self.load else None) or (self.facts.max_total_tokens if self.facts else None)
        if pool is None:
            return None
        used = self.reserved_tokens
        if self.load is not None:
            since = self.load.used_tokens + self.reserved_since_poll_tokens - self.released_since_poll_tokens
            used = max(used, since)
        return max(pool - used, 0)

    def reserve(self, kv_tokens: int) -> int:
        """A request's decode KV dispatched here. Returns its ticket, for :meth:`release`."""
        self.last_ticket += 1
        self.reserved_tokens += kv_tokens
        self.reserved_since_poll_tokens += kv_tokens
        self._open[self.last_ticket] = kv_tokens
        return self.last_ticket

    def release(self, ticket: int) -> None:
        """The request under ``ticket`` ended: its reservation goes (an unknown ticket, e.g. one issued
        before a role change, is ignored)."""
        kv_tokens = self._open.pop(ticket, None)
        if kv_tokens is None:
            return
        self.reserved_tokens = max(self.reserved_tokens - kv_tokens, 0)
        if ticket > self.load_covers_ticket:
            self.reserved_since_poll_tokens = max(self.reserved_since_poll_tokens - kv_tokens, 0)
        elif self.load is not None:
            self.released_since_poll_tokens += kv_tokens

    def take_load(self, load: WorkerLoad | None, covers_ticket: int) -> None:
        """A ``/v1/loads`` answer (None: unreadable). ``covers_ticket``: :attr:`last_ticket` when the
        request was sent; what was dispatched after that is not in the answer and still counts.
        What ended between sending and the answer may be in it: nothing is subtracted for that."""
        self.load, self.load_covers_ticket = load, covers_ticket
        self.reserved_since_poll_tokens = sum(n for t, n in self._open.items() if t > covers_ticket)
        self.released_since_poll_tokens = 0

    def forget_reservations(self) -> None:
        """The worker changed role: reservations of its old role can no longer be released here."""
        self._open.clear()
        self.reserved_tokens = 0
        self.reserved_since_poll_tokens = self.released_since_poll_tokens = 0

    @property
    def kv_events_url(self) -> str | None:
        if self.events_endpoint:
            return self.events_endpoint
        if self.facts is not None and self.facts.kv_events is not None:
            return f"tcp://{self.host}:{self.facts.kv_events.port}"
        return None

    @property
    def kv_events_topic(self) -> str | None:
        return self.facts.kv_events.topic if self.facts is not None and self.facts.kv_events else None

    @property
    def running_requests(self) -> int:
        """Requests it runs: what it last reported, or the router's own leases on it if more (a poll lags)."""
        return max(self.load.running if self.load else 0, self.reserved_requests)

    def snapshot(self) -> WorkerState:
        # a worker without (accepted) facts is not routable: it counts as unhealthy to the policy
        return WorkerState(self.name, self.cluster, self.role, self.healthy and self.facts is not None and self.refused is None,
                           self.draining,
                           self.outstanding_prefill_s, self.running_requests,
                           self.kv_free_tokens if self.role == "decode" else None)


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
        url = f"http://{host}:{node.port}"
        switch_url = {"in-place": url, "restart": f"http://{host}:{node.switch_port}"}.get(node.role_switch)
        records[node.name] = WorkerRecord(node.name, url, spec.cluster_kind, role, host,
                                          node.bootstrap_port, events, telemetry, switch_url, site=node.cluster)
    if not any(r.role == "decode" for r in records.values()):
        raise ConfigError("clusters", "the topology has no pd-decode node")
    if not any(r.role == "prefill" for r in records.values()):
        raise ConfigError("clusters", "the topology has no prefill node")
    return records


def conversion_problem(records: dict[str, WorkerRecord], name: str, new_role: str) -> str | None:
    """Why worker ``name`` cannot be turned into a ``new_role`` worker now (None: it can): PD-cluster
    workers with a role-switch endpoint only, a bootstrap port to serve as prefill, and never the last
    routable worker of its present role."""
    record = records.get(name)
    if record is None:
        return f"unknown worker {name!r}"
    if new_role not in ("prefill", "decode"):
        return f"new_role must be prefill or decode, got {new_role!r}"
    if record.cluster != "pd":
        return f"{name} is a {record.cluster} worker; only PD-cluster workers change roles"
    if record.switch_url is None:
        return f"{name} cannot switch roles (its topology node has no role_switch)"
    if new_role == "prefill" and record.bootstrap_port is None:
        return f"{name} has no bootstrap port to serve as prefill"
    if record.role != new_role:
        others = [w for w in records.values() if w.name != name and w.site == record.site and w.role == record.role
                  and w.healthy and not w.draining]
        if not others:
            return f"{name} is the last serving {record.role} worker of {record.site}; converting it would leave none"
    return None


def facts_problem(record: WorkerRecord, facts: WorkerFacts, peers: list[WorkerRecord], emulation: Emulation | None,
                  cost_states: Mapping[SitePair, str]) -> str | None:
    """:func:`check_facts` against the kind of state of every pair's cost model that holds the worker's
    cluster (``cost_states``: pair -> ``RuntimeModel.state``; a PrfaaS cluster linked to several PD clusters
    must fit each); the first problem, or None."""
    states = dict.fromkeys(state for pair, state in cost_states.items() if record.site in (pair.pd, pair.prfaas))
    for state in states or [None]:
        if (problem := check_facts(record, facts, peers, emulation, state)) is not None:
            return problem
    return None


def check_facts(record: WorkerRecord, facts: WorkerFacts, peers: list[WorkerRecord], emulation: Emulation | None,
                cost_state: str | None = None) -> str | None:
    """Why ``facts`` cannot be right for ``record`` in this deployment (None: they can).
    ``cost_state``: the topology's cost model's kind of state (``runtime.state_kind``); None: not checked."""
    if facts.disaggregation_mode is not None and facts.disaggregation_mode != record.role:
        return f"{record.name} runs --disaggregation-mode {facts.disaggregation_mode}, the topology says {record.role}"
    if facts.block_hash != HASH_SCHEME:
        return f"{record.name} hashes KV blocks with {facts.block_hash!r}; the kv-index uses {HASH_SCHEME!r}"
    for peer in peers:
        if peer.name != record.name and peer.site == record.site and peer.facts is not None \
                and peer.facts.page_size != facts.page_size:
            return (f"page size {facts.page_size} of {record.name} differs from {peer.facts.page_size} of {peer.name} "
                    f"in the same cluster ({record.site})")
    if is_emulated(facts):
        want = emulation or Emulation()
        got = (facts.emulated.get("speedup"), facts.emulated.get("kv_scale"))
        if got != (want.speedup, want.kv_scale):
            return (f"{record.name} is an emulated engine at speedup {got[0]}, kv_scale {got[1]}; the topology's "
                    f"emulation section says {want.speedup}, {want.kv_scale}, so the router's cost model would be wrong")
    for peer in peers:
        if peer.name != record.name and peer.facts is not None and is_emulated(peer.facts) != is_emulated(facts):
            return f"{record.name} and {peer.name} mix emulated and real engines in one deployment"
    return _state_mismatch(record.name, facts.linear_state, cost_state)


def _state_mismatch(name: str, linear_state: bool | None, cost_state: str | None) -> str | None:
    """The served model's linear-attention state against the cost model's (the kv-index predicts reuse
    by the cost model's): one with state where the cost model has none, or none where the cost model
    is a linear-attention hybrid. A sliding-window cost model's workers have no Mamba cache either way."""
    if linear_state is None or cost_state is None:
        return None
    if linear_state and cost_state in ("none", "swa"):
        return (f"{name} serves a linear-attention hybrid (SGLang's uses_mamba_radix_cache) but the topology's "
                f"cost model has no linear-attention state ({cost_state}): the kv-index would predict reuse past "
                "the state checkpoints SGLang can resume from; set model.cost_model to the served model's family")
    if not linear_state and cost_state == "recurrent":
        return (f"{name} serves a model without linear-attention state but the topology's cost model is a "
                "linear-attention hybrid: the kv-index would predict reuse only at state checkpoints where SGLang "
                "reuses whole prefixes; set model.cost_model to the served model's family")
    return None


def is_emulated(facts: WorkerFacts) -> bool:
    return facts.emulated is not None and facts.emulated.get("engine") == "mock"
