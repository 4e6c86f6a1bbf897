"""The ``prfaas-hybrid`` radix-cache backend and the ``prfaas-zmq`` event publisher, registered with SGLang.

SGLang builds a worker's tree cache through its radix-cache registry (``--radix-cache-backend``)
and its KV-event publisher through its publisher factory (``--kv-events-config``);
:func:`register_backends` binds our names there, in every SGLang process the plugin loads into.
:func:`build_tree_cache` is the backend: SGLang's default choice, with the caches of
:mod:`prfaas_sglang.hooks.hybrid_cache` (state events, prefill admission) in place of SGLang's, and on
a decode worker with the decode radix cache :mod:`prfaas_sglang.hooks.decode_radix`'s. Both of those
modules are the caches only; this one chooses among them, so neither imports the other's way back.
"""

from __future__ import annotations

from typing import Any

from prfaas_sglang._compat import RADIX_TREES, installed_has
from prfaas_sglang.hooks.event_publisher import StateEventsZmqPublisher
from prfaas_sglang.launch.command import EVENT_PUBLISHER, RADIX_CACHE_BACKEND


def build_tree_cache(ctx: Any):
    """The ``prfaas-hybrid`` radix-cache factory: SGLang's default choice, with the state-reporting
    caches in place of ``MambaRadixCache`` and ``SWARadixCache`` (on a decode worker with the decode
    radix cache, :class:`~prfaas_sglang.hooks.decode_radix.DecodeMambaRadixCache`). Reports the
    pools' geometry first (:func:`~prfaas_sglang.hooks.hybrid_cache.report_pool_geometry`). On a
    release with the unified tree: :func:`build_unified`."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    if not installed_has(RADIX_TREES):
        return build_unified(ctx)
    from prfaas_sglang.hooks.decode_radix import DecodeMambaRadixCache
    from prfaas_sglang.hooks.hybrid_cache import (
        AdmissionRadixCache,
        StateEventsMambaRadixCache,
        StateEventsSWARadixCache,
        cache_capacity,
        default_builds_mamba_radix_cache,
        default_builds_radix_cache,
        default_builds_swa_radix_cache,
        report_pool_geometry,
    )
    from prfaas_sglang.kvindex.admission_env import admission_from_env, chunk_checkpoints_from_env

    report_pool_geometry(ctx.params)

    if default_builds_mamba_radix_cache(ctx):
        if ctx.server_args.disaggregation_mode == "decode":  # the decode radix cache (patch 0001)
            return DecodeMambaRadixCache(ctx.params)
        return StateEventsMambaRadixCache(ctx.params, admission_from_env(*cache_capacity(ctx.params)), chunk_checkpoints_from_env())
    if default_builds_swa_radix_cache(ctx):
        return StateEventsSWARadixCache(ctx.params, admission_from_env(*cache_capacity(ctx.params)))
    if default_builds_radix_cache(ctx) and (admission := admission_from_env(*cache_capacity(ctx.params))) is not None:
        return AdmissionRadixCache(ctx.params, admission)
    return default_radix_cache_factory(ctx)


def build_unified(ctx: Any):
    """``prfaas-hybrid`` on a release with the unified radix tree (SGLang 0.5.23): upstream's own cache.
    What our caches add there is not ported yet, and what depends on it is refused rather than silently
    off: a PrfaaS prefill worker's admission (``PRFAAS_PREFILL_CACHE``) raises ValueError; the cache
    reports no state events (its batches carry none, which consumers read as "reports no state")."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from prfaas_sglang.envs import envs

    if envs.PREFILL_CACHE.get() not in (None, "", "off"):
        raise ValueError("PRFAAS_PREFILL_CACHE (a PrfaaS worker's prefill admission) is not ported to this SGLang's "
                         "unified radix tree yet; unset it (the launcher: --prefill-cache off)")
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
