"""Hook: a scheduler that ran no batch waits briefly on its input sockets (``PRFAAS_POLL_WAIT_MS``).

AFTER ``Scheduler.on_idle`` (SGLang's loops call it when an iteration ran no batch): in a process with
``PRFAAS_POLL_WAIT_MS`` set, the scheduler then waits up to that many milliseconds for a message on the
sockets it reads requests from (the tokenizer's and the RPC's), and goes round again at once when one
arrives. Without the variable nothing changes.

Why: SGLang's ``--sleep-on-idle`` sleeps only when the scheduler is *fully* idle. A PD server with a
request in flight but nothing to run (a decode waiting for its KV, a prefill waiting for its decode's
bootstrap or for a transfer to end) polls its queues without pause, a whole core: measured on the
2-core CPU machine (2026-11-30), a PD decode burned 1.98 CPU-s while its PrfaaS prefill computed a
4,096-token prompt for 1.94 s, and took that core from the prefill. On a GPU node the core is spare, so
the launcher never sets the variable; the CPU harness (``gpu/e2e.py`` ``CPU_PROFILE``) and the test
suite do. What the wait costs: a transfer's end or a bootstrap is seen up to that many milliseconds
late; a new request is seen at once.

A malformed value stops the scheduler at its first idle iteration (:class:`ConfigError`).
"""

from __future__ import annotations

from prfaas_sglang.envs import envs, non_negative_int

_ATTR = "_prfaas_poll_wait"  # the scheduler's (milliseconds, zmq.Poller), or (None, None): set at first use


def wait_for_input(result, scheduler):
    """AFTER hook on ``Scheduler.on_idle``: with ``PRFAAS_POLL_WAIT_MS`` set, wait up to that long for a
    request on the scheduler's input sockets. Returns ``result`` (``on_idle`` returns None)."""
    wait_ms, poller = scheduler.__dict__.get(_ATTR) or _setup(scheduler)
    if poller is not None:
        poller.poll(wait_ms)
    return result


def _setup(scheduler) -> tuple[int | None, object | None]:
    """The wait and a poller on ``scheduler``'s input sockets (none without the variable), kept on it."""
    wait_ms = envs.POLL_WAIT_MS.parse(non_negative_int)
    poller = None
    if wait_ms:
        import zmq

        poller = zmq.Poller()
        for sock in (scheduler.ipc_channels.recv_from_tokenizer, scheduler.ipc_channels.recv_from_rpc):
            if sock is not None:  # ranks other than the first receive nothing
                poller.register(sock, zmq.POLLIN)
    setattr(scheduler, _ATTR, (wait_ms, poller))
    return wait_ms, poller
