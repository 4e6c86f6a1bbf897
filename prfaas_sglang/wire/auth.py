"""Authentication from one deployment secret: derived keys, signed hand-offs, replay refusal (pure).

Every process of a deployment reads the same secret (``PRFAAS_SECRET_FILE``, loaded by
:mod:`prfaas_sglang.security`). Independent keys are derived from it by labelled HMAC-SHA256,
so no key is used for two purposes and none reveals the secret:

* ``handoff_key``: the MAC over worker-to-worker hand-off messages (a decode's registration, a
  prefill's ``kv_ready``, a cache export), which the receiver checks before it acts on any
  host, address or byte the message names;
* ``worker_api_key``: the bearer token of every worker's HTTP API (SGLang's ``--api-key``);
  the router and the workers send it to workers;
* ``zmq_server_seed`` / ``zmq_client_seed``: 32-byte CURVE secret keys; publishers are the CURVE
  servers, subscribers the clients (:mod:`prfaas_sglang.adapters.zmq` makes the key pairs).

Hand-off signature, header :data:`AUTH_HEADER`, version 1::

    X-Prfaas-Auth: v1 t=<unix seconds, integer> mac=<64 lowercase hex>
    mac = HMAC-SHA256(handoff_key, "prfaas-auth-v1\\n" METHOD "\\n" PATH "\\n" t "\\n" SHA256(body))

The signature binds the method, the path (not the host: a worker behind another name is the
same worker) and the exact body bytes. A receiver refuses it when ``t`` is more than
``max_skew_s`` from its own clock, and :class:`ReplayGuard` refuses the same MAC twice within
that window.

History:
  v1 (2026-11-24): first version.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections import OrderedDict
from dataclasses import dataclass

AUTH_HEADER = "X-Prfaas-Auth"
AUTH_VERSION = 1
MIN_SECRET_BYTES = 16
DEFAULT_MAX_SKEW_S = 60.0
_HEADER_RE = re.compile(r"v1 t=(\d{1,12}) mac=([0-9a-f]{64})")


class AuthError(ValueError):
    """A credential was missing or wrong. ``reason`` is a short metric label: ``missing``,
    ``malformed``, ``stale``, ``bad_mac``, ``replayed``, ``bad_key`` or ``unknown_peer``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, b"prfaas-sglang key v1: " + label.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, repr=False)
class DeploymentKeys:
    """The keys of one deployment; build with :meth:`from_secret`. ``repr`` hides them."""

    handoff_key: bytes
    worker_api_key: str
    zmq_server_seed: bytes
    zmq_client_seed: bytes
    tunnel_seed: bytes = b""  # the WireGuard keys of the hosts (tunnel_private_key)

    @classmethod
    def from_secret(cls, secret: bytes) -> DeploymentKeys:
        """Raises ValueError for a secret shorter than :data:`MIN_SECRET_BYTES` (surrounding
        whitespace, as a file's trailing newline, is not part of it)."""
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the deployment secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
        return cls(handoff_key=_derive(secret, "handoff"),
                   worker_api_key=_derive(secret, "worker-api-key").hex(),
                   zmq_server_seed=_derive(secret, "zmq-curve-server"),
                   zmq_client_seed=_derive(secret, "zmq-curve-client"),
                   tunnel_seed=_derive(secret, "wireguard"))

    def tunnel_private_key(self, host: str) -> bytes:
        """The WireGuard private key (32 bytes; WireGuard clamps it) of the tunnel endpoint at ``host``: every
        holder of the secret derives every host's key, so the peers of an encrypted link need no key exchange."""
        if not self.tunnel_seed:
            raise ValueError("these keys were not derived from a secret (DeploymentKeys.from_secret)")
        return hmac.new(self.tunnel_seed, b"host:" + host.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "DeploymentKeys(<hidden>)"

    def bearer(self) -> dict[str, str]:
        """The ``Authorization`` header a worker's API demands."""
        return {"Authorization": f"Bearer {self.worker_api_key}"}


def _mac(key: bytes, method: str, path: str, body: bytes, t: int) -> str:
    msg = b"prfaas-auth-v1\n%s\n%s\n%d\n%s" % (method.upper().encode(), path.encode(), t,
                                               hashlib.sha256(body).hexdigest().encode())
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, body: bytes, now_s: float) -> str:
    """The :data:`AUTH_HEADER` value for sending ``body`` as ``METHOD path`` at ``now_s`` (unix s)."""
    t = int(now_s)
    return f"v1 t={t} mac={_mac(key, method, path, body, t)}"


def verify(key: bytes, header: str | None, method: str, path: str, body: bytes, now_s: float,
           max_skew_s: float = DEFAULT_MAX_SKEW_S) -> str:
    """Check a signature; returns its MAC (for :class:`ReplayGuard`). Raises :class:`AuthError`."""
    if not header:
        raise AuthError("missing", f"{AUTH_HEADER} is required: this deployment signs its hand-offs")
    m = _HEADER_RE.fullmatch(header.strip())
    if m is None:
        raise AuthError("malformed", f"{AUTH_HEADER} must read 'v1 t=<unix seconds> mac=<64 hex>'")
    t, mac = int(m.group(1)), m.group(2)
    if abs(now_s - t) > max_skew_s:
        raise AuthError("stale", f"signed at {t}, {now_s - t:+.0f} s from this worker's clock (limit {max_skew_s:.0f} s)")
    if not hmac.compare_digest(mac, _mac(key, method, path, body, t)):
        raise AuthError("bad_mac", "the signature does not match this deployment's secret")
    return mac


def check_bearer(expected: str, authorization: str | None) -> None:
    """SGLang's ``--api-key`` rule (``Authorization: Bearer <key>``, constant-time compare)."""
    if not authorization:
        raise AuthError("missing", "an API key is required (Authorization: Bearer ...)")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise AuthError("bad_key", "invalid API key")


class ReplayGuard:
    """Refuses a MAC seen within the last ``window_s`` (pass the verifier's ``2 * max_skew_s``:
    a signature is acceptable for that long). Memory is bounded by ``max_entries``; past it the
    oldest entries go first, which only shortens the window for a flood of valid signatures."""

    def __init__(self, window_s: float = 2 * DEFAULT_MAX_SKEW_S, max_entries: int = 200_000):
        self.window_s, self.max_entries = window_s, max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # mac -> when first seen, oldest first

    def check(self, mac: str, now_s: float) -> None:
        while self._seen:
            oldest, seen_s = next(iter(self._seen.items()))
            if now_s - seen_s <= self.window_s and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        if mac in self._seen:
            raise AuthError("replayed", "this signed message was already accepted")
        self._seen[mac] = now_s

    def __len__(self) -> int:
        return len(self._seen)
