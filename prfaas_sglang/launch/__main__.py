"""``python -m prfaas_sglang.launch``: start one process of a PrfaaS deployment.

Examples::

    python -m prfaas_sglang.launch --role prfaas --model-path /models/m --dry-run
    python -m prfaas_sglang.launch --config launch/local-two-cluster.yaml --node prfaas-0 --engine mock
    python -m prfaas_sglang.launch --config launch/local-two-cluster.yaml            # the router node
    python -m prfaas_sglang.launch --config launch/local-two-cluster.yaml --node router --threshold 20000
    python -m prfaas_sglang.launch --role pd-decode --model-path /models/m -- --mem-fraction-static 0.3
    python -m prfaas_sglang.launch --emit k8s --config launch/paper-case-study.yaml --out deploy/   # manifests

With ``--config`` and no ``--node`` the topology's router node starts (or, with
no single router node, the error lists the nodes to choose from). For the
router and the kv-index, flags the launcher does not know are theirs
(``--threshold``, ``--max-ttft-s``, ...: see ``python -m prfaas_sglang.router --help``)
and are checked before anything starts. Arguments after ``--`` go to
``sglang.launch_server`` (or the emulated engine) unchanged; flags the launcher
owns are refused there. An emulated engine (``--engine mock``) started from a
topology takes its profile, scale (``emulation:``), tokenizer and decode batch
from the topology's runtime model, like the router's cost model.

Errors print one line and exit non-zero: 2 bad configuration or role not
available yet, 3 wrong SGLang version, 4 patch series not applied.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from prfaas_sglang.envs import envs, seconds
from prfaas_sglang.errors import ConfigError, PrfaasError, RoleNotAvailableError
from prfaas_sglang.hosts import is_wildcard
from prfaas_sglang.launch.command import (
    LaunchCommand,
    control_command,
    mock_command,
    sglang_command,
    wan_link,
    with_bind_shim,
    with_peer_hosts,
)
from prfaas_sglang.roles import ROLE_SPECS, Engine, KvTransport, Role, parse_role
from prfaas_sglang.topology import Node, Topology, load_topology


def build_parser() -> argparse.ArgumentParser:
    roles = ", ".join(r.value for r in Role)
    parser = argparse.ArgumentParser(
        prog="python -m prfaas_sglang.launch",
        description="Start one process of a PrfaaS-PD deployment (SGLang server, emulated engine, router or kv-index).",
        epilog="Arguments after `--` are passed to sglang.launch_server. Router / kv-index flags are passed to them.",
    )
    parser.add_argument("--role", help=f"one of: {roles} (or taken from --node)")
    parser.add_argument("--engine", default=None, help="sglang (default) | mock (emulated engine, GPU-less)")
    parser.add_argument("--config", type=Path, help="topology YAML (see launch/*.yaml)")
    parser.add_argument("--node", help="node name in --config (default: its router node); its settings are defaults for the flags below")
    parser.add_argument("--model-path", help="model directory or hub id (engine roles)")
    parser.add_argument("--host", help="address the server binds (and the bootstrap server, for prefill roles)")
    parser.add_argument("--port", type=int, help="HTTP port")
    parser.add_argument("--bootstrap-port", type=int, help="PD bootstrap port (prefill roles)")
    parser.add_argument("--kv-events-port", type=int, help="publish SGLang KV events over ZMQ on this port")
    parser.add_argument("--kv-transport", help="tcp (Mooncake TCP, default) | rdma")
    parser.add_argument("--kv-profile", choices=("wan", "upstream"), default="wan",
                        help="wan (default): the WAN transport profile for the cross-cluster leg; upstream: "
                             "Mooncake's and SGLang's own settings (the baseline a transport comparison starts from)")
    parser.add_argument("--tp-size", type=int, help="tensor parallel size")
    mock = parser.add_argument_group("emulated engine (--engine mock)")
    mock.add_argument("--profile", help="MODEL@ACCELERATOR from the planner's data (e.g. kimi-linear-1t-hybrid@h20x8) or a "
                                        "measured profile YAML (default with --config: the topology's cost model)")
    mock.add_argument("--speedup", type=float, help="divide emulated durations by this (default: the topology's emulation)")
    mock.add_argument("--kv-scale", type=float, help="real KV bytes shipped = S_kv(l) * kv_scale (default: the topology's)")
    parser.add_argument("--emit", choices=("k8s",), help="write Kubernetes manifests for --config's topology "
                                                         "(one directory per cluster, plus monitoring/) and exit")
    parser.add_argument("--out", type=Path, help="with --emit: the output directory (default: k8s-<topology name>)")
    parser.add_argument("--tunnel", action="store_true",
                        help="hold this host's WireGuard tunnel for the topology's encrypted links (links[].encrypt) until "
                             "stopped: the host of --node, or --host; needs PRFAAS_SECRET_FILE and CAP_NET_ADMIN. A node on "
                             "an encrypted link refuses to start without it")
    parser.add_argument("--dry-run", action="store_true", help="print the command and environment, start nothing")
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the command as JSON")
    return parser


def _split_passthrough(argv: list[str]) -> tuple[list[str], tuple[str, ...]]:
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], tuple(argv[at + 1 :])
    return argv, ()


def _default_node(topology: Topology, args: argparse.Namespace) -> Node:
    """No ``--node``: the topology's router (the usual entry point), else say which nodes exist."""
    wanted = parse_role(args.role) if args.role else Role.ROUTER
    candidates = topology.nodes_of(wanted)
    if len(candidates) == 1:
        print(f"note: no --node given: starting {wanted.value} node {candidates[0].name!r} of {args.config}", file=sys.stderr)
        return candidates[0]
    listing = ", ".join(f"{n.name} ({n.role.value})" for n in topology.nodes)
    raise ConfigError("--node", f"choose the node to start (nodes: {listing})")


def resolve_node(args: argparse.Namespace) -> tuple[Node, Topology | None]:
    """The node to start: topology defaults (``--config/--node``) overridden by flags.

    ``node.extra_args`` holds the topology's SGLang arguments only; arguments
    after ``--`` are added by the command for the chosen engine.
    """
    topology = None
    if args.node and not args.config:
        raise ConfigError("--node", "needs --config")
    if args.config:
        topology = load_topology(args.config)
        node = topology.node(args.node) if args.node else _default_node(topology, args)
        if args.role and parse_role(args.role) is not node.role:
            raise ConfigError("--role", f"{args.role} contradicts node {node.name}, whose role is {node.role.value}")
    else:
        if not args.role:
            raise ConfigError("--role", "is required (or give --config and --node)")
        node = Node(name=args.role, cluster="cli", role=parse_role(args.role))
    overrides = {
        "model_path": args.model_path,
        "host": args.host,
        "port": args.port,
        "bootstrap_port": args.bootstrap_port,
        "kv_events_port": args.kv_events_port,
        "tp_size": args.tp_size,
    }
    if args.kv_transport is not None:
        try:
            overrides["kv_transport"] = KvTransport(args.kv_transport)
        except ValueError:
            raise ConfigError("--kv-transport", f"unknown transport {args.kv_transport!r} (expected tcp or rdma)") from None
    for key in ("port", "bootstrap_port", "kv_events_port"):
        value = overrides[key]
        if value is not None and not 1 <= value <= 65535:
            raise ConfigError("--" + key.replace("_", "-"), f"must be a port number in 1..65535, got {value}")
    if args.bootstrap_port is not None and ROLE_SPECS[node.role].disaggregation_mode != "prefill" and node.role_switch is None:
        raise ConfigError("--bootstrap-port", f"only prefill roles serve a bootstrap port, not {node.role.value}")
    return dataclasses.replace(node, **{k: v for k, v in overrides.items() if v is not None}), topology


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~"))


def _check_control_flags(role: Role, flags: list[str]) -> None:
    """Flags for the router / kv-index must parse with its own parser (one-line error otherwise)."""
    if role is Role.ROUTER:
        from prfaas_sglang.router.__main__ import build_parser as control_parser
    else:
        from prfaas_sglang.kvindex.__main__ import build_parser as control_parser
    parser = control_parser()
    _, unknown = parser.parse_known_args(["--config", "x", *flags])
    if unknown:
        module = "router" if role is Role.ROUTER else "kvindex"
        raise ConfigError(unknown[0], f"is neither a launcher nor a {role.value} flag (see python -m prfaas_sglang.{module} --help)")


def _mock_args(args: argparse.Namespace, node: Node, topology: Topology | None) -> tuple[str, tuple[str, ...]]:
    """(profile, emulated-engine flags) from the command line, else from the topology's runtime model."""
    profile = args.profile
    speedup, kv_scale = args.speedup, args.kv_scale
    extra: list[str] = []
    if topology is not None:
        from prfaas_sglang import runtime

        model = runtime.site_model(topology, node.cluster)
        kind = runtime.engine_role_kind(node.role)
        profile = profile or model.costs[kind].engine_profile
        speedup = speedup if speedup is not None else model.emulation.speedup
        kv_scale = kv_scale if kv_scale is not None else model.emulation.kv_scale
        if node.role is Role.PD_DECODE or node.role_switch is not None:  # a switchable node may become decode
            extra += ["--max-batch", str(max(int(model.decode.bs_max), 1))]
        if topology.model.tokenizer:
            from prfaas_sglang.tokenizer import resolve

            extra += ["--tokenizer", resolve(topology.model.tokenizer, topology.base_dir)]
        if topology.model.served_name:
            extra += ["--served-model-name", topology.model.served_name]
    if not profile:
        raise ConfigError("--profile", "is required with --engine mock (e.g. kimi-linear-1t-hybrid@h20x8), or give --config")
    flags = [x for flag, value in (("--speedup", speedup), ("--kv-scale", kv_scale)) if value is not None for x in (flag, str(value))]
    return profile, tuple(flags + extra)


def make_command(args: argparse.Namespace, extra: tuple[str, ...], unknown: list[str] = (),
                 role: Role | None = None) -> LaunchCommand:
    """The command for the node ``args`` name; ``role``: as the other PD role (the role supervisor's restart)."""
    node, topology = resolve_node(args)
    if role is not None:
        node = dataclasses.replace(node, role=role)
    spec = ROLE_SPECS[node.role]
    try:
        engine = Engine(args.engine or "sglang")
    except ValueError:
        raise ConfigError("--engine", f"unknown engine {args.engine!r} (expected sglang or mock)") from None
    if engine not in spec.available_engines:
        if spec.planned_in is None:
            raise ConfigError("--engine", f"role {node.role.value} runs with --engine "
                                          f"{' or '.join(e.value for e in spec.available_engines)} only")
        raise RoleNotAvailableError(f"role {node.role.value} is not available in this release yet (planned: {spec.planned_in})")

    if not spec.is_engine_role:
        if not args.config:
            raise ConfigError("--config", f"the {node.role.value} reads its workers from a topology file")
        _check_control_flags(node.role, list(unknown))
        return control_command(node, sys.executable, str(args.config), tuple(unknown) + extra)
    if unknown:
        raise ConfigError(unknown[0], "is not a launcher flag (SGLang flags go after `--`)")
    if engine is Engine.MOCK:
        profile, mock_args = _mock_args(args, node, topology)
        # The topology's extra_args are SGLang flags; the emulated engine takes only `--` arguments.
        if node.role_switch == "in-place":
            mock_args += ("--enable-pd-role-switch",)
        command = mock_command(dataclasses.replace(node, extra_args=()), sys.executable, profile, mock_args + extra,
                               os.environ, wan_link(topology, node), wan_profile=args.kv_profile == "wan")
        return with_peer_hosts(_supervised(_bound(command)), topology, os.environ)
    if node.role_switch == "in-place":
        _require_in_place_switch(node)
    given = [flag for flag, value in (("--profile", args.profile), ("--speedup", args.speedup), ("--kv-scale", args.kv_scale))
             if value is not None]
    if given:
        raise ConfigError(given[0], "applies to --engine mock only")

    from prfaas_sglang.patches import verify_installed

    try:
        notes = (f"patch series verified: {verify_installed()}",)
    except PrfaasError as err:
        if not (args.dry_run or envs.SKIP_PATCH_VERIFY.get()):
            raise
        notes = (f"patch series NOT verified ({type(err).__name__}): {err}",)
    node = dataclasses.replace(node, extra_args=node.extra_args + _model_args(topology, node) + extra)
    command = _supervised(_bound(sglang_command(node, sys.executable, os.environ, notes, wan_link(topology, node),
                                                wan_profile=args.kv_profile == "wan")))
    if not args.dry_run and _looks_local(node.model_path) and not Path(node.model_path).expanduser().is_dir():
        raise ConfigError("--model-path", f"{node.model_path} is not a directory")
    return with_peer_hosts(command, topology, os.environ)


def _bound(command: LaunchCommand) -> LaunchCommand:
    """An engine's command with the bind shim (``PRFAAS_BIND_SHIM``: auto | require | off) when its
    node names a host: built here if needed, the host resolved to the address to bind. A node that
    binds all interfaces by configuration gets nothing. Raises ConfigError under ``require`` when
    the shim cannot be had."""
    mode = (envs.BIND_SHIM.get() or "auto").strip().lower()
    if mode not in ("auto", "require", "off"):
        raise ConfigError(envs.BIND_SHIM.name, f"expected auto, require or off, got {mode!r}")
    host = command.node.host or "127.0.0.1"
    if is_wildcard(host):
        return command  # configured to listen on every interface
    if mode == "off":
        return with_bind_shim(command, os.environ, None, None, f"{envs.BIND_SHIM.name}=off")
    from prfaas_sglang.native import NativeBuildError, build_bind_shim

    try:
        ip = _resolve(host)
        shim = str(build_bind_shim())
    except (NativeBuildError, OSError) as err:
        if mode == "require":
            raise ConfigError(envs.BIND_SHIM.name, f"require: {err}") from None
        return with_bind_shim(command, os.environ, None, None, str(err))
    return with_bind_shim(command, os.environ, shim, ip)


def _resolve(host: str) -> str:
    """``host`` as an address literal (a name resolved, IPv4 first). Raises OSError when it does not resolve."""
    import ipaddress
    import socket

    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    if not infos:
        raise OSError(f"{host} does not resolve")
    return infos[0][4][0]


def _require_in_place_switch(node: Node) -> None:
    """Raise ConfigError unless the installed SGLang serves ``/pd_role_switch`` (``_compat.serves_pd_role_switch``:
    0.5.23 does, 0.5.15 does not)."""
    from prfaas_sglang._compat import installed_sglang_version, serves_pd_role_switch

    if not serves_pd_role_switch():
        raise ConfigError(f"nodes.{node.name}.role_switch",
                          f"the installed SGLang ({installed_sglang_version() or 'none'}) has no /pd_role_switch; use "
                          "role_switch: restart (the launcher restarts the engine in the other role)")


def _supervised(command: LaunchCommand) -> LaunchCommand:
    """A ``role_switch: restart`` node's command, noted as run under the role supervisor."""
    node = command.node
    if node.role_switch != "restart":
        return command
    note = (f"role supervisor on {node.host or '127.0.0.1'}:{node.switch_port}: POST /pd_role_switch restarts this "
            "engine in the other PD role (launch/supervisor.py)")
    return dataclasses.replace(command, notes=command.notes + (note,))


def _model_args(topology: Topology | None, node: Node) -> tuple[str, ...]:
    """``--tokenizer-path`` / ``--served-model-name`` from the topology's model section, unless given."""
    if topology is None:
        return ()
    out: list[str] = []
    given = {a.split("=", 1)[0] for a in node.extra_args}
    if topology.model.tokenizer and "--tokenizer-path" not in given:
        from prfaas_sglang.tokenizer import resolve

        out += ["--tokenizer-path", resolve(topology.model.tokenizer, topology.base_dir)]
    if topology.model.served_name and "--served-model-name" not in given:
        out += ["--served-model-name", topology.model.served_name]
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    ours, extra = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args, unknown = build_parser().parse_known_args(ours)
    if args.emit:
        return _emit(args, unknown, extra)
    if args.tunnel:
        return _run_tunnel(args)
    try:
        command = make_command(args, extra, unknown)
        if not args.dry_run:
            _require_tunnel(args, command.node)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if args.dry_run:
        print(json.dumps(command.to_json(), indent=2) if args.json else command.render())
        return 0
    sys.stdout.flush()
    if command.node.role_switch == "restart":
        return _run_supervisor(args, extra, unknown, command)
    os.execvpe(command.argv[0], list(command.argv), {**os.environ, **command.env})
    return 0  # not reached


def _emit(args: argparse.Namespace, unknown: list[str], extra: tuple[str, ...]) -> int:
    """``--emit k8s``: the manifests of launch/k8s.py, written under ``--out``."""
    import yaml

    from prfaas_sglang.launch import grafana, k8s
    from prfaas_sglang.runtime import pair_models

    try:
        if not args.config:
            raise ConfigError("--config", "--emit needs the topology to deploy")
        stray = [flag for flag, value in (("--node", args.node), ("--role", args.role), ("--dry-run", args.dry_run))
                 if value] + list(unknown) + (["--"] if extra else [])
        if stray:
            raise ConfigError(stray[0], "does not apply to --emit (the manifests cover every node of the topology)")
        try:
            engine = Engine(args.engine or "sglang")
        except ValueError:
            raise ConfigError("--engine", f"unknown engine {args.engine!r} (expected sglang or mock)") from None
        topology = load_topology(args.config)
        pair_models(topology)  # what the router will refuse at its start is refused here, not in a crash-looping pod
        raw = yaml.safe_load(Path(args.config).read_text())
        files = k8s.render(raw, topology, engine, grafana.build_json())
        out = args.out or Path(f"k8s-{Path(args.config).stem}")
        for rel, text in files.items():
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"error: --out: {err}", file=sys.stderr)
        return 2
    clusters = sorted({rel.split("/")[0] for rel in files} - {"monitoring"})
    print(f"wrote {len(files)} files under {out}/ ({', '.join(clusters)}, monitoring); "
          f"apply with: kubectl apply -k {out}/<cluster>")
    return 0


def _tunnel_address(host: str) -> str:
    """A topology host name's address now, for the tunnel; ConfigError when it has none."""
    try:
        return _resolve(host)
    except OSError as err:
        raise ConfigError("--tunnel", f"host {host} does not resolve ({err})") from None


def _tunnel_plan(args: argparse.Namespace, host: str, public_key):
    from prfaas_sglang.transport.tunnel_plan import plan

    return plan(load_topology(args.config), host, public_key, resolve=_tunnel_address)


def _resolved_plan(args: argparse.Namespace, host: str, public_key):
    """:func:`_tunnel_plan`, waiting up to ``PRFAAS_TUNNEL_WAIT_S`` for names that do not resolve yet (Kubernetes:
    peer pods not created yet), rather than exit and be restarted with a growing back-off."""
    deadline = time.monotonic() + (envs.TUNNEL_WAIT_S.parse(seconds) or 0.0)
    while True:
        try:
            return _tunnel_plan(args, host, public_key)
        except ConfigError as err:
            if err.field != "--tunnel" or time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def _require_tunnel(args: argparse.Namespace, node: Node) -> None:
    """Refuse to start a node on an encrypted link whose host's tunnel is not up (after waiting up to
    ``PRFAAS_TUNNEL_WAIT_S`` for it): its traffic would be dropped (the tunnel's routes fail closed) or, with no
    tunnel ever set up, sent in clear."""
    if not args.config or not node.host:
        return
    from prfaas_sglang.adapters.wireguard import not_up
    from prfaas_sglang.transport.tunnel_plan import plan

    tunnel = plan(load_topology(args.config), node.host, lambda host: "", resolve=lambda host: host)  # names as they are
    if tunnel is None:
        return
    deadline = time.monotonic() + (envs.TUNNEL_WAIT_S.parse(seconds) or 0.0)
    while (why := not_up(tunnel)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    if why is not None:
        raise ConfigError(f"links ({', '.join(tunnel.links)}) encrypt",
                          f"the tunnel of host {node.host} is not up ({why}); start it first: python -m "
                          f"prfaas_sglang.launch --config {args.config} --tunnel --host {node.host}")


def _run_tunnel(args: argparse.Namespace) -> int:
    """``--tunnel``: bring up the host's tunnel and hold it until SIGTERM or SIGINT. Stopping removes the interface
    and leaves the peers' addresses blackholed (fail closed: nothing leaves in clear while the tunnel is away); a
    restart brings it back. ``ip rule del priority 9000; ip route flush table 28917`` and ``nft delete table inet
    prfaas_<interface>`` (the netfilter lock, where ``nft`` is installed) undo that for good."""
    import signal

    from prfaas_sglang.adapters.wireguard import Tunnel, public_keys
    from prfaas_sglang.security import load_keys

    try:
        if not args.config:
            raise ConfigError("--config", "--tunnel needs the topology whose encrypted links it serves")
        host = args.host or (resolve_node(args)[0].host if args.node else None)
        if not host:
            raise ConfigError("--host", "--tunnel needs the host it runs for (--host, or --node)")
        keys = load_keys()
        if keys is None:
            raise ConfigError("PRFAAS_SECRET_FILE", "an encrypted link's keys derive from the deployment secret; none is set")
        every_s = envs.TUNNEL_RESOLVE_S.parse(seconds) or 5.0  # 0: the default; a bad value stops here, tunnel down
        tunnel_plan = _resolved_plan(args, host, public_keys(keys))
        if tunnel_plan is None:
            raise ConfigError("--host", f"{host} is on no encrypted link of {args.config}")
        tunnel = Tunnel(tunnel_plan, keys.tunnel_private_key(host))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        tunnel.up()
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    try:
        print(f"tunnel {tunnel_plan.interface} up on {host}:{tunnel_plan.listen_port} for "
              f"{', '.join(tunnel_plan.links)}: peers {', '.join(tunnel_plan.peer_hosts)}", flush=True)
        _hold_tunnel(args, tunnel, public_keys(keys), every_s)
    finally:
        tunnel.take_down_interface()
    return 0


def _hold_tunnel(args: argparse.Namespace, tunnel, public_key, every_s: float) -> None:
    """Until SIGTERM or SIGINT; where the topology's hosts are names, resolve them again every
    ``PRFAAS_TUNNEL_RESOLVE_S`` and move a peer that came back at a new address (a recreated pod)."""
    import signal

    from prfaas_sglang.transport.tunnel_plan import is_address

    stop = {signal.SIGTERM, signal.SIGINT}
    if all(is_address(p.host) for p in tunnel.plan.peers):
        signal.sigwait(stop)
        return
    while signal.sigtimedwait(stop, every_s) is None:
        try:
            moved = tunnel.update(_tunnel_plan(args, tunnel.plan.host, public_key))
        except PrfaasError as err:  # a name that does not resolve now (its pod is being recreated): try again
            print(f"tunnel {tunnel.plan.interface}: {err}", file=sys.stderr, flush=True)
            continue
        for old, new in moved:
            print(f"tunnel {tunnel.plan.interface}: peer {old} moved to {new}", flush=True)


def _run_supervisor(args: argparse.Namespace, extra: tuple[str, ...], unknown: list[str], command: LaunchCommand) -> int:
    from prfaas_sglang.hosts import bracketed, local_host
    from prfaas_sglang.launch.supervisor import supervise
    from prfaas_sglang.security import load_keys

    node = command.node
    host = node.host or "127.0.0.1"
    url_host = bracketed(local_host(host))
    try:
        keys = load_keys()
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return supervise(lambda role: make_command(args, extra, unknown, role), node.role, f"http://{url_host}:{node.port}",
                     host, node.switch_port, keys)


if __name__ == "__main__":
    sys.exit(main())
