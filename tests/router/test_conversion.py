"""P/D conversion without processes: the wire format, the router's checks and how its records and
model follow (the pure parts of router/conversion.py), and the launcher's commands for switchable
nodes. The live path is tests/router/test_conversion_e2e.py."""

from __future__ import annotations

import argparse
import time

import pytest

from prfaas_sglang.demo.cluster import local_topology
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.router.conversion import ConversionError, RoleSwitchClient, convert
from prfaas_sglang.router.service import RouterConfig, new_service
from prfaas_sglang.router.workers import WorkerFacts, conversion_problem, workers_from_topology
from prfaas_sglang.runtime import from_topology
from prfaas_sglang.topology import parse_topology
from prfaas_sglang.wire.blocks import HASH_SCHEME
from prfaas_sglang.wire.role_switch import RoleSwitchReply, RoleSwitchRequest


def test_request_is_upstreams_shape():
    assert RoleSwitchRequest("decode").to_json() == {"new_role": "decode"}
    assert RoleSwitchRequest("decode", 1.5).to_json() == {"new_role": "decode", "decode_cuda_graph_memory_gb": 1.5}
    assert RoleSwitchRequest.decode({"new_role": "prefill", "decode_cuda_graph_bs": [1, 2]}).new_role == "prefill"
    assert RoleSwitchRequest.decode({"new_role": "decode", "decode_cuda_graph_memory_gb": 0}) == RoleSwitchRequest("decode", 0.0)
    for bad in ({"new_role": "both"}, {}, b"[1]", b"{", {"new_role": None},
                {"new_role": "decode", "decode_cuda_graph_memory_gb": -1},
                {"new_role": "decode", "decode_cuda_graph_memory_gb": "2"},
                {"new_role": "decode", "decode_cuda_graph_memory_gb": True}):
        with pytest.raises(ValueError):
            RoleSwitchRequest.decode(bad)


GRAPH_METRICS = """# HELP sglang:graph_memory_usage_gb Memory used by captured device graphs in GB.
# TYPE sglang:graph_memory_usage_gb gauge
sglang:graph_memory_usage_gb{engine_type="decode",model_name="m",phase="prefill",tp_rank="0"} 0.0
sglang:graph_memory_usage_gb{engine_type="decode",model_name="m",phase="decode",tp_rank="0"} 2.25
"""


def test_the_decode_graph_memory_is_read_from_a_decode_peers_metrics():
    """Upstream's worker refuses a switch to decode that would capture graphs without their size, which
    the caller measures on a decode peer: the first peer whose /metrics says, skipping one that is
    down or does not (SGLang 0.5.15, the emulated engine)."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from prfaas_sglang.router.workers import WorkerRecord
    from prfaas_sglang.wire.role_switch import decode_graph_memory_gb

    assert decode_graph_memory_gb(GRAPH_METRICS) == 2.25
    assert decode_graph_memory_gb("sglang:num_requests_total 3\n") is None

    async def scenario():
        def app(text):
            async def metrics(_):
                return web.Response(text=text)

            server = web.Application()
            server.router.add_get("/metrics", metrics)
            return TestServer(server)

        async with app("sglang:num_requests_total 3\n") as without, app(GRAPH_METRICS) as with_graphs, \
                aiohttp.ClientSession() as session:
            def peer(name, url):
                return WorkerRecord(name, url, "pd", "decode", "127.0.0.1", None, None, None)

            client = RoleSwitchClient(session)
            down = peer("down", "http://127.0.0.1:9")
            found = await client.decode_graph_memory_gb([down, peer("old", str(without.make_url("")).rstrip("/")),
                                                         peer("new", str(with_graphs.make_url("")).rstrip("/"))])
            none = await client.decode_graph_memory_gb([down])
            return found, none

    assert asyncio.run(scenario()) == (2.25, None)


def test_reply_reads_upstream_and_unknown_fields():
    ok = RoleSwitchReply.decode({"success": True, "message": "ok", "old_role": "prefill", "new_role": "decode", "extra": 1})
    assert ok == RoleSwitchReply(True, "ok", "prefill", "decode", True)
    # upstream's worker sends no safe_to_restore: a failure is then taken as unsafe, as mini_lb does
    assert RoleSwitchReply.decode({"success": False, "message": "boom"}).safe_to_restore is False
    assert RoleSwitchReply.decode({"success": False, "message": "not idle", "safe_to_restore": True}).safe_to_restore
    assert RoleSwitchReply(False, "x").http_status == 400 and ok.http_status == 200
    with pytest.raises(ValueError):
        RoleSwitchReply.decode({"message": "no success field"})


def _service(role_switch: str | None = "in-place", pd_prefill: int = 2, pd_decode: int = 2, threshold=None):
    doc = local_topology(pd_prefill=pd_prefill, pd_decode=pd_decode, speedup=None, kv_scale=None, role_switch=role_switch,
                         threshold_tokens=threshold, accelerators=("h200x8", "h20x8"),
                         workload={"kind": "lognormal", "mu": 9.9, "sigma": 1.0, "min_tokens": 128, "max_tokens": 131072})
    topology = parse_topology(doc)
    records = workers_from_topology(topology)
    for r in records.values():
        r.healthy = True
        r.facts = WorkerFacts("m", 512, r.role, 100_000, 64, 131_072, None, HASH_SCHEME, None, None, None)
    return new_service(RouterConfig(), from_topology(topology, emulated=False), records)


def test_conversion_problem_names_each_refusal():
    service = _service()
    assert conversion_problem(service.workers, "pd-prefill-0", "decode") is None
    assert conversion_problem(service.workers, "pd-decode-0", "prefill") is None
    assert "unknown" in conversion_problem(service.workers, "nope", "decode")
    assert "only PD-cluster" in conversion_problem(service.workers, "prfaas-0", "decode")
    assert "prefill or decode" in conversion_problem(service.workers, "pd-prefill-0", "sideways")
    service.workers["pd-prefill-1"].draining = True  # the other PD-P is out of service: this one is the last
    assert "last serving prefill worker of pd" in conversion_problem(service.workers, "pd-prefill-0", "decode")
    fixed = _service(role_switch=None)
    assert "no role_switch" in conversion_problem(fixed.workers, "pd-prefill-0", "decode")


def test_converted_moves_the_records_index_and_model():
    service = _service()
    ps = service.only_pair()
    before_t = ps.controller.threshold_tokens
    service.index.add_worker("pd-prefill-0", "pd", 512)
    worker = service.workers["pd-prefill-0"]
    worker.draining, worker.prefill_requests, worker.outstanding_prefill_s = True, 0, 0.0
    assert service.pd_split(ps.pair.pd) == (2, 2)
    new_t = service.converted("pd-prefill-0", "decode", 100.0).get(ps.pair)
    assert worker.role == "decode" and worker.facts is None and not worker.draining and not worker.routable
    assert "pd-prefill-0" not in service.index.workers()
    assert (ps.runtime.n_prefill, ps.runtime.n_decode) == (1, 3)
    # fewer PD-P instances: the planner's t moves down (more prompts are long enough for PrfaaS)
    assert new_t is not None and new_t < before_t
    assert ps.controller.history[-1][2].startswith("replan: pd-prefill-0 -> decode")


def test_converted_keeps_the_operators_threshold():
    service = _service(threshold=6_000)
    assert service.converted("pd-prefill-0", "decode", 1.0) == {}  # no pair's t moved
    ps = service.only_pair()
    assert ps.controller.threshold_tokens == 6_000 and ps.runtime.n_prefill == 1


class _Client(RoleSwitchClient):
    def __init__(self, replies):
        self.replies, self.calls = list(replies), []

    async def decode_graph_memory_gb(self, peers):
        self.peers = [p.name for p in peers]
        return 0.5

    async def switch(self, worker, new_role, decode_graph_gb=None):
        self.calls.append((worker.name, new_role))
        self.graph_gb = decode_graph_gb
        return self.replies.pop(0)


def _run(coro):
    import asyncio

    return asyncio.run(coro)


def test_convert_waits_for_the_ledgers_then_restores_or_quarantines():
    service = _service()
    worker = service.workers["pd-prefill-0"]
    # a leg that never ends: 504, back in service, the worker never asked
    worker.prefill_requests = 1
    client = _Client([])
    with pytest.raises(ConversionError) as err:
        _run(convert(service, client, "pd-prefill-0", "decode", drain_timeout_s=0.3, poll_s=0.05))
    assert err.value.status == 504 and not worker.draining and client.calls == []
    worker.prefill_requests = 0
    # "not idle" is retried, then a safe refusal restores the worker
    client = _Client([RoleSwitchReply(False, "instance is not idle", "prefill"), RoleSwitchReply(False, "role switching is off")])
    client.replies[1] = RoleSwitchReply(False, "role switching is off", "prefill", safe_to_restore=True)
    with pytest.raises(ConversionError) as err:
        _run(convert(service, client, "pd-prefill-0", "decode", drain_timeout_s=5, poll_s=0.05))
    assert err.value.status == 502 and len(client.calls) == 2 and not worker.draining and worker.role == "prefill"
    assert client.peers == ["pd-decode-0", "pd-decode-1"] and client.graph_gb == 0.5  # to decode: a decode peer's size
    # an unsafe failure: out of service until restarted
    client = _Client([RoleSwitchReply(False, "rebuild failed; restart required", "prefill", safe_to_restore=False)])
    with pytest.raises(ConversionError, match="until restarted"):
        _run(convert(service, client, "pd-prefill-0", "decode", drain_timeout_s=5, poll_s=0.05))
    assert worker.draining and not worker.healthy and worker.role == "prefill"
    # success on another worker: the records follow and the hook runs
    seen = []
    client = _Client([RoleSwitchReply(True, "switched", "decode", "prefill")])
    async def rejoining():  # a new prefill stays drained while its decode peers' heartbeat notices the rebuild
        task = asyncio.create_task(convert(service, client, "pd-decode-0", "prefill", drain_timeout_s=5, poll_s=0.05,
                                           on_converted=seen.append, rejoin_s=0.3))
        while not seen:
            await asyncio.sleep(0.01)
        during = (service.workers["pd-decode-0"].role, service.workers["pd-decode-0"].draining)
        return during, await task

    import asyncio

    during, done = _run(rejoining())
    assert during == ("prefill", True) and not service.workers["pd-decode-0"].draining
    assert (done.old_role, done.new_role) == ("decode", "prefill") and seen == ["pd-decode-0"]
    assert client.graph_gb is None and not hasattr(client, "peers")  # to prefill: no graphs to size
    assert service.workers["pd-decode-0"].role == "prefill"


def test_a_poll_answered_before_the_role_change_is_not_written_after_it():
    """The load and health loops await the worker while a conversion may finish: an answer from the
    old role (a prefill worker's 2M-token cache read as a decode worker's KV room) is dropped, so the
    policy never sees the converted worker through its old role's numbers."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from prfaas_sglang.router.loops import poll_health, poll_load

    service = _service()
    worker = service.workers["pd-prefill-0"]

    async def scenario():
        answered, release = asyncio.Event(), asyncio.Event()

        async def loads(request):
            answered.set()
            await release.wait()  # the answer is the old role's; the conversion lands meanwhile
            return web.json_response({"loads": [{"num_running_reqs": 0, "num_used_tokens": 4096,
                                                 "max_total_num_tokens": 2_097_152}]})

        async def health(request):
            answered.set()
            await release.wait()
            return web.Response(status=503)  # mid-switch

        app = web.Application()
        app.router.add_get("/v1/loads", loads)
        app.router.add_get("/health", health)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            worker.url = str(server.make_url("")).rstrip("/")
            results = {}
            for name, poll in (("load", lambda: poll_load(session, worker)),
                               ("health", lambda: poll_health(service, session, None, worker))):
                for convert_meanwhile in (False, True):
                    worker.healthy, worker.load = True, None
                    answered.clear(), release.clear()
                    task = asyncio.create_task(poll())
                    await answered.wait()
                    if convert_meanwhile:
                        worker.epoch += 1  # what service.converted() does
                    release.set()
                    await task
                    results[name, convert_meanwhile] = (worker.load, worker.healthy)
            return results

    results = _run(scenario())
    assert results["load", False][0].max_total_tokens == 2_097_152  # a current answer is written
    assert results["load", True][0] is None  # a stale one is not
    assert results["health", False][1] is False and results["health", True][1] is True
    # and converted() is what moves the epoch
    before = worker.epoch
    worker.draining = True
    service.converted("pd-prefill-0", "decode", 1.0)
    assert worker.epoch == before + 1


def test_the_first_health_pass_asks_only_the_workers_the_preflight_did_not_adopt():
    """Preflight has just checked the workers it adopted: the health loop's first pass asks only the
    others, so a worker that dies right after startup is learned of from the leg that fails on it
    (re-dispatched, counted), not from a pass racing the first requests (CI flake of
    test_a_dead_decode_worker_is_routed_around_before_anything_streamed). The next pass asks all."""
    import asyncio
    import dataclasses

    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from prfaas_sglang.router.loops import health_loop

    service = _service()
    service.config = dataclasses.replace(service.config, health_interval_s=0.3)
    names = sorted(service.workers)
    late = service.workers[names[0]]
    late.healthy = False  # not up at preflight

    async def scenario():
        asked: list[str] = []

        async def health(request):
            asked.append(request.match_info["name"])
            return web.Response(text="OK")

        app = web.Application()
        app.router.add_get("/{name}/health", health)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            for name, worker in service.workers.items():
                worker.url = str(server.make_url(f"/{name}")).rstrip("/")
            loop = asyncio.create_task(health_loop(service, session, None))
            deadline = time.monotonic() + 10.0
            while not asked:  # the first pass, however loaded the machine (a fixed 0.15 s was not, in CI's leg)
                assert time.monotonic() < deadline, "no health pass"
                await asyncio.sleep(0.01)
            first = list(asked)
            while set(asked) != set(names):  # a later pass asks every worker
                assert time.monotonic() < deadline, asked
                await asyncio.sleep(0.01)
            loop.cancel()
            return first, asked

    first, asked = _run(scenario())
    assert first == [late.name]
    assert late.healthy
    assert sorted(set(asked)) == names


def _launch_args(config, node, engine="mock"):
    return argparse.Namespace(role=None, engine=engine, config=config, node=node, model_path="/models/x", host=None,
                              port=None, bootstrap_port=None, kv_events_port=None, kv_transport=None, kv_profile="wan",
                              tp_size=None, profile=None, speedup=None, kv_scale=None, dry_run=True, json=False)


@pytest.mark.parametrize("mode", ["in-place", "restart"])
def test_launcher_commands_for_switchable_nodes(tmp_path, mode, monkeypatch):
    from prfaas_sglang.demo.cluster import write_topology
    from prfaas_sglang.launch.__main__ import make_command
    from prfaas_sglang.roles import Role

    monkeypatch.setenv("PRFAAS_SKIP_PATCH_VERIFY", "1")
    config = write_topology(local_topology(role_switch=mode), tmp_path / "t.yaml")
    decode = make_command(_launch_args(config, "pd-decode-0"), ())
    assert "--bootstrap-port" in decode.argv and "--max-batch" in decode.argv
    assert ("--enable-pd-role-switch" in decode.argv) == (mode == "in-place")
    as_prefill = make_command(_launch_args(config, "pd-decode-0"), (), role=Role.PD_PREFILL)
    assert as_prefill.argv[as_prefill.argv.index("--role") + 1] == "pd-prefill"
    assert any("role supervisor" in n for n in decode.notes) == (mode == "restart")
    if mode == "in-place":
        from prfaas_sglang._compat import PD_ROLE_SWITCH, installed_has

        if installed_has(PD_ROLE_SWITCH):  # SGLang 0.5.23: its own endpoint, turned on
            sglang = make_command(_launch_args(config, "pd-decode-0", engine="sglang"), ())
            assert "--enable-pd-role-switch" in sglang.argv and not any("role supervisor" in n for n in sglang.notes)
        else:  # SGLang 0.5.15 cannot switch in place: refused before anything starts
            with pytest.raises(ConfigError, match="has no /pd_role_switch"):
                make_command(_launch_args(config, "pd-decode-0", engine="sglang"), ())
    else:
        sglang = make_command(_launch_args(config, "pd-decode-0", engine="sglang"), ())
        assert "--disaggregation-mode" in sglang.argv and any("role supervisor" in n for n in sglang.notes)


def test_an_operators_conversion_moves_the_long_term_controllers_split_too():
    from prfaas_sglang.router.longterm import LongTermSettings

    service = _service()
    service.start_longterm(LongTermSettings())
    (ctl,) = service.longterm.values()
    assert ctl.runtime.n_prefill == 2
    service.converted("pd-prefill-0", "decode", 1.0)
    assert ctl.runtime.n_prefill == 1 and ctl.runtime.n_decode == 3
    ctl.runtime = ctl.runtime.with_split(2)  # a decision whose conversion then failed
    service.sync_longterm()
    assert ctl.runtime.n_prefill == 1


def test_a_burst_between_two_load_polls_spreads_over_the_decode_workers():
    """Between two ``/v1/loads`` answers the router's own dispatches are all it knows of a decode
    worker's use. They count on top of the polled use, so a burst alternates between two workers
    of nearly equal room instead of landing whole on the one that looked roomier at the last poll
    (before: ``max(reserved, polled)`` left the polled figure unchanged until the reservations
    outgrew it). An answer counts what was dispatched before it left the worker, not after."""
    from prfaas_sglang.protocol import EngineRequest
    from prfaas_sglang.router.workers import WorkerLoad

    service = _service(pd_decode=2)
    d0, d1 = service.workers["pd-decode-0"], service.workers["pd-decode-1"]
    d0.take_load(WorkerLoad(0, 0, 40_000, 100_000), 0)  # 60K free
    d1.take_load(WorkerLoad(0, 0, 42_000, 100_000), 0)  # 58K free
    chosen, leases = [], []
    for n in range(6):
        req = EngineRequest("generate", tuple(range(1_000 + n, 4_000 + n)), 1_000, False, f"r{n}", None, None)
        decision = service.decide(service.route_input(req), set(), 0.0)
        leases.append(service.begin(req, decision, 0.0, 0))
        chosen.append(decision.decode)
    assert chosen.count("pd-decode-0") == chosen.count("pd-decode-1") == 3, chosen
    assert d0.kv_free_tokens == 60_000 - 3 * 4_000 and d0.reserved_since_poll_tokens == 12_000
    # a poll sent after two of these left and answered after the third: the third still counts
    first_two = sorted(lease.decode_ticket for lease in leases if lease.decision.decode == "pd-decode-0")[1]
    d0.take_load(WorkerLoad(2, 0, 48_000, 100_000), covers_ticket=first_two)
    assert d0.reserved_since_poll_tokens == 4_000 and d0.kv_free_tokens == 100_000 - 52_000
    # finished requests give their room back; what is left since the poll never exceeds what is reserved
    for lease in leases:
        service.finish(lease)
    assert (d0.reserved_tokens, d0.reserved_since_poll_tokens) == (0, 0)
    # the two the answer counted ended after it arrived: their room is back before the next poll
    assert d0.released_since_poll_tokens == 8_000 and d0.kv_free_tokens == 100_000 - 40_000


def test_a_worker_that_finished_its_requests_since_the_last_poll_does_not_look_full():
    """A ``/v1/loads`` answer taken while a burst was open counts that burst's KV. When the burst
    ends before the next poll, the worker must not look fuller than a peer that was polled idle:
    the next burst spreads over both instead of landing whole on the peer (a converted worker
    received no requests for a whole poll period this way). What ended between sending the poll
    and its answer is not subtracted (the answer may or may not count it), nor a reservation the
    answer never saw, and a role change forgets the old role's reservations."""
    from prfaas_sglang.protocol import EngineRequest
    from prfaas_sglang.router.workers import WorkerLoad

    service = _service(pd_decode=2)
    d0, d1 = service.workers["pd-decode-0"], service.workers["pd-decode-1"]
    burst = [d0.reserve(5_000) for _ in range(4)]
    d0.take_load(WorkerLoad(4, 0, 20_000, 100_000), covers_ticket=d0.last_ticket)  # the burst, in use
    d1.take_load(WorkerLoad(0, 0, 1_000, 100_000), covers_ticket=d1.last_ticket)
    for ticket in burst:
        d0.release(ticket)
    assert d0.kv_free_tokens == 100_000 and d1.kv_free_tokens == 99_000
    chosen = []
    for n in range(4):
        req = EngineRequest("generate", tuple(range(n, 2_000 + n)), 500, False, f"r{n}", None, None)
        decision = service.decide(service.route_input(req), set(), 0.0)
        service.begin(req, decision, 0.0, 0)
        chosen.append(decision.decode)
    assert chosen.count("pd-decode-0") == chosen.count("pd-decode-1") == 2, chosen

    # ended between sending a poll and its answer: the answer may still count it, so nothing is subtracted
    ticket = d1.reserve(3_000)
    covers = d1.last_ticket
    d1.release(ticket)
    d1.take_load(WorkerLoad(2, 0, 9_000, 100_000), covers_ticket=covers)
    assert d1.released_since_poll_tokens == 0 and d1.kv_free_tokens == 100_000 - 9_000

    # a role change forgets the reservations of the old role; releasing one later changes nothing
    open_before = d0.reserved_tokens
    assert open_before > 0
    d0.forget_reservations()
    d0.release(d0.last_ticket)
    assert (d0.reserved_tokens, d0.reserved_requests, d0.released_since_poll_tokens) == (0, 0, 0)
