"""Layer-wise KV streaming inside SGLang's Mooncake backend, on CPU: when does the decode have the KV?

``python -m prfaas_sglang.bench layerwise`` runs :func:`rounds` (below) in a subprocess inside a
network namespace whose loopback ``tbf`` shapes at ``--rate-mbit``: SGLang 0.5.15's own bootstrap
server, prefill and decode ``MooncakeKVManager`` s over real KV pools (``MHATokenToKVPool`` on CPU,
registered in Mooncake's TCP transfer engine), ``MooncakeKVSender`` / ``MooncakeKVReceiver``, and
SGLang's scheduling code (``send_kv_chunk`` of the prefill mixin, real ``Req`` and ``ReqToTokenPool``),
with our plugin's hooks. The forward is emulated: each layer's KV is written with the pool's
``set_kv_buffer``, announced through the ``kv-layerwise`` hooks, then the layer "computes" for
``forward_s / layers`` (a sleep). Measured per request: from the forward's start to the decode's
``KVPoll.Success``, with ``PRFAAS_KV_LAYERWISE`` on and off (the launcher's PrfaaS profile
otherwise: asynchronous sends), in alternation. Off, the whole chunk is sent after the forward:
``forward + transfer``; on, layer ``i`` is sent while layers ``i+1..`` compute: about
``max(forward, transfer) + one layer's transfer``. Needs root (namespace, tc).

:func:`rounds` is also the CPU test's probe (``tests/transport/sglang_mooncake_probe.py``), there
with ``wait_each_layer``: each layer must land on the decode before the next is written.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import types
from array import array

import numpy as np

from prfaas_sglang._compat.accessors import set_chunk, set_pool_row
from prfaas_sglang.bench.subcommands import Invocation, Subcommand
from prfaas_sglang.bench.zygote import Zygote

N_AUX, AUX_BYTES = 4, 64


def make_kv_args(kv_ptrs: list[int], kv_lens: list[int], kv_item_lens: list[int], aux: np.ndarray):
    """SGLang's ``KVArgs`` for one CPU rank over host buffers (K per layer, then V) and one aux buffer of
    ``AUX_BYTES`` rows, page size 1: what a model runner would register in the transfer engine."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = list(kv_ptrs), list(kv_lens), list(kv_item_lens)
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.ctypes.data], [aux.nbytes], [aux.shape[-1]]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens, a.state_dim_per_tensor = [], [], [], [], []
    a.ib_device, a.ib_traffic_class, a.gpu_id = None, None, 0
    a.kv_head_num = a.total_kv_head_num = 1
    a.page_size = 1
    a.system_dp_rank, a.pp_rank, a.prefill_start_layer, a.prefill_end_layer = 0, 0, 0, None
    a.mla_compression_ratios = None
    # What 0.5.23's managers also read (0.5.15 ignores them): an MHA pool's, as its model runner sets them
    # (no layer ids: the peers pair buffers by position; no host mirror, no hybrid state, no draft).
    a.kv_layer_ids, a.kv_cache_dtype_str, a.kv_layout = [], "auto", None
    a.host_kv_data_ptrs = a.host_kv_data_lens = a.host_kv_item_lens = None
    a.host_state_data_ptrs = a.host_state_data_lens = a.host_state_item_lens = None
    a.state_layer_ids, a.state_slice_outer_counts, a.state_conv_shard_groups = [], [], []
    a.is_hybrid_mla_backend, a.swa_kv_cache_layout, a.rust_http_port = False, None, None
    a.kv_buf_groups, a.hidden_kv_layers, a.draft_kv_layers, a.num_draft_entries = 1, 0, 0, 0
    return a


def single_rank_state() -> None:
    """What a model runner sets up and SGLang's Mooncake managers read: parallel groups of one rank
    (attention TP, CP and PP) and attention DP rank 0 of 1. Imports SGLang."""
    import sglang.srt.distributed.parallel_state as ps
    import sglang.srt.layers.dp_attention as dpa

    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    ps._ATTN_TP = ps._ATTN_CP = ps._PP = group
    dpa._ATTN_DP_RANK, dpa._ATTN_DP_SIZE = 0, 1


def manager_server_args(host: str, boot_port: int, **extra):
    """The server arguments SGLang's Mooncake KV managers read, for one rank whose bootstrap server is
    ``host:boot_port`` (``extra`` adds or overrides)."""
    return types.SimpleNamespace(**{
        "host": host, "port": 30000, "disaggregation_bootstrap_port": boot_port, "dist_init_addr": None, "nnodes": 1,
        "enable_dp_attention": False, "dp_size": 1, "pp_size": 1, "kv_cache_dtype": "auto",
        "load_balance_method": "round_robin", "enable_trace": False, "chunked_prefill_size": 8192, **extra})


def published_server_args(boot_port: int, host: str = "127.0.0.1", mode: str = "prefill"):
    """0.5.23: the managers read a real ``ServerArgs`` and the serving config from the process's published
    runtime context (as the scheduler process publishes it), so one is built (for the repository's tiny
    hybrid model, disaggregation ``mode``) and published; None on 0.5.15, whose managers read only the arguments given
    (:func:`manager_server_args`)."""
    from prfaas_sglang._compat import publishes_runtime_context

    if not publishes_runtime_context():
        return None
    from pathlib import Path
    from unittest import mock

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    tiny = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models" / "tiny-qwen3-next"
    with mock.patch.dict(os.environ):  # resolving exports defaults for the server's processes
        args = ServerArgs(model_path=str(tiny), device="cpu", host=host, port=30000,
                          disaggregation_bootstrap_port=boot_port, disaggregation_mode=mode,
                          disaggregation_transfer_backend="mooncake", mamba_radix_cache_strategy="no_buffer",
                          disable_overlap_schedule=True, served_model_name="probe",
                          enable_metrics="PROMETHEUS_MULTIPROC_DIR" in os.environ)
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0, gpu_id=0))
    group = types.SimpleNamespace(world_size=1, rank_in_group=0)  # the groups a model runner would build
    runtime_context.get_parallel().override_permanently(
        **{name: group for name in ("tp_group", "pp_group", "attn_tp_group", "attn_cp_group")})
    return args


def _kv_args(pool, aux: np.ndarray):
    return make_kv_args(*pool.get_contiguous_buf_infos(), aux)


def _wait(obj, want, timeout_s: float = 60.0):
    end = time.time() + timeout_s
    while time.time() < end:
        if obj.poll() in want:
            return obj.poll()
        time.sleep(0.001)
    return obj.poll()


def new_sender(mgr, addr: str, room: int):
    """SGLang's ``MooncakeKVSender`` for ``room``: 0.5.15's takes the destination TP ranks and PP rank too
    (one rank: ``[0], 0``). On 0.5.23 its GPU index path (pinned memory, a CUDA event) is off: on CPU the
    scheduler takes its other path, which every sender without host-tensor indices takes."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    placement = ([0], 0) if "dest_tp_ranks" in inspect.signature(MooncakeKVSender).parameters else ()
    sender = MooncakeKVSender(mgr, addr, room, *placement)
    if getattr(sender, "supports_host_tensor_indices", False):
        sender.supports_host_tensor_indices = False
    return sender


def open_room(prefill, decode, addr: str, room: int, dst_pages: np.ndarray):
    """SGLang's bootstrap for ``room``: a sender on ``prefill``, a receiver on ``decode`` that registers
    ``dst_pages`` (aux row ``room % N_AUX``); returns both once the sender waits for input (or failed)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    sender = new_sender(prefill, addr, room)
    receiver = MooncakeKVReceiver(decode, addr, room)
    while not decode.try_ensure_parallel_info(addr):
        time.sleep(0.05)
    receiver.init(0)
    receiver.send_metadata(dst_pages, aux_index=room % N_AUX)
    _wait(sender, (KVPoll.WaitingForInput, KVPoll.Failed))
    return sender, receiver


def rounds(boot_port: int, server_args, requests: int = 3, tokens: int = 192, chunk: int = 64, layers: int = 4,
           heads: int = 4, head_dim: int = 64, forward_s: float = 0.0, wait_each_layer: bool = False,
           fragmented: bool = True) -> dict:
    """``requests`` requests of ``tokens`` tokens in ``chunk``-token chunks, prefilled layer by layer and
    sent through SGLang; the caller has set up SGLang's process state (parallel groups, Mooncake engine).
    ``fragmented``: both sides' slots in random order (one write per token and layer), else contiguous
    (one write per chunk and layer, as a fresh pool allocates)."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer, MooncakeKVManager
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from prfaas_sglang.hooks.layerwise_hook import layer_written, stream_forward, streamer_of

    slots = 2 * tokens + 2
    p_pool = MHATokenToKVPool(slots, 1, torch.bfloat16, heads, head_dim, layers, "cpu", False)
    d_pool = MHATokenToKVPool(slots, 1, torch.bfloat16, heads, head_dim, layers, "cpu", False)
    MooncakeKVBootstrapServer("127.0.0.1", boot_port)
    time.sleep(0.3)
    p_aux = np.full((N_AUX, AUX_BYTES), 0xAB, dtype=np.uint8)
    d_aux = np.zeros((N_AUX, AUX_BYTES), dtype=np.uint8)
    prefill = MooncakeKVManager(_kv_args(p_pool, p_aux), DisaggregationMode.PREFILL, server_args, False)
    decode = MooncakeKVManager(_kv_args(d_pool, d_aux), DisaggregationMode.DECODE, server_args, False)
    streamer = streamer_of(prefill)

    class Scheduler(SchedulerDisaggregationPrefillMixin):
        pass

    req_pool = ReqToTokenPool(4, tokens + 1, "cpu", False)
    sched = Scheduler()
    sched.disaggregation_mode, sched.enable_staging = DisaggregationMode.PREFILL, False
    sched.req_to_token_pool = req_pool
    sched.token_to_kv_pool_allocator = types.SimpleNamespace(  # 0.5.23 asks for transfer ids: a static pool's
        page_size=1, get_kvcache=lambda: p_pool, translate_kv_indices_for_transfer=lambda ids: ids)
    # what SGLang 0.5.23's send path also reads (no overlap, no checksum, its chunk bookkeeping)
    sched.enable_overlap, sched.kv_checksum_computer, sched.disagg_prefill_pending_chunk_rids = False, None, set()
    sched.disagg_metadata_buffers = types.SimpleNamespace(set_buf=lambda req: None)
    sched.disagg_prefill_bootstrap_queue = types.SimpleNamespace(kv_manager=prefill)
    # As SGLang's model runner runs a forward: the batch names no KV pool, the forward context does.
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    forward_batch = types.SimpleNamespace()
    context = ForwardContext(attn_backend=types.SimpleNamespace(token_to_kv_pool=p_pool))
    layer_objs = [types.SimpleNamespace(layer_id=i, k_scale=None, v_scale=None) for i in range(layers)]
    addr = f"127.0.0.1:{boot_port}"
    rng = np.random.default_rng(5)
    results = []
    for room in range(1, requests + 1):
        for buf in d_pool.k_buffer + d_pool.v_buffer:
            buf.zero_()
        order = rng.permutation if fragmented else (lambda x: x)
        src = torch.from_numpy(order(np.arange(1, slots))[:tokens].astype(np.int64))
        dst = order(np.arange(1, slots))[:tokens].astype(np.int32)
        sender, receiver = open_room(prefill, decode, addr, room, dst)
        sender.init(tokens, aux_index=1)
        req = Req(rid=f"r{room}", origin_input_text="", origin_input_ids=array("q", range(tokens)),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.start_send_idx, req.pending_bootstrap = 0, False
        set_pool_row(req, 0)
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.disagg_kv_sender = sender
        req_pool.req_to_token[0, :tokens] = src.to(torch.int32)
        batch = types.SimpleNamespace(reqs=[req], forward_mode=types.SimpleNamespace(is_extend=lambda: True))
        landed_in_order = True
        started = time.perf_counter()
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            set_chunk(req, start, end)
            locs = src[start:end]
            got = torch.from_numpy(dst[start:end].astype(np.int64))

            def forward(_sched, _batch, locs=locs, got=got, room=room):
                with forward_context(context):
                    layers_forward(locs, got, room)
                return None

            def layers_forward(locs, got, room):
                nonlocal landed_in_order
                for i, layer in enumerate(layer_objs):
                    value = float(room * 16 + i + 1)
                    k = torch.full((len(locs), heads, head_dim), value, dtype=torch.bfloat16)
                    p_pool.set_kv_buffer(layer, locs, k, -k)
                    layer_written(None, layer, None, None, None, forward_batch)
                    if wait_each_layer:  # the layer must reach the decode before the next is written
                        deadline = time.time() + 10
                        while not bool((d_pool.k_buffer[i][got] == value).all()) and time.time() < deadline:
                            time.sleep(0.002)
                        landed_in_order &= bool((d_pool.k_buffer[i][got] == value).all())
                        if i + 1 < layers:
                            landed_in_order &= not bool((d_pool.k_buffer[i + 1][got] != 0).any())
                    if forward_s:
                        time.sleep(forward_s / layers)

            stream_forward(forward, sched, batch)
            sched.send_kv_chunk(req, last_chunk=end >= tokens)
        forward_done = time.perf_counter()
        states = (_wait(sender, (KVPoll.Success, KVPoll.Failed)), _wait(receiver, (KVPoll.Success, KVPoll.Failed)))
        landed = time.perf_counter()
        dst_t = torch.from_numpy(dst.astype(np.int64))
        intact = all(bool((d[dst_t] == p[src]).all())
                     for p, d in zip(p_pool.k_buffer + p_pool.v_buffer, d_pool.k_buffer + d_pool.v_buffer, strict=True))
        results.append({"room": room, "sender": int(states[0]), "receiver": int(states[1]), "kv_intact": intact,
                        "aux_intact": bool((d_aux[room % N_AUX] == p_aux[1]).all()),
                        "layer_landed_before_next_written": landed_in_order,
                        "forward_s": forward_done - started, "kv_landed_s": landed - started})
        sender.clear()
        receiver.clear()
    async_sender = getattr(prefill, "_prfaas_sender", None)
    if async_sender is not None:
        async_sender.settle(10.0)
    return {"requests": results, "success": int(KVPoll.Success), "failed": int(KVPoll.Failed),
            "layerwise": None if streamer is None else {
                "streamed_bytes": streamer.streamed_bytes, "unplanned_bytes": streamer.unplanned_bytes,
                "layers_streamed": streamer.layers_streamed, "open_chunks": streamer.ledger.open_chunks(),
                "forwards_without_layers": streamer.forwards_without_layers},
            "kv_bytes_total": requests * tokens * sum(_kv_args(p_pool, p_aux).kv_item_lens),
            "async": None if async_sender is None else {
                "batches": async_sender.batches_submitted, "writes": async_sender.writes_submitted,
                "writes_failed": async_sender.writes_failed, "in_flight_bytes": async_sender.ledger.in_flight_bytes()},
            "prefill_rooms_left": sorted(prefill.request_status), "decode_rooms_left": sorted(decode.request_status),
            "transfer_infos_left": sorted(prefill.transfer_infos)}


# --- the benchmark ----------------------------------------------------------------------------


def _probe_main() -> None:
    """``python -m prfaas_sglang.bench.layerwise_bench PROBE_JSON``: SGLang's process state as a model
    runner would set it up, then :func:`rounds`; one JSON line on stdout, then a hard exit (SGLang's
    listener threads are not daemons)."""
    opts = json.loads(sys.argv[1])
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    try:
        from prfaas_sglang.plugin import register

        register()
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        single_rank_state()
        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        server_args = published_server_args(opts["boot_port"]) or manager_server_args("127.0.0.1", opts["boot_port"])
        out = rounds(opts["boot_port"], server_args, opts["requests"], opts["tokens"], opts["chunk"], opts["layers"],
                     opts["heads"], opts["head_dim"], opts["forward_s"], fragmented=False)
        print(json.dumps(out), flush=True)
    except BaseException as err:  # noqa: BLE001 - report, then hard-exit
        print(json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
    sys.stdout.flush()
    os._exit(0)


def run(rate_mbit: float = 400.0, forward_s: float = 0.3, tokens: int = 2048, chunk: int = 2048, layers: int = 8,
        heads: int = 2, head_dim: int = 128, requests: int = 4, repeats: int = 3, zygote: Zygote | None = None) -> dict:
    """Layer-wise off and on, ``repeats`` probe runs each in alternation, in one namespace whose loopback
    is shaped at ``rate_mbit``; per request the time from the forward's start to the decode's Success.

    Each probe run is forked from ``zygote`` (the caller's, left running; None: one of this run's own, stopped at
    its end), which imported SGLang once: a probe started afresh spent about 12 CPU-s importing it."""
    with contextlib.ExitStack() as stack:
        if zygote is None:
            zygote = stack.enter_context(Zygote())
        return _run(zygote, rate_mbit, forward_s, tokens, chunk, layers, heads, head_dim, requests, repeats)


def _run(zygote: Zygote, rate_mbit: float, forward_s: float, tokens: int, chunk: int, layers: int, heads: int,
         head_dim: int, requests: int, repeats: int) -> dict:
    from prfaas_sglang.demo.cluster import free_port
    from prfaas_sglang.launch.command import sglang_command
    from prfaas_sglang.roles import Role
    from prfaas_sglang.topology import Node
    from prfaas_sglang.transport.wan_defaults import WanLink

    ns = f"prfaas-lw{os.getpid() % 1000}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        # Ethernet's MTU: tbf drops a packet larger than its bucket, and loopback's is 64 KiB.
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "mtu", "1500", "up"], check=True,
                       capture_output=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                        f"{rate_mbit}mbit", "burst", "65536b", "latency", "2000ms"], check=True, capture_output=True)
        node = Node(name="prfaas", cluster="c", role=Role.PRFAAS, model_path="unused")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PRFAAS_", "MC_", "SGLANG_ENABLE_FAILED"))}
        base.update(sglang_command(node, sys.executable, {}, link=WanLink(rate_mbit * 1e6, 0.0)).env)
        base.pop("PRFAAS_ROLE", None)  # no role contract to check: there is no SGLang server here
        item_bytes = heads * head_dim * 2
        out = {"rate_mbit": rate_mbit, "forward_s": forward_s, "tokens": tokens, "chunk": chunk, "layers": layers,
               "kv_bytes_per_request": 2 * layers * tokens * item_bytes, "runs": {"off": [], "on": []}}
        for _ in range(repeats):
            for mode in ("off", "on"):
                env = {**base, "PRFAAS_KV_LAYERWISE": "1" if mode == "on" else "0"}
                opts = {"boot_port": free_port(), "requests": requests, "tokens": tokens, "chunk": chunk, "layers": layers,
                        "heads": heads, "head_dim": head_dim, "forward_s": forward_s}
                proc = zygote.run([sys.executable, "-m", "prfaas_sglang.bench.layerwise_bench", json.dumps(opts)],
                                  env=env, wrap=("ip", "netns", "exec", ns), timeout=300)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                result = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
                if "error" in result:
                    raise RuntimeError(f"layerwise probe ({mode}): {result['error']}")
                if (result["layerwise"] is not None) != (mode == "on"):
                    raise RuntimeError(f"layerwise probe ({mode}): streaming was {'off' if mode == 'on' else 'on'}")
                bad = [r for r in result["requests"] if not (r["kv_intact"] and r["sender"] == result["success"])]
                if bad:
                    raise RuntimeError(f"layerwise probe ({mode}): requests failed or arrived corrupt: {bad}")
                out["runs"][mode].append({"kv_landed_s": [r["kv_landed_s"] for r in result["requests"]],
                                          "forward_s": [r["forward_s"] for r in result["requests"]],
                                          "layerwise": result["layerwise"]})
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for mode in ("off", "on"):  # each run's first request also connects the lanes: left out
        landed = [t for run_ in out["runs"][mode] for t in run_["kv_landed_s"][1:]]
        after = [t - f for run_ in out["runs"][mode] for t, f in zip(run_["kv_landed_s"][1:], run_["forward_s"][1:],
                                                                     strict=True)]
        out[f"{mode}_kv_landed_s"] = _spread(landed)
        out[f"{mode}_after_forward_s"] = _spread(after)  # what a request waits for its KV once its forward is done
    out["transfer_s_at_rate"] = out["kv_bytes_per_request"] * 8 / (rate_mbit * 1e6)
    out["on_over_off"] = out["on_kv_landed_s"]["median"] / out["off_kv_landed_s"]["median"]
    out["after_forward_on_over_off"] = out["on_after_forward_s"]["median"] / out["off_after_forward_s"]["median"]
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=400.0,
                        help="the shaped loopback's rate, Mbit/s")
    parser.add_argument("--forward-s", type=float, default=0.3, help="the emulated forward's duration per chunk (wall)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="prompt tokens per request, prefilled as one chunk")
    parser.add_argument("--layers", type=int, default=8,
                        help="layers of the emulated model (the forward split evenly over them)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="probe runs with layer-wise streaming off and on each, in alternation")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON (it does anyway: no Markdown report)")


def cli(args: argparse.Namespace, inv: Invocation) -> int:
    from prfaas_sglang.demo.netns import available

    if args.rate_mbit <= 0 or args.forward_s < 0 or args.tokens < 1 or args.layers < 1 or args.repeats < 1:
        inv.error("--rate-mbit must be > 0, --forward-s >= 0, --tokens, --layers and --repeats >= 1")
    if (why := available()) is not None:
        inv.error(f"the shaped loopback {why}")
    result = run(args.rate_mbit, args.forward_s, args.tokens, args.tokens, args.layers, repeats=args.repeats)
    return inv.report(args, result, None, None)  # no Markdown table: JSON


SUBCOMMANDS = {"layerwise": Subcommand(add_arguments, cli)}


if __name__ == "__main__":
    _probe_main()
