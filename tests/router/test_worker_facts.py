"""Worker facts and load as real SGLang 0.5.15 reports them (its own ServerArgs / GetLoadsReqOutput), and the checks."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import zygote
from helpers import REPO_ROOT

from prfaas_sglang.router.workers import (
    FactsError,
    WorkerRecord,
    check_facts,
    parse_loads,
    parse_server_info,
)
from prfaas_sglang.topology import Emulation
from prfaas_sglang.wire.blocks import HASH_SCHEME

MODEL = REPO_ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3-next"

# /server_info as the installed SGLang's http_server builds it: 0.5.23's build_server_info (the resolved
# arguments, scheduler info, describe_kv_events_publisher); 0.5.15's asdict(server_args) + scheduler info +
# args.describe_kv_events_publisher(). Resolving ServerArgs touches process-global state: run it in a subprocess.
PROBE = textwrap.dedent(f"""
    import dataclasses, json, sys
    import sglang
    from sglang.srt.server_args import ServerArgs
    args = ServerArgs(model_path={str(MODEL)!r}, disaggregation_mode=sys.argv[1], disaggregation_transfer_backend="mooncake_tcp",
                      device="cuda", load_format="dummy", mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True,
                      served_model_name="tiny-hybrid", page_size=int(sys.argv[2]),
                      kv_events_config=json.dumps({{"publisher": "zmq", "endpoint": "tcp://*:5559", "topic": "kv-events"}}))
    scheduler_info = {{"max_total_num_tokens": 123456, "max_req_input_len": 32767}}
    try:
        from sglang.srt.utils.common import build_server_info
    except ImportError:
        info = {{**dataclasses.asdict(args), **scheduler_info, "kv_events": args.describe_kv_events_publisher()}}
    else:
        args.resolve_once()  # 0.5.23 resolves apart from construction; its launcher does it before serving
        info = build_server_info(args, scheduler_info)
    print(json.dumps({{**info, "version": sglang.__version__}}, default=str))
""")


def _probe(mode: str, page_size: int = 64) -> dict:
    proc = zygote.run([sys.executable, "-c", PROBE, mode, str(page_size)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sglang_server_info() -> dict:
    return _probe("decode")


@pytest.mark.slow
def test_real_server_info_parses_to_the_facts_the_router_uses(sglang_server_info):
    facts = parse_server_info(sglang_server_info)
    assert facts.page_size == 64 and facts.kv_events.block_size == 64 and facts.kv_events.port == 5559
    assert facts.kv_events.topic == "kv-events" and facts.served_model_name == "tiny-hybrid"
    assert facts.disaggregation_mode == "decode" and facts.max_total_tokens == 123456
    assert facts.block_hash == HASH_SCHEME and facts.emulated is None  # a real engine states no scheme: SGLang's own
    record = WorkerRecord("d0", "http://h:1", "pd", "decode", "h", None, None)
    assert check_facts(record, facts, [], None) is None
    assert record.kv_events_url is None and WorkerRecord("d0", "http://h:1", "pd", "decode", "h", None, None,
                                                         facts=facts).kv_events_url == "tcp://h:5559"


def test_an_sglang_worker_serves_cache_moves_only_when_its_server_info_says_so(sglang_server_info, monkeypatch):
    """What the cache-move-routes hook adds to the first scheduler's info (merged into /server_info)
    is what the router reads; a stock server, or one that cannot move, is not asked to."""
    from types import SimpleNamespace

    from sglang.srt.entrypoints import http_server

    from prfaas_sglang.hooks.cache_move_hook import add_routes

    assert parse_server_info(sglang_server_info).cache_import is False  # a stock SGLang server
    monkeypatch.setattr(http_server.app.router, "routes", list(http_server.app.router.routes))  # undone after
    monkeypatch.setenv("PRFAAS_ROLE", "pd-prefill")
    monkeypatch.delenv("PRFAAS_SECRET_FILE", raising=False)
    port_args = SimpleNamespace(scheduler_input_ipc_name="ipc:///tmp/x")
    for tp_size, served in ((1, True), (2, False)):
        args = SimpleNamespace(disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake_tcp",
                               tp_size=tp_size, pp_size=1, dp_size=1)
        scheduler_infos = [{"max_total_num_tokens": 123456}]
        add_routes(args, None, None, port_args, scheduler_infos, None)
        info = {**sglang_server_info, **scheduler_infos[0]}  # as /server_info merges them
        assert parse_server_info(info).cache_import is served
    assert parse_server_info({**sglang_server_info, "prfaas_cache_move": {"v": 2, "served": True}}).cache_import is False


def test_real_loads_parse():
    """The body SGLang's /v1/loads builds per DP rank: 0.5.15 ``LoadSnapshot.from_get_loads_output(GetLoadsReqOutput)
    .to_dict(include)``; 0.5.23 the scheduler's ``LoadSnapshot`` itself, ``.to_dict(include)``."""
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    fields = dict(timestamp=0.0, num_running_reqs=3, num_waiting_reqs=1, num_waiting_uncached_tokens=900,
                  num_used_tokens=5000, num_total_tokens=6000, max_total_num_tokens=100_000, token_usage=0.05,
                  gen_throughput=10.0, cache_hit_rate=0.0, utilization=0.1, max_running_requests=64)
    if hasattr(io_struct, "GetLoadsReqOutput"):  # 0.5.15
        ranks = [LoadSnapshot.from_get_loads_output(io_struct.GetLoadsReqOutput(dp_rank=r, **fields)) for r in range(2)]
    else:
        ranks = [LoadSnapshot(dp_rank=r, **fields) for r in range(2)]
    load = parse_loads(json.loads(json.dumps({"timestamp": "x", "version": "0.5.15", "loads": [r.to_dict(None) for r in ranks]})))
    assert (load.running, load.waiting, load.used_tokens, load.max_total_tokens, load.waiting_uncached_tokens) == (6, 2, 10_000, 200_000, 1800)


@pytest.mark.parametrize("body", [None, [], {"loads": []}, {"loads": [{"num_running_reqs": -1}]}, {"loads": ["x"]}])
def test_bad_loads_are_typed_errors(body):
    with pytest.raises(FactsError):
        parse_loads(body)


@pytest.mark.parametrize("info", [None, [], {}, {"page_size": 0}, {"page_size": "64"},
                                  {"kv_events": {"endpoint_port_base": 5557, "block_size": -1}}])
def test_bad_server_info_is_a_typed_error(info):
    with pytest.raises(FactsError):
        parse_server_info(info)


def facts(page=512, mode="prefill", emulated=None, scheme=None):
    info = {"page_size": page, "disaggregation_mode": mode}
    if emulated is not None:
        info["prfaas"] = {"engine": "mock", "speedup": emulated[0], "kv_scale": emulated[1], **({"block_hash": scheme} if scheme else {})}
    return parse_server_info(info)


def record(name, cluster="pd", role="prefill", f=None):
    return WorkerRecord(name, "http://h:1", cluster, role, "h", 1, None, facts=f)


@pytest.mark.parametrize("candidate, peers, emulation, problem", [
    (facts(mode="decode"), [], None, "runs --disaggregation-mode decode"),
    (facts(page=256), [record("b", f=facts(page=512))], None, "page size 256 of a differs from 512 of b"),
    (facts(emulated=(20, 0.01)), [], Emulation(10, 0.01), "emulated engine at speedup 20"),
    (facts(emulated=(20, 0.01), scheme="md5"), [], Emulation(20, 0.01), "hashes KV blocks with 'md5'"),
    (facts(emulated=(1.0, 1.0)), [record("b", f=facts())], None, "mix emulated and real engines"),
])
def test_facts_that_contradict_the_deployment_are_refused(candidate, peers, emulation, problem):
    assert problem in check_facts(record("a"), candidate, peers, emulation)


@pytest.mark.slow
def test_a_hybrid_sglang_worker_must_run_under_a_cost_model_with_linear_state(sglang_server_info):
    """SGLang's own /server_info of the tiny Qwen3-Next prefill says uses_mamba_radix_cache; under a
    cost model without linear-attention state the kv-index would predict reuse SGLang cannot give, so
    the worker is refused, naming the setting to change. Under a linear-attention cost model it is
    adopted. Its decode keeps no prefix cache and says False: not checked."""
    assert sglang_server_info["disable_radix_cache"] is True and sglang_server_info["uses_mamba_radix_cache"] is False
    assert parse_server_info(sglang_server_info).linear_state is None
    hybrid = parse_server_info(_probe("prefill", page_size=1))  # SGLang's no_buffer Mamba cache: pages of one
    assert hybrid.linear_state is True
    worker = WorkerRecord("p0", "http://h:1", "pd", "prefill", "h", None, None)
    for cost_state in ("none", "swa"):
        assert "model.cost_model" in check_facts(worker, hybrid, [], None, cost_state)
    for cost_state in ("recurrent", "recurrent+swa", None):
        assert check_facts(worker, hybrid, [], None, cost_state) is None


@pytest.mark.parametrize("linear_state, cost_state, refused", [
    (False, "recurrent", True),  # a dense model under a linear-attention hybrid's cost model: reuse underpredicted
    (False, "swa", False), (False, "recurrent+swa", False), (False, "none", False),  # SWA models have no Mamba cache
    (None, "recurrent", False), (None, "none", False),  # a worker that does not say (older SGLang, emulated engine)
])
def test_a_worker_without_linear_state_is_refused_only_under_a_linear_attention_cost_model(linear_state, cost_state, refused):
    info = {"page_size": 1, "disaggregation_mode": "prefill", "disable_radix_cache": False}
    if linear_state is not None:
        info["uses_mamba_radix_cache"] = linear_state
    problem = check_facts(record("a"), parse_server_info(info), [], None, cost_state)
    assert (problem is not None) == refused
    assert problem is None or "linear-attention hybrid" in problem


def test_the_cost_models_state_kind_comes_from_its_layers():
    from prfaas_sglang.plan.scenario import Catalog
    from prfaas_sglang.runtime import state_kind

    catalog = Catalog()
    assert state_kind(catalog.model("kimi-linear-1t-hybrid", "m")) == "recurrent"
    assert state_kind(catalog.model("qwen3-235b-a22b", "m")) == "none"
    assert state_kind(catalog.model("mimo-v2-flash", "m")) == "swa"


def test_page_sizes_may_differ_between_clusters():
    assert check_facts(record("a", cluster="prfaas"), facts(page=256), [record("b", f=facts(page=512))], None) is None
