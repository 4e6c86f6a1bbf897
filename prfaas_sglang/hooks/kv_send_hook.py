"""Hooks: a PrfaaS prefill worker sends its KV through the asynchronous sender, and never spins.

The sender is :class:`~prfaas_sglang.transport.kv_sender.AsyncKvSender` (what it does and why, and
how a failed write fails its rooms). In a process started with ``PRFAAS_KV_ASYNC_SEND=1`` (the
launcher sets it for the prfaas role), a prefill manager gets one and these hooks change how it sends:

* ``kv-send-start`` (AFTER ``MooncakeKVManager.__init__``): attach the sender;
* ``kv-send`` (AROUND ``_transfer_data``): a chunk's entries, adjacent ones merged
  (:func:`~prfaas_sglang.transport.kv_send.coalesce`) or, with a staging buffer
  (``PRFAAS_KV_STAGING_MIB``, :mod:`~prfaas_sglang.transport.kv_stager`), grouped by destination run and
  each run of scattered small sources gathered into one write as it comes up, are queued in the sender and the call
  returns 0 at once; at most :data:`~prfaas_sglang.transport.kv_sender.MAX_BATCHES_IN_FLIGHT` chunks per decode
  session are queued or on the wire (a new one waits, sleeping). The sender's thread hands the engine one write per
  lane at a time, as lanes free up. The call returns -1 when a write to that session already
  failed, so SGLang fails the room and blacklists the session as it does for a failed synchronous
  batch. Without a sender (or inside the aux barrier below) the original synchronous batch runs,
  metered as before;
* ``kv-send-aux-barrier`` (AROUND ``send_aux``, the last chunk's, after any linear or SWA
  state): first wait, sleeping, until nothing to that session is queued or in flight; when a
  write failed, or the room was in flight on a session when a write to it failed, return -1
  before sending the aux, so the decode never hears Success for KV that did not land.

* ``kv-send-ack-drain`` (AROUND ``_maybe_ack_drained_abort``, only where SGLang has it: 0.5.23's deferred
  decode KV release): an aborted room's ACK, on which the decode frees its pages, waits until every batch
  queued or in flight when SGLang would have sent it has ended; poisoned if one of them failed.

Left as upstream on 0.5.15: a decode that aborts a room (a client abort) frees its pages at once, while the
prefill side may still be sending the room's KV into them (that release has no ACK to hold there).
``PRFAAS_KV_ASYNC_SEND=0`` restores SGLang's sending.
"""

from __future__ import annotations

import logging

from prfaas_sglang.adapters.prom import ProcessMetrics, worker_labels
from prfaas_sglang.adapters.sockopts import ResetOnClose
from prfaas_sglang.envs import envs, non_negative_int
from prfaas_sglang.hooks import layerwise_hook
from prfaas_sglang.hooks.kv_telemetry import meter_transfer
from prfaas_sglang.transport.kv_send import SENDER_METRICS
from prfaas_sglang.transport.kv_sender import (
    MAX_BATCHES_IN_FLIGHT,
    AsyncKvSender,
    lane_pacing_from_env,
    mooncake_lanes_per_peer,
    mooncake_wait_bound_s,
)
from prfaas_sglang.transport.kv_stager import KvStager

logger = logging.getLogger(__name__)
_ATTR = "_prfaas_sender"


def staging_mib_from_env() -> int:
    """``PRFAAS_KV_STAGING_MIB`` parsed (0 when unset). Raises ConfigError when malformed or negative."""
    return envs.KV_STAGING_MIB.parse(non_negative_int) or 0


def kv_device(manager, server_args) -> str:
    """Where the manager's KV buffers live: SGLang's ``--device`` (cuda with the worker's GPU), else
    cuda when torch sees one, else cpu."""
    import torch

    device = getattr(server_args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        return f"cuda:{getattr(manager.kv_args, 'gpu_id', 0)}"
    return device


def stager_for(manager, engine, server_args) -> KvStager | None:
    """A :class:`KvStager` over the manager's KV buffers when ``PRFAAS_KV_STAGING_MIB`` > 0, its buffer
    registered with ``engine`` (Mooncake's ``register_memory``); None otherwise. Raises ConfigError on a
    malformed value; a buffer that cannot be allocated or registered stops startup (it was asked for)."""
    mib = staging_mib_from_env()
    if mib == 0:
        return None
    device = kv_device(manager, server_args)
    if device != "cpu" and not device.startswith("cuda"):
        logger.warning("prfaas_sglang: PRFAAS_KV_STAGING_MIB set but the KV is on %s; sending unstaged", device)
        return None
    args = manager.kv_args
    stager = KvStager(zip(args.kv_data_ptrs, args.kv_data_lens, strict=True), mib << 20, device, engine.register_memory)
    logger.info("prfaas_sglang: KV staging buffer of %d MiB on %s: scattered prefill pages go as one write per "
                "destination run", mib, device)
    return stager


def start_async_sender(result, manager, args, disaggregation_mode, server_args, is_mla_backend=False):
    """AFTER hook on ``MooncakeKVManager.__init__``: a prefill manager in a process with
    ``PRFAAS_KV_ASYNC_SEND`` set sends asynchronously."""
    if not envs.KV_ASYNC_SEND.get() or getattr(disaggregation_mode, "value", None) != "prefill":
        return None
    pacing = lane_pacing_from_env()  # a malformed value stops startup here
    staging_mib_from_env()  # and here
    engine = getattr(getattr(manager, "engine", None), "engine", None)
    if engine is None or not hasattr(engine, "transfer_submit_write") or not hasattr(engine, "transfer_check_status"):
        logger.warning("prfaas_sglang: PRFAAS_KV_ASYNC_SEND set but the transfer engine has no asynchronous "
                       "single writes; sending synchronously")
        return None
    metrics = None
    if getattr(server_args, "enable_metrics", False):  # SGLang's /metrics then shows the sender's counters too
        metrics = ProcessMetrics(SENDER_METRICS, worker_labels(server_args))
    sender = AsyncKvSender(manager, engine, mooncake_wait_bound_s(), mooncake_lanes_per_peer(), ResetOnClose(),
                           pacing=pacing, metrics=metrics, stager=stager_for(manager, engine, server_args))
    setattr(manager, _ATTR, sender)
    if envs.KV_LAYERWISE.get():
        layerwise_hook.attach(manager, sender)
    logger.info("prfaas_sglang: KV sent asynchronously (at most %d chunks queued per decode session, %d writes "
                "in the engine at once; lane pacing %s)", MAX_BATCHES_IN_FLIGHT, sender.lanes,
                f"for {sender.pacing.rate_bps / 1e9:g} Gbit/s, {sender.pacing.rtt_s * 1e3:g} ms" if sender.pacing else "off")
    return None


def send_transfer(original, manager, mooncake_session_id, transfer_blocks):
    """AROUND hook on ``MooncakeKVManager._transfer_data``: asynchronous with a sender (outside the
    aux barrier), else SGLang's synchronous batch, metered."""
    sender = getattr(manager, _ATTR, None)
    if sender is None or sender.synchronous or not transfer_blocks:
        return meter_transfer(original, manager, mooncake_session_id, transfer_blocks)
    try:
        return sender.submit(str(mooncake_session_id), transfer_blocks, layerwise_hook.streamer_of(manager))
    except Exception:  # noqa: BLE001 - SGLang's transfer thread dies on an exception; fail the chunk instead
        logger.exception("prfaas_sglang: asynchronous KV submit failed")
        return -1


def aux_barrier(original, manager, req, prefill_aux_index, dst_aux_ptrs):
    """AROUND hook on ``MooncakeKVManager.send_aux``: the room's KV has landed before its aux goes."""
    sender = getattr(manager, _ATTR, None)
    if sender is None:
        return original(manager, req, prefill_aux_index, dst_aux_ptrs)
    try:
        landed = sender.barrier(str(req.mooncake_session_id), req.room)
    except Exception:  # noqa: BLE001
        logger.exception("prfaas_sglang: waiting for KV writes failed")
        landed = False
    if not landed:
        # SGLang records no reason when the aux fails; give the room the one its chunk failure would have
        manager.record_failure(req.room, f"Failed to send kv chunk of {req.room} to "
                                         f"{getattr(req, 'endpoint', '?')}:{getattr(req, 'dst_port', '?')}")
        return -1
    sender.set_synchronous(True)
    try:
        return original(manager, req, prefill_aux_index, dst_aux_ptrs)
    finally:
        sender.set_synchronous(False)


def _in_sglang(manager, room) -> bool:
    """Whether SGLang 0.5.23's transfer worker holds a chunk of ``room`` (its count, as its own ACK check reads it)."""
    return getattr(manager, "_staging_outstanding", {}).get(room, 0) > 0


def hold_drained_ack(original, manager, room):
    """AROUND hook on ``_maybe_ack_drained_abort`` (SGLang 0.5.23's deferred decode KV release): SGLang ACKs
    an aborted room once its own count of chunks in flight is 0, and the decode then frees the room's pages;
    with a sender, a chunk's writes may still be queued or on the wire after SGLang counted it done. So the
    ACK waits for every batch open now (:meth:`AsyncKvSender.hold_ack`), then SGLang's own check runs (its
    count, a poisoned room); when one of them failed, the room is poisoned instead, as SGLang does after a
    failed send, and the decode frees the pages on its release timeout. Nothing is held while a chunk of the
    room is still inside SGLang (its count, read first, as SGLang's check does): that chunk's writes are not
    queued yet (found end to end: an ACK held on the batches open at the abort fired while the next chunk's
    writes, queued after it, were on the wire)."""
    sender = getattr(manager, _ATTR, None)
    if sender is None:
        return original(manager, room)
    if _in_sglang(manager, room):
        # A chunk of the room is still inside SGLang, its writes not yet queued here: a hold now would miss
        # them. SGLang checks again once that chunk is done (sent, or skipped as the room failed), through
        # this hook, with every write of the room then queued or on the wire.
        return None

    def fire(ok: bool) -> None:
        if not ok:
            manager.poison_deferred_ack_room(room)
        elif _in_sglang(manager, room):
            return  # a chunk of the room reached SGLang meanwhile: its own check, after it, holds again
        original(manager, room)

    try:
        if sender.hold_ack(room, fire):
            return None
    except Exception:  # noqa: BLE001 - SGLang's transfer thread dies on an exception; never ACK unproven
        logger.exception("prfaas_sglang: holding the drained ACK of room %s failed; poisoning it", room)
        manager.poison_deferred_ack_room(room)
    return original(manager, room)
