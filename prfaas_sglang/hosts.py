"""Host strings as the launcher, the hooks and the emulated engine read them (pure).

One rule for every process: a node's ``host`` is what it binds; a wildcard binds every interface,
and a process on the same machine reaches a wildcard-bound server on loopback.
"""

from __future__ import annotations

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*", ""})


def is_wildcard(host: str | None) -> bool:
    """True for a host that binds every interface (``None`` and ``""`` included: the default)."""
    return host is None or host.strip() in WILDCARD_HOSTS


def bracketed(host: str) -> str:
    """``host`` as it goes before ``:port`` in a URL or a ZMQ endpoint (IPv6 literals bracketed)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def local_host(host: str | None) -> str:
    """How a process on the same machine reaches a server bound at ``host``: loopback for a
    wildcard, else ``host`` itself (unbracketed)."""
    return "127.0.0.1" if is_wildcard(host) else host


def zmq_bind_host(host: str | None) -> str:
    """``host`` in a ZMQ bind endpoint: ``*`` for a wildcard, IPv6 literals bracketed."""
    return "*" if is_wildcard(host) else bracketed(host)
