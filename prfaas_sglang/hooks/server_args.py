"""Reading and setting SGLang's server arguments inside its resolution, on every supported release.

SGLang 0.5.15 resolves ``ServerArgs`` by writing the record: a handler such as
``handle_pd_disaggregation`` rewrites ``disaggregation_transfer_backend`` ``mooncake_tcp`` ->
``mooncake`` in place, and a hook may set ``api_key`` the same way. SGLang 0.5.23 keeps the raw
inputs frozen while it resolves (``resolve_once``): handlers *declare* decisions
(``arg_groups.overrides.declare_resolution``) and readers see raw inputs with the declarations on top
(``resolving_view`` during resolution). Which release this is, is decided here once, by whether that
API exists.
"""

from __future__ import annotations

from typing import Any


def resolving(server_args: Any) -> Any:
    """The arguments as resolution has decided them so far: 0.5.23's resolving view, else the record."""
    try:
        from sglang.srt.arg_groups.overrides import resolving_view
    except ImportError:
        return server_args
    return resolving_view(server_args)


def decide(server_args: Any, source: str, **fields: Any) -> None:
    """Set ``fields`` as a resolution decision of ``source``: declared on 0.5.23, written on 0.5.15."""
    try:
        from sglang.srt.arg_groups.overrides import declare_resolution
    except ImportError:
        for name, value in fields.items():
            setattr(server_args, name, value)
        return
    declare_resolution(server_args, source, **fields)
