"""SGLang 0.5.15's own Mooncake KV classes on CPU, with our plugin's hooks installed (run as a subprocess).

Real objects: ``MooncakeKVBootstrapServer``, a prefill and a decode ``MooncakeKVManager`` (host numpy
buffers registered in Mooncake's transfer engine, TCP), ``MooncakeKVSender`` / ``MooncakeKVReceiver``.
What is stubbed is what a model runner would set up: the parallel groups (world size 1) and the
process's Mooncake engine (``init_mooncake_transfer_engine``). Prints one JSON line and hard-exits
(SGLang's listener threads are not daemons and there is no shutdown API).

Environment: PRFAAS_ROLE / PRFAAS_TELEMETRY_PORT / PRFAAS_KV_ASYNC_SEND / PRFAAS_KV_LAYERWISE as the
launcher or an operator sets them; PROBE_LAYERWISE=1 runs :func:`main_layerwise` instead of :func:`main`, PROBE_ABORT=1 :func:`main_abort`;
BOOT_PORT; PROBE_DECODE_RESERVE_PAGES (see below); PROBE_DST=contiguous: each room's decode pages are one run (else random, as the source's);
FAIL_ROOM (optional): that room's KV is sent to a Mooncake session nobody listens on
(``127.0.0.1:1``, with the real decode's registration), so the transfer engine refuses it; SGLang
then fails the room on both sides and blacklists that session, not the real one.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("SGLANG_DISAGGREGATION_QUEUE_SIZE", "1")
os.environ.setdefault("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "1")

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from prfaas_sglang.bench.layerwise_bench import (  # noqa: E402
    make_kv_args,
    manager_server_args,
    open_room,
    published_server_args,
    single_rank_state,
)
from prfaas_sglang.plugin import register  # noqa: E402

register()  # what SGLang's plugin loader does in every server process; raises if a hook fails

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # noqa: E402
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # noqa: E402
    init_mooncake_transfer_engine,
)

from prfaas_sglang.transport.kv_send import FAILED, PENDING  # noqa: E402
from prfaas_sglang.wire.telemetry import TELEMETRY_TOPIC, LinkSample  # noqa: E402

single_rank_state()
init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)


BOOT_PORT = int(os.environ["BOOT_PORT"])
SERVER_ARGS = published_server_args(BOOT_PORT) or manager_server_args(  # PROMETHEUS_MULTIPROC_DIR given: SGLang's --enable-metrics, as its launcher sets it up
    "127.0.0.1", BOOT_PORT, enable_metrics="PROMETHEUS_MULTIPROC_DIR" in os.environ, served_model_name="probe",
    model_path="/m")
NUM_LAYERS, NUM_PAGES, PAGE_BYTES, N_AUX, AUX_BYTES = 4, 256, 64 << 10, 4, 64  # 128 MiB of KV per side
# PROBE_DECODE_RESERVE_PAGES=N: N more pages per buffer, the decode's KV reserve (hooks/decode_stage.py), as
# the decode-staging-start hook would set aside from a fresh pool; rooms draw their pages from the first 256
RESERVE_PAGES = int(os.environ.get("PROBE_DECODE_RESERVE_PAGES", "0"))
USED_PAGES, NUM_PAGES = NUM_PAGES, NUM_PAGES + RESERVE_PAGES
DEAD_SESSION = "127.0.0.1:1"


def kv_args(fill: bool):
    bufs = [np.zeros((NUM_PAGES, PAGE_BYTES), dtype=np.uint8) for _ in range(2 * NUM_LAYERS)]  # K0..Kn, V0..Vn
    if fill:
        for i, b in enumerate(bufs):
            b[:] = ((np.arange(NUM_PAGES)[:, None] * 7 + i * 31) % 251).astype(np.uint8)
    aux = np.full((N_AUX, AUX_BYTES), 0xAB if fill else 0, dtype=np.uint8)
    a = make_kv_args([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [PAGE_BYTES] * len(bufs), aux)
    return a, bufs, aux


def wait(obj, want, timeout_s=30.0):
    end = time.time() + timeout_s
    while time.time() < end:
        if obj.poll() in want:
            return obj.poll()
        time.sleep(0.005)
    return obj.poll()


def managers():
    """SGLang's bootstrap server and a prefill and a decode Mooncake manager over fresh buffers (the prefill's
    filled): ``(prefill, decode, (p_args, p_bufs, p_aux), (d_args, d_bufs, d_aux))``."""
    MooncakeKVBootstrapServer("127.0.0.1", BOOT_PORT)
    time.sleep(0.3)
    p, d = kv_args(True), kv_args(False)
    prefill = MooncakeKVManager(p[0], DisaggregationMode.PREFILL, SERVER_ARGS, False)
    decode = MooncakeKVManager(d[0], DisaggregationMode.DECODE, SERVER_ARGS, False)
    return prefill, decode, p, d


def main() -> dict:
    sub = None
    if os.environ.get("PRFAAS_TELEMETRY_PORT"):
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TELEMETRY_TOPIC)
        sub.connect(f"tcp://127.0.0.1:{os.environ['PRFAAS_TELEMETRY_PORT']}")
    prefill, decode, (_, p_bufs, p_aux), (d_args, d_bufs, d_aux) = managers()
    reserve = None
    if RESERVE_PAGES:
        from prfaas_sglang.hooks.decode_stage import DecodeStaging, attach

        reserve = DecodeStaging(zip(d_args.kv_data_ptrs, d_args.kv_data_lens, d_args.kv_item_lens, strict=True),
                                USED_PAGES, RESERVE_PAGES, "cpu")
        attach(decode, reserve)
    addr = f"127.0.0.1:{BOOT_PORT}"
    rng = np.random.default_rng(3)
    fail_room = int(os.environ.get("FAIL_ROOM", "0"))
    results = []
    for room in range(1, 4):
        for d in d_bufs:
            d[:] = 0
        src = rng.permutation(USED_PAGES)[:192].astype(np.int32)
        dst = rng.permutation(USED_PAGES)[:192].astype(np.int32)
        if os.environ.get("PROBE_DST") == "contiguous":  # as the decode-contiguous-kv hook pre-allocates
            dst = np.arange(32, 32 + 192, dtype=np.int32)
        sender, receiver = open_room(prefill, decode, addr, room, dst)
        if room == fail_room:  # a session nobody listens on, with the real decode's registration
            for real, info in prefill.transfer_infos[room].items():
                prefill.decode_kv_args_table[DEAD_SESSION] = prefill.decode_kv_args_table[real]
                info.mooncake_session_id = DEAD_SESSION
        sender.init(len(src), aux_index=1)
        for start in range(0, len(src), 64):  # three chunks, as chunked prefill sends them
            sender.send(src[start:start + 64])
        states = (wait(sender, (KVPoll.Success, KVPoll.Failed)), wait(receiver, (KVPoll.Success, KVPoll.Failed)))
        intact = all((d[dst] == p[src]).all() for p, d in zip(p_bufs, d_bufs, strict=True))
        if reserve is not None:  # and nothing else of the decode's own pages written
            others = np.setdiff1d(np.arange(USED_PAGES), dst)
            intact = intact and not any(d[others].any() for d in d_bufs)
        results.append({"room": room, "sender": int(states[0]), "receiver": int(states[1]), "kv_intact": bool(intact),
                        "aux_intact": bool((d_aux[room % N_AUX] == p_aux[1]).all())})
        sender.clear()
        receiver.clear()
    samples = []
    if sub is not None:
        deadline = time.time() + 3.0
        while time.time() < deadline:
            if sub.poll(100):
                samples.append(json.loads(LinkSample.decode(sub.recv_multipart()[1]).encode()))
    telemetry = getattr(prefill, "_prfaas_link", None)
    async_sender = getattr(prefill, "_prfaas_sender", None)
    if async_sender is not None:  # let the last writes' completions be read (they are, at the latest, by the aux barrier)
        async_sender.settle(10.0)
    return {"requests": results, "success": int(KVPoll.Success), "failed": int(KVPoll.Failed), "samples": samples,
            "metrics": collected_metrics(async_sender, prefill),
            "async": None if async_sender is None else {
                "batches": async_sender.batches_submitted, "writes": async_sender.writes_submitted,
                "writes_failed": async_sender.writes_failed, "in_flight_bytes": async_sender.ledger.in_flight_bytes(),
                "lanes": async_sender.lanes, "max_writes_in_flight": async_sender.max_writes_in_flight,
                "staging": async_sender.stager.counters() if async_sender.stager is not None else None},
            "decode_staging": reserve.counters() if reserve is not None else None,
            "failed_sessions": sorted(prefill.failed_sessions),
            "prefill_rooms_left": sorted(prefill.request_status), "decode_rooms_left": sorted(decode.request_status),
            "transfer_infos_left": sorted(prefill.transfer_infos),
            "metered_bytes": telemetry.delivered_bytes_total if telemetry else None,
            "metered_transfers": telemetry.transfers_total if telemetry else None,
            "kv_bytes_per_request": 192 * PAGE_BYTES * 2 * NUM_LAYERS, "aux_bytes_per_request": AUX_BYTES,
            "decode_has_telemetry": hasattr(decode, "_prfaas_link")}


def collected_metrics(async_sender, prefill_manager) -> dict | None:
    """``{metric line name: value}`` of every ``prfaas:`` sample, collected from the multiprocess
    directory as SGLang's /metrics does, once the pump has published the sender's final counts."""
    if not SERVER_ARGS.enable_metrics:
        return None
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    samples: dict = {}
    deadline = time.time() + 5.0
    while time.time() < deadline:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in generate_latest(registry).decode().splitlines() if line.startswith("prfaas:")}
        telemetry = getattr(prefill_manager, "_prfaas_link", None)
        sender_done = async_sender is None or samples.get(
            'prfaas:kv_writes_submitted_total{model_name="probe"}') == async_sender.writes_submitted
        link_done = telemetry is None or samples.get(
            'prfaas:kv_bytes_sent_total{model_name="probe"}') == telemetry.delivered_bytes_total
        if sender_done and link_done:
            break
        time.sleep(0.05)
    return samples


ABORT_HOLD_S = 3.0  # how long main_abort holds the writes after its last chunk when no ACK comes first


class HeldWrites:
    """The transfer engine, with every write handed to it held back until ``release`` is set: the sender gets
    an id at once and reads it as pending (nothing waits on a lock); once released, the held writes go to the
    engine as they are next read."""

    def __init__(self, engine, release):
        self.engine, self.release = engine, release
        self.held: dict[int, tuple] = {}
        self.real: dict[int, int] = {}
        self._ids = itertools.count(-1, -1)  # never an engine's id (those are positive)

    def transfer_submit_write(self, session, *entry) -> int:
        if self.release.is_set():
            return self.engine.transfer_submit_write(session, *entry)
        write_id = next(self._ids)
        self.held[write_id] = (session, entry)
        return write_id

    def transfer_check_status(self, write_id: int) -> int:
        if write_id in self.held:
            if not self.release.is_set():
                return PENDING
            session, entry = self.held.pop(write_id)
            self.real[write_id] = self.engine.transfer_submit_write(session, *entry)
        if write_id in self.real:
            real = self.real[write_id]
            return self.engine.transfer_check_status(real) if real else FAILED
        return self.engine.transfer_check_status(write_id)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def main_abort() -> dict:
    """PROBE_ABORT=1 (SGLang with the deferred decode KV release, 0.5.23): the decode aborts room 1 while the
    writes of its first two chunks are queued or on the wire, the prefill then sends the last chunk (which
    SGLang skips, checking the drained ACK at once), and the decode waits for the ACK, on which SGLang's
    decode frees the room's pages. What the decode's pages held at the ACK is compared with what
    they hold once every write has ended: whatever changed landed after the ACK, in pages SGLang would have
    given to another request. PROBE_UNHOOK_ACK=1 puts SGLang's own ``_maybe_ack_drained_abort`` back (what
    the check finds without the kv-send-ack-drain hook).

    The race is not left to the machine's load: the writes are held (:class:`HeldWrites`) until the decode
    has its ACK or :data:`ABORT_HOLD_S` has passed, whichever comes first, so whether writes are still open
    at the ACK depends only on what SGLang's check waits for."""
    import threading

    from sglang.srt.disaggregation.common.conn import CommonKVManager

    from prfaas_sglang.bench.layerwise_bench import open_room

    if os.environ.get("PROBE_UNHOOK_ACK"):
        MooncakeKVManager._maybe_ack_drained_abort = CommonKVManager._maybe_ack_drained_abort
    prefill, decode, (_, p_bufs, _), (_, d_bufs, _) = managers()
    release = threading.Event()
    prefill._prfaas_sender.engine = HeldWrites(prefill._prfaas_sender.engine, release)
    src = np.arange(USED_PAGES, dtype=np.int32)[:192]
    dst = np.random.default_rng(5).permutation(USED_PAGES)[:192].astype(np.int32)
    sender, receiver = open_room(prefill, decode, f"127.0.0.1:{BOOT_PORT}", 1, dst)
    sender.init(len(src), aux_index=1)
    for start in range(0, len(src) - 64, 64):  # every chunk but the last: its aux would wait for the writes
        sender.send(src[start:start + 64])
    async_sender = prefill._prfaas_sender
    deadline = time.time() + 10.0
    while not any(not b.ended for b in list(async_sender.ledger.batches)) and time.time() < deadline:
        time.sleep(0.0002)  # until SGLang's transfer thread has handed a chunk to our sender
    queued_at_abort = sum(not b.ended for b in list(async_sender.ledger.batches))
    receiver.abort()
    time.sleep(0.01)
    sender.send(src[-64:])  # the last chunk, after the abort: SGLang skips it and checks the ACK at once
    # A check that waits for the writes gets them then. Counted from the last chunk, not from the abort: on a
    # machine loaded tenfold the abort and the send took over 2 s (CI-like run 65, 2026-12-01).
    threading.Timer(ABORT_HOLD_S, release.set).start()
    deadline = time.time() + 30.0
    while not decode.is_abort_release_safe(1, 1) and time.time() < deadline:
        time.sleep(0.0005)  # about as soon as the decode could release the pages
    acked = decode.is_abort_release_safe(1, 1)
    at_ack = [d[dst].copy() for d in d_bufs]
    open_at_ack = sum(not b.ended for b in list(async_sender.ledger.batches))
    release.set()
    settled = async_sender.settle(30.0)
    time.sleep(0.2)
    changed = sum(int((d[dst] != before).any(axis=1).sum()) for d, before in zip(d_bufs, at_ack, strict=True))
    landed = sum(int((d[dst] == p[src]).all(axis=1).sum()) for p, d in zip(p_bufs, d_bufs, strict=True))
    return {"deferred_release": bool(prefill.enable_deferred_decode_kv_release), "acked": bool(acked),
            "batches_open_at_abort": queued_at_abort, "batches_open_at_ack": open_at_ack, "settled": settled,
            "pages_changed_after_ack": changed, "pages_landed": landed, "pages": len(dst) * len(d_bufs)}


def main_layerwise() -> dict:
    """PROBE_LAYERWISE=1: three requests of three 64-token chunks through SGLang's scheduling code,
    written layer by layer and announced through the kv-layerwise hooks; after each layer, wait for
    its pages to reach the decode before writing the next (``prfaas_sglang.bench.layerwise_bench.rounds``)."""
    from prfaas_sglang.bench.layerwise_bench import rounds

    return rounds(BOOT_PORT, SERVER_ARGS, wait_each_layer=True)


if __name__ == "__main__":
    try:
        main_of = main_layerwise if os.environ.get("PROBE_LAYERWISE") else main_abort if os.environ.get("PROBE_ABORT") else main
        print(json.dumps(main_of()), flush=True)
    except BaseException as err:  # noqa: BLE001 - report, then hard-exit below
        traceback.print_exc()  # to stderr, which a failed run shows
        print(json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
    sys.stdout.flush()
    os._exit(0)
