"""One end of SGLang 0.5.15's Mooncake KV path on CPU, driven over stdin/stdout (run as a subprocess).

    python sglang_session_probe.py prefill   # bootstrap server + prefill MooncakeKVManager (sender)
    python sglang_session_probe.py decode    # decode MooncakeKVManager (receiver)

``test_sglang_session_recovery.py`` starts one of each in the two network namespaces of an
emulated WAN link. Real: ``MooncakeKVBootstrapServer`` (SGLang runs it with the prefill server, so
it lives in the prefill process), the prefill and decode ``MooncakeKVManager`` (host numpy buffers
registered in Mooncake's TCP transfer engine; SGLang's transfer worker, failed-session blacklist
and probe loop, the decode side's heartbeat), ``MooncakeKVSender`` / ``MooncakeKVReceiver``, and
our plugin's hooks (``register()``, as SGLang's plugin loader runs it). Stubbed: what a model
runner would set up, i.e. the parallel groups (world size 1) and the process's Mooncake engine
(``init_mooncake_transfer_engine`` on this end's address). Instrumentation only: a wrapper that
records each ``send_probe`` call (start, duration, return code) around the engine's own, a thread
that timestamps what enters and leaves the prefill manager's ``failed_sessions``
(``time.monotonic``: one clock for every process on the host), and ``scan``, which attributes the
decode pool's non-zero page slots to the request whose KV they hold.

A request is concluded as SGLang's schedulers do: on Success ``clear()``, on Failed
``failure_exception()`` (which clears and raises the recorded reason). Its KV goes in four chunks,
as chunked prefill sends it; consecutive requests land in different halves of the decode pool, so
KV that arrives late for one request shows as itself instead of corrupting the next one.

One JSON command per stdin line (``{"op": name, **arguments}``, a method of :class:`Prefill` or
:class:`Decode`), one JSON answer per stdout line (anything native writes to fd 1 goes to stderr);
stdin closing ends the process (``os._exit``: SGLang's listener threads are not daemons and there
is no shutdown API). Environment: PEER_IP (this end's address), PREFILL_IP and BOOT_PORT (the
bootstrap server), and what the launcher gives the role (PRFAAS_ROLE, MC_*, SGLANG_*).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time

OUT = os.fdopen(os.dup(1), "w", buffering=1)  # answers only; anything native writes to fd 1 goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr

PEER_IP, PREFILL_IP, BOOT_PORT = os.environ["PEER_IP"], os.environ["PREFILL_IP"], int(os.environ["BOOT_PORT"])
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ["SGLANG_HOST_IP"] = PEER_IP
os.environ.setdefault("SGLANG_DISAGGREGATION_QUEUE_SIZE", "1")
os.environ.setdefault("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "1")

import numpy as np  # noqa: E402

from prfaas_sglang.adapters.sockopts import mooncake_connections  # noqa: E402
from prfaas_sglang.bench.layerwise_bench import (  # noqa: E402
    make_kv_args,
    manager_server_args,
    new_sender,
    published_server_args,
    single_rank_state,
)
from prfaas_sglang.plugin import register  # noqa: E402

register()

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # noqa: E402
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # noqa: E402
    init_mooncake_transfer_engine,
)

single_rank_state()

SERVER_ARGS = (published_server_args(BOOT_PORT, PREFILL_IP, "decode" if sys.argv[1:2] == ["decode"] else "prefill")
               or manager_server_args(PREFILL_IP, BOOT_PORT))
BOOTSTRAP_ADDR = f"{PREFILL_IP}:{BOOT_PORT}"
NUM_LAYERS, NUM_PAGES, PAGE_BYTES, N_AUX, AUX_BYTES = 2, 128, 64 << 10, 4, 64  # 32 MiB of KV per side
PAGES_PER_REQUEST, CHUNKS = 48, 4  # 12 MiB per request (~0.5 s at 200 Mbit/s), in four chunks
PREFILL_AUX_INDEX = 1


def expected_page(buffer: int, pages: np.ndarray) -> np.ndarray:
    """What the prefill side holds in ``pages`` of KV buffer ``buffer`` (K0..Kn, V0..Vn)."""
    return ((pages[:, None] * 7 + buffer * 31 + np.arange(PAGE_BYTES)[None, :] % 13) % 251).astype(np.uint8)


@functools.cache
def pages_of(room: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's source pages (prefill) and destination pages (decode), the same in both processes;
    odd and even requests land in different halves of the decode pool."""
    rng = np.random.default_rng(room)
    src = rng.permutation(NUM_PAGES)[:PAGES_PER_REQUEST].astype(np.int32)
    half = NUM_PAGES // 2
    dst = ((room % 2) * half + rng.permutation(half)[:PAGES_PER_REQUEST]).astype(np.int32)
    return src, dst


def kv_args(fill: bool):
    bufs = [np.zeros((NUM_PAGES, PAGE_BYTES), dtype=np.uint8) for _ in range(2 * NUM_LAYERS)]
    if fill:
        for i, b in enumerate(bufs):
            b[:] = expected_page(i, np.arange(NUM_PAGES))
    aux = np.zeros((N_AUX, AUX_BYTES), dtype=np.uint8)
    if fill:
        aux[PREFILL_AUX_INDEX] = 0xAB
    a = make_kv_args([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [PAGE_BYTES] * len(bufs), aux)
    return a, bufs, aux


def wait(obj, want, timeout_s: float) -> KVPoll:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = obj.poll()
        if state in want:
            return state
        time.sleep(0.005)
    return obj.poll()


def conclude(obj) -> str | None:
    """What SGLang's scheduler does with a concluded sender or receiver; the failure reason, if any."""
    if obj.poll() == KVPoll.Failed:
        try:
            obj.failure_exception()
        except Exception as err:  # noqa: BLE001 - KVTransferError carries the recorded reason
            return str(err)
        return "failure_exception() did not raise"
    obj.clear()
    return None


class Prefill:
    def __init__(self):
        MooncakeKVBootstrapServer(PREFILL_IP, BOOT_PORT)
        time.sleep(0.3)
        self.args, self.bufs, self.aux = kv_args(fill=True)
        self.mgr = MooncakeKVManager(self.args, DisaggregationMode.PREFILL, SERVER_ARGS, False)
        self.senders: dict[int, MooncakeKVSender] = {}
        self.events: list[dict] = []  # failed_sessions changes
        self.probes: list[dict] = []  # send_probe calls: SGLang's probe loop ("sglang") and ours ("direct")
        engine = self.mgr.engine  # SGLang's MooncakeTransferEngine wrapper, whose send_probe the loop calls
        self._send_probe = engine.send_probe
        engine.send_probe = lambda session_id: self._timed_probe(session_id, "sglang")["rc"]
        self._seen: set[str] = set()
        self._scan_lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def _timed_probe(self, session_id: str, origin: str, box: dict | None = None) -> dict:
        start = time.monotonic()
        rc = self._send_probe(session_id)
        record = {"t": start, "s": time.monotonic() - start, "rc": rc, "origin": origin}
        self.probes.append(record)
        if box is not None:
            box.update(record)
        return record

    def _scan(self) -> None:
        """Timestamp what entered or left ``failed_sessions`` since the last scan."""
        with self._scan_lock:
            with self.mgr.session_lock:
                now = set(self.mgr.failed_sessions)
            t = time.monotonic()
            self.events += [{"t": t, "op": "add", "session": s} for s in sorted(now - self._seen)]
            self.events += [{"t": t, "op": "remove", "session": s} for s in sorted(self._seen - now)]
            self._seen = now

    def _watch(self) -> None:
        while True:
            self._scan()
            time.sleep(0.02)

    def open(self, room: int) -> dict:
        self.senders[room] = new_sender(self.mgr, BOOTSTRAP_ADDR, room)
        return {"ok": True}

    def wait_input(self, room: int, timeout_s: float) -> dict:
        return {"state": int(wait(self.senders[room], (KVPoll.WaitingForInput, KVPoll.Failed), timeout_s))}

    def send(self, room: int, timeout_s: float) -> dict:
        """Send the request's KV in chunks, as chunked prefill does, and wait for the outcome."""
        sender = self.senders.pop(room)
        src, _ = pages_of(room)
        sender.init(len(src), aux_index=PREFILL_AUX_INDEX)
        started = time.monotonic()
        step = len(src) // CHUNKS
        for start in range(0, len(src), step):
            sender.send(src[start:start + step])
        state = wait(sender, (KVPoll.Success, KVPoll.Failed), timeout_s)
        elapsed = time.monotonic() - started
        return {"state": int(state), "elapsed_s": elapsed, "t_start": started, "reason": conclude(sender)}

    def probe(self, session: str, timeout_s: float) -> dict:
        """``send_probe`` called directly and waited for (in a thread: a hang cannot wedge this process)."""
        box: dict = {}
        thread = threading.Thread(target=self._timed_probe, args=(session, "direct", box), daemon=True)
        thread.start()
        thread.join(timeout_s)
        return {"hung": thread.is_alive(), **box}

    def probe_later(self, session: str, delay_s: float) -> dict:
        """``send_probe`` called directly after ``delay_s``, not waited for (recorded in ``probes``)."""
        def run():
            time.sleep(delay_s)
            self._timed_probe(session, "direct")

        threading.Thread(target=run, daemon=True).start()
        return {"ok": True}

    def state(self) -> dict:
        self._scan()
        m = self.mgr
        with m.session_lock:
            failed, failures = sorted(m.failed_sessions), dict(m.session_failures)
        link = getattr(m, "_prfaas_link", None)
        sender = getattr(m, "_prfaas_sender", None)  # the kv-send hooks' (PRFAAS_KV_ASYNC_SEND)
        return {
            "failed_sessions": failed, "session_failures": failures,
            "request_status": sorted(m.request_status), "transfer_infos": sorted(m.transfer_infos),
            "req_to_decode_prefix_len": sorted(m.req_to_decode_prefix_len),
            "failure_records": sorted(m.failure_records), "decode_kv_args_table": sorted(m.decode_kv_args_table),
            "probe_enabled": bool(getattr(m, "enable_failed_session_probe", False)),
            "probe_interval_s": getattr(m, "failed_session_probe_interval", None),
            "events": list(self.events), "probes": list(self.probes),
            "metered_failed": link.failed_total if link else None,
            "metered_transfers": link.transfers_total if link else None,
            "lanes": sender.lanes if sender else None,
            "max_writes_in_flight": sender.max_writes_in_flight if sender else None,
            "lanes_reset": sender.resets.sockets_reset if sender and sender.resets else None,
        }


class Decode:
    def __init__(self):
        self.args, self.bufs, self.aux = kv_args(fill=False)
        self.mgr = MooncakeKVManager(self.args, DisaggregationMode.DECODE, SERVER_ARGS, False)
        self.receivers: dict[int, MooncakeKVReceiver] = {}

    def recv(self, room: int, timeout_s: float) -> dict:
        """Pre-allocate the request's pages (zeroed) and send its metadata to the prefill side."""
        _, dst = pages_of(room)
        for b in self.bufs:
            b[dst] = 0
        self.aux[room % N_AUX] = 0
        receiver = MooncakeKVReceiver(self.mgr, BOOTSTRAP_ADDR, room)
        end = time.monotonic() + timeout_s
        while not self.mgr.try_ensure_parallel_info(BOOTSTRAP_ADDR):
            if time.monotonic() > end:
                return {"ok": False, "why": "no parallel info from the bootstrap server"}
            time.sleep(0.05)
        receiver.init(0)
        receiver.send_metadata(dst, aux_index=room % N_AUX)
        self.receivers[room] = receiver
        return {"ok": True}

    def wait(self, room: int, timeout_s: float) -> dict:
        receiver = self.receivers.pop(room)
        started = time.monotonic()
        state = wait(receiver, (KVPoll.Success, KVPoll.Failed), timeout_s)
        src, dst = pages_of(room)
        intact = all((b[dst] == expected_page(i, src)).all() for i, b in enumerate(self.bufs))
        aux_intact = bool((self.aux[room % N_AUX] == 0xAB).all())
        return {"state": int(state), "elapsed_s": time.monotonic() - started, "kv_intact": bool(intact),
                "aux_intact": aux_intact, "reason": conclude(receiver), "pages": self.scan()}

    def zero(self) -> dict:
        """Zero every KV page, as if the decode side had freed them and handed them to new requests."""
        for b in self.bufs:
            b[:] = 0
        return {"ok": True}

    def scan(self, rooms: int = 8) -> dict:
        """Which (buffer, page) slots hold data, attributed to the request whose KV it is: a slot
        holds request r's KV when it equals the prefill page r sends to that slot."""
        by_room: dict[str, int] = {}
        other = 0
        for i, b in enumerate(self.bufs):
            for page in np.flatnonzero(b.any(axis=1)):
                owners = []
                for r in range(1, rooms + 1):
                    src, dst = pages_of(r)
                    hit = np.flatnonzero(dst == page)
                    if hit.size and (b[page] == expected_page(i, src[hit])[0]).all():
                        owners.append(str(r))
                for r in owners:
                    by_room[r] = by_room.get(r, 0) + 1
                other += not owners
        return {"by_room": by_room, "other": other}

    def state(self) -> dict:
        m = self.mgr
        return {
            "request_status": sorted(m.request_status),
            "required_prefill_response_num_table": sorted(m.required_prefill_response_num_table),
            "prefill_response_tracker": sorted(m.prefill_response_tracker),
            "failure_records": sorted(m.failure_records),
            "addr_to_rooms_tracker": {addr: sorted(rooms) for addr, rooms in m.addr_to_rooms_tracker.items()},
            "heartbeat_failures": dict(m.heartbeat_failures),
            "prefill_info_table": sorted(m.prefill_info_table),
            "connection_pool": sorted(m.connection_pool),
        }


def connections() -> dict:
    """This process's connections to or from a Mooncake port: [[local host, port], [remote host, port]]."""
    return {"connections": mooncake_connections()}


def serve(side) -> None:
    OUT.write(json.dumps({"ready": True, "session": side.mgr.engine.get_session_id(), "pid": os.getpid(),
                          "success": int(KVPoll.Success), "failed": int(KVPoll.Failed),
                          "waiting_for_input": int(KVPoll.WaitingForInput)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = connections() if op == "connections" else getattr(side, op)(**cmd)
        except Exception as err:  # noqa: BLE001 - report, keep serving
            answer = {"error": f"{type(err).__name__}: {err}"}
        OUT.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    try:
        init_mooncake_transfer_engine(hostname=PEER_IP, gpu_id=0, ib_device=None)
        serve(Prefill() if sys.argv[1] == "prefill" else Decode())
    except BaseException as err:  # noqa: BLE001 - report, then hard-exit below
        OUT.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
    OUT.flush()
    os._exit(0)
