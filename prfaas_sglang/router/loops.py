"""The PrfaaS router's background loops (adapter): what keeps its view of the workers and links
current, and its controllers ticking. Each loop takes what it uses (the service, the HTTP session, the
ZMQ subscriber, the room the request path waits on); ``router/app.py`` starts them with the app.

    health        ``/health`` every ``health_interval_s`` (``/server_info`` while a worker has no facts:
                  checked per pair, then its KV events and link telemetry subscribed)
    load          ``/v1/loads`` every ``load_interval_s``; the stage meter; wakes requests waiting for room
    control       every link's threshold controller, every ``control_interval_s``
    long-term     (``--long-term``) a stage sample every ``sample_s``, one decision per PD cluster,
                  carried out through ``router/conversion.py``
    restore       the kv-index service's snapshot, once at start-up
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from prfaas_sglang.adapters.zmq import ZmqSubscriber
from prfaas_sglang.kvindex.feed import kv_event_handler
from prfaas_sglang.kvindex.index import InvalidEvents
from prfaas_sglang.router.conversion import RoleSwitchClient, convert
from prfaas_sglang.router.longterm import Replan, pick_nodes
from prfaas_sglang.router.service import RouterService
from prfaas_sglang.router.workers import FactsError, WorkerRecord, parse_loads, parse_server_info
from prfaas_sglang.wire import kv_snapshot
from prfaas_sglang.wire.kv_events import KV_EVENTS_TOPIC
from prfaas_sglang.wire.server_info import with_live_mode
from prfaas_sglang.wire.telemetry import TELEMETRY_TOPIC, LinkSample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LongTermOptions:
    """How the router runs the long-term controller's decisions (the policy's own settings are in
    ``LongTermSettings``)."""

    sample_s: float = 10.0  # stage samples; decisions come every LongTermSettings.interval_s
    drain_timeout_s: float = 300.0  # a conversion gives up (back in service) after this


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0):
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise FactsError(f"{url} answered {resp.status}")
        return await resp.json(content_type=None)


async def _model_info(session: aiohttp.ClientSession, url: str) -> dict | None:
    """A worker's ``/model_info`` (where SGLang 0.5.23 states its live role), or None when it has none to give."""
    try:
        return await _get_json(session, url + "/model_info")
    except (aiohttp.ClientError, asyncio.TimeoutError, FactsError, ValueError):
        return None


def adopt_facts(service: RouterService, worker: WorkerRecord, info, sub: ZmqSubscriber | None) -> str | None:
    """Parse and check a worker's /server_info (``RouterService.facts_problem``: against every pair its
    cluster is in); on success start its event feed. Returns why it was refused."""
    try:
        facts = parse_server_info(info)
    except FactsError as err:
        worker.refused = f"{worker.name}: bad /server_info: {err}"
        return worker.refused
    problem = service.facts_problem(worker, facts)
    worker.refused = problem
    if problem is None:
        worker.facts = facts
        if sub is not None:
            watch_worker(service, worker, sub)
    return problem


def watch_worker(service: RouterService, worker: WorkerRecord, sub: ZmqSubscriber) -> None:
    url = worker.kv_events_url
    if url is not None and f"kv:{worker.name}" not in sub.sources():
        block = worker.facts.kv_events.block_size if worker.facts and worker.facts.kv_events else worker.facts.page_size
        service.index.add_worker(worker.name, worker.cluster, block)
        topic = (worker.kv_events_topic if worker.kv_events_topic is not None else KV_EVENTS_TOPIC).encode()
        sub.watch(f"kv:{worker.name}", url, topic, kv_event_handler(service.index, worker.name))
    if worker.telemetry_endpoint and worker.cluster == "prfaas" and f"link:{worker.name}" not in sub.sources():
        def on_sample(frames, name=worker.name):
            service.take_telemetry(name, LinkSample.decode(frames[-1]), time.monotonic(), time.time())

        sub.watch(f"link:{worker.name}", worker.telemetry_endpoint, TELEMETRY_TOPIC, on_sample)


async def poll_health(service: RouterService, session: aiohttp.ClientSession, sub: ZmqSubscriber | None,
                      worker: WorkerRecord) -> None:
    """One health check of ``worker`` (``/health``; ``/server_info`` while it has no facts), recorded
    with :meth:`WorkerRecord.note_health`: no answer within ``health_timeout_s`` is a miss, and only
    ``health_misses_to_down`` misses in a row take the worker out. An answer that left the worker
    before a role change (``worker.epoch`` moved meanwhile) is dropped."""
    epoch, config = worker.epoch, service.config
    try:
        async with session.get(worker.url + "/health", timeout=aiohttp.ClientTimeout(total=config.health_timeout_s)) as resp:
            answer = "ok" if resp.status == 200 else "down"
        if answer == "ok" and worker.facts is None:
            info = with_live_mode(await _get_json(session, worker.url + "/server_info"),
                                  await _model_info(session, worker.url))
            if not worker.poll_is_current(epoch):
                return
            problem = adopt_facts(service, worker, info, sub)
            if problem:
                logger.error("refusing worker %s: %s", worker.name, problem)
    except asyncio.TimeoutError:
        answer = "timeout"
    except (aiohttp.ClientError, FactsError, ValueError):
        answer = "down"
    if worker.poll_is_current(epoch):
        was = worker.healthy
        worker.note_health(answer, config.health_misses_to_down)
        if was and not worker.healthy:
            logger.warning("worker %s is down (health check: %s)", worker.name, answer)


async def poll_load(session: aiohttp.ClientSession, worker: WorkerRecord) -> None:
    """One ``/v1/loads`` read of ``worker`` into ``worker.load`` (None when it cannot be read). An
    answer that left the worker before a role change is dropped: a prefill worker's load read as a
    decode worker's would make its KV room look like the old role's cache size until the next poll."""
    epoch, covers = worker.epoch, worker.last_ticket
    try:
        load = parse_loads(await _get_json(session, worker.url + "/v1/loads", 1.0))
    except (aiohttp.ClientError, asyncio.TimeoutError, FactsError, ValueError):
        load = None
    if worker.poll_is_current(epoch):
        worker.take_load(load, covers)


async def health_loop(service: RouterService, session: aiohttp.ClientSession, sub: ZmqSubscriber | None) -> None:
    """Every ``health_interval_s``, one health check of each worker. The first pass asks only the
    workers the startup preflight did not adopt (it has just checked the others), so what the router
    knows of an adopted worker one interval after start comes from that preflight or a failed leg."""
    first_pass = True
    while True:
        for worker in list(service.workers.values()):
            if not (first_pass and worker.healthy):
                await poll_health(service, session, sub, worker)
        first_pass = False
        await asyncio.sleep(service.config.health_interval_s)


async def load_loop(service: RouterService, session: aiohttp.ClientSession, room: asyncio.Condition) -> None:
    """Every ``load_interval_s``, each healthy worker's load; then the stage meter, and the requests
    waiting for decode room are woken."""
    while True:
        for worker in list(service.workers.values()):
            if worker.healthy:
                await poll_load(session, worker)
        service.poll_stages(time.monotonic())
        async with room:
            room.notify_all()
        await asyncio.sleep(service.config.load_interval_s)


async def control_loop(service: RouterService) -> None:
    """Every ``control_interval_s``, one step of every link's threshold controller."""
    while True:
        for pair, t in service.control_tick(time.monotonic()).items():
            logger.info("threshold t of %s -> %.0f tokens (%s)", pair, t, service.pairs[pair].controller.history[-1][2])
        await asyncio.sleep(service.config.control_interval_s)


async def longterm_loop(service: RouterService, session: aiohttp.ClientSession, options: LongTermOptions,
                        unwatch: Callable[[str], None]) -> None:
    """The long-term scheduler (``router.longterm``, the simulator's own policy object), one controller
    per PD cluster: a stage sample every ``sample_s``; a decision converts that cluster's least-loaded
    workers through ``convert`` (``unwatch``: stop a converted worker's streams). A conversion that
    fails leaves the controller on the split that really serves."""
    service.stage_samples(time.monotonic())  # the first sample starts here
    interval_s = min(ctl.settings.interval_s for ctl in service.longterm.values())
    while True:
        await asyncio.sleep(min(options.sample_s, interval_s))
        now = time.monotonic()
        for pd, replan in service.observe_longterm(now, service.stage_samples(now)).items():
            await convert_for(service, session, options, unwatch, pd, replan)
        service.sync_longterm()  # a conversion that failed, or too few switchable workers: the split that serves


async def convert_for(service: RouterService, session: aiohttp.ClientSession, options: LongTermOptions,
                      unwatch: Callable[[str], None], pd: str, replan: Replan) -> None:
    """Carry out one long-term decision on PD cluster ``pd``."""
    from_role, to_role = ("decode", "prefill") if replan.convert > 0 else ("prefill", "decode")
    candidates = [(w.name, float(service.open_legs(w.name))) for w in service.workers.values()
                  if w.cluster == "pd" and w.site == pd and w.role == from_role and w.routable
                  and w.switch_url is not None]
    chosen = pick_nodes(candidates, abs(replan.convert))
    logger.info("long-term %s: convert %s to %s (%s)", pd, ", ".join(chosen) or "nothing switchable", to_role,
                replan.reason)
    results = await asyncio.gather(*(convert(service, RoleSwitchClient(session), name, to_role,
                                             drain_timeout_s=options.drain_timeout_s, runtime=replan.runtime,
                                             why=f"long-term: {replan.reason}", on_converted=unwatch,
                                             rejoin_s=service.config.prefill_rejoin_s)
                                     for name in chosen), return_exceptions=True)
    for err in (r for r in results if isinstance(r, BaseException)):
        logger.error("long-term conversion failed: %s", err)


async def restore_index(service: RouterService, session: aiohttp.ClientSession, kv_index_url: str) -> None:
    """Take the kv-index service's view once at start-up (a restarted router does not wait for new
    events to learn what the workers hold); merged into what live events already stored. A missing
    or unreachable kv-index service is logged, not fatal."""
    try:
        async with session.get(kv_index_url + "/snapshot", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            payload = await resp.read() if resp.status == 200 else None
        snapshot = kv_snapshot.decode(payload) if payload is not None else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        logger.warning("kv-index snapshot from %s not taken: %s", kv_index_url, err or type(err).__name__)
        return
    for name, snap in snapshot.items():
        worker = service.workers.get(name)
        if worker is None or name not in service.index.workers():
            continue  # not ours, or not adopted yet (its facts, hence its page size, unknown)
        try:
            added = service.index.restore(name, snap)
        except InvalidEvents as err:
            logger.warning("kv-index snapshot for %s refused: %s", name, err)
            continue
        service.counters.restored_blocks += added
        logger.info("kv-index snapshot: %d blocks of %s restored", added, name)


def unwatch(sub: ZmqSubscriber, name: str) -> None:
    """Stop following worker ``name``'s streams (deregistered; or converted: the health loop re-reads
    its facts and subscribes again for its new role)."""
    sub.unwatch(f"kv:{name}")
    sub.unwatch(f"link:{name}")
