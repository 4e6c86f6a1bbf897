"""One end of ``bench kv-staging``: SGLang 0.5.15's Mooncake KV path on CPU, driven over stdin/stdout.

    python -m prfaas_sglang.bench.kv_staging_peer prefill   # bootstrap server + prefill MooncakeKVManager
    python -m prfaas_sglang.bench.kv_staging_peer decode    # decode MooncakeKVManager (+ its KV reserve)

Real: SGLang's ``MooncakeKVBootstrapServer``, ``MooncakeKVManager`` (host buffers registered in Mooncake's
TCP transfer engine), ``MooncakeKVSender`` / ``MooncakeKVReceiver``, and our plugin's hooks (``register()``,
as SGLang's plugin loader runs it), configured by the environment the launcher gives the role. Stubbed:
what a model runner sets up (parallel groups of one; the process's Mooncake engine on this end's address).
With ``RESERVE_PAGES`` > 0 the decode's buffers have that many more pages, set aside as its KV reserve
(:class:`~prfaas_sglang.hooks.decode_stage.DecodeStaging`), as the ``decode-staging-start`` hook sets them
aside from a fresh pool.

Pages: request ``room``'s source and destination pages come from :func:`pages_of` (the same in both
processes): runs of random length (geometric, mean ``MEAN_RUN`` pages) in random order, drawn apart on
each side, or, with ``MEAN_RUN`` 0, one run per side. One JSON command per stdin line, one JSON answer
per stdout line; stdin closing ends the process. Environment: PEER_IP, PREFILL_IP, BOOT_PORT, LAYERS,
POOL_PAGES, PAGE_BYTES, REQUEST_PAGES, CHUNKS, MEAN_RUN, RESERVE_PAGES, and the role's launcher settings.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

OUT = os.fdopen(os.dup(1), "w", buffering=1)  # answers only; anything native writes to fd 1 goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr

PEER_IP, PREFILL_IP, BOOT_PORT = os.environ["PEER_IP"], os.environ["PREFILL_IP"], int(os.environ["BOOT_PORT"])
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ["SGLANG_HOST_IP"] = PEER_IP
os.environ.setdefault("SGLANG_DISAGGREGATION_QUEUE_SIZE", "1")
os.environ.setdefault("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "1")
LAYERS, POOL_PAGES, PAGE_BYTES = (int(os.environ[k]) for k in ("LAYERS", "POOL_PAGES", "PAGE_BYTES"))
REQUEST_PAGES, CHUNKS, MEAN_RUN = (int(os.environ[k]) for k in ("REQUEST_PAGES", "CHUNKS", "MEAN_RUN"))
RESERVE_PAGES = int(os.environ.get("RESERVE_PAGES", "0"))

import numpy as np  # noqa: E402

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
               or manager_server_args(PREFILL_IP, BOOT_PORT, device="cpu"))
BOOTSTRAP_ADDR = f"{PREFILL_IP}:{BOOT_PORT}"


def _scattered(rng, pool: int, n: int, mean_run: int) -> np.ndarray:
    """``n`` distinct pages of ``pool`` in runs of geometric length (mean ``mean_run``), runs in random order."""
    if mean_run <= 0:
        start = int(rng.integers(0, pool - n + 1))
        return np.arange(start, start + n, dtype=np.int32)
    edges, at = [0], 0
    while at < pool:
        at = min(pool, at + int(rng.geometric(1 / mean_run)))
        edges.append(at)
    runs = [np.arange(a, b) for a, b in zip(edges, edges[1:], strict=False)]
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])[:n].astype(np.int32)


@functools.cache
def pages_of(room: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(room)
    return (_scattered(rng, POOL_PAGES, REQUEST_PAGES, MEAN_RUN),
            _scattered(rng, POOL_PAGES, REQUEST_PAGES, MEAN_RUN))


def expected(buffer: int, pages: np.ndarray) -> np.ndarray:
    return ((pages[:, None] * 7 + buffer * 31 + np.arange(PAGE_BYTES)[None, :] % 13) % 251).astype(np.uint8)


def kv_args(fill: bool, extra_pages: int = 0):
    bufs = [np.zeros((POOL_PAGES + extra_pages, PAGE_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]
    if fill:
        for i, b in enumerate(bufs):
            b[:POOL_PAGES] = expected(i, np.arange(POOL_PAGES))
    aux = np.zeros((4, 64), dtype=np.uint8)
    return make_kv_args([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [PAGE_BYTES] * len(bufs), aux), bufs


def wait(obj, want, timeout_s: float):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = obj.poll()
        if state in want:
            return state
        time.sleep(0.001)
    return obj.poll()


class Prefill:
    def __init__(self):
        init_mooncake_transfer_engine(hostname=PEER_IP, gpu_id=0, ib_device=None)
        MooncakeKVBootstrapServer(PREFILL_IP, BOOT_PORT)
        self.args, self.bufs = kv_args(fill=True)
        self.mgr = MooncakeKVManager(self.args, DisaggregationMode.PREFILL, SERVER_ARGS, False)
        self.senders: dict[int, MooncakeKVSender] = {}

    def open(self, room: int) -> dict:
        self.senders[room] = new_sender(self.mgr, BOOTSTRAP_ADDR, room)
        return {"ok": True}

    def send(self, room: int, timeout_s: float) -> dict:
        """Once the decode's metadata is in: the request's KV in ``CHUNKS`` chunks, as chunked prefill sends
        it; the seconds from the first chunk to Success."""
        sender = self.senders.pop(room)
        if wait(sender, (KVPoll.WaitingForInput, KVPoll.Failed), timeout_s) != KVPoll.WaitingForInput:
            return {"state": int(sender.poll()), "elapsed_s": None}
        src, _ = pages_of(room)
        sender.init(len(src), aux_index=1)
        started = time.monotonic()
        step = -(-len(src) // CHUNKS)
        for start in range(0, len(src), step):
            sender.send(src[start:start + step])
        state = wait(sender, (KVPoll.Success, KVPoll.Failed), timeout_s)
        elapsed = time.monotonic() - started
        sender.clear()
        async_sender = getattr(self.mgr, "_prfaas_sender", None)
        return {"state": int(state), "elapsed_s": elapsed,
                "writes": async_sender.writes_submitted if async_sender else None,
                "staging": async_sender.stager.counters() if async_sender and async_sender.stager else None}


class Decode:
    def __init__(self):
        init_mooncake_transfer_engine(hostname=PEER_IP, gpu_id=0, ib_device=None)
        self.args, self.bufs = kv_args(fill=False, extra_pages=RESERVE_PAGES)
        self.mgr = MooncakeKVManager(self.args, DisaggregationMode.DECODE, SERVER_ARGS, False)
        self.reserve = None
        if RESERVE_PAGES:
            from prfaas_sglang.hooks.decode_stage import DecodeStaging, attach

            self.reserve = DecodeStaging(zip(self.args.kv_data_ptrs, self.args.kv_data_lens, self.args.kv_item_lens,
                                             strict=True), POOL_PAGES, RESERVE_PAGES, "cpu")
            attach(self.mgr, self.reserve)
        self.receivers: dict[int, MooncakeKVReceiver] = {}

    def recv(self, room: int, timeout_s: float) -> dict:
        _, dst = pages_of(room)
        for b in self.bufs:
            b[dst] = 0
        receiver = MooncakeKVReceiver(self.mgr, BOOTSTRAP_ADDR, room)
        end = time.monotonic() + timeout_s
        while not self.mgr.try_ensure_parallel_info(BOOTSTRAP_ADDR):
            if time.monotonic() > end:
                return {"ok": False}
            time.sleep(0.05)
        receiver.init(0)
        receiver.send_metadata(dst, aux_index=room % 4)
        self.receivers[room] = receiver
        return {"ok": True}

    def wait(self, room: int, timeout_s: float) -> dict:
        receiver = self.receivers.pop(room)
        state = wait(receiver, (KVPoll.Success, KVPoll.Failed), timeout_s)
        src, dst = pages_of(room)
        intact = all((b[dst] == expected(i, src)).all() for i, b in enumerate(self.bufs))
        receiver.clear()
        return {"state": int(state), "kv_intact": bool(intact),
                "reserve": self.reserve.counters() if self.reserve else None}


def main() -> None:
    peer = Prefill() if sys.argv[1] == "prefill" else Decode()
    OUT.write(json.dumps({"ready": True, "success": int(KVPoll.Success)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer = getattr(peer, cmd.pop("op"))(**cmd)
        except Exception as err:  # noqa: BLE001 - report, keep serving
            answer = {"error": repr(err)}
        OUT.write(json.dumps(answer) + "\n")
    os._exit(0)


if __name__ == "__main__":
    main()
