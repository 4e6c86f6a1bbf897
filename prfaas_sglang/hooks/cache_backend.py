"""The ``prfaas-hybrid`` radix-cache backend and the ``prfaas-zmq`` event publisher, registered with SGLang.

SGLang builds a worker's tree cache through its radix-cache registry (``--radix-cache-backend``)
and its KV-event publisher through its publisher factory (``--kv-events-config``);
:func:`register_backends` binds our names there, in every SGLang process the plugin loads into.
:func:`build_tree_cache` is the backend: SGLang's default choice, with the caches of
:mod:`prfaas_sglang.hooks.hybrid_cache` (0.5.15) or :mod:`prfaas_sglang.hooks.unified_cache` (0.5.23)
(state events, prefill admission) in place of SGLang's, and on a 0.5.15 decode worker with the decode
radix cache :mod:`prfaas_sglang.hooks.decode_radix`'s. Those modules are the caches only; this one
chooses among them, so none imports another's way back.
"""

from __future__ import annotations

from typing import Any

from prfaas_sglang._compat import TreeKind, tree_kind
from prfaas_sglang.hooks.event_publisher import StateEventsZmqPublisher
from prfaas_sglang.launch.command import EVENT_PUBLISHER, RADIX_CACHE_BACKEND


def build_tree_cache(ctx: Any):
    """The ``prfaas-hybrid`` radix-cache factory: SGLang's default choice, with the state-reporting
    caches in place of SGLang's and a PrfaaS prefill worker's admission policy
    (``PRFAAS_PREFILL_CACHE``). On a release with a cache class per model kind (0.5.15, by the upstream
    adapter's :func:`~prfaas_sglang._compat.tree_kind`): :func:`build_per_kind`; on one with the unified
    tree (0.5.23): :func:`~prfaas_sglang.hooks.unified_cache.build_unified`. Reports the pools' geometry first
    (:func:`~prfaas_sglang.hooks.pool_geometry.report_pool_geometry`)."""
    from prfaas_sglang.hooks.pool_geometry import cache_capacity, report_pool_geometry
    from prfaas_sglang.kvindex.admission_env import admission_from_env, chunk_checkpoints_from_env

    report_pool_geometry(ctx.params)
    admission, chunk_checkpoints = admission_from_env(*cache_capacity(ctx.params)), chunk_checkpoints_from_env()
    if tree_kind() is TreeKind.PER_KIND:
        return build_per_kind(ctx, admission, chunk_checkpoints)
    from prfaas_sglang.hooks.unified_cache import build_unified

    return build_unified(ctx, admission, chunk_checkpoints)


def build_per_kind(ctx: Any, admission: Any, chunk_checkpoints: bool):
    """SGLang 0.5.15's chain with :mod:`prfaas_sglang.hooks.hybrid_cache`'s caches in place of
    ``MambaRadixCache``, ``SWARadixCache`` and (with an admission policy) ``RadixCache``; on a decode
    worker, the decode radix cache (:class:`~prfaas_sglang.hooks.decode_radix.DecodeMambaRadixCache`)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from prfaas_sglang.hooks.decode_radix import DecodeMambaRadixCache
    from prfaas_sglang.hooks.hybrid_cache import (
        AdmissionRadixCache,
        StateEventsMambaRadixCache,
        StateEventsSWARadixCache,
        default_builds_mamba_radix_cache,
        default_builds_radix_cache,
        default_builds_swa_radix_cache,
    )

    if default_builds_mamba_radix_cache(ctx):
        if ctx.server_args.disaggregation_mode == "decode":  # the decode radix cache (patch 0001)
            return DecodeMambaRadixCache(ctx.params)
        return StateEventsMambaRadixCache(ctx.params, admission, chunk_checkpoints)
    if default_builds_swa_radix_cache(ctx):
        return StateEventsSWARadixCache(ctx.params, admission)
    if default_builds_radix_cache(ctx) and admission is not None:
        return AdmissionRadixCache(ctx.params, admission)
    return default_radix_cache_factory(ctx)


def register_backends() -> list[str]:
    """Register the radix-cache backend and the event publisher with SGLang's registries
    (idempotent: a name already bound to ours is left alone). Returns the names registered now.
    Raises RuntimeError if a name is taken by something else."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    done = []
    current = get_radix_cache_factory(RADIX_CACHE_BACKEND)
    if current is None:
        register_radix_cache_backend(RADIX_CACHE_BACKEND, build_tree_cache)
        done.append(RADIX_CACHE_BACKEND)
    elif current is not build_tree_cache:
        raise RuntimeError(f"radix-cache backend {RADIX_CACHE_BACKEND!r} is registered by {current!r}")
    current = EventPublisherFactory._registry.get(EVENT_PUBLISHER)
    if current is None:
        EventPublisherFactory.register_publisher(EVENT_PUBLISHER, StateEventsZmqPublisher)
        done.append(EVENT_PUBLISHER)
    elif current is not StateEventsZmqPublisher:
        raise RuntimeError(f"event publisher {EVENT_PUBLISHER!r} is registered by {current!r}")
    return done
