"""The scheduler-poll-wait hook (prfaas_sglang/hooks/poll_wait.py) on real ZMQ sockets of SGLang's kinds.

The scheduler here is the part of SGLang's the hook reads: ``ipc_channels`` with the tokenizer's PULL and the
RPC's DEALER socket (``SchedulerIpcChannels``); that the hook is installed on SGLang's own ``Scheduler.on_idle``
and verified there is tests/unit/test_plugin.py's and tests/drift/test_hook_targets.py's.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import zmq

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.hooks.poll_wait import wait_for_input

HANG_GUARD_S = 60.0  # a wait that never ends fails here instead of hanging the suite
FOREVER_MS = 3_600_000  # longer than the guard: only a message ends such a wait in time


@pytest.fixture
def channels():
    """A scheduler's two input sockets, each with the peer that sends to it (the tokenizer, the RPC caller)."""
    ctx = zmq.Context()
    endpoints = {"recv_from_tokenizer": ("inproc://tokenizer", zmq.PULL, zmq.PUSH),
                 "recv_from_rpc": ("inproc://rpc", zmq.DEALER, zmq.DEALER)}
    sockets, peers = {}, {}
    for name, (endpoint, kind, peer_kind) in endpoints.items():
        sockets[name] = ctx.socket(kind)
        sockets[name].bind(endpoint)
        peers[name] = ctx.socket(peer_kind)
        peers[name].connect(endpoint)
    yield SimpleNamespace(**sockets), peers
    for sock in [*sockets.values(), *peers.values()]:
        sock.close(linger=0)
    ctx.term()


def call_on_idle(scheduler) -> object:
    """The hook as SGLang's HookRegistry calls it after ``on_idle`` (which returns None), in a thread the
    test can give up on; returns what the hook returned."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", wait_for_input(None, scheduler)), daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the hook still waited after the hang guard"
    return out["result"]


def test_without_the_variable_the_scheduler_goes_round_at_once(channels, monkeypatch):
    monkeypatch.delenv("PRFAAS_POLL_WAIT_MS", raising=False)
    ipc, _ = channels
    scheduler = SimpleNamespace(ipc_channels=ipc)
    assert call_on_idle(scheduler) is None
    assert scheduler._prfaas_poll_wait == (None, None)  # nothing to wait on, decided once


def test_zero_turns_the_wait_off(channels, monkeypatch):
    monkeypatch.setenv("PRFAAS_POLL_WAIT_MS", "0")
    ipc, _ = channels
    scheduler = SimpleNamespace(ipc_channels=ipc)
    call_on_idle(scheduler)
    assert scheduler._prfaas_poll_wait == (0, None)


@pytest.mark.parametrize("socket_name", ["recv_from_tokenizer", "recv_from_rpc"])
def test_a_message_ends_the_wait_and_stays_for_sglangs_loop(channels, monkeypatch, socket_name):
    monkeypatch.setenv("PRFAAS_POLL_WAIT_MS", str(FOREVER_MS))
    ipc, peers = channels
    scheduler = SimpleNamespace(ipc_channels=ipc)
    timer = threading.Timer(0.2, lambda: peers[socket_name].send(b"req"))
    timer.start()
    try:
        assert call_on_idle(scheduler) is None
    finally:
        timer.cancel()
    assert getattr(ipc, socket_name).recv(zmq.NOBLOCK) == b"req"  # the hook only looked


def test_a_message_already_waiting_is_not_waited_for(channels, monkeypatch):
    monkeypatch.setenv("PRFAAS_POLL_WAIT_MS", str(FOREVER_MS))
    ipc, peers = channels
    peers["recv_from_tokenizer"].send(b"queued")
    scheduler = SimpleNamespace(ipc_channels=ipc)
    call_on_idle(scheduler)
    call_on_idle(scheduler)  # the poller is kept; the message still there ends this wait too
    assert ipc.recv_from_tokenizer.recv(zmq.NOBLOCK) == b"queued"


def test_a_rank_without_input_sockets_only_waits(monkeypatch):
    monkeypatch.setenv("PRFAAS_POLL_WAIT_MS", "1")
    scheduler = SimpleNamespace(ipc_channels=SimpleNamespace(recv_from_tokenizer=None, recv_from_rpc=None))
    assert call_on_idle(scheduler) is None
    assert scheduler._prfaas_poll_wait[0] == 1


@pytest.mark.parametrize("value", ["soon", "-5", "2.5"])
def test_a_malformed_value_stops_the_scheduler_naming_the_variable(channels, monkeypatch, value):
    monkeypatch.setenv("PRFAAS_POLL_WAIT_MS", value)
    ipc, _ = channels
    with pytest.raises(ConfigError, match="PRFAAS_POLL_WAIT_MS"):
        wait_for_input(None, SimpleNamespace(ipc_channels=ipc))
