"""``POST /pd_role_switch``: turn a PD worker from prefill into decode or back (wire format, pure).

The shape is upstream's (SGLang 0.5.23 ``PdRoleSwitchReqInput`` / ``PdRoleSwitchReqOutput``, served by
a worker started with ``--enable-pd-role-switch``), so that one client speaks to all three servers of it:

* the emulated engine (``--enable-pd-role-switch``): rebuilds its transfer side in place;
* the launcher's role supervisor (``--role-switch restart``, SGLang 0.5.15, which has no such endpoint):
  stops the engine and starts it again in the other role;
* SGLang >= 0.5.23 itself: the adapter then points at the worker instead of the supervisor.

Semantics, upstream's: the instance must be idle (the caller drains it first); the same role is a
successful no-op; a rebuild that fails leaves the instance unhealthy until it is restarted, and the
reply says whether the caller may route to it again (``safe_to_restore``). The HTTP status is 200 on
success, 400 on a refusal or failure, with the reply as the body either way.

No ``"v"`` field: the body is upstream's. History:
  2026-11 first version: upstream's fields; ``safe_to_restore`` as sglang-router's mini_lb reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prfaas_sglang.wire._json import json_object

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleSwitchRequest:
    new_role: str
    # Upstream's: the device memory the decode graphs will take, measured on a decode peer (its
    # ``sglang:graph_memory_usage_gb{phase="decode"}``, :func:`decode_graph_memory_gb`). A worker that would
    # capture decode graphs on the switch refuses one to decode without it (safe to restore).
    decode_cuda_graph_memory_gb: float | None = None

    def to_json(self) -> dict:
        body: dict = {"new_role": self.new_role}
        if self.decode_cuda_graph_memory_gb is not None:
            body["decode_cuda_graph_memory_gb"] = self.decode_cuda_graph_memory_gb
        return body

    @classmethod
    def decode(cls, payload) -> RoleSwitchRequest:
        """ValueError for a body that is not ``{"new_role": "prefill" | "decode", ...}`` or whose
        ``decode_cuda_graph_memory_gb`` is not a non-negative number; upstream's other optional fields
        (``decode_cuda_graph_bs``) are accepted and ignored."""
        obj = json_object(payload, "role switch request")
        role = obj.get("new_role")
        if role not in ROLES:
            raise ValueError(f"invalid new_role {role!r} (expected prefill or decode)")
        graph_gb = obj.get("decode_cuda_graph_memory_gb")
        if graph_gb is not None and (isinstance(graph_gb, bool) or not isinstance(graph_gb, (int, float)) or graph_gb < 0):
            raise ValueError(f"decode_cuda_graph_memory_gb must be a non-negative number, got {graph_gb!r}")
        return cls(role, None if graph_gb is None else float(graph_gb))


DECODE_GRAPH_GAUGE = "sglang:graph_memory_usage_gb"  # SGLang >= 0.5.23, labelled by phase


def decode_graph_memory_gb(metrics_text: str) -> float | None:
    """The decode graphs' memory a worker's ``/metrics`` reports (:data:`DECODE_GRAPH_GAUGE`, phase
    ``decode``; 0.0 where it captured none), or None where it reports none (SGLang 0.5.15, metrics off).
    ValueError for a body that is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [sample.value for family in text_string_to_metric_families(metrics_text) for sample in family.samples
             if sample.name == DECODE_GRAPH_GAUGE and sample.labels.get("phase") == "decode"]
    return max(found) if found else None


@dataclass(frozen=True)
class RoleSwitchReply:
    success: bool
    message: str
    old_role: str | None = None
    new_role: str | None = None
    safe_to_restore: bool = True  # False: the instance is unhealthy; route to it again only after a restart

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def http_status(self) -> int:
        return 200 if self.success else 400

    @classmethod
    def decode(cls, payload) -> RoleSwitchReply:
        """ValueError for a reply without a boolean ``success``; unknown fields are ignored (upstream's
        may grow). A reply without ``safe_to_restore`` is taken as unsafe when it failed (upstream's
        worker does not send it; mini_lb restores only on an explicit true)."""
        obj = json_object(payload, "role switch reply")
        if not isinstance(obj.get("success"), bool):
            raise ValueError("role switch reply has no boolean 'success'")
        message = obj.get("message")
        safe = obj.get("safe_to_restore")
        return cls(obj["success"], message if isinstance(message, str) else "",
                   obj.get("old_role") if obj.get("old_role") in ROLES else None,
                   obj.get("new_role") if obj.get("new_role") in ROLES else None,
                   safe if isinstance(safe, bool) else obj["success"])
