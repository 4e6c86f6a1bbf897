"""One end of ``bench transport``: a Mooncake transfer engine (TCP) inside a network namespace.

    python -m prfaas_sglang.bench.transport_peer recv --host IP --buffer-mib N
        registers an N MiB landing buffer, prints {"session", "addr"} and waits for stdin to close.
    python -m prfaas_sglang.bench.transport_peer send --host IP --buffer-mib N --peer SESSION --addr ADDR
        reads one job per stdin line ({"payload_bytes", "request_bytes", "chunk_bytes"}) and answers
        {"elapsed_s", "ok", "requests"} per job (pipelined jobs add "done_s": each request's completion).
    python -m prfaas_sglang.bench.transport_peer tcp-recv --host IP   /   tcp-send --host IP --peer IP:PORT [--warm]
        the reference: one plain TCP stream of the same payload over the same link (1 MiB writes), on a
        new connection per job or (--warm) on one connection kept open, like a persistent lane;
        tcp-recv prints its port, tcp-send answers {"elapsed_s", "ok"} per job like send.

A job sends ``payload_bytes`` as SGLang 0.5.15's Mooncake backend does: one synchronous batch
write per chunk (``chunk_bytes``, a chunked-prefill chunk's KV), each batch made of
``request_bytes`` entries (SGLang: one per contiguous page run per layer, K and V apart).
The Mooncake settings are the process's ``MC_*`` environment, read once at engine start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np


def _engine(host: str, buffer_bytes: int):
    os.environ.setdefault("MC_FORCE_TCP", "1")
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit(f"mooncake initialize({host}) failed")
    buffer = np.ones(buffer_bytes, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, buffer_bytes) != 0:
        raise SystemExit("mooncake register_memory failed")
    return engine, buffer


def _lengths(job: dict) -> list[int]:
    """The job's request sizes: ``sizes`` as given, else ``payload_bytes`` in ``request_bytes`` pieces."""
    if job.get("sizes"):
        return [int(n) for n in job["sizes"]]
    payload, request = int(job["payload_bytes"]), int(job["request_bytes"])
    return [min(request, payload - off) for off in range(0, payload, request)]


class ProductSender:
    """The ``kv-send`` hooks' :class:`~prfaas_sglang.transport.kv_sender.AsyncKvSender`, as a PrfaaS prefill
    worker runs it (lanes from ``MC_TCP_LANES_PER_PEER``, connections reset on close, fast failures
    handed again), in front of this process's engine. What SGLang's manager would give it is empty here:
    no rooms (nothing to taint), no blacklist. Each job's requests go as chunks of up to ``chunk_bytes``,
    submitted as SGLang's transfer thread submits them (within the hooks' window of queued chunks), then
    the aux barrier. Destinations are laid out mirrored (the first request lands last), so no two requests
    continue each other on both sides and ``coalesce`` keeps each one whole."""

    def __init__(self, engine):
        from prfaas_sglang.adapters.sockopts import ResetOnClose
        from prfaas_sglang.transport.kv_sender import (
            AsyncKvSender,
            DetachedManager,
            lane_pacing_from_env,
            mooncake_lanes_per_peer,
        )

        self.sender = AsyncKvSender(DetachedManager(), engine, wait_bound_s=600.0, lanes=mooncake_lanes_per_peer(),
                                    resets=ResetOnClose(), pacing=lane_pacing_from_env())
        self._done: list[float] = []
        self._first_cap: int | None = None  # the lanes' pacing cap when a run's first write ended
        record = self.sender._record

        def timed(ended, telemetry) -> None:  # each write's end, for the bench's lane spread
            self._done.append(time.perf_counter())
            if len(self._done) == 1:  # the cap that write ran under (pump thread)
                self._first_cap = self.sender.lane_cap
            record(ended, telemetry)

        self.sender._record = timed

    def run(self, base: int, session: str, peer_addr: int, job: dict) -> dict:
        lengths, chunk = _lengths(job), int(job.get("chunk_bytes") or (64 << 20))
        total = sum(lengths)
        self._done.clear()
        self._first_cap = None
        changes = self.sender.pacing_changes
        started = time.perf_counter()
        entries: list[tuple[int, int, int]] = []
        in_chunk = 0
        for off, length in zip(itertools.accumulate(lengths, initial=0), lengths, strict=False):
            entries.append((base + off, peer_addr + total - off - length, length))
            in_chunk += length
            if in_chunk >= chunk or off + length == total:
                if self.sender.submit(session, entries) != 0:
                    return {"elapsed_s": time.perf_counter() - started, "ok": False, "requests": len(lengths)}
                entries, in_chunk = [], 0
        ok = self.sender.barrier(session, 0)
        return {"elapsed_s": time.perf_counter() - started, "ok": ok, "requests": len(lengths),
                "done_s": [round(t - started, 4) for t in self._done],
                "pacing_changes": self.sender.pacing_changes - changes,
                "first_cap_bytes_per_s": self._first_cap}


def send_job(engine, base: int, session: str, peer_addr: int, job: dict, product: ProductSender | None = None) -> dict:
    if job.get("product"):
        return product.run(base, session, peer_addr, job)
    if job.get("pipeline"):
        return pipeline_job(engine, base, session, peer_addr, job)
    payload, request, chunk = int(job["payload_bytes"]), int(job["request_bytes"]), int(job["chunk_bytes"])
    requests = 0
    started = time.perf_counter()
    for chunk_off in range(0, payload, chunk):
        chunk_len = min(chunk, payload - chunk_off)
        offsets = range(chunk_off, chunk_off + chunk_len, request)
        lengths = [min(request, chunk_off + chunk_len - off) for off in offsets]
        rc = engine.batch_transfer_sync_write(session, [base + off for off in offsets],
                                              [peer_addr + off for off in offsets], lengths)
        requests += len(lengths)
        if rc != 0:
            return {"elapsed_s": time.perf_counter() - started, "ok": False, "requests": requests,
                    "failed_at_bytes": chunk_off}
    return {"elapsed_s": time.perf_counter() - started, "ok": True, "requests": requests}


def pipeline_job(engine, base: int, session: str, peer_addr: int, job: dict, poll_s: float = 0.001) -> dict:
    """Each request submitted as soon as its KV exists (here: at once), at most ``inflight`` outstanding,
    completions polled with a sleep: no barrier at chunk ends, no thread spinning in a sync call."""
    inflight = int(job.get("inflight", 8))
    pending: list[int] = []
    lengths = _lengths(job)
    # (offset, length) in order; accumulate(initial=0) yields one more item, the total, which zip drops
    pieces = iter(zip(itertools.accumulate(lengths, initial=0), lengths, strict=False))
    requests = 0
    done_s: list[float] = []  # each request's completion, seconds after the first submit
    started = time.perf_counter()
    while True:
        while len(pending) < inflight and (piece := next(pieces, None)) is not None:
            off, length = piece
            batch = engine.transfer_submit_write(session, base + off, peer_addr + off, length)
            if batch <= 0:
                return {"elapsed_s": time.perf_counter() - started, "ok": False, "requests": requests, "failed_at_bytes": off}
            pending.append(batch)
            requests += 1
        if not pending:
            return {"elapsed_s": time.perf_counter() - started, "ok": True, "requests": requests, "done_s": done_s}
        still: list[int] = []
        for batch in pending:
            status = engine.transfer_check_status(batch)
            if status == 1:
                done_s.append(round(time.perf_counter() - started, 4))
            elif status < 0:
                return {"elapsed_s": time.perf_counter() - started, "ok": False, "requests": requests, "status": status}
            else:
                still.append(batch)
        if len(still) == len(pending):
            time.sleep(poll_s)
        pending = still


def _recv_exactly(conn, n: int, buf: bytearray) -> bool:
    """Read and drop ``n`` bytes; False if the peer closed first."""
    view = memoryview(buf)
    while n:
        got = conn.recv_into(view[: min(n, len(buf))])
        if not got:
            return False
        n -= got
    return True


def _tcp_recv(host: str) -> int:
    """Every connection carries jobs as frames (8-byte big-endian length, then the payload), each
    answered with one byte once its last byte is read; a fresh-connection sender sends one frame."""
    import socket
    import threading

    def serve(conn) -> None:
        buf = bytearray(1 << 20)
        with conn:
            while (head := conn.recv(8, socket.MSG_WAITALL)) and len(head) == 8:
                if not _recv_exactly(conn, int.from_bytes(head, "big"), buf):
                    return
                conn.sendall(b"k")  # the sender times until the last byte is read

    with socket.socket() as server:
        server.bind((host, 0))
        server.listen(8)
        print(json.dumps({"port": server.getsockname()[1]}), flush=True)
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _tcp_send(peer: str, warm: bool) -> int:
    """``warm``: one connection for every job (opened before the first), like a persistent lane;
    otherwise a new connection per job, its connect and slow start timed with it."""
    import socket

    host, port = peer.rsplit(":", 1)
    block = bytes(1 << 20)
    conn = socket.create_connection((host, int(port))) if warm else None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        payload = int(json.loads(line)["payload_bytes"])
        started = time.perf_counter()
        sock = conn or socket.create_connection((host, int(port)))
        try:
            sock.sendall(payload.to_bytes(8, "big"))
            for off in range(0, payload, len(block)):
                sock.sendall(block[: min(len(block), payload - off)])
            ok = sock.recv(1) == b"k"
        finally:
            if sock is not conn:
                sock.close()
        print(json.dumps({"elapsed_s": time.perf_counter() - started, "ok": ok, "requests": 1}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.bench.transport_peer")
    parser.add_argument("mode", choices=("recv", "send", "tcp-recv", "tcp-send"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--buffer-mib", type=int, default=64)
    parser.add_argument("--peer")
    parser.add_argument("--addr", type=int)
    parser.add_argument("--warm", action="store_true", help="tcp-send: one persistent connection for every job")
    args = parser.parse_args(argv)
    if args.mode == "tcp-recv":
        return _tcp_recv(args.host)
    if args.mode == "tcp-send":
        return _tcp_send(args.peer, args.warm)
    engine, buffer = _engine(args.host, args.buffer_mib << 20)
    if args.mode == "recv":
        print(json.dumps({"session": f"{args.host}:{engine.get_rpc_port()}", "addr": buffer.ctypes.data}), flush=True)
        sys.stdin.read()
        return 0
    print(json.dumps({"ready": True}), flush=True)
    product = ProductSender(engine)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(send_job(engine, buffer.ctypes.data, args.peer, args.addr, json.loads(line), product)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
