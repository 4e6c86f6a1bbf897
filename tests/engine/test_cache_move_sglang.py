"""Cache moves in the real SGLang path (``hooks/cache_move_hook.py``), on CPU.

Two worker processes (``cache_move_worker.py``: SGLang's pools and radix cache, SGLang's Mooncake
transfer engine over TCP, the agent and routes our hooks install, SGLang's ``--api-key``
middleware, uvicorn) with one deployment secret; the router's own ``_move_cache`` drives the move
as it does for emulated workers. The full-attention variant and the pieces without sockets run in
this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import SGLANG_PROCESS_GUARD_S

from prfaas_sglang._compat import UNIFIED_TREE, installed_has
from prfaas_sglang.adapters import http_sync
from prfaas_sglang.demo.cluster import PortPicker
from prfaas_sglang.wire.auth import AUTH_HEADER, DeploymentKeys, sign
from prfaas_sglang.wire.cache_move import CacheExport, CacheImport, CacheImported

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.radix_cache")

WORKER = Path(__file__).with_name("cache_move_worker.py")
SECRET = b"a deployment secret for the cache-move tests, long enough"
SHORT = list(range(100, 108))  # cached with a state at its end
LONG = SHORT + list(range(108, 112))  # extends it: states at 8 and 12
KEYS = DeploymentKeys.from_secret(SECRET)


def _start(port: int, tmp: Path, seed_prefixes: list[list[int]]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRFAAS_", "MC_"))}
    env.update(PROBE_PORT=str(port), PROBE_IPC_DIR=str(tmp), PRFAAS_ROLE="pd-prefill",
               PRFAAS_SECRET_FILE=str(tmp / "secret"), PROBE_SEED_PREFIXES=json.dumps(seed_prefixes), PROBE_SEED="7")
    log = open(tmp / f"worker-{port}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, deadline_s: float = SGLANG_PROCESS_GUARD_S) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if http_sync.post(url + "/probe/held", json_body={"tokens": [1]}, headers=KEYS.bearer(), timeout_s=2).ok:
                return
        except http_sync.HttpError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"worker not ready:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """(source URL, target URL): the source caches SHORT and LONG, the target nothing."""
    tmp = tmp_path_factory.mktemp("cache-move")
    (tmp / "secret").write_bytes(SECRET)
    os.chmod(tmp / "secret", 0o600)
    pick = PortPicker()
    ports = pick(), pick()
    procs = [_start(ports[0], tmp, [SHORT, LONG]), _start(ports[1], tmp, [])]
    urls = tuple(f"http://127.0.0.1:{p}" for p in ports)
    try:
        for url, proc, port in zip(urls, procs, ports, strict=True):
            _wait_ready(url, proc, tmp / f"worker-{port}.log")
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def held(url: str, tokens: list[int]) -> dict:
    r = http_sync.post(url + "/probe/held", json_body={"tokens": tokens}, headers=KEYS.bearer(), timeout_s=10)
    r.raise_for_status()
    return r.json()


def accounting_holds(answer: dict) -> bool:
    """Pool free + cached = total, for KV tokens and state slots (no page or slot leaked)."""
    return (answer["free_plus_cached"] == answer["total"]
            and answer.get("state_free_plus_cached") == answer.get("state_total"))


def router_move(source: str, target: str, prompt: list[int], tokens: int) -> dict:
    """The router's own ``_move_cache`` for a decision to move ``tokens`` of ``prompt`` from
    ``source`` to ``target``; returns its outcome counters."""
    import aiohttp

    from prfaas_sglang.router.metrics import RouterCounters
    from prfaas_sglang.router.policy import CacheTransfer
    from prfaas_sglang.router.server import SERVICE_KEY, SESSION_KEY, _move_cache

    async def run():
        service = SimpleNamespace(
            workers={"src": SimpleNamespace(name="src", url=source), "dst": SimpleNamespace(name="dst", url=target)},
            config=SimpleNamespace(phase_timeout_s=30.0), counters=RouterCounters())
        async with aiohttp.ClientSession(headers=KEYS.bearer()) as session:  # as the router's, with a secret
            app = {SERVICE_KEY: service, SESSION_KEY: session}
            decision = SimpleNamespace(prefill="dst", transfer=CacheTransfer("src", tokens, 0.5))
            await _move_cache(app, SimpleNamespace(input_ids=prompt), decision)
        return service.counters.cache_moves

    return asyncio.run(run())



@pytest.mark.slow
def test_the_routers_move_lands_the_prefix_in_the_target_with_the_sources_bytes(workers):
    """A prefix cached only in the source's SGLang cache: the router's move makes the target fetch it
    (Mooncake TCP into a landing buffer, then an insert on the scheduler thread); the target then
    reuses it with the source's usable length, and its KV rows and state are the source's, bit for
    bit. Asked again, it moves nothing. No page or state slot leaks on either side."""
    source, target = workers
    prompt = LONG + [7, 7, 7]
    before = held(source, prompt)
    assert before["held"] == len(LONG) and held(target, prompt)["held"] == 0
    assert router_move(source, target, prompt, len(LONG)) == {"ok": 1}
    after = held(target, prompt)
    assert after["held"] == len(LONG) and after["digest"] == before["digest"]
    assert accounting_holds(after) and accounting_holds(held(source, prompt))
    again = http_sync.post(target + "/prfaas/cache/import", headers=KEYS.bearer(), timeout_s=30,
                           json_body=CacheImport(prompt, len(LONG), source, 10.0).to_json())
    assert again.status == 200
    assert CacheImported.decode(again.json()) == CacheImported(0, len(LONG), 0, None)


def test_a_move_the_source_can_no_longer_serve_is_a_409_and_the_router_recomputes(workers):
    source, target = workers
    prompt = list(range(500, 520))
    assert router_move(source, target, prompt, 16) == {"source_lost": 1}
    after = held(target, prompt)
    assert after["held"] == 0 and accounting_holds(after)


def test_an_unreachable_source_fails_the_move_promptly_and_allocates_nothing(workers):
    _, target = workers
    dead = f"http://127.0.0.1:{PortPicker()()}"
    started = time.monotonic()
    r = http_sync.post(target + "/prfaas/cache/import", headers=KEYS.bearer(), timeout_s=30,
                       json_body=CacheImport(list(range(900, 913)), 12, dead, 10.0).to_json())
    assert r.status == 502 and "cannot fetch the prefix" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5.0
    after = held(target, [1])
    assert accounting_holds(after) and after["quarantined_bytes"] == 0  # never asked: its buffer is gone


def test_a_source_that_takes_the_request_and_goes_silent_times_out_and_its_landing_buffer_stays_registered(workers):
    """A source that accepted the export but never answered may still write: the target answers by
    the move's deadline, allocates nothing in its pools, and keeps the landing buffer registered
    (released after the grace period) instead of freeing memory a late write could land in."""
    _, target = workers
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        r = http_sync.post(target + "/prfaas/cache/import", headers=KEYS.bearer(), timeout_s=30,
                           json_body=CacheImport(list(range(700, 713)), 12, url, 1.0).to_json())
        elapsed = time.monotonic() - started
    assert r.status in (502, 504) and elapsed < 4.0
    after = held(target, [1])
    assert accounting_holds(after) and after["quarantined_bytes"] > 0


def _export_body(num_tokens: int, length: int) -> bytes:
    return json.dumps(CacheExport(LONG, num_tokens, "127.0.0.1:1", 4096, length).to_json()).encode()


def _signed(body: bytes, key: bytes = KEYS.handoff_key) -> dict:
    return {**KEYS.bearer(), "Content-Type": "application/json",
            AUTH_HEADER: sign(key, "POST", "/prfaas/cache/export", body, time.time())}


def test_moves_need_the_worker_key_and_an_export_a_fresh_signature(workers):
    source, target = workers
    body = CacheImport(LONG + [1], len(LONG), source, 10.0).to_json()
    assert http_sync.post(target + "/prfaas/cache/import", json_body=body, timeout_s=10).status == 401  # SGLang's middleware
    export = _export_body(len(LONG), 10)
    assert http_sync.post(source + "/prfaas/cache/export", data=export, timeout_s=10,
                          headers={**KEYS.bearer(), "Content-Type": "application/json"}).status == 401
    other = DeploymentKeys.from_secret(b"another deployment's secret, also long enough").handoff_key
    assert http_sync.post(source + "/prfaas/cache/export", data=export, headers=_signed(export, other), timeout_s=10).status == 401
    headers = _signed(export)
    first = http_sync.post(source + "/prfaas/cache/export", data=export, headers=headers, timeout_s=10)
    assert first.status == 400 and "smaller than the prefix" in first.json()["error"]["message"]  # signed: reaches the agent
    assert http_sync.post(source + "/prfaas/cache/export", data=export, headers=headers, timeout_s=10).status == 401  # replay


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"v": 1}', json.dumps(
    {"v": 1, "token_ids": [1 << 32], "num_tokens": 1, "source_url": "http://x", "timeout_s": 1}).encode(),
    json.dumps({"v": 9, "token_ids": [1], "num_tokens": 1, "source_url": "http://x", "timeout_s": 1}).encode()])
def test_a_malformed_import_is_a_400_with_a_reason(workers, body):
    _, target = workers
    r = http_sync.post(target + "/prfaas/cache/import", data=body, timeout_s=10,
                       headers={**KEYS.bearer(), "Content-Type": "application/json"})
    assert r.status == 400 and r.json()["error"]["message"]
    assert accounting_holds(held(target, [1]))


# --- in this process -------------------------------------------------------------------------------


def test_a_step_the_scheduler_has_not_started_by_the_deadline_is_cancelled_and_never_runs():
    from prfaas_sglang.hooks.cache_move_hook import MoveRefused, SchedulerSteps

    steps, ran = SchedulerSteps(), []
    with pytest.raises(MoveRefused) as err:
        steps.call(lambda: ran.append(1), 0.05)
    assert err.value.status == 504
    assert steps.run_pending() == 0 and ran == []


def test_servers_that_cannot_move_answer_501_with_the_reason(monkeypatch):
    """A server that cannot move says why, with a 501: its configuration."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.server_args import ServerArgs

    from prfaas_sglang.hooks.cache_move_hook import install_routes, unsupported_reason

    assert {"disaggregation_mode", "disaggregation_transfer_backend", "tp_size", "pp_size", "dp_size",
            "api_key"} <= set(inspect.signature(ServerArgs).parameters)  # what the reason reads, on either release
    port_args = SimpleNamespace(scheduler_input_ipc_name="ipc:///tmp/x")
    args = SimpleNamespace(disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake_tcp",
                           tp_size=2, pp_size=1, dp_size=1)
    able = unsupported_reason(SimpleNamespace(**{**vars(args), "tp_size": 1}), port_args, "prfaas")
    assert able is None
    assert "tp, pp and dp size 1" in unsupported_reason(args, port_args, "prfaas")
    assert "prefill worker" in unsupported_reason(args, port_args, "pd-decode")
    assert "ipc" in unsupported_reason(SimpleNamespace(**{**vars(args), "tp_size": 1}),
                                       SimpleNamespace(scheduler_input_ipc_name="tcp://10.0.0.1:5"), "prfaas")
    app = FastAPI()
    install_routes(app, args, port_args, "prfaas")
    r = TestClient(app).post("/prfaas/cache/import", json={})
    assert r.status_code == 501 and "tp, pp and dp size 1" in r.json()["error"]["message"]


def test_the_routes_hook_adds_them_to_sglangs_app_for_prefill_roles_only(monkeypatch):
    from sglang.srt.entrypoints import http_server

    from prfaas_sglang.hooks.cache_move_hook import add_routes

    def paths():
        return [r.path for r in http_server.app.routes if getattr(r, "path", "").startswith("/prfaas/cache/")]

    monkeypatch.setattr(http_server.app.router, "routes", list(http_server.app.router.routes))  # undone after
    args = SimpleNamespace(disaggregation_mode="decode", disaggregation_transfer_backend="mooncake", tp_size=1, pp_size=1, dp_size=1)
    port_args = SimpleNamespace(scheduler_input_ipc_name="ipc:///tmp/x")
    monkeypatch.setenv("PRFAAS_ROLE", "pd-decode")
    monkeypatch.delenv("PRFAAS_SECRET_FILE", raising=False)
    infos = [{}]
    add_routes(args, None, None, port_args, infos, None)
    assert paths() == [] and infos == [{}]
    monkeypatch.setenv("PRFAAS_ROLE", "pd-prefill")
    add_routes(args, None, None, port_args, infos, None)
    assert paths() == ["/prfaas/cache/import", "/prfaas/cache/export"]
    assert infos[0]["prfaas_cache_move"]["served"] is False and "prefill" in infos[0]["prfaas_cache_move"]["reason"]


def _key(tokens: list[int]):
    """A prefix cache's key for ``tokens`` as a server keys a request (``array('q')`` on both releases;
    a list key fails 0.5.15's match against it: the harness's cache-move check found that)."""
    from prfaas_sglang.hooks.cache_import import request_key

    return request_key(tokens)


def _matched_rows(cache, tokens: list[int]) -> torch.Tensor:
    """The KV buffer rows of what ``cache`` matches of ``tokens`` (SGLang 0.5.23: from the matched node
    id, translated; 0.5.15: the match's own indices)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    match = cache.match_prefix(MatchPrefixParams(key=_key(tokens)))
    if not installed_has(UNIFIED_TREE):
        return match.device_indices
    indices = cache.path_device_indices(match.last_device_node)
    return cache.token_to_kv_pool_allocator.translate_kv_indices_for_transfer(indices)


def _cached(cache) -> tuple[int, ...]:
    """(tokens, state slots) the tree holds; (tokens,) for a full-attention 0.5.15 tree."""
    size = cache.total_size()
    return size if isinstance(size, tuple) else (size,)


def test_a_full_attention_prefix_moves_with_its_bytes_and_a_partly_held_one_frees_its_duplicates():
    """SGLang's own tree for a full-attention model (0.5.15's ``RadixCache``, 0.5.23's unified tree on
    its Rust core; page 4, two MHA layers): no state travels; a target that already holds the first
    page keeps it and takes the rest, with no page leaked (on 0.5.23 the tree frees the duplicate)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    from prfaas_sglang.bench.sglang_cpu import cpu_full_cache
    from prfaas_sglang.hooks.cache_import import export_prefix, import_prefix, message_bound_bytes
    from prfaas_sglang.wire import prefix_transfer

    def build():
        return cpu_full_cache(4, 64, events=False, kv_buffers=True)

    def cache_with_data(built, tokens, seed):
        gen = torch.Generator().manual_seed(seed)
        indices = built.kv.alloc(len(tokens))
        for buf in built.kv_pool.k_buffer + built.kv_pool.v_buffer:
            buf[indices] = torch.randn(buf[indices].shape, generator=gen).to(buf.dtype)
        built.cache.insert(InsertParams(key=_key(tokens), value=indices))

    def rows(built, tokens):
        idx = _matched_rows(built.cache, tokens)
        return len(idx), [buf[idx].clone() for buf in built.kv_pool.k_buffer + built.kv_pool.v_buffer]

    source, target = build(), build()
    tokens = list(range(10, 22))  # three pages
    cache_with_data(source, tokens, seed=1)
    transfer = export_prefix(source.cache, tokens + [5])
    assert transfer.token_ids == tokens and transfer.state == []
    payload = prefix_transfer.encode(transfer)
    assert len(payload) <= message_bound_bytes(target.cache, len(tokens))
    cache_with_data(target, tokens[:4], seed=2)  # the target holds the first page already (other bytes)
    assert import_prefix(target.cache, prefix_transfer.decode(payload)) == 8
    n_src, rows_src = rows(source, tokens)
    n_dst, rows_dst = rows(target, tokens)
    assert n_src == n_dst == 12
    assert all(torch.equal(a[4:], b[4:]) for a, b in zip(rows_src, rows_dst, strict=True))  # the moved pages
    assert target.kv.available_size() + _cached(target.cache)[0] == 64


def _random_transfer(cache, tokens: list[int], seed: int):
    """A message of ``tokens`` shaped for ``cache``'s pools, with random KV rows and state."""
    from prfaas_sglang.bench.sglang_cpu import random_prefix_transfer

    return random_prefix_transfer(cache, tokens, torch.Generator().manual_seed(seed))


def test_a_hybrid_prefix_moves_with_its_state_and_evicts_for_a_slot_when_every_one_is_taken():
    """The ``prfaas-hybrid`` tree of the installed SGLang (page 1, the tiny Mamba layout): the target's
    every state slot holds another prefix, so the import evicts one; the target then reuses the whole
    prefix with the source's KV rows and state, bit for bit, and neither pages nor slots leak."""
    from prfaas_sglang.bench.sglang_cpu import cpu_prefill_hybrid_cache
    from prfaas_sglang.hooks.cache_import import (
        _kv_buffers,
        export_prefix,
        import_prefix,
        usable_prefix_tokens,
    )

    kv_tokens, slots = 64, 3
    source, target = (cpu_prefill_hybrid_cache(1, kv_tokens, slots, events=False) for _ in range(2))
    tokens = list(range(40, 52))
    assert import_prefix(source.cache, _random_transfer(source.cache, tokens, 1)) == 12
    for i in range(slots):  # the target's slots all taken
        import_prefix(target.cache, _random_transfer(target.cache, list(range(100 + 10 * i, 105 + 10 * i)), 2 + i))
    assert target.req_pool.mamba_allocator.available_size() == 0
    moved = export_prefix(source.cache, tokens + [9])
    assert moved.token_ids == tokens and moved.state
    assert import_prefix(target.cache, moved) == 12
    assert usable_prefix_tokens(target.cache, tokens) == 12
    again = export_prefix(target.cache, tokens)
    assert [b.data for b in again.kv + again.state] == [b.data for b in moved.kv + moved.state]
    rows_src, rows_dst = _matched_rows(source.cache, tokens), _matched_rows(target.cache, tokens)
    assert all(torch.equal(buf[rows_src], other[rows_dst]) for (_, buf), (_, other)
               in zip(_kv_buffers(source.cache), _kv_buffers(target.cache), strict=True))
    for built in (source, target):
        tokens_held, slots_held = _cached(built.cache)
        assert built.kv.available_size() + tokens_held == kv_tokens
        assert built.req_pool.mamba_allocator.available_size() + slots_held == slots
    assert import_prefix(target.cache, moved) == 0  # held already: nothing allocated


@pytest.mark.skipif(not installed_has(UNIFIED_TREE), reason="SGLang 0.5.15 has no unified tree")
def test_a_unified_tree_a_move_cannot_carry_refuses_it_before_reading_or_allocating(monkeypatch):
    """What a move would leave behind (int8 Mamba checkpoints, replayed-SSM tensors, a sliding-window
    component) refuses export and import alike, naming it; the pools are untouched."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from prfaas_sglang.bench.sglang_cpu import cpu_prefill_hybrid_cache
    from prfaas_sglang.hooks.cache_import import UnsupportedTree, export_prefix, import_prefix

    built = cpu_prefill_hybrid_cache(1, 32, 2, events=False)
    tokens = list(range(60, 68))
    import_prefix(built.cache, _random_transfer(built.cache, tokens, 1))
    other = _random_transfer(built.cache, list(range(80, 84)), 2)
    free = (built.kv.available_size(), built.req_pool.mamba_allocator.available_size())
    state = built.req_pool.mamba_pool.mamba_cache
    for setting, named in (
            (lambda: monkeypatch.setattr(built.req_pool, "mamba_ckpt_pool", object(), raising=False), "int8 Mamba"),
            (lambda: monkeypatch.setattr(built.req_pool.mamba_pool, "mamba_cache",
                                         dataclasses.replace(state, replayssm_d=torch.zeros(1))), "replayssm"),
            (lambda: monkeypatch.setitem(built.cache.components, ComponentType.SWA, object()), "sliding-window")):
        with monkeypatch.context():
            setting()
            with pytest.raises(UnsupportedTree, match=named):
                export_prefix(built.cache, tokens)
            with pytest.raises(UnsupportedTree, match=named):
                import_prefix(built.cache, other)
        monkeypatch.undo()
    assert (built.kv.available_size(), built.req_pool.mamba_allocator.available_size()) == free
    assert export_prefix(built.cache, tokens).token_ids == tokens  # the same tree moves once nothing stands in the way
