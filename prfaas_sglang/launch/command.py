"""Turn a node's settings into the exact command and environment to start it (pure).

No I/O: the caller passes the Python executable and the current environment,
and decides whether to print the command (``--dry-run``) or exec it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from prfaas_sglang.envs import envs
from prfaas_sglang.errors import ConfigError
from prfaas_sglang.hosts import is_wildcard, zmq_bind_host
from prfaas_sglang.roles import ROLE_SPECS, Engine, KvTransport, Role
from prfaas_sglang.topology import PORT_KEYS, Node, Topology
from prfaas_sglang.transport.wan_defaults import (
    MOONCAKE_RPC_PORTS,
    EnvDefault,
    WanLink,
    mooncake_env,
)
from prfaas_sglang.wire.kv_events import KV_EVENTS_TOPIC

# Flags the launcher derives from the role and node; passing them again after
# `--` would contradict the role, so it is refused up front.
LAUNCHER_OWNED_FLAGS = (
    "--model-path",
    "--host",
    "--port",
    "--tp-size",
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
    "--disaggregation-bootstrap-port",
    "--kv-events-config",
)


@dataclass(frozen=True)
class LaunchCommand:
    """What the launcher will run. ``env`` holds only the variables it sets;
    ``env_kept`` the defaults it did not set because the environment already
    had a value (shown by ``--dry-run``)."""

    node: Node
    engine: Engine
    argv: tuple[str, ...]
    env: dict[str, str]
    env_kept: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        lines = [f"# prfaas-sglang launch: node={self.node.name} role={self.node.role.value} engine={self.engine.value}"]
        lines += [f"# {note}" for note in self.notes]
        lines.append("# environment set by the launcher (the rest is inherited):")
        lines += [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        if self.env_kept:
            lines.append("# defaults not applied, the environment already sets them:")
            lines += [f"#   {k}={shlex.quote(v)}" for k, v in sorted(self.env_kept.items())]
        lines.append("# command:")
        lines.append(shlex.join(self.argv))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "node": self.node.name,
            "role": self.node.role.value,
            "engine": self.engine.value,
            "argv": list(self.argv),
            "env": dict(sorted(self.env.items())),
            "env_kept": dict(sorted(self.env_kept.items())),
            "notes": list(self.notes),
        }


def _refuse_owned_flags(extra_args: tuple[str, ...]) -> None:
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in LAUNCHER_OWNED_FLAGS:
            raise ConfigError(
                "--", f"{flag} is set by the launcher from the role/node settings; pass it as a launcher flag instead"
            )


# Registered with SGLang by our plugin (prfaas_sglang/hooks/hybrid_cache.py): SGLang's ZMQ publisher
# writing the cache's state events too (wire.kv_events v2), and SGLang's default cache chain with a
# state-reporting MambaRadixCache. Names only: the launcher does not import SGLang.
EVENT_PUBLISHER = "prfaas-zmq"
RADIX_CACHE_BACKEND = "prfaas-hybrid"
# SGLang's PD control channel: each KV manager binds a ZMQ PULL on a random port of pyzmq's
# bind_to_random_port range (sglang/srt/utils/network.py get_zmq_socket_on_host), advertised through
# the bootstrap server; prefill and decode push their transfer status to each other there.
SGLANG_PD_ZMQ_PORTS = (49152, 65535)
PREFILL_CACHE_DEFAULT = "auto"  # what a PrfaaS prefill worker's tree keeps (envs.PREFILL_CACHE)
DECODE_RADIX_FLAG = "--disaggregation-decode-enable-radix-cache"  # SGLang's; ours serves it for hybrids
# Upstream refuses --radix-cache-backend together with these (server_args: not int8-aware).
_EXCLUDES_CACHE_BACKEND = ("--enable-int8-mamba-checkpoint",)


def kv_events_config(port: int, host: str | None = None) -> str:
    """SGLang's ``--kv-events-config`` for our ZMQ publisher on ``host:port`` (the node's interface;
    ``*``, all interfaces, only without a host). Our publisher binds whatever the host."""
    return json.dumps({"publisher": EVENT_PUBLISHER, "endpoint": f"tcp://{zmq_bind_host(host)}:{port}", "topic": KV_EVENTS_TOPIC},
                      separators=(",", ":"))


def peer_hosts(topology: Topology | None) -> str | None:
    """``PRFAAS_PEER_HOSTS`` for an engine of ``topology``: every engine node's host, comma-separated;
    None without a topology, or when a node's host is a wildcard (its peers' address is unknown)."""
    if topology is None:
        return None
    hosts = set()
    for node in topology.nodes:
        if ROLE_SPECS[node.role].is_engine_role:
            if node.host is not None and is_wildcard(node.host):
                return None
            hosts.add((node.host or "127.0.0.1").lower())
    return ",".join(sorted(hosts)) or None


def with_peer_hosts(command: LaunchCommand, topology: Topology | None, environ: Mapping[str, str]) -> LaunchCommand:
    """``command`` with ``PRFAAS_PEER_HOSTS`` set from the topology, unless the environment sets it."""
    peers = peer_hosts(topology)
    if peers is None:
        return command
    name = envs.PEER_HOSTS.name
    if environ.get(name):
        return replace(command, env_kept={**command.env_kept, name: peers})
    return replace(command, env={**command.env, name: peers})


def _prefill_cache_default(node: Node, environ: Mapping[str, str], env: dict[str, str]) -> dict[str, str]:
    """A PrfaaS node's prefix cache keeps shared prefixes, and one-off prompts only where the cache
    is large enough to hold them until they come back (``auto``, kvindex/admission.py), SGLang or
    emulated: sets ``PRFAAS_PREFILL_CACHE`` in ``env``, or, when ``environ`` has one, leaves it and
    returns the default as kept (shown by --dry-run). Every supported SGLang applies it
    (``hooks/hybrid_cache.py``, ``hooks/unified_cache.py``)."""
    if node.role is not Role.PRFAAS:
        return {}
    if environ.get(envs.PREFILL_CACHE.name):
        return {envs.PREFILL_CACHE.name: PREFILL_CACHE_DEFAULT}
    env[envs.PREFILL_CACHE.name] = PREFILL_CACHE_DEFAULT
    return {}


def _kv_events_args(node: Node) -> tuple[list[str], tuple[str, ...]]:
    """``--kv-events-config`` and, unless the node's own flags choose another cache, our cache
    backend: its state events make a hybrid model's KV-index hits exact, on a PrfaaS node (with or
    without events) it applies the prefill admission policy (``PRFAAS_PREFILL_CACHE``), and on a
    decode node with SGLang's ``--disaggregation-decode-enable-radix-cache`` it serves that cache
    for a linear-attention hybrid (patch 0001, ``hooks/decode_radix``). Returns (argv, notes)."""
    argv = [] if node.kv_events_port is None else ["--kv-events-config", kv_events_config(node.kv_events_port, node.host)]
    flags = {arg.split("=", 1)[0] for arg in node.extra_args}
    decode_radix = DECODE_RADIX_FLAG in flags
    if node.kv_events_port is None and node.role is not Role.PRFAAS and not decode_radix:
        return argv, ()
    given = "--radix-cache-backend" if "--radix-cache-backend" in flags else next(
        (f for f in _EXCLUDES_CACHE_BACKEND if f in flags), None)
    if given is not None:
        lost = [what for what, applies in (("no state events, the kv-index infers hybrid checkpoints", node.kv_events_port),
                                           ("no prefill admission, every prefill is kept", node.role is Role.PRFAAS),
                                           ("SGLang refuses the decode radix cache for a Mamba/SSM model", decode_radix))
                if applies]
        why = "given" if given == "--radix-cache-backend" else "excludes a radix-cache backend"
        return argv, (f"{given} {why}: {'; '.join(lost)}",)
    return argv + ["--radix-cache-backend", RADIX_CACHE_BACKEND], ()


def with_bind_shim(command: LaunchCommand, environ: Mapping[str, str], shim: str | None, bind_ip: str | None,
                   why_not: str | None = None) -> LaunchCommand:
    """``command`` with the bind shim preloaded (prfaas_sglang/native/bindshim.c): Mooncake's
    wildcard listeners, in ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT`` (default 15000-17000), bind
    ``bind_ip``. ``shim`` None: unchanged but for a note saying Mooncake binds all interfaces and
    ``why_not``. A preload the environment already has is kept after ours."""
    if shim is None or bind_ip is None:
        return replace(command, notes=command.notes + (f"Mooncake's listeners bind all interfaces: {why_not}",))
    env = dict(command.env)
    low = environ.get("MC_MIN_RPC_PORT") or command.env.get("MC_MIN_RPC_PORT") or str(MOONCAKE_RPC_PORTS[0])
    high = environ.get("MC_MAX_RPC_PORT") or command.env.get("MC_MAX_RPC_PORT") or str(MOONCAKE_RPC_PORTS[1])
    preload = environ.get("LD_PRELOAD")
    env.update({"LD_PRELOAD": f"{shim}:{preload}" if preload else shim,
                envs.BIND_HOST.name: bind_ip, envs.BIND_PORTS.name: f"{low}-{high}"})
    note = f"Mooncake's listeners bind {bind_ip} (ports {low}-{high}; bind shim {shim})"
    kept = dict(command.env_kept)
    # SGLang advertises its KV endpoints (Mooncake session, bootstrap registration) at its own guess of
    # the host's address (the default route's interface) unless SGLANG_HOST_IP says otherwise: with the
    # listeners bound to bind_ip, every peer's connection to that guess would be refused
    if environ.get("SGLANG_HOST_IP"):
        kept["SGLANG_HOST_IP"] = bind_ip
    elif "SGLANG_HOST_IP" not in env:
        env["SGLANG_HOST_IP"] = bind_ip
    return replace(command, env=env, env_kept=kept, notes=command.notes + (note,))


def port_range_notes(node: Node, sglang_pd: bool) -> tuple[str, ...]:
    """A note for each of ``node``'s topology ports inside a range the engine binds ports in at
    random on the same host (Mooncake's; with ``sglang_pd``, SGLang's PD ZMQ channel too): the two
    can collide at start-up, so that one launch in many fails to bind."""
    ranges = [("Mooncake's handshake and data ports", MOONCAKE_RPC_PORTS)]
    if sglang_pd:
        ranges.append(("SGLang's PD ZMQ channel (random ports)", SGLANG_PD_ZMQ_PORTS))
    notes = []
    for key in PORT_KEYS:
        value = getattr(node, key)
        for what, (low, high) in ranges:
            if value is not None and low <= value <= high:
                notes.append(f"{key} {value} lies in {what} range {low}-{high} on the same host: a start-up may "
                             f"fail to bind; choose a port outside it")
    return tuple(notes)


def sglang_command(node: Node, python: str, environ: Mapping[str, str], notes: tuple[str, ...] = (),
                   link: WanLink | None = None, wan_profile: bool = True) -> LaunchCommand:
    """The ``sglang.launch_server`` command and environment for an engine ``node``; without
    ``wan_profile``, Mooncake's and SGLang's own transport settings (``MC_FORCE_TCP`` aside)."""
    spec = ROLE_SPECS[node.role]
    if not spec.is_engine_role:
        raise ConfigError("--role", f"{node.role.value} is not an SGLang server role")
    if not node.model_path:
        raise ConfigError("--model-path", f"is required for role {node.role.value} with --engine sglang")
    _refuse_owned_flags(node.extra_args)
    if not spec.is_disaggregated:
        return _single_command(node, python, notes, environ)
    transport = node.kv_transport or spec.default_kv_transport
    if transport not in spec.allowed_kv_transports:
        raise ConfigError("--kv-transport", f"role {node.role.value} cannot use {transport.value}")

    argv = _server_argv(node, python)
    argv += ["--disaggregation-mode", spec.disaggregation_mode]
    argv += ["--disaggregation-transfer-backend", "mooncake_tcp" if transport is KvTransport.TCP else "mooncake"]
    if node.bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(node.bootstrap_port)]
    if node.role_switch == "in-place":  # SGLang's own /pd_role_switch (the launcher checked it has one)
        argv += ["--enable-pd-role-switch"]
    events_argv, events_notes = _kv_events_args(node)
    argv += events_argv + list(node.extra_args)
    notes = notes + events_notes + port_range_notes(node, sglang_pd=True)

    env = {"PRFAAS_ROLE": node.role.value, "PRFAAS_KV_TRANSPORT": transport.value}
    if node.telemetry_port is not None:
        env["PRFAAS_TELEMETRY_PORT"] = str(node.telemetry_port)  # the kv-telemetry hook publishes there
    kept = _prefill_cache_default(node, environ, env)
    if transport is KvTransport.TCP:
        env["MC_FORCE_TCP"] = "1"
        if wan_profile:  # the cross-cluster leg's profile, by role
            _set_defaults(mooncake_env(node.role, link), environ, env, kept)
    _set_defaults(grpc_port_default(node), environ, env, kept)
    return LaunchCommand(node, Engine.SGLANG, tuple(argv), env, kept, notes)


# SGLang 0.5.15 derives its native gRPC port from the HTTP port (port + 10000) even with gRPC off, and
# refuses to start when that passes 65535 (server_args._handle_deprecated_args): a --port above 55535,
# which a picker of free ports hands out about one time in five, needs SGLANG_GRPC_PORT set.
GRPC_PORT_OFFSET = 10000


def grpc_port_default(node: Node) -> tuple[EnvDefault, ...]:
    """``SGLANG_GRPC_PORT`` for a server whose derived gRPC port would be out of range (port - 10000:
    a valid port SGLang binds only with SGLANG_ENABLE_GRPC); nothing otherwise."""
    if node.port is None or node.port + GRPC_PORT_OFFSET <= 65535:
        return ()
    return (EnvDefault("SGLANG_GRPC_PORT", str(node.port - GRPC_PORT_OFFSET),
                       f"SGLang derives its gRPC port as --port + {GRPC_PORT_OFFSET} and refuses to start above 65535"),)


def _set_defaults(defaults, environ: Mapping[str, str], env: dict[str, str], kept: dict[str, str]) -> None:
    """Each default into ``env``, or into ``kept`` where ``environ`` already has a value (it wins)."""
    for default in defaults:
        if environ.get(default.name):
            kept[default.name] = default.value
        else:
            env[default.name] = default.value


def _single_command(node: Node, python: str, notes: tuple[str, ...], environ: Mapping[str, str]) -> LaunchCommand:
    """A plain SGLang server (role ``single``): no disaggregation, no KV transport."""
    if node.bootstrap_port is not None:
        raise ConfigError("--bootstrap-port", f"role {node.role.value} runs no bootstrap server")
    argv = _server_argv(node, python)
    events_argv, events_notes = _kv_events_args(node)
    argv += events_argv + list(node.extra_args)
    env, kept = {"PRFAAS_ROLE": node.role.value}, {}
    _set_defaults(grpc_port_default(node), environ, env, kept)
    return LaunchCommand(node, Engine.SGLANG, tuple(argv), env, kept, notes + events_notes)


def _server_argv(node: Node, python: str) -> list[str]:
    """``sglang.launch_server`` with the node's model, address and tensor parallelism, and SGLang's
    Prometheus metrics on (``/metrics``: the dashboard's per-worker panels) unless the node's own
    flags mention them."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", node.model_path]
    if node.host:
        argv += ["--host", node.host]
    if node.port is not None:
        argv += ["--port", str(node.port)]
    if node.tp_size is not None:
        argv += ["--tp-size", str(node.tp_size)]
    if not any(arg.startswith("--enable-metrics") for arg in node.extra_args):
        argv.append("--enable-metrics")
    return argv


def wan_link(topology: Topology | None, node: Node) -> WanLink | None:
    """The cross-cluster link ``node``'s KV crosses (from a PrfaaS cluster to a PD one), as the topology
    states it; None without a topology or such a link."""
    if topology is None:
        return None
    kinds = topology.cluster_kinds
    for link in topology.links:
        if kinds.get(link.src) == "prfaas" and kinds.get(link.dst) == "pd" and node.cluster in (link.src, link.dst):
            return WanLink(link.bandwidth_gbps * 1e9, link.rtt_ms / 1e3 if link.rtt_ms is not None else None,
                           link.layerwise)
    return None


# What of the WAN profile the emulated engine honours: Mooncake's own settings, and its PrfaaS worker's
# sender (the kv-send hooks' AsyncKvSender); the rest configures SGLang's hooks, which it does not run.
_MOCK_PROFILE = ("PRFAAS_KV_ASYNC_SEND", "PRFAAS_KV_LANE_PACING", "PRFAAS_KV_LAYERWISE")


def mock_command(node: Node, python: str, profile: str, mock_args: tuple[str, ...] = (),
                 environ: Mapping[str, str] | None = None, link: WanLink | None = None,
                 wan_profile: bool = True) -> LaunchCommand:
    """The emulated worker's command (``python -m prfaas_sglang.engine.mock``) for an engine ``node``.

    The emulated engine ships KV over Mooncake TCP whatever the node's transport says, with the
    cross-cluster leg's profile for its role and ``link`` as an SGLang worker gets it (unless
    ``wan_profile`` is off), the part of it that applies to the emulated engine: ``MC_*`` and the
    PrfaaS worker's sender. A PrfaaS node's prefix cache applies the same admission policy as an
    SGLang one's. A variable ``environ`` already sets is kept, and shown.
    """
    environ = {} if environ is None else environ
    spec = ROLE_SPECS[node.role]
    if not spec.is_engine_role:
        raise ConfigError("--role", f"{node.role.value} is not an engine role")
    if node.port is None:
        raise ConfigError("--port", f"is required for role {node.role.value} with --engine mock")
    if spec.disaggregation_mode == "prefill" and node.bootstrap_port is None:
        raise ConfigError("--bootstrap-port", f"is required for role {node.role.value} with --engine mock")
    argv = [python, "-m", "prfaas_sglang.engine.mock", "--role", node.role.value, "--host", node.host or "127.0.0.1",
            "--port", str(node.port), "--profile", profile]
    if node.bootstrap_port is not None:
        argv += ["--bootstrap-port", str(node.bootstrap_port)]
    if node.kv_events_port is not None:
        argv += ["--kv-events-port", str(node.kv_events_port)]
    if node.telemetry_port is not None:
        argv += ["--telemetry-port", str(node.telemetry_port)]
    argv += list(mock_args) + list(node.extra_args)
    env = {"PRFAAS_ROLE": node.role.value, "PRFAAS_KV_TRANSPORT": KvTransport.TCP.value, "MC_FORCE_TCP": "1"}
    kept = _prefill_cache_default(node, environ, env)
    if wan_profile:
        _set_defaults([d for d in mooncake_env(node.role, link) if d.name.startswith("MC_") or d.name in _MOCK_PROFILE],
                      environ, env, kept)
    elif node.role is Role.PRFAAS:  # its default is the hooks' sender; upstream is SGLang's synchronous batches
        _set_defaults([EnvDefault("PRFAAS_KV_ASYNC_SEND", "0", "SGLang's own sending")], environ, env, kept)
    return LaunchCommand(node, Engine.MOCK, tuple(argv), env, kept, port_range_notes(node, sglang_pd=False))


def control_command(node: Node, python: str, config_path: str, extra: tuple[str, ...] = ()) -> LaunchCommand:
    """A control-plane process (router or kv-index) for the workers of the topology at ``config_path``."""
    if node.port is None:
        raise ConfigError("--port", f"is required for role {node.role.value}")
    module = {"router": "prfaas_sglang.router", "kv-index": "prfaas_sglang.kvindex"}[node.role.value]
    argv = [python, "-m", module, "--config", config_path, "--host", node.host or "127.0.0.1", "--port", str(node.port), *extra]
    return LaunchCommand(node, Engine.SGLANG, tuple(argv), {"PRFAAS_ROLE": node.role.value})
