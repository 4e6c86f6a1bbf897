"""Turning a PD worker from prefill into decode or back, live (the long-term scheduler's actuator).

One conversion (``convert``), the order upstream's role switch requires::

    conversion_problem()         PD worker, switchable, not the last of its role      else 409
    draining = True              the policy routes around it; legs in flight go on
    open_legs() == 0             the router's own ledgers: every prefill leg ended, every decode
                                 reservation released (or drain_timeout_s: 504, back in service)
    decode graph memory          to decode: what a decode peer's graphs take (its /metrics), sent along
    POST switch_url/pd_role_switch   the adapter (RoleSwitchClient): the worker itself
                                 (role_switch: in-place; the emulated engine, SGLang >= 0.5.23) or the
                                 launcher's supervisor (role_switch: restart; SGLang 0.5.15). "not idle"
                                 (the engine's own view lags the router's by a load poll) is retried
                                 until the drain deadline
    success                      service.converted(): the record takes the new role, its facts are
                                 re-read by the health loop (the new disaggregation mode checked), its
                                 KV-event subscription restarts, its blocks leave the index, every pair
                                 of its PD cluster moves to the new split and re-solves its t
    to prefill                   drained rejoin_s more: its decode peers' heartbeat notices the rebuild
    refused, safe_to_restore     back in service in the old role (502 with the worker's message)
    failed, unsafe               unhealthy and still draining until an operator restarts it (502)

Nothing here decides *whether* to convert: the admin API (an operator) or the long-term controller
(``router.longterm``, pure) does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp

from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.router.service import RouterService
from prfaas_sglang.router.workers import WorkerRecord, conversion_problem
from prfaas_sglang.runtime import PdClusterModel
from prfaas_sglang.wire.role_switch import (
    RoleSwitchReply,
    RoleSwitchRequest,
    decode_graph_memory_gb,
)

logger = logging.getLogger("prfaas.router.conversion")


class ConversionError(PrfaasError):
    """A conversion that did not happen; ``status`` is the admin API's HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Conversion:
    worker: str
    old_role: str
    new_role: str
    drained_s: float  # from draining = True until the worker held no leg
    switched_s: float  # the role switch itself
    thresholds: dict[str, float]  # t of each pair of the worker's PD cluster (prfaas->pd) after the re-solve
    message: str

    def to_json(self) -> dict:
        """Its fields; a PD cluster of one pair also gives that pair's t as ``threshold_tokens``."""
        one = {"threshold_tokens": next(iter(self.thresholds.values()))} if len(self.thresholds) == 1 else {}
        return {**vars(self), "thresholds": dict(self.thresholds), **one}


class RoleSwitchClient:
    """The adapter: upstream's ``/pd_role_switch`` wherever the worker's topology says it is served."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 1800.0):
        self.session, self.timeout_s = session, timeout_s

    async def decode_graph_memory_gb(self, peers: list[WorkerRecord]) -> float | None:
        """What the decode graphs take on the first of ``peers`` (decode workers) whose ``/metrics`` says
        (``wire.role_switch.decode_graph_memory_gb``); None where none does (SGLang 0.5.15, the emulated
        engine, metrics off, unreachable)."""
        for peer in peers:
            try:
                async with self.session.get(peer.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    text = await resp.text() if resp.status == 200 else ""
                found = decode_graph_memory_gb(text)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeDecodeError) as err:
                logger.info("no decode graph memory from %s: %s", peer.name, err or type(err).__name__)
                continue
            if found is not None:
                return found
        return None

    async def switch(self, worker: WorkerRecord, new_role: str, decode_graph_gb: float | None = None) -> RoleSwitchReply:
        """The worker's (or its supervisor's) reply; a transport failure or an unreadable reply is
        an unsafe failure (whether the worker switched is unknown). ``decode_graph_gb``: upstream's
        ``decode_cuda_graph_memory_gb``, sent when known."""
        body = RoleSwitchRequest(new_role, decode_graph_gb).to_json()
        try:
            async with self.session.post(worker.switch_url + "/pd_role_switch", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                body = await resp.read()
            reply = RoleSwitchReply.decode(body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            return RoleSwitchReply(False, f"cannot reach {worker.switch_url}: {err or type(err).__name__}", worker.role,
                                   safe_to_restore=False)
        except ValueError as err:
            return RoleSwitchReply(False, f"{worker.switch_url} answered {resp.status} without a role-switch reply: {err}",
                                   worker.role, safe_to_restore=False)
        return reply


async def convert(service: RouterService, client: RoleSwitchClient, name: str, new_role: str, *,
                  drain_timeout_s: float = 300.0, poll_s: float = 0.2, runtime: PdClusterModel | None = None,
                  why: str | None = None, on_converted=None, rejoin_s: float = 0.0) -> Conversion:
    """Drain worker ``name``, switch it to ``new_role``, and make the router follow. Raises
    :class:`ConversionError` (the worker is back in service unless its reply said it is unsafe).
    ``on_converted(name)`` runs after the records follow (the server restarts subscriptions there).
    ``rejoin_s``: a worker that became a prefill stays drained this long before it is routed to
    (``RouterConfig.prefill_rejoin_s``: its decode peers' heartbeat notices the rebuild)."""
    if (problem := conversion_problem(service.workers, name, new_role)) is not None:
        raise ConversionError(404 if name not in service.workers else 409, problem)
    worker = service.workers[name]
    old_role = worker.role
    if old_role == new_role:
        return Conversion(name, old_role, new_role, 0.0, 0.0, _thresholds(service, worker), "already in target role")
    if worker.draining:
        raise ConversionError(409, f"{name} is draining already (another conversion, or an operator's drain)")
    worker.draining = True
    start = time.monotonic()
    deadline = start + drain_timeout_s
    while service.open_legs(name) > 0:
        if time.monotonic() > deadline:
            worker.draining = False
            raise ConversionError(504, f"{name} still holds {service.open_legs(name)} request(s) after {drain_timeout_s:g} s; "
                                       "back in service, not converted")
        await asyncio.sleep(poll_s)
    drained = time.monotonic()
    graph_gb = None
    if new_role == "decode":  # upstream's worker sizes its decode graphs by a decode peer's
        peers = [w for w in service.workers.values() if w.site == worker.site and w.role == "decode" and w.healthy]
        graph_gb = await client.decode_graph_memory_gb(peers)
    while True:
        reply = await client.switch(worker, new_role, graph_gb)
        if reply.success or not reply.safe_to_restore or "not idle" not in reply.message or time.monotonic() > deadline:
            break
        await asyncio.sleep(max(poll_s, 0.5))  # the engine finishes what the router already saw end
    switched = time.monotonic()
    if not reply.success:
        if reply.safe_to_restore:
            worker.draining = False
            raise ConversionError(502, f"{name} refused to switch to {new_role}: {reply.message}; back in service as {old_role}")
        worker.healthy = False
        raise ConversionError(502, f"{name} failed to switch to {new_role}: {reply.message}; it stays out of service "
                                   "until restarted")
    service.converted(name, new_role, time.monotonic(), runtime, why)
    if on_converted is not None:
        on_converted(name)
    if new_role == "prefill" and rejoin_s > 0:
        worker.draining = True
        await asyncio.sleep(rejoin_s)
        worker.draining = False
    thresholds = _thresholds(service, worker)
    logger.info("converted %s from %s to %s (drained in %.1f s, switched in %.1f s); t %s", name, old_role, new_role,
                drained - start, switched - drained, ", ".join(f"{pair} {t:.0f}" for pair, t in thresholds.items()))
    return Conversion(name, old_role, new_role, drained - start, switched - drained, thresholds, reply.message)


def _thresholds(service: RouterService, worker: WorkerRecord) -> dict[str, float]:
    """The ``t`` of each pair of ``worker``'s PD cluster, by link (``prfaas->pd``)."""
    return {str(ps.pair): ps.controller.threshold_tokens for ps in service.pairs_of(worker.site)}
