"""Release-dependent reads and writes of SGLang's own objects (inside SGLang's processes: the launcher's
argument resolution, the scheduler, the event publisher).

Part of the upstream adapter (:mod:`prfaas_sglang._compat`): a hook or backend that needs something
SGLang keeps differently per supported release asks here, and nothing else in the package tells the
releases apart. Each function says what differs, and which marker decides it; where the difference is a
field's place on a request (:func:`chunk_end`, :func:`pool_row`) it is read from the object itself, since
tests hand both releases' shapes to one release. SGLang is imported inside the functions, only where the
installed release has what is imported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from prfaas_sglang._compat import (
    DECLARED_RESOLUTION,
    PUBLISHER_BOUND_ENDPOINTS,
    TreeKind,
    exercised_by,
    installed_has,
    tree_kind,
)


@exercised_by(DECLARED_RESOLUTION.tests)
def resolving(server_args: Any) -> Any:
    """The arguments as resolution has decided them so far: on a release that resolves with frozen inputs
    (:data:`~prfaas_sglang._compat.DECLARED_RESOLUTION`, 0.5.23) its resolving view, else (0.5.15, which
    writes its decisions into the record) the record itself. Call during or after resolution."""
    if not installed_has(DECLARED_RESOLUTION):
        return server_args
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args)


@exercised_by("tests/unit/test_security.py")
def decide(server_args: Any, source: str, **fields: Any) -> None:
    """Set ``fields`` as a resolution decision of ``source`` (a handler's name): declared on 0.5.23
    (:data:`~prfaas_sglang._compat.DECLARED_RESOLUTION`), written into the record on 0.5.15."""
    if not installed_has(DECLARED_RESOLUTION):
        for name, value in fields.items():
            setattr(server_args, name, value)
        return
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, source, **fields)


@exercised_by("tests/transport/test_layerwise.py")
def chunk_end(req: Any) -> int | None:
    """Where this forward's chunk of ``req`` ends: ``extend_range.end`` (SGLang 0.5.15), ``extend_end``
    (0.5.23); None when neither is set."""
    extend = getattr(req, "extend_range", None)
    return extend.end if extend is not None else getattr(req, "extend_end", None)


@exercised_by("tests/transport/test_layerwise.py")
def pool_row(req: Any) -> int | None:
    """``req``'s row of ``req_to_token``: ``req.req_pool_idx`` (SGLang 0.5.15), ``req.kv.req_pool_idx``
    (0.5.23); None before the request has one."""
    row = getattr(req, "req_pool_idx", None)
    return row if row is not None else getattr(getattr(req, "kv", None), "req_pool_idx", None)


@exercised_by("tests/transport/test_layerwise.py")
def set_chunk(req: Any, start: int, end: int) -> None:
    """Make ``req``'s next forward the chunk ``[start, end)``, as SGLang's scheduler does: 0.5.15's
    ``set_extend_range``, 0.5.23's ``prefix_len`` and ``extend_end`` (what :func:`chunk_end` reads)."""
    if hasattr(req, "set_extend_range"):
        req.set_extend_range(start, end)
    else:
        req.prefix_len, req.extend_end = start, end


@exercised_by("tests/transport/test_layerwise.py")
def set_pool_row(req: Any, row: int) -> None:
    """Give ``req`` row ``row`` of the request pool: 0.5.15's ``req_pool_idx``, 0.5.23's ``req.kv``
    (what :func:`pool_row` reads)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        kv.req_pool_idx = row
    else:
        req.req_pool_idx = row


@exercised_by(PUBLISHER_BOUND_ENDPOINTS.tests)
def record_bound_endpoint(publisher: Any, socket: Any, replay: bool = False) -> None:
    """On a release whose ZMQ event publisher records where it bound (:data:`~prfaas_sglang._compat.
    PUBLISHER_BOUND_ENDPOINTS`, 0.5.23: ``/server_info`` advertises it), record ``socket``'s bound endpoint
    as ``publisher``'s PUB endpoint (``replay``: its replay endpoint); nothing on 0.5.15. Call right
    after binding, on the publisher's thread."""
    if not installed_has(PUBLISHER_BOUND_ENDPOINTS):
        return
    endpoint = publisher._bound_endpoint(socket)
    if replay:
        publisher._local_replay_endpoint = endpoint
    else:
        publisher._local_pub_endpoint = endpoint


@exercised_by("tests/transport/test_decode_stage.py")
def staged_pages(allocator: Any) -> int:
    """Pages SGLang's paged allocator has staged for a later release (0.5.23's ``num_staged_pages``: not
    free yet, though out of use); 0 on 0.5.15, which stages none."""
    return int(getattr(allocator, "num_staged_pages", 0) or 0)


@exercised_by("tests/engine/test_cache_move_sglang.py tests/engine/test_state_events.py")
def cache_move_backend(root: Any = None) -> ModuleType:
    """The module whose ``usable_prefix_tokens`` / ``export_prefix`` / ``import_prefix`` move prefixes on the
    installed SGLang's tree (``root``: another tree; :func:`~prfaas_sglang._compat.tree_kind`):
    :mod:`prfaas_sglang.hooks.cache_import_radix` on the per-kind trees (0.5.15),
    :mod:`prfaas_sglang.hooks.cache_import_unified` on the unified tree (0.5.23). Both import SGLang."""
    if tree_kind(root) is TreeKind.UNIFIED:
        from prfaas_sglang.hooks import cache_import_unified as backend
    else:
        from prfaas_sglang.hooks import cache_import_radix as backend
    return backend
