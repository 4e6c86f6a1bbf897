"""Hook: refuse to start an SGLang server whose settings contradict its PrfaaS role.

Runs in every process that resolves ``ServerArgs`` (the launcher's
``launch_server`` and each scheduler subprocess), as an AFTER hook on
``sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation``.
Without ``PRFAAS_ROLE`` in the environment it does nothing, so installing the
plugin never changes a stock ``sglang.launch_server``.
"""

from __future__ import annotations

import os

from prfaas_sglang.envs import envs
from prfaas_sglang.errors import ConfigError, PrfaasError
from prfaas_sglang.roles import KvTransport, parse_role, role_contract_violations


class RoleContractError(PrfaasError, ValueError):
    """SGLang's resolved server arguments do not match ``PRFAAS_ROLE``."""


def check_role_contract(result, server_args) -> None:
    """AFTER hook: ``result`` is handle_pd_disaggregation's (None); raise on a violation."""
    role_name = envs.ROLE.get()
    if role_name is None:
        return None
    try:
        role = parse_role(role_name, "PRFAAS_ROLE")
        transport_name = envs.KV_TRANSPORT.get()
        transport = KvTransport(transport_name) if transport_name else None
    except (ConfigError, ValueError) as err:
        raise RoleContractError(f"prfaas_sglang: {err}") from None
    from prfaas_sglang._compat.accessors import resolving

    resolved = resolving(server_args)  # SGLang 0.5.23 declares mooncake_tcp -> mooncake instead of writing it
    problems = role_contract_violations(
        role,
        getattr(resolved, "disaggregation_mode", None),
        getattr(resolved, "disaggregation_transfer_backend", None),
        transport,
        os.environ,
    )
    if problems:
        raise RoleContractError("prfaas_sglang: " + "; ".join(problems))
    return None
