"""Hook ``decode-peer-rebootstrap``: a decode forgets a prefill whose KV manager was rebuilt.

SGLang 0.5.23's decode caches, per prefill bootstrap address, the prefill ranks' KV endpoints
(``connection_pool``: ``rank_ip``/``rank_port``) and registers its own KV buffers with that prefill once.
It drops the cache only when the prefill's bootstrap server stops answering ``/health``. A prefill
switched in place by ``/pd_role_switch`` (to decode and back) rebuilds its KV manager on a new port,
without registrations, while its bootstrap server keeps answering: every decode that had served it
sends later requests' metadata to the old port, and they wait until they time out.

On each successful heartbeat (``CommonKVManager._on_heartbeat_success``, upstream's hook for this), the
decode asks the prefill's bootstrap server where its first cached rank is now (its own ``/route``); a
rank that moved or is gone is a rebuilt prefill: SGLang's own ``_handle_node_failure`` then drops the
cache and fails that prefill's rooms in flight, and the next request bootstraps and registers afresh.
One GET per prefill per heartbeat (5 s by default).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("prfaas.peer_rebootstrap")


def route_query(pool_key: str, bootstrap_addr: str, infos: list[dict]) -> str | None:
    """The bootstrap server's ``/route`` query for the first of the cached ranks ``infos`` under
    ``connection_pool`` key ``pool_key`` (``{addr}_{prefill dp rank}_{prefill cp rank}_{target tp rank}``;
    each rank as ``/route`` gave it, plus its ``pp_rank``), or None (pure). Only where the key's one target
    TP rank is all that was cached (one rank per PP rank): with several target TP ranks the first cached
    rank's TP rank is not recorded, and asking for the key's would compare another rank."""
    fields = pool_key[len(bootstrap_addr) + 1:].split("_") if pool_key.startswith(bootstrap_addr + "_") else []
    pp_ranks = [info.get("pp_rank") for info in infos]
    if len(fields) != 3 or not infos or None in pp_ranks or len(set(pp_ranks)) != len(infos):
        return None
    dp_rank, cp_rank, tp_rank = fields
    return (f"/route?prefill_dp_rank={dp_rank}&prefill_cp_rank={cp_rank}&target_tp_rank={tp_rank}"
            f"&target_pp_rank={infos[0]['pp_rank']}")


def moved(cached: dict, current: dict | None) -> bool:
    """Whether a cached rank's endpoint is no longer where the bootstrap server says (pure); a rank it no
    longer knows (None) has moved too."""
    if current is None:
        return True
    return (cached.get("rank_ip"), str(cached.get("rank_port"))) != (current.get("rank_ip"), str(current.get("rank_port")))


def forget_rebuilt_prefill(result, manager, bootstrap_addr: str) -> None:
    """AFTER hook on ``CommonKVManager._on_heartbeat_success``: see the module docstring."""
    from sglang.srt.disaggregation.common.conn import _get_bootstrap_session

    with manager.connection_lock:
        cached = next(((key, list(infos)) for key, infos in manager.connection_pool.items()
                       if key.startswith(bootstrap_addr + "_") and infos), None)
    if cached is None or (query := route_query(cached[0], bootstrap_addr, cached[1])) is None:
        return None
    first = cached[1][0]
    try:
        response = _get_bootstrap_session(bootstrap_addr).get(f"http://{bootstrap_addr}{query}", timeout=(2, 3))
        current = response.json() if response.status_code == 200 else None
    except Exception as err:  # noqa: BLE001 - the heartbeat answered; an unreadable route is the next heartbeat's
        logger.debug("route of %s unreadable: %s", bootstrap_addr, err)
        return None
    if moved(first, current):
        logger.warning("prefill %s rebuilt its KV manager (rank endpoint %s:%s is gone); dropping its cached "
                       "connection", bootstrap_addr, first.get("rank_ip"), first.get("rank_port"))
        manager._handle_node_failure(bootstrap_addr)
    return None
