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
  decode worker contacts that host. SGLang's own marker ``FAKE_BOOTSTRAP_HOST`` passes: its
  ``/health`` probe and start-up warm-up of a PD worker carry it, and no worker contacts it (the
  prefill skips the transfer, the decode fakes the hand-off). Refusing it left every PD worker
  unhealthy for good (seen on the lent H200, 2026-11-26).

* ``check_ids_in_vocab`` (BEFORE the same method, every worker): a prompt id outside
  ``[0, vocab_size)`` is refused with SGLang's 400. SGLang 0.5.15 defines this check
  (``_validate_input_ids_in_vocab``) but never calls it, and its tp=1 embedding does not mask:
  one such id reads out of bounds on the GPU (garbage, or a device assert that ends the worker).

Without the variables the first two do nothing, so installing the plugin never changes a stock
server's behaviour for valid requests.
SGLang's bootstrap server (``--disaggregation-bootstrap-port``) still takes unauthenticated
registrations; docs/security.md names the network policy that must close it.
"""

from __future__ import annotations

from prfaas_sglang.errors import PrfaasError
from prfaas_sglang.security import check_peer, load_keys, peer_hosts
from prfaas_sglang.wire.auth import AuthError


class DeploymentAuthError(PrfaasError, ValueError):
    """The server's API key contradicts the deployment secret."""


def set_worker_api_key(result, server_args) -> None:
    """AFTER hook: ``result`` is handle_pd_disaggregation's (None)."""
    from prfaas_sglang._compat.accessors import decide, resolving

    keys = load_keys()
    if keys is None:
        return None
    current = getattr(resolving(server_args), "api_key", None)
    if current is None:
        decide(server_args, "prfaas_sglang.worker-api-key", api_key=keys.worker_api_key)
    elif current != keys.worker_api_key:
        raise DeploymentAuthError("prfaas_sglang: --api-key differs from the key PRFAAS_SECRET_FILE derives; "
                                  "leave --api-key out (the deployment secret sets it)")
    return None


def check_bootstrap_peer(tokenizer_manager, obj, input_ids=None, *args, **kwargs):
    """BEFORE hook: refuse a ``bootstrap_host`` outside ``PRFAAS_PEER_HOSTS`` (ValueError: SGLang's 400)."""
    host = getattr(obj, "bootstrap_host", None)
    if host is None:  # no PD hand-off: nothing to check, and no environment to read per request
        return None
    allowed = peer_hosts()
    if allowed is None:
        return None
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    for one in host if isinstance(host, list) else [host]:
        if one is None or one == FAKE_BOOTSTRAP_HOST:
            continue
        try:
            check_peer(allowed, str(one), "bootstrap_host")
        except AuthError as err:
            raise ValueError(str(err)) from None
    return None


def check_ids_in_vocab(tokenizer_manager, obj, input_ids=None, *args, **kwargs):
    """BEFORE hook: refuse prompt ids outside the model's vocabulary (ValueError: SGLang's 400).
    Multimodal requests are left to SGLang (their processors place special ids)."""
    if not input_ids or any(getattr(obj, k, None) for k in ("image_data", "video_data", "audio_data")):
        return None
    vocab_size = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        return None
    seqs = input_ids if isinstance(input_ids[0], list) else [input_ids]
    for seq in seqs:
        if seq and (max(seq) >= vocab_size or min(seq) < 0):
            bad = next(i for i in seq if i >= vocab_size or i < 0)
            raise ValueError(f"input_ids contain {bad}, outside the model's vocabulary [0, {vocab_size})")
    return None
