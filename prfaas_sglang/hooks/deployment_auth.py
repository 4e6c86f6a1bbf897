"""Hooks: an SGLang worker of a deployment with a secret demands its API key and hands KV only to peers.

* ``set_worker_api_key`` (AFTER ``handle_pd_disaggregation``, which every process resolving
  ``ServerArgs`` runs): with ``PRFAAS_SECRET_FILE`` set, SGLang's own ``--api-key`` becomes the
  key derived from the secret (``wire.auth.DeploymentKeys.worker_api_key``), so SGLang's
  middleware guards every endpoint but ``/health*`` and ``/metrics``, and the key never appears
  on a command line. An ``--api-key`` given that differs from it stops startup: the router could
  not reach this worker.
* ``check_bootstrap_peer`` (BEFORE ``TokenizerManager._validate_one_request``): with
  ``PRFAAS_PEER_HOSTS`` set (the launcher sets it from the topology), a request whose
  ``bootstrap_host`` is not a peer is refused with SGLang's 400 for invalid input, before a
  decode worker contacts that host.

Without the variables both do nothing, so installing the plugin never changes a stock server.
SGLang's bootstrap server (``--disaggregation-bootstrap-port``) still takes unauthenticated
registrations; README "Security" names the network policy that must close it.
"""

from __future__ import annotations

from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.security import check_peer, load_keys, peer_hosts
from prfaas_sglang.wire.auth import AuthError


class DeploymentAuthError(PrfaasError, ValueError):
    """The server's API key contradicts the deployment secret."""


def set_worker_api_key(result, server_args) -> None:
    """AFTER hook: ``result`` is handle_pd_disaggregation's (None)."""
    keys = load_keys()
    if keys is None:
        return None
    current = getattr(server_args, "api_key", None)
    if current is None:
        server_args.api_key = keys.worker_api_key
    elif current != keys.worker_api_key:
        raise DeploymentAuthError("prfaas_sglang: --api-key differs from the key PRFAAS_SECRET_FILE derives; "
                                  "leave --api-key out (the deployment secret sets it)")
    return None


def check_bootstrap_peer(tokenizer_manager, obj, input_ids=None, *args, **kwargs):
    """BEFORE hook: refuse a ``bootstrap_host`` outside ``PRFAAS_PEER_HOSTS`` (ValueError: SGLang's 400)."""
    host = getattr(obj, "bootstrap_host", None)
    allowed = peer_hosts()
    if allowed is None or host is None:
        return None
    for one in host if isinstance(host, list) else [host]:
        if one is None:
            continue
        try:
            check_peer(allowed, str(one), "bootstrap_host")
        except AuthError as err:
            raise ValueError(str(err)) from None
    return None
