"""Load the deployment's authentication settings from the environment (I/O: reads a file).

The keys themselves and every check are pure (:mod:`prfaas_sglang.wire.auth`); this module
only finds the secret (``PRFAAS_SECRET_FILE``) and the allowed peers (``PRFAAS_PEER_HOSTS``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from urllib.parse import urlsplit

from prfaas_sglang.envs import envs
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.wire.auth import AuthError, DeploymentKeys

logger = logging.getLogger(__name__)


def load_keys(path: str | None = None) -> DeploymentKeys | None:
    """The deployment's keys from ``path`` (default ``PRFAAS_SECRET_FILE``); None when neither is
    set. Raises :class:`ConfigError` for an unreadable or too short secret."""
    path = path or envs.SECRET_FILE.get()
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16)
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ConfigError(envs.SECRET_FILE.name, f"cannot read the deployment secret {path}: {err.strerror}") from None
    try:
        keys = DeploymentKeys.from_secret(secret)
    except ValueError as err:
        raise ConfigError(envs.SECRET_FILE.name, f"{path}: {err}") from None
    if mode & stat.S_IWOTH:
        raise ConfigError(envs.SECRET_FILE.name, f"{path} is writable by anyone; refusing it")
    return keys


def warn_if_open(keys: DeploymentKeys | None, what: str) -> None:
    if keys is None:
        logger.warning("%s: no deployment secret (%s unset): hand-offs, KV events and the worker API are "
                       "unauthenticated; keep this deployment on a trusted network", what, envs.SECRET_FILE.name)


def peer_hosts(raw: str | None = None) -> frozenset[str] | None:
    """The hosts a worker may hand KV to or take it from (``PRFAAS_PEER_HOSTS``); None: any."""
    raw = raw if raw is not None else envs.PEER_HOSTS.get()
    if raw is None:
        return None
    hosts = frozenset(_normal_host(h) for h in raw.split(",") if h.strip())
    if not hosts:
        raise ConfigError(envs.PEER_HOSTS.name, "is set but names no host")
    return hosts


def _normal_host(host: str) -> str:
    """A host as compared against ``PRFAAS_PEER_HOSTS``: lower case, brackets off, an IP address in
    its canonical form (``0:0:0:0:0:0:0:1`` and ``::1`` are one host)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def check_peer(allowed: frozenset[str] | None, host_or_url: str, what: str) -> None:
    """Raise :class:`AuthError` (``unknown_peer``) unless the host of ``host_or_url`` is allowed."""
    if allowed is None:
        return
    host = host_or_url
    if "//" in host_or_url:
        try:
            host = urlsplit(host_or_url).hostname or ""
        except ValueError:
            host = ""
    elif host_or_url.startswith("[") and "]" in host_or_url:  # [v6]:port (a Mooncake session id on IPv6)
        host = host_or_url[1:host_or_url.index("]")]
    elif host_or_url.count(":") == 1:  # host:port (a Mooncake session id)
        host = host_or_url.rsplit(":", 1)[0]
    host = _normal_host(host)
    if host not in allowed:
        raise AuthError("unknown_peer", f"{what} {host!r} is not a peer of this deployment")
