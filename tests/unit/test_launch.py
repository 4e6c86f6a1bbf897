"""python -m prfaas_sglang.launch: plans, dry runs, topology files, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, run_py

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.launch.__main__ import main as launch_main
from prfaas_sglang.launch.command import mock_command, sglang_command
from prfaas_sglang.roles import KvTransport, Role
from prfaas_sglang.topology import Node, load_topology, parse_topology
from prfaas_sglang.transport.lane_pacing import LanePacing
from prfaas_sglang.transport.wan_defaults import (
    MOONCAKE_TCP_WAN_DEFAULTS,
    WanLink,
    lanes_per_peer,
    mooncake_env,
    stall_timeout_s,
)


def launch_cli(*args: str, env: dict | None = None):
    return run_py(["-m", "prfaas_sglang.launch", *args], env=env)


class TestAcceptanceCommands:
    def test_prfaas_dry_run_prints_prefill_command_and_tcp_environment(self):
        proc = launch_cli("--role", "prfaas", "--engine", "sglang", "--model-path", "/some/dir", "--dry-run")
        assert proc.returncode == 0, proc.stderr
        command = [line for line in proc.stdout.splitlines() if "sglang.launch_server" in line]
        assert len(command) == 1
        argv = shlex.split(command[0])
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
        assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "mooncake_tcp"
        assert argv[argv.index("--model-path") + 1] == "/some/dir"
        env_lines = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line and not line.startswith(("#", "/")))
        assert env_lines["MC_FORCE_TCP"] == "1"
        assert env_lines["PRFAAS_ROLE"] == "prfaas"
        for default in MOONCAKE_TCP_WAN_DEFAULTS:
            assert env_lines[default.name] == default.value

    @pytest.mark.parametrize(
        "args, reason",
        [
            (["--role", "prefil", "--model-path", "/m"], "--role: unknown role 'prefil'"),
            (["--role", "prfaas", "--dry-run"], "--model-path: is required for role prfaas"),
            (["--role", "kv-index", "--port", "8001"], "--config: the kv-index reads its workers from a topology file"),
            (["--role", "router", "--port", "8000"], "--config: the router reads its workers from a topology file"),
            (["--role", "pd-decode", "--engine", "mock"], "--profile: is required with --engine mock"),
            (["--role", "pd-decode", "--model-path", "/m", "--profile", "x@y", "--dry-run"], "--profile: applies to --engine mock only"),
            (["--role", "prfaas", "--engine", "mock", "--profile", "m@a", "--dry-run"], "--port: is required for role prfaas with --engine mock"),
            (["--role", "pd-decode", "--engine", "vllm"], "--engine: unknown engine 'vllm'"),
            (["--role", "prfaas", "--model-path", "/no/such/dir"], "--model-path: /no/such/dir is not a directory"),
            (["--role", "pd-decode", "--model-path", "/m", "--bootstrap-port", "8998", "--dry-run"], "only prefill roles"),
            (["--role", "prfaas", "--model-path", "/m", "--kv-transport", "rdma", "--dry-run"], "cannot use rdma"),
            (["--role", "prfaas", "--model-path", "/m", "--port", "70000", "--dry-run"], "--port: must be a port number"),
        ],
    )
    def test_bad_input_exits_nonzero_with_one_line(self, args, reason):
        proc = launch_cli(*args)
        assert proc.returncode != 0
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert reason in proc.stderr
        assert proc.stdout == ""


class TestWanProfile:
    """Cross-cluster legs only, scaled to the link the topology states."""

    def test_by_role(self):
        names = lambda role: {d.name for d in mooncake_env(role, WanLink(1e9, 0.02))}  # noqa: E731
        assert {"MC_TCP_LANES_PER_PEER", "MC_TCP_SLICE_SIZE", "MC_TCP_PROGRESS_TIMEOUT_SEC",
                "SGLANG_ENABLE_FAILED_SESSION_PROBE"} <= names(Role.PRFAAS)  # a blacklisted peer is probed back
        # it receives the WAN leg: the stall bound, each prompt's KV slots in one run (decode-contiguous-kv),
        # a reserve for prompts without one (decode-staging-*), and keepalive on its Mooncake connections
        # (kv-lane-keepalive), as the sender has
        assert names(Role.PD_DECODE) == {"MC_TCP_PROGRESS_TIMEOUT_SEC", "PRFAAS_DECODE_CONTIGUOUS_KV",
                                         "PRFAAS_DECODE_STAGING_TOKENS", "PRFAAS_KV_KEEPALIVE"}
        assert {"PRFAAS_KV_KEEPALIVE", "PRFAAS_KV_STAGING_MIB"} <= names(Role.PRFAAS)
        assert names(Role.PD_PREFILL) == set()  # in-cluster: SGLang's defaults

    def test_lane_pacing_gets_the_stated_link_and_only_a_stated_one(self):
        def pacing(link):
            return {d.name: d.value for d in mooncake_env(Role.PRFAAS, link)}.get("PRFAAS_KV_LANE_PACING")

        assert LanePacing.parse(pacing(WanLink(1e9, 0.02))) == LanePacing(1e9, 0.02)  # what the sender reads back
        assert LanePacing.parse(pacing(WanLink(25e9, 0.0035))) == LanePacing(25e9, 0.0035)
        assert pacing(WanLink()) is None and pacing(WanLink(1e9, None)) is None and pacing(WanLink(None, 0.02)) is None

    def test_the_emulated_engine_gets_the_part_of_the_profile_it_honours(self):
        """Mooncake's settings and the PrfaaS worker's sender, by role, as SGLang's worker gets them;
        with ``--kv-profile upstream`` its PrfaaS worker sends SGLang's way; the environment wins."""
        link = WanLink(1e9, 0.02)
        node = lambda role, **kw: Node("n", "c", role, port=30000, bootstrap_port=8998, **kw)  # noqa: E731
        prfaas = mock_command(node(Role.PRFAAS), "python", "h200x8", link=link).env
        assert prfaas["PRFAAS_KV_ASYNC_SEND"] == "1" and prfaas["MC_TCP_LANES_PER_PEER"] == "4"
        assert LanePacing.parse(prfaas["PRFAAS_KV_LANE_PACING"]) == LanePacing(1e9, 0.02)
        sglang = {d.name: d.value for d in mooncake_env(Role.PRFAAS, link)}
        assert {k: v for k, v in sglang.items() if k.startswith("MC_")}.items() <= prfaas.items()
        assert not any(k.startswith("SGLANG_") or k == "PRFAAS_KV_KEEPALIVE" for k in prfaas)  # SGLang's hooks only
        decode = mock_command(node(Role.PD_DECODE), "python", "h20x8", link=link).env
        assert decode["MC_TCP_PROGRESS_TIMEOUT_SEC"] == sglang["MC_TCP_PROGRESS_TIMEOUT_SEC"]
        assert "PRFAAS_DECODE_CONTIGUOUS_KV" not in decode
        in_cluster = mock_command(node(Role.PD_PREFILL), "python", "h20x8", link=link).env
        assert not {k for k in in_cluster if k.startswith("MC_")} - {"MC_FORCE_TCP"} and "PRFAAS_KV_ASYNC_SEND" not in in_cluster
        upstream = mock_command(node(Role.PRFAAS), "python", "h200x8", link=link, wan_profile=False).env
        assert upstream["PRFAAS_KV_ASYNC_SEND"] == "0" and "MC_TCP_LANES_PER_PEER" not in upstream
        own = mock_command(node(Role.PRFAAS), "python", "h200x8", environ={"MC_TCP_LANES_PER_PEER": "8"}, link=link)
        assert "MC_TCP_LANES_PER_PEER" not in own.env and own.env_kept["MC_TCP_LANES_PER_PEER"] == "4"

    def test_a_layerwise_link_streams_on_its_prfaas_workers_and_in_the_routers_estimate(self, tmp_path):
        """``links[].layerwise``: PRFAAS_KV_LAYERWISE on the PrfaaS worker (SGLang's and the emulated one's), none
        elsewhere; the router's model of the pair knows it (its estimate overlaps, ``router.policy``)."""
        from prfaas_sglang.launch.command import wan_link
        from prfaas_sglang.runtime import from_topology

        text = (REPO_ROOT / "launch" / "local-two-cluster.yaml").read_text()
        plain = parse_topology(yaml.safe_load(text), base_dir=REPO_ROOT / "launch")
        raw = yaml.safe_load(text)
        for link in raw["links"]:
            link["layerwise"] = True
        streamed = parse_topology(raw, base_dir=REPO_ROOT / "launch")
        for topology, expected in ((plain, False), (streamed, True)):
            prfaas = topology.nodes_of(Role.PRFAAS)[0]
            link = wan_link(topology, prfaas)
            assert link.layerwise is expected and from_topology(topology).layerwise is expected
            env = mock_command(prfaas, "python", "h200x8", link=link).env
            assert (env.get("PRFAAS_KV_LAYERWISE") == "1") is expected
            assert ({d.name: d.value for d in mooncake_env(Role.PRFAAS, link)}.get("PRFAAS_KV_LAYERWISE") == "1") is expected
            assert all(d.name != "PRFAAS_KV_LAYERWISE" for d in mooncake_env(Role.PD_DECODE, link))
        raw["links"][0]["layerwise"] = "yes"
        with pytest.raises(ConfigError, match=r"links\[0\]\.layerwise: must be true or false"):
            parse_topology(raw, base_dir=REPO_ROOT / "launch")

    def test_bounds_scale_with_the_link(self):
        fast, slow = WanLink(1e9, 0.02), WanLink(10e6, 0.2)
        assert stall_timeout_s(fast) == 5 < stall_timeout_s(slow)  # 1 MiB at 10 Mbit/s is 0.84 s a slice
        env = lambda link: {d.name: int(d.value) for d in mooncake_env(Role.PRFAAS, link) if d.name.endswith("TIMEOUT")}  # noqa: E731
        assert env(fast)["MC_TRANSFER_TIMEOUT"] == 35 and env(slow)["MC_TRANSFER_TIMEOUT"] > 3000
        assert env(WanLink())["MC_TRANSFER_TIMEOUT"] == 300  # no link stated: the old flat bound

    @pytest.mark.parametrize(("env", "lanes"), [
        ({}, 4), ({"MC_TCP_LANES_PER_PEER": "8"}, 8), ({"MC_TCP_LANES_PER_PEER": "16"}, 16),
        ({"MC_TCP_LANES_PER_PEER": "0"}, 4), ({"MC_TCP_LANES_PER_PEER": "17"}, 4),  # out of range: Mooncake's default
        ({"MC_TCP_LANES_PER_PEER": " 8"}, 4), ({"MC_TCP_LANES_PER_PEER": "+8"}, 4), ({"MC_TCP_LANES_PER_PEER": ""}, 4),
        ({"MC_TCP_LANES_PER_PEER": "\u0668"}, 4),  # a digit to str.isdigit, not to Mooncake
        ({"MC_TCP_MAX_CONNECTIONS_PER_PEER": "2"}, 2),  # the deprecated name, when the new one is unset
        ({"MC_TCP_LANES_PER_PEER": "3", "MC_TCP_MAX_CONNECTIONS_PER_PEER": "2"}, 3),
    ])
    def test_lanes_per_peer_reads_the_environment_as_mooncake_does(self, env, lanes):
        """The kv-send hooks hand Mooncake at most this many writes per decode session: a figure above
        the engine's own would queue writes inside it, where a failed room's could go out late."""
        assert lanes_per_peer(env) == lanes

    def test_the_launcher_reads_the_link_from_the_topology(self, tmp_path):
        doc = {"version": 1, "clusters": {
            "remote": {"kind": "prfaas", "nodes": [{"name": "p0", "role": "prfaas", "port": 30000, "bootstrap_port": 8998,
                                                 "telemetry_port": 5600}]},
            "local": {"kind": "pd", "nodes": [{"name": "pp0", "role": "pd-prefill", "port": 30001, "bootstrap_port": 8999},
                                              {"name": "d0", "role": "pd-decode", "port": 30002}]}},
               "links": [{"from": "remote", "to": "local", "bandwidth_gbps": 0.01, "rtt_ms": 200}]}
        config = tmp_path / "t.yaml"
        config.write_text(yaml.safe_dump(doc))

        def env_of(name, prefix="MC_"):
            proc = launch_cli("--config", str(config), "--node", name, "--model-path", "/m", "--dry-run")
            assert proc.returncode == 0, proc.stderr
            return dict(line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith(prefix))

        slow = str(stall_timeout_s(WanLink(10e6, 0.2)))
        assert env_of("p0")["MC_TCP_PROGRESS_TIMEOUT_SEC"] == slow and env_of("p0")["MC_TCP_LANES_PER_PEER"] == "4"
        assert env_of("d0") == {"MC_FORCE_TCP": "1", "MC_TCP_PROGRESS_TIMEOUT_SEC": slow}
        assert env_of("pp0") == {"MC_FORCE_TCP": "1"}
        assert env_of("p0", "PRFAAS_TELEMETRY_PORT")["PRFAAS_TELEMETRY_PORT"] == "5600"  # the kv-telemetry hook's port


class TestPlan:
    def test_decode_plan(self):
        node = Node("d0", "pd", Role.PD_DECODE, host="0.0.0.0", port=30001, kv_events_port=5558, model_path="/m", tp_size=2)
        plan = sglang_command(node, "/usr/bin/python3", {})
        argv = list(plan.argv)
        assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
        assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == "30001"
        assert argv[argv.index("--tp-size") + 1] == "2"
        events = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert events == {"publisher": "prfaas-zmq", "endpoint": "tcp://*:5558", "topic": "kv-events"}
        assert argv[argv.index("--radix-cache-backend") + 1] == "prfaas-hybrid"
        assert "--disaggregation-bootstrap-port" not in argv

    def test_kv_events_config_is_accepted_by_sglang_and_names_registered_backends(self):
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventsConfig
        from sglang.srt.mem_cache.registry import get_radix_cache_factory

        from prfaas_sglang.hooks.cache_backend import register_backends

        register_backends()  # what the plugin does in every SGLang process
        node = Node("p0", "pd", Role.PD_PREFILL, kv_events_port=5557, model_path="/m")
        argv = list(sglang_command(node, "python", {}).argv)
        config = KVEventsConfig.from_cli(argv[argv.index("--kv-events-config") + 1])
        assert config.publisher == "prfaas-zmq" and config.endpoint == "tcp://*:5557"
        assert config.publisher in EventPublisherFactory._registry
        assert get_radix_cache_factory(argv[argv.index("--radix-cache-backend") + 1]) is not None

    def test_only_the_prfaas_role_gets_the_auto_admission_policy(self):
        """PRFAAS_PREFILL_CACHE=auto for the prfaas role (kvindex/admission.py); an operator's own
        value is kept and shown; other roles keep SGLang's behaviour."""
        from prfaas_sglang.kvindex.admission_env import admission_from_env

        prfaas = Node("p0", "prfaas", Role.PRFAAS, bootstrap_port=8998, kv_events_port=5557, model_path="/m")
        plan = sglang_command(prfaas, "python", {})
        assert plan.env["PRFAAS_PREFILL_CACHE"] == "auto"  # either supported release applies it
        own = sglang_command(prfaas, "python", {"PRFAAS_PREFILL_CACHE": "all"})
        assert "PRFAAS_PREFILL_CACHE" not in own.env and own.env_kept == {**own.env_kept, "PRFAAS_PREFILL_CACHE": "auto"}
        for role in (Role.PD_PREFILL, Role.PD_DECODE):
            node = Node("x", "pd", role, bootstrap_port=8999 if role is Role.PD_PREFILL else None, model_path="/m",
                        port=30001)
            assert "PRFAAS_PREFILL_CACHE" not in sglang_command(node, "python", {}).env
            assert "PRFAAS_PREFILL_CACHE" not in mock_command(node, "python", "h20x8").env
        # the emulated engine follows the same policy (its cache uses the same PrefixAdmission)
        emulated = mock_command(dataclasses.replace(prfaas, port=30000), "python", "h200x8")
        assert emulated.env["PRFAAS_PREFILL_CACHE"] == "auto"
        own = mock_command(dataclasses.replace(prfaas, port=30000), "python", "h200x8", environ={"PRFAAS_PREFILL_CACHE": "all"})
        assert "PRFAAS_PREFILL_CACHE" not in own.env and own.env_kept["PRFAAS_PREFILL_CACHE"] == "auto"
        import os

        saved = os.environ.get("PRFAAS_PREFILL_CACHE")
        try:
            os.environ["PRFAAS_PREFILL_CACHE"] = emulated.env["PRFAAS_PREFILL_CACHE"]
            assert admission_from_env(capacity_tokens=1 << 20).mode == "auto"
            with pytest.raises(ValueError, match="capacity"):  # auto needs the cache's size
                admission_from_env()
            os.environ["PRFAAS_PREFILL_CACHE"] = "most"
            with pytest.raises(ValueError, match="all, shared, auto, none"):
                admission_from_env()
        finally:
            os.environ.pop("PRFAAS_PREFILL_CACHE", None)
            if saved is not None:
                os.environ["PRFAAS_PREFILL_CACHE"] = saved

    @pytest.mark.parametrize("flag", ["--radix-cache-backend=mine", "--enable-int8-mamba-checkpoint"])
    def test_a_node_choosing_its_own_cache_keeps_it_and_is_told(self, flag):
        node = Node("p0", "pd", Role.PD_PREFILL, kv_events_port=5557, model_path="/m", extra_args=(flag,))
        plan = sglang_command(node, "python", {})
        assert list(plan.argv).count("--radix-cache-backend") == 0 and flag in plan.argv
        assert any("kv-index infers hybrid checkpoints" in note for note in plan.notes)

    def test_a_prfaas_node_gets_the_admission_cache_with_or_without_kv_events(self):
        """The prefill admission policy lives in the prfaas-hybrid backend: a PrfaaS node gets it even
        without a KV-event port (other roles then keep SGLang's cache); a node that names its own
        cache keeps it and is told what it loses."""
        bare = Node("p0", "prfaas", Role.PRFAAS, bootstrap_port=8998, model_path="/m")
        argv = list(sglang_command(bare, "python", {}).argv)
        assert argv[argv.index("--radix-cache-backend") + 1] == "prfaas-hybrid" and "--kv-events-config" not in argv
        pd = Node("x", "pd", Role.PD_PREFILL, bootstrap_port=8999, model_path="/m")
        assert "--radix-cache-backend" not in sglang_command(pd, "python", {}).argv
        own = sglang_command(dataclasses.replace(bare, extra_args=("--radix-cache-backend", "mine")), "python", {})
        assert list(own.argv).count("--radix-cache-backend") == 1
        assert any("no prefill admission" in note and "state events" not in note for note in own.notes)

    def test_a_decode_node_with_sglangs_decode_radix_cache_gets_the_backend_that_serves_it_for_hybrids(self):
        """SGLang 0.5.15 refuses the decode radix cache for a Mamba/SSM model unless the
        prfaas-hybrid backend serves it (patch 0001): a decode node asking for it gets the backend
        even without a KV-event port; one that names its own cache keeps it and is told."""
        node = Node("d0", "pd", Role.PD_DECODE, model_path="/m", extra_args=("--disaggregation-decode-enable-radix-cache",))
        argv = list(sglang_command(node, "python", {}).argv)
        assert argv[argv.index("--radix-cache-backend") + 1] == "prfaas-hybrid"
        plain = dataclasses.replace(node, extra_args=())
        assert "--radix-cache-backend" not in sglang_command(plain, "python", {}).argv
        own = sglang_command(dataclasses.replace(node, extra_args=node.extra_args + ("--radix-cache-backend=mine",)),
                             "python", {})
        assert any("decode radix cache for a Mamba/SSM model" in note for note in own.notes)

    def test_plan_arguments_parse_with_sglang_own_parser(self):
        """Every flag we emit exists in sglang 0.5.15's argument parser with the value we give."""
        import argparse

        from sglang.srt.server_args import ServerArgs

        node = Node("p0", "prfaas", Role.PRFAAS, host="127.0.0.1", port=30000, bootstrap_port=8998,
                    kv_events_port=5557, model_path="/m", tp_size=1)
        argv = list(sglang_command(node, "python", {}).argv)[3:]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        assert ns.disaggregation_mode == "prefill"
        assert ns.disaggregation_transfer_backend == "mooncake_tcp"
        assert ns.disaggregation_bootstrap_port == 8998 and ns.port == 30000

    def test_rdma_plan_sets_no_tcp_environment(self):
        node = Node("p0", "pd", Role.PD_PREFILL, model_path="/m", kv_transport=KvTransport.RDMA)
        plan = sglang_command(node, "python", {})
        argv = list(plan.argv)
        assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "mooncake"
        assert "MC_FORCE_TCP" not in plan.env and plan.env["PRFAAS_KV_TRANSPORT"] == "rdma"

    def test_operator_environment_wins_over_wan_defaults(self):
        node = Node("p0", "prfaas", Role.PRFAAS, model_path="/m")
        plan = sglang_command(node, "python", {"MC_TCP_LANES_PER_PEER": "16"})
        assert "MC_TCP_LANES_PER_PEER" not in plan.env
        assert plan.env_kept == {"MC_TCP_LANES_PER_PEER": "4"}  # the profile's value, not applied
        assert plan.env["MC_FORCE_TCP"] == "1"

    def test_passthrough_cannot_override_the_role(self):
        node = Node("p0", "prfaas", Role.PRFAAS, model_path="/m", extra_args=("--disaggregation-mode=decode",))
        with pytest.raises(ConfigError, match="--disaggregation-mode is set by the launcher"):
            sglang_command(node, "python", {})

    def test_passthrough_arguments_are_appended(self, capsys):
        rc = launch_main(["--role", "pd-decode", "--model-path", "/m", "--dry-run", "--json", "--", "--mem-fraction-static", "0.3"])
        assert rc == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["argv"][-2:] == ["--mem-fraction-static", "0.3"]
        assert plan["role"] == "pd-decode" and plan["env"]["PRFAAS_ROLE"] == "pd-decode"


TOPOLOGIES = sorted((REPO_ROOT / "launch").glob("*.yaml"))


class TestTopology:
    @pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
    def test_shipped_topologies_validate(self, path):
        topology = load_topology(path)
        roles = {n.role for n in topology.nodes}
        assert {Role.PRFAAS, Role.PD_PREFILL, Role.PD_DECODE} <= roles

    def test_shipped_topologies_exist(self):
        assert TOPOLOGIES

    def test_node_from_config_and_flag_override(self, capsys):
        path = REPO_ROOT / "launch" / "local-two-cluster.yaml"
        node = next(n for n in load_topology(path).nodes if n.role is Role.PRFAAS)
        rc = launch_main(["--config", str(path), "--node", node.name, "--port", "31999", "--dry-run", "--json"])
        assert rc == 0
        argv = json.loads(capsys.readouterr().out)["argv"]
        assert argv[argv.index("--port") + 1] == "31999"
        assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == str(node.bootstrap_port)
        assert argv[argv.index("--model-path") + 1] == node.model_path

    def test_role_flag_contradicting_node(self):
        path = REPO_ROOT / "launch" / "local-two-cluster.yaml"
        node = next(n for n in load_topology(path).nodes if n.role is Role.PRFAAS)
        proc = launch_cli("--config", str(path), "--node", node.name, "--role", "pd-decode", "--dry-run")
        assert proc.returncode == 2 and "contradicts node" in proc.stderr


def base_topology() -> dict:
    return {
        "version": 1,
        "model": {"path": "/m"},
        "clusters": {
            "b": {"kind": "prfaas", "nodes": [{"name": "p0", "role": "prfaas", "port": 30000, "bootstrap_port": 8998}]},
            "a": {
                "kind": "pd",
                "nodes": [
                    {"name": "pp0", "role": "pd-prefill", "port": 30100, "bootstrap_port": 8999},
                    {"name": "d0", "role": "pd-decode", "port": 30200},
                ],
            },
        },
        "links": [{"from": "b", "to": "a", "bandwidth_gbps": 100, "rtt_ms": 5}],
    }


def mutate(path: str, value):
    data = base_topology()
    keys = path.replace("[", ".").replace("]", "").split(".")
    target = data
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    last = keys[-1]
    if value is KeyError:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return data


class TestTopologyErrorsNameTheField:
    def test_base_is_valid(self):
        topology = parse_topology(base_topology())
        assert [n.name for n in topology.nodes] == ["p0", "pp0", "d0"]
        assert topology.links[0].bandwidth_gbps == 100.0

    @pytest.mark.parametrize(
        "path, value, field, message",
        [
            ("version", 2, "version", "must be one of"),
            ("clusters.a.nodes[1].role", "decoder", "clusters.a.nodes[1].role", "unknown role 'decoder'"),
            ("clusters.a.nodes[1].role", "prfaas", "clusters.a.nodes[1].role", "cannot run in a pd cluster"),
            ("clusters.a.nodes[0].port", "30100", "clusters.a.nodes[0].port", "port number"),
            ("clusters.a.nodes[0].bootstrap_port", 0, "clusters.a.nodes[0].bootstrap_port", "port number"),
            ("clusters.a.nodes[1].bootstrap_port", 9000, "clusters.a.nodes[1].bootstrap_port", "only prefill roles"),
            ("clusters.a.nodes[1].bootstrap_prot", 9000, "clusters.a.nodes[1].bootstrap_prot", "did you mean 'bootstrap_port'"),
            ("clusters.a.kind", "gpu", "clusters.a.kind", "must be one of"),
            ("clusters.a.nodes", [], "clusters.a.nodes", "non-empty list"),
            ("clusters.a.kv_transport", "udp", "clusters.a.kv_transport", "unknown KV transport"),
            ("clusters.b.kv_transport", "rdma", "clusters.b.nodes[0].role", "cannot use the rdma KV transport"),
            ("clusters.a.nodes[1].port", 30000, "clusters.a.nodes[1].port", "already used by p0.port"),
            ("clusters.a.nodes[1].name", "p0", "clusters.a.nodes[1].name", "used twice"),
            ("clusters.a.nodes[0].tp_size", 1.5, "clusters.a.nodes[0].tp_size", "must be an integer"),
            ("links[0].to", "c", "links[0].to", "unknown cluster 'c'"),
            ("links[0].bandwidth_gbps", -1, "links[0].bandwidth_gbps", "positive number"),
            ("links[0].bandwidth_gbps", KeyError, "links[0].bandwidth_gbps", "is required"),
            ("model.extra_args", "--x", "model.extra_args", "list of strings"),
            ("clusters", {}, "clusters", "at least one cluster"),
        ],
    )
    def test_bad_field(self, path, value, field, message):
        with pytest.raises(ConfigError) as err:
            parse_topology(mutate(path, value))
        assert err.value.field == field
        assert message in err.value.problem

    def test_bad_yaml_and_missing_file(self, tmp_path: Path):
        bad = tmp_path / "t.yaml"
        bad.write_text("clusters: [unclosed\n")
        with pytest.raises(ConfigError, match="not valid YAML"):
            load_topology(bad)
        with pytest.raises(ConfigError, match="cannot read"):
            load_topology(tmp_path / "missing.yaml")

    def test_cli_names_the_bad_field(self, tmp_path: Path):
        path = tmp_path / "t.yaml"
        path.write_text(yaml.safe_dump(mutate("clusters.a.nodes[1].role", "decoder")))
        proc = launch_cli("--config", str(path), "--node", "d0", "--dry-run")
        assert proc.returncode == 2
        assert proc.stderr.strip() == (
            "error: clusters.a.nodes[1].role: unknown role 'decoder' "
            "(expected one of: prfaas, pd-prefill, pd-decode, router, kv-index)"
        )


def test_relative_model_path_resolves_against_the_topology_file():
    topology = load_topology(REPO_ROOT / "launch" / "local-two-cluster.yaml")
    node = next(n for n in topology.nodes if n.role is Role.PD_DECODE)
    assert Path(node.model_path) == REPO_ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3-next"
    assert (Path(node.model_path) / "config.json").is_file()


def test_mock_engine_plan(capsys):
    rc = launch_main(["--role", "pd-decode", "--engine", "mock", "--profile", "kimi-linear-1t-hybrid@h20x8", "--port", "31234",
                      "--speedup", "10", "--dry-run", "--json", "--", "--max-batch", "8"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    argv = plan["argv"]
    assert argv[1:3] == ["-m", "prfaas_sglang.engine.mock"] and plan["engine"] == "mock"
    assert argv[argv.index("--profile") + 1] == "kimi-linear-1t-hybrid@h20x8"
    assert argv[argv.index("--speedup") + 1] == "10.0" and argv[-2:] == ["--max-batch", "8"]
    assert plan["env"]["MC_FORCE_TCP"] == "1"


def test_mock_plan_runs_the_emulated_engine_parser():
    """The emitted flags are accepted by the emulated engine's own parser."""
    from prfaas_sglang.engine.mock.__main__ import build_parser, config_from_args
    from prfaas_sglang.launch.command import mock_command

    node = Node("p0", "prfaas", Role.PRFAAS, host="127.0.0.1", port=30000, bootstrap_port=8998, kv_events_port=5557)
    argv = list(mock_command(node, "python", "kimi-linear-1t-hybrid@h200x8", ("--speedup", "5")).argv)[3:]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.bootstrap_port == 8998 and config.kv_events_port == 5557 and config.speedup == 5.0


def test_the_emulated_prefill_refuses_a_malformed_link_by_name(monkeypatch):
    """Its KV sender sizes writes from PRFAAS_KV_LANE_PACING: a bad value is a one-line config error."""
    from prfaas_sglang.engine.mock.__main__ import build_parser, config_from_args
    from prfaas_sglang.launch.command import mock_command

    node = Node("p0", "prfaas", Role.PRFAAS, host="127.0.0.1", port=30000, bootstrap_port=8998)
    argv = list(mock_command(node, "python", "kimi-linear-1t-hybrid@h200x8").argv)[3:]
    monkeypatch.setenv("PRFAAS_KV_LANE_PACING", "bogus")
    with pytest.raises(ConfigError, match="PRFAAS_KV_LANE_PACING"):
        config_from_args(build_parser().parse_args(argv))
    monkeypatch.setenv("PRFAAS_KV_LANE_PACING", "1e9,0.02")
    assert config_from_args(build_parser().parse_args(argv)).role is Role.PRFAAS


@pytest.mark.parametrize("node, module", [("router", "prfaas_sglang.router"), ("kv-index", "prfaas_sglang.kvindex")])
def test_control_plane_plans(capsys, node, module):
    rc = launch_main(["--config", str(REPO_ROOT / "launch" / "local-two-cluster.yaml"), "--node", node, "--dry-run", "--json"])
    assert rc == 0
    argv = json.loads(capsys.readouterr().out)["argv"]
    assert argv[1:3] == ["-m", module] and "--config" in argv


LOCAL = str(REPO_ROOT / "launch" / "local-two-cluster.yaml")


def dry_run(capsys, *args: str, stderr: list | None = None) -> list[str]:
    assert launch_main([*args, "--dry-run", "--json"]) == 0
    captured = capsys.readouterr()
    if stderr is not None:
        stderr.append(captured.err)
    return json.loads(captured.out)["argv"]


class TestUsability:
    def test_config_without_node_starts_the_router(self, capsys):
        err: list[str] = []
        argv = dry_run(capsys, "--config", LOCAL, stderr=err)
        assert argv[1:3] == ["-m", "prfaas_sglang.router"]
        assert "no --node given: starting router node 'router'" in err[0]

    def test_config_without_node_and_no_single_router_names_the_choices(self, tmp_path):
        doc = yaml.safe_load(Path(LOCAL).read_text())
        doc["clusters"]["control"]["nodes"].append({"name": "router-2", "role": "router", "port": 8002})
        path = tmp_path / "two-routers.yaml"
        path.write_text(yaml.safe_dump(doc))
        proc = launch_cli("--config", str(path), "--dry-run")
        assert proc.returncode == 2 and proc.stderr.startswith("error: --node: choose the node to start (nodes: ")
        assert "router-2 (router)" in proc.stderr and "prfaas-0 (prfaas)" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1

    def test_router_flags_pass_through_the_launcher(self, capsys):
        argv = dry_run(capsys, "--config", LOCAL, "--node", "router", "--threshold", "20000", "--max-ttft-s", "8")
        assert argv[argv.index("--threshold") + 1] == "20000" and argv[argv.index("--max-ttft-s") + 1] == "8"
        from prfaas_sglang.router.__main__ import build_parser

        parsed = build_parser().parse_args(argv[3:])  # what the router will parse
        assert parsed.threshold == 20000 and parsed.max_ttft_s == 8

    @pytest.mark.parametrize("args, reason", [
        (["--config", LOCAL, "--node", "router", "--threshhold", "5"],
         "--threshhold: is neither a launcher nor a router flag (see python -m prfaas_sglang.router --help)"),
        (["--config", LOCAL, "--node", "prfaas-0", "--threshold", "5"], "--threshold: is not a launcher flag (SGLang flags go after `--`)"),
    ])
    def test_unknown_flags_are_one_line_errors(self, args, reason):
        proc = launch_cli(*args, "--dry-run")
        assert proc.returncode == 2 and proc.stderr.strip() == f"error: {reason}"

    def test_emulated_engines_take_their_settings_from_the_topology(self, capsys):
        """Profile (the cluster's accelerator), scale (emulation:), tokenizer and served name, decode batch."""
        from prfaas_sglang import runtime

        model = runtime.from_topology(load_topology(LOCAL))
        prfaas = dry_run(capsys, "--config", LOCAL, "--node", "prfaas-0", "--engine", "mock")
        assert prfaas[prfaas.index("--profile") + 1] == "kimi-linear-1t-hybrid@h200x8"
        assert prfaas[prfaas.index("--speedup") + 1] == "20.0" and prfaas[prfaas.index("--kv-scale") + 1] == "0.01"
        assert prfaas[prfaas.index("--tokenizer") + 1].endswith("tokenizer/data/prfaas-tiny-chatml")
        assert prfaas[prfaas.index("--served-model-name") + 1] == "tiny-hybrid"
        assert prfaas[prfaas.index("--telemetry-port") + 1] == "5560"
        decode = dry_run(capsys, "--config", LOCAL, "--node", "pd-decode-0", "--engine", "mock")
        assert decode[decode.index("--profile") + 1] == "kimi-linear-1t-hybrid@h20x8"
        assert decode[decode.index("--max-batch") + 1] == str(int(model.decode.bs_max))

    def test_real_engines_get_the_tokenizer_and_served_name_but_no_emulation(self, capsys):
        argv = dry_run(capsys, "--config", LOCAL, "--node", "pd-prefill-0")
        assert argv[argv.index("--tokenizer-path") + 1].endswith("tokenizer/data/prfaas-tiny-chatml")
        assert argv[argv.index("--served-model-name") + 1] == "tiny-hybrid"
        assert "--skip-tokenizer-init" not in argv and "--speedup" not in argv


def test_a_topology_port_inside_a_range_the_engine_binds_at_random_is_noted():
    """Mooncake binds its handshake and data ports in 15000-17000, SGLang's PD ZMQ channel at random
    in 49152-65535: a topology port there can collide at start-up. Noted (shown by --dry-run), not
    refused: a port outside them gets no note."""
    from prfaas_sglang.launch.command import port_range_notes

    prfaas = Node("p0", "prfaas", Role.PRFAAS, port=30000, bootstrap_port=8998, kv_events_port=5557, model_path="/m")
    assert port_range_notes(prfaas, sglang_pd=True) == ()
    assert sglang_command(prfaas, "python", {}).notes == ()
    risky = dataclasses.replace(prfaas, bootstrap_port=50000, telemetry_port=16000)
    notes = sglang_command(risky, "python", {}).notes
    assert len(notes) == 2 and "bootstrap_port 50000" in notes[0] and "49152-65535" in notes[0]
    assert "telemetry_port 16000" in notes[1] and "15000-17000" in notes[1]
    # the emulated engine binds Mooncake's ports, not SGLang's ZMQ channel
    assert [n.split(" ")[0] for n in mock_command(risky, "python", "h200x8").notes] == ["telemetry_port"]


def test_a_port_above_55535_gets_a_grpc_port_sglang_accepts():
    """SGLang 0.5.15 derives its gRPC port as --port + 10000 with gRPC off too, and refuses to start
    above 65535 (found by the harness on real SGLang on CPU: a free-port picker's 60669 killed a
    PrfaaS worker at start-up). The launcher sets SGLANG_GRPC_PORT then; the environment wins."""
    low = Node("p0", "prfaas", Role.PRFAAS, port=30000, bootstrap_port=8998, model_path="/m")
    high = dataclasses.replace(low, port=60669)
    assert "SGLANG_GRPC_PORT" not in sglang_command(low, "python", {}).env
    assert sglang_command(high, "python", {}).env["SGLANG_GRPC_PORT"] == "50669"
    single = Node("s0", "single", Role.SINGLE, port=60669, model_path="/m")
    assert sglang_command(single, "python", {}).env["SGLANG_GRPC_PORT"] == "50669"
    given = sglang_command(high, "python", {"SGLANG_GRPC_PORT": "40000"})
    assert "SGLANG_GRPC_PORT" not in given.env and given.env_kept["SGLANG_GRPC_PORT"] == "50669"
