"""``python -m prfaas_sglang.launch``: start one process of a PrfaaS deployment.

Examples::

    python -m prfaas_sglang.launch --role prfaas --model-path /models/m --dry-run
    python -m prfaas_sglang.launch --config launch/local-two-cluster.yaml --node prfaas-0
    python -m prfaas_sglang.launch --role pd-decode --model-path /models/m -- --mem-fraction-static 0.3

Arguments after ``--`` go to ``sglang.launch_server`` unchanged (flags the
launcher owns are refused). Errors print one line and exit non-zero:
2 bad configuration or role not available yet, 3 wrong SGLang version,
4 patch series not applied.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from prfaas_sglang.envs import envs
from prfaas_sglang.errors import ConfigError, PrfaasError, RoleNotAvailableError
from prfaas_sglang.launch.plan import LaunchPlan, plan_control, plan_mock, plan_sglang
from prfaas_sglang.launch.roles import ROLE_SPECS, Engine, KvTransport, Role, parse_role
from prfaas_sglang.launch.topology import Node, load_topology


def build_parser() -> argparse.ArgumentParser:
    roles = ", ".join(r.value for r in Role)
    parser = argparse.ArgumentParser(
        prog="python -m prfaas_sglang.launch",
        description="Start one process of a PrfaaS-PD deployment (SGLang server, router or kv-index).",
        epilog="Arguments after `--` are passed to sglang.launch_server.",
    )
    parser.add_argument("--role", help=f"one of: {roles} (or taken from --node)")
    parser.add_argument("--engine", default=None, help="sglang (default) | mock (emulated engine, GPU-less)")
    parser.add_argument("--config", type=Path, help="topology YAML (see launch/*.yaml)")
    parser.add_argument("--node", help="node name in --config; its settings are defaults for the flags below")
    parser.add_argument("--model-path", help="model directory or hub id (engine roles)")
    parser.add_argument("--host", help="address the server binds (and the bootstrap server, for prefill roles)")
    parser.add_argument("--port", type=int, help="HTTP port")
    parser.add_argument("--bootstrap-port", type=int, help="PD bootstrap port (prefill roles)")
    parser.add_argument("--kv-events-port", type=int, help="publish SGLang KV events over ZMQ on this port")
    parser.add_argument("--kv-transport", help="tcp (Mooncake TCP, default) | rdma")
    parser.add_argument("--tp-size", type=int, help="tensor parallel size")
    mock = parser.add_argument_group("emulated engine (--engine mock)")
    mock.add_argument("--profile", help="MODEL@ACCELERATOR from the planner's data (e.g. kimi-linear-1t-hybrid@h20x8) or a measured profile YAML")
    mock.add_argument("--speedup", type=float, help="divide emulated durations by this")
    mock.add_argument("--kv-scale", type=float, help="real KV bytes shipped = S_kv(l) * kv_scale")
    parser.add_argument("--dry-run", action="store_true", help="print the command and environment, start nothing")
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    return parser


def _split_passthrough(argv: list[str]) -> tuple[list[str], tuple[str, ...]]:
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], tuple(argv[at + 1 :])
    return argv, ()


def resolve_node(args: argparse.Namespace) -> Node:
    """The node to start: topology defaults (``--config/--node``) overridden by flags.

    ``node.extra_args`` holds the topology's SGLang arguments only; arguments
    after ``--`` are added by the plan for the chosen engine.
    """
    if args.node and not args.config:
        raise ConfigError("--node", "needs --config")
    if args.config:
        topology = load_topology(args.config)
        if not args.node:
            raise ConfigError("--node", f"is required with --config (nodes: {', '.join(n.name for n in topology.nodes)})")
        node = topology.node(args.node)
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
    if args.bootstrap_port is not None and ROLE_SPECS[node.role].disaggregation_mode != "prefill":
        raise ConfigError("--bootstrap-port", f"only prefill roles serve a bootstrap port, not {node.role.value}")
    return dataclasses.replace(node, **{k: v for k, v in overrides.items() if v is not None})


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~"))


def make_plan(args: argparse.Namespace, extra: tuple[str, ...]) -> LaunchPlan:
    node = resolve_node(args)
    spec = ROLE_SPECS[node.role]
    try:
        engine = Engine(args.engine or "sglang")
    except ValueError:
        raise ConfigError("--engine", f"unknown engine {args.engine!r} (expected sglang or mock)") from None
    if engine not in spec.available_engines:
        raise RoleNotAvailableError(f"role {node.role.value} is not available in this release yet (planned: {spec.planned_in})")

    if not spec.is_engine_role:
        if not args.config:
            raise ConfigError("--config", f"the {node.role.value} reads its workers from a topology file")
        return plan_control(node, sys.executable, str(args.config), extra)
    mock_flags = {"--profile": args.profile, "--speedup": args.speedup, "--kv-scale": args.kv_scale}
    if engine is Engine.MOCK:
        if not args.profile:
            raise ConfigError("--profile", "is required with --engine mock (e.g. kimi-linear-1t-hybrid@h20x8)")
        mock_args = tuple(x for flag in ("--speedup", "--kv-scale") if mock_flags[flag] is not None for x in (flag, str(mock_flags[flag])))
        # The topology's extra_args are SGLang flags; the emulated engine takes only `--` arguments.
        return plan_mock(dataclasses.replace(node, extra_args=()), sys.executable, args.profile, mock_args + extra)
    given = [flag for flag, value in mock_flags.items() if value is not None]
    if given:
        raise ConfigError(given[0], "applies to --engine mock only")

    from prfaas_sglang.patches import verify_installed

    try:
        notes = (f"patch series verified: {verify_installed()}",)
    except PrfaasError as err:
        if not (args.dry_run or envs.SKIP_PATCH_VERIFY.get()):
            raise
        notes = (f"patch series NOT verified ({type(err).__name__}): {err}",)
    node = dataclasses.replace(node, extra_args=node.extra_args + extra)
    plan = plan_sglang(node, sys.executable, os.environ, notes)
    if not args.dry_run and _looks_local(node.model_path) and not Path(node.model_path).expanduser().is_dir():
        raise ConfigError("--model-path", f"{node.model_path} is not a directory")
    return plan


def main(argv: list[str] | None = None) -> int:
    ours, extra = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(ours)
    try:
        plan = make_plan(args, extra)
    except PrfaasError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if args.dry_run:
        print(json.dumps(plan.to_json(), indent=2) if args.json else plan.render())
        return 0
    sys.stdout.flush()
    os.execvpe(plan.argv[0], list(plan.argv), {**os.environ, **plan.env})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
