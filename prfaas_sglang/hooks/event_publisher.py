"""The ``prfaas-zmq`` KV-event publisher: SGLang's ZMQ publisher writing wire v2 batches (I/O).

A cache that reports state (:mod:`prfaas_sglang.hooks.hybrid_cache`) hands its state events to the
publisher inside the list ``take_events()`` returns (:class:`EventsWithState`), which SGLang passes on
untouched; this publisher writes them as the batch's 4th element. It imports no cache of SGLang's, so
it registers on every supported release (SGLang 0.5.23 dropped the radix-cache modules the caches of
0.5.15 subclass). On a release whose publisher records its bound endpoints (0.5.23:
``describe_local_source`` advertises them in ``/server_info``), ours records them too
(``_compat.accessors.record_bound_endpoint``).
"""

from __future__ import annotations

from sglang.srt.disaggregation.kv_events import EventBatch, ZmqEventPublisher

from prfaas_sglang.wire.kv_events import KVEventBatch


class EventsWithState(list):
    """A cache's block events (the list itself) and its ``state_events``; true when either is
    non-empty, so SGLang publishes a batch that changed only state."""

    def __init__(self, events: list, state_events: list):
        super().__init__(events)
        self.state_events = state_events

    def __bool__(self) -> bool:
        return bool(len(self) or self.state_events)


def to_wire_batch(batch: EventBatch) -> KVEventBatch:
    """SGLang's batch as wire v2: its events, and as ``state_events`` the cache's state events when
    the cache reports state (:class:`EventsWithState`), else None."""
    state_events = getattr(batch.events, "state_events", None)  # the list is encoded as it is, not copied
    return KVEventBatch(ts=batch.ts, events=batch.events, attn_dp_rank=batch.attn_dp_rank, state_events=state_events)


class StateEventsZmqPublisher(ZmqEventPublisher):
    """SGLang's ZMQ publisher (same sequence numbers, replay buffer and thread) writing wire v2
    batches (:func:`to_wire_batch`). Its PUB socket binds the endpoint's host (our consumers
    connect; upstream would connect for a non-wildcard host); when the deployment has a secret,
    the PUB and the replay ROUTER are both CURVE servers in one context of their own that admit
    only the deployment's clients, and :meth:`shutdown` closes that context after the sockets."""

    _curve_server = None  # adapters.zmq.CurveServer, when the deployment has a secret

    def publish(self, events: EventBatch) -> None:
        super().publish(to_wire_batch(events))

    def _socket_setup(self) -> None:
        import zmq

        from prfaas_sglang._compat.accessors import record_bound_endpoint
        from prfaas_sglang.adapters.zmq import CurveKeys, CurveServer, bind_socket
        from prfaas_sglang.security import load_keys

        if self._pub is None:
            keys = load_keys()
            self._curve_server = CurveServer(CurveKeys.from_deployment(keys)) if keys is not None else None
            if self._curve_server is not None:
                self._ctx = self._curve_server.ctx  # its ZAP handler belongs to this context
            self._pub = bind_socket(zmq.PUB, self._endpoint, self._curve_server, hwm=self._hwm)
            record_bound_endpoint(self, self._pub)
        if self._replay_endpoint is not None and self._replay is None:
            self._replay = bind_socket(zmq.ROUTER, self._replay_endpoint, self._curve_server)
            record_bound_endpoint(self, self._replay, replay=True)

    def shutdown(self) -> None:
        super().shutdown()  # closes the PUB and replay sockets
        if self._curve_server is not None:
            self._curve_server.close()
            self._curve_server = None
