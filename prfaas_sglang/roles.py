"""Cluster roles and what each one means for SGLang (pure).

Shared by the launcher (which builds the command) and the plugin's
role-contract hook (which checks the resolved server arguments against it).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError


class Role(str, enum.Enum):
    PRFAAS = "prfaas"  # PrfaaS cluster: long uncached prefills, KV out over Ethernet/TCP
    PD_PREFILL = "pd-prefill"  # local PD cluster, prefill nodes (short prefills)
    PD_DECODE = "pd-decode"  # local PD cluster, decode nodes (all decoding)
    ROUTER = "router"  # global scheduler (control plane)
    KV_INDEX = "kv-index"  # global KVCache manager (control plane)
    SINGLE = "single"  # a plain SGLang server, no disaggregation: the reference the GPU check compares with


class Engine(str, enum.Enum):
    SGLANG = "sglang"
    MOCK = "mock"


class KvTransport(str, enum.Enum):
    TCP = "tcp"  # Mooncake TCP transport (MC_FORCE_TCP=1): crosses commodity Ethernet
    RDMA = "rdma"  # Mooncake RDMA: inside one RDMA island only


@dataclass(frozen=True)
class RoleSpec:
    role: Role
    cluster_kind: str  # "prfaas" | "pd" | "control" | "standalone" (never in a topology)
    disaggregation_mode: str | None  # SGLang --disaggregation-mode ("null": none), None for control-plane roles
    default_kv_transport: KvTransport | None
    allowed_kv_transports: tuple[KvTransport, ...]
    available_engines: tuple[Engine, ...]  # what this release can start
    planned_in: str | None  # which issue brings the missing engines/roles

    @property
    def is_engine_role(self) -> bool:
        return self.disaggregation_mode is not None

    @property
    def is_disaggregated(self) -> bool:
        return self.disaggregation_mode in ("prefill", "decode")


# The local PD cluster's decode nodes receive KV from the PrfaaS cluster over
# TCP, so the PD roles default to TCP too; RDMA is allowed for a PD cluster
# with no PrfaaS leg (one Mooncake engine cannot mix transports per peer in
# 0.3.13; the transport issue revisits this).
ROLE_SPECS: dict[Role, RoleSpec] = {
    Role.PRFAAS: RoleSpec(Role.PRFAAS, "prfaas", "prefill", KvTransport.TCP, (KvTransport.TCP,), (Engine.SGLANG, Engine.MOCK), None),
    Role.PD_PREFILL: RoleSpec(Role.PD_PREFILL, "pd", "prefill", KvTransport.TCP, (KvTransport.TCP, KvTransport.RDMA), (Engine.SGLANG, Engine.MOCK), None),
    Role.PD_DECODE: RoleSpec(Role.PD_DECODE, "pd", "decode", KvTransport.TCP, (KvTransport.TCP, KvTransport.RDMA), (Engine.SGLANG, Engine.MOCK), None),
    Role.ROUTER: RoleSpec(Role.ROUTER, "control", None, None, (), (Engine.SGLANG, Engine.MOCK), None),
    Role.KV_INDEX: RoleSpec(Role.KV_INDEX, "control", None, None, (), (Engine.SGLANG, Engine.MOCK), None),
    Role.SINGLE: RoleSpec(Role.SINGLE, "standalone", "null", None, (), (Engine.SGLANG,), None),
}


def parse_role(value: str, field: str = "--role", topology: bool = False) -> Role:
    """``value`` as a Role; ``topology``: only the roles a topology file may hold (not ``single``)."""
    allowed = [r for r in Role if not (topology and ROLE_SPECS[r].cluster_kind == "standalone")]
    try:
        role = Role(value)
    except ValueError:
        role = None
    if role not in allowed:
        choices = ", ".join(r.value for r in allowed)
        raise ConfigError(field, f"unknown role {value!r} (expected one of: {choices})")
    return role


def role_contract_violations(
    role: Role,
    disaggregation_mode: str | None,
    transfer_backend: str | None,
    kv_transport: KvTransport | None,
    environ: Mapping[str, str],
) -> list[str]:
    """What is wrong with SGLang's *resolved* settings for ``role`` (empty: nothing).

    Called after SGLang's own PD normalisation, which rewrites the
    ``mooncake_tcp`` backend to ``mooncake`` and sets ``MC_FORCE_TCP=1``.
    """
    spec = ROLE_SPECS[role]
    if not spec.is_engine_role:
        return [f"role {role.value} is a control-plane role and cannot run inside an SGLang server"]
    problems: list[str] = []
    if disaggregation_mode != spec.disaggregation_mode:
        problems.append(
            f"role {role.value} needs --disaggregation-mode {spec.disaggregation_mode}, got {disaggregation_mode!r}"
        )
    if not spec.is_disaggregated:  # a plain server ships no KV
        return problems
    if transfer_backend != "mooncake":
        problems.append(
            f"role {role.value} ships KV with Mooncake, got --disaggregation-transfer-backend {transfer_backend!r}"
        )
    transport = kv_transport or spec.default_kv_transport
    if transport not in spec.allowed_kv_transports:
        problems.append(f"role {role.value} cannot use the {transport.value} KV transport")
    if transport is KvTransport.TCP and environ.get("MC_FORCE_TCP") != "1":
        problems.append(f"role {role.value} uses the TCP KV transport but MC_FORCE_TCP is not 1")
    return problems
