"""``bench gpu-e2e`` without a GPU: its pure parts, its process handling, the broken-hook scaffold
against real SGLang on CPU, the shaped namespace it builds through netlink, and its refusal to run."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from prfaas_sglang.demo.cluster import ProcessGroup, log_tail
from prfaas_sglang.gpu import checks, e2e
from prfaas_sglang.gpu.tiny_model import tiny_cpu_config
from prfaas_sglang.launch.command import sglang_command
from prfaas_sglang.roles import Role, role_contract_violations
from prfaas_sglang.topology import Node


def test_without_a_gpu_it_exits_at_once_with_one_line(tmp_path):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "gpu-e2e", "--bundle", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no NVIDIA GPU" in proc.stderr
    assert time.monotonic() - started < 20


def test_gpu_detection_reads_the_device_nodes(tmp_path):
    assert "no NVIDIA GPU" in e2e.gpu_unavailable(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert e2e.gpu_unavailable(tmp_path) is None


def test_cases_cover_every_length_endpoint_and_mode():
    cases = e2e.request_cases(4096)
    assert len(cases) == 4 * 2 * 2 and len({c["name"] for c in cases}) == len(cases)
    assert {c["num_tokens"] for c in cases if c["long"]} == set(e2e.LONG_TOKENS)
    assert max(e2e.LONG_TOKENS) == 32768 and all(n < e2e.THRESHOLD_TOKENS for n in e2e.SHORT_TOKENS)
    ids = e2e.prompt_ids(1000, 4096, seed=3)
    assert ids == e2e.prompt_ids(1000, 4096, seed=3) != e2e.prompt_ids(1000, 4096, seed=4)
    assert len(ids) == 1000 and min(ids) >= 16 and max(ids) < 4096
    chat = next(c for c in cases if c["endpoint"].endswith("chat/completions") and c["stream"])
    body = e2e.request_body(chat, ids, "hello", "m")
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert e2e.request_body(cases[0], ids, None, "m")["prompt"] == ids


def test_answers_parse_the_same_streamed_or_not():
    plain = json.dumps({"choices": [{"text": "ab", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}).encode()
    stream = b"".join(b"data: " + json.dumps(obj).encode() + b"\n\n" for obj in (
        {"choices": [{"text": "a", "finish_reason": None}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}})) + b"data: [DONE]\n\n"
    want = {"text": "ab", "finish_reason": "length", "cached_tokens": 4, "prompt_tokens": 9}
    assert e2e.parse_answer("/v1/completions", False, plain) == want
    assert e2e.parse_answer("/v1/completions", True, stream) == want
    chat = b"data: " + json.dumps({"choices": [{"delta": {"content": "ab"}, "finish_reason": "stop"}]}).encode() + b"\n\n"
    assert e2e.parse_answer("/v1/chat/completions", True, chat)["text"] == "ab"
    assert e2e.parse_answer("/v1/chat/completions", True, chat)["cached_tokens"] is None  # no usage: unknown
    nothing_reused = json.dumps({"choices": [{"text": "ab", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}).encode()
    assert e2e.parse_answer("/v1/completions", False, nothing_reused)["cached_tokens"] == 0  # SGLang omits a 0
    with pytest.raises(ValueError, match="stream error"):
        e2e.parse_answer("/v1/completions", True, b'data: {"error": {"message": "KV transfer failed"}}\n\n')
    assert e2e.output_mismatch(want, dict(want)) is None
    assert "reference 'ac'" in e2e.output_mismatch(want, {**want, "text": "ac"})
    assert "finish_reason" in e2e.output_mismatch(want, {**want, "finish_reason": "stop"})


def test_the_topology_loads_and_every_engine_gets_the_gpu_flags(tmp_path):
    import yaml

    from prfaas_sglang.demo.cluster import PortPicker
    from prfaas_sglang.topology import load_topology

    doc = e2e.e2e_topology(tmp_path / "model", PortPicker(), prfaas_host="10.78.0.2")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    topology = load_topology(path)
    engines = [n for n in topology.nodes if n.role in (Role.PRFAAS, Role.PD_PREFILL, Role.PD_DECODE)]
    assert len(engines) == 3 and next(n for n in engines if n.role is Role.PRFAAS).host == "10.78.0.2"
    proc = subprocess.run([sys.executable, "-m", "prfaas_sglang.launch", "--config", str(path), "--node", "prfaas-0",
                           "--dry-run", "--json"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)["argv"]
    joined = " ".join(argv)
    assert "--load-format dummy" in joined and "--enable-cache-report" in joined and "--disaggregation-mode prefill" in joined


@pytest.mark.parametrize(("profile", "hybrid"), [(e2e.GPU_PROFILE, True), (e2e.CPU_PROFILE, False)])
def test_the_kv_index_is_told_the_served_models_kind(tmp_path, profile, hybrid):
    """The kv-index applies the checkpoint rule (reuse stops at a linear-state checkpoint) only for a
    hybrid cost model: the tiny hybrid on the GPU, not the CPU's tiny Llama, whose repeated prompt
    SGLang reuses whole (a hybrid cost model there made the index predict 0 for 2,047 reused tokens)."""
    import yaml

    from prfaas_sglang import runtime
    from prfaas_sglang.demo.cluster import PortPicker
    from prfaas_sglang.topology import load_topology

    path, model_dir = tmp_path / "t.yaml", tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny_cpu_config(4096, 2, 0)))  # the CPU profile models it
    path.write_text(yaml.safe_dump(e2e.e2e_topology(model_dir, PortPicker(), profile=profile)))
    assert runtime.from_topology(load_topology(path)).hybrid is hybrid


def test_the_single_role_is_a_plain_server_and_the_upstream_profile_sets_nothing():
    node = Node("ref", "standalone", Role.SINGLE, host="127.0.0.1", port=31000, model_path="/m", extra_args=("--load-format", "dummy"))
    cmd = sglang_command(node, "python", {})
    assert "--disaggregation-mode" not in cmd.argv and "--disaggregation-transfer-backend" not in cmd.argv
    assert cmd.env == {"PRFAAS_ROLE": "single"}
    assert role_contract_violations(Role.SINGLE, "null", None, None, {}) == []
    assert role_contract_violations(Role.SINGLE, "prefill", "mooncake", None, {})
    prfaas = Node("p", "prfaas", Role.PRFAAS, port=1, bootstrap_port=2, model_path="/m")
    upstream = sglang_command(prfaas, "python", {}, wan_profile=False).env  # transport: SGLang's and Mooncake's own
    assert {k for k in upstream if not k.startswith("PRFAAS_")} == {"MC_FORCE_TCP"}
    assert set(upstream) - {"MC_FORCE_TCP"} == {"PRFAAS_ROLE", "PRFAAS_KV_TRANSPORT", "PRFAAS_PREFILL_CACHE"}
    assert "MC_TCP_LANES_PER_PEER" in sglang_command(prfaas, "python", {}).env


def test_stop_kills_children_that_outlive_their_parent(tmp_path):
    procs = ProcessGroup(tmp_path / "logs")
    script = "import subprocess, sys; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); sys.exit(0)"
    parent = procs.start("orphaning", [sys.executable, "-c", script], dict(os.environ))
    parent.wait(timeout=30)
    child_pid = int((tmp_path / "logs" / "orphaning.log").read_text().split()[0])
    os.kill(child_pid, 0)  # alive after its parent exited
    procs.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        try:
            os.waitpid(child_pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the orphaned child survived stop()")


def test_stop_by_name_leaves_the_others_running_and_forgets_the_stopped(tmp_path):
    procs = ProcessGroup(tmp_path / "logs")
    for name in ("reference", "router"):
        procs.start(name, [sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ))
    try:
        assert procs.stop(["router"]) == []
        assert {p.name for p in procs.procs} == {"reference"} and procs.latest("reference").poll() is None
    finally:
        procs.stop()
    assert procs.latest("reference").poll() is not None


def test_a_forked_copy_of_the_harness_stops_none_of_its_servers(tmp_path):
    """A child forked from the harness (pyroute2's netns helpers are) that unwinds through the harness's
    ``finally`` must not stop the servers: they are its parent's."""
    procs = ProcessGroup(tmp_path / "logs")
    server = procs.start("reference", [sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ))
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's exit status is the assertion
            try:
                procs.kill("reference")
                os._exit(0 if procs.stop() == [] else 3)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert server.poll() is None, "the forked copy killed its parent's server"
    finally:
        procs.stop()
    assert server.poll() is not None


def test_on_cpu_sglangs_own_health_check_outwaits_the_routers():
    """A slow CPU forward must look like a late /health answer (a miss the router tolerates), not SGLang's
    503 after its own 20 s (the router takes a worker out at once on that)."""
    env = e2e.bundle_env(None, REPO_ROOT, base={}, profile=e2e.CPU_PROFILE)
    args = e2e.CPU_PROFILE.router_args
    router_timeout_s = float(args[args.index("--health-timeout-s") + 1])
    assert float(env["SGLANG_HEALTH_CHECK_TIMEOUT"]) > 2 * router_timeout_s
    # on a GPU a process's first forward compiles Triton kernels for about a minute (H200, 2026-11-26)
    assert float(e2e.bundle_env(None, REPO_ROOT, base={}, profile=e2e.GPU_PROFILE)["SGLANG_HEALTH_CHECK_TIMEOUT"]) > 60


def test_on_cpu_the_servers_run_the_sglang_the_harness_runs(tmp_path):
    """An overlay of another release on the harness's PYTHONPATH (``make test-sglang``) reaches every
    server after the checkout (the first 0.5.23 run of the harness started 0.5.15 servers without it);
    with a bundle, the bundle's site is the only SGLang."""
    overlay = str(tmp_path / "sglang-0.5.23")
    cpu = e2e.bundle_env(None, REPO_ROOT, base={"PYTHONPATH": overlay}, profile=e2e.CPU_PROFILE)
    assert cpu["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), overlay]
    gpu = e2e.bundle_env(tmp_path, REPO_ROOT, base={"PYTHONPATH": overlay}, profile=e2e.GPU_PROFILE)
    assert gpu["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), str(tmp_path / "site")]


def test_a_worker_is_unroutable_while_down_refused_draining_or_behind_a_downed_link():
    workers = {"prfaas-0": {"healthy": True, "refused": None, "draining": False},
               "pd-prefill-0": {"healthy": True, "refused": None, "draining": False},
               "pd-decode-0": {"healthy": True, "refused": None, "draining": False}}
    assert e2e.unroutable({"workers": workers, "link_down_workers": []}) == []
    assert e2e.unroutable({"workers": {**workers, "prfaas-0": {"healthy": False}}}) == ["prfaas-0"]
    assert e2e.unroutable({"workers": {**workers, "pd-decode-0": {"healthy": True, "refused": "page size"}}}) == [
        "pd-decode-0"]
    assert e2e.unroutable({"workers": {**workers, "pd-prefill-0": {"healthy": True, "draining": True}}}) == [
        "pd-prefill-0"]
    assert e2e.unroutable({"workers": workers, "link_down_workers": ["prfaas-0"]}) == ["prfaas-0"]


def test_a_failed_start_reports_the_servers_last_words():
    log = ("[t] Ignore import error when loading sglang.srt.models.x: No module named 'cutlass'\n"
           "[t] Scheduler hit an exception\nRuntimeError: Not enough GPU memory\n\n"
           "[t] Health check failed. Server couldn't get a response\n" + "x" * 500 + "\n")
    assert log_tail(log, width=20) == "[t] Scheduler hit an | RuntimeError: Not en | " + "x" * 20
    assert log_tail("") == "(empty)"


def test_shaped_link_runs_first_failover_last_and_the_others_keep_their_order():
    assert checks.run_order(["failover", "hooks", "shaped-link", "routing"]) == ["shaped-link", "hooks", "routing", "failover"]
    assert checks.run_order(["routing", "hooks"]) == ["routing", "hooks"]


def test_the_shaped_link_topology_states_the_shaped_rate(tmp_path):
    from prfaas_sglang.demo.cluster import PortPicker

    doc = e2e.e2e_topology(tmp_path, PortPicker(), link=(e2e.SHAPED_RATE_MBIT / 1000, e2e.SHAPED_RTT_MS))
    assert doc["links"] == [{"from": "prfaas-b", "to": "pd-a", "bandwidth_gbps": 0.2, "rtt_ms": 1.0}]


def test_shaped_medians_take_answered_rows_and_compare_to_upstream():
    from prfaas_sglang.gpu.checks import shaped_medians

    rows = [{"profile": p, "tokens": 8192, "ttft_s": t, "status": st}
            for p, t, st in (("upstream", 2.0, 200), ("upstream", 4.0, 200), ("upstream", 3.0, 200),
                             ("wan", 1.0, 200), ("wan", 1.5, 200), ("wan", 99.0, 503))]
    out = shaped_medians(rows)
    assert out["median_ttft_s"] == {"upstream": {8192: 3.0}, "wan": {8192: 1.25}}
    assert out["ratio_to_upstream"] == {"upstream": {8192: 1.0}, "wan": {8192: 0.417}}
    assert shaped_medians([{"profile": "wan", "tokens": 1, "ttft_s": 1.0, "status": 200}])["ratio_to_upstream"] == {"wan": {}}


def test_a_misrouted_prompt_is_explained_by_the_routers_own_status():
    from prfaas_sglang.gpu.checks import why_routed

    status = {"recent": [{"rid": "a", "tokens": 4096, "attempt": 0, "cluster": "prfaas", "reason": "uncached 4096 > t"},
                         {"rid": "b", "tokens": 4096, "attempt": 0, "cluster": "prfaas", "reason": "uncached 4096 > t"},
                         {"rid": "b", "tokens": 4096, "attempt": 1, "cluster": "pd", "reason": "spill to pd"},
                         {"rid": "c", "tokens": 64, "attempt": 0, "cluster": "pd", "reason": "short"}],
              "link_down_workers": ["prfaas-0"], "workers": {"prfaas-0": {"healthy": False, "role": "prefill"},
                          "pd-decode-0": {"healthy": True, "role": "decode", "kv_free_tokens": 900, "reserved_tokens": 64}},
              "controller": {"capacity_est_bps": 2e5}}
    said = why_routed(status, 4096)
    assert said == ("attempt 0: prfaas (uncached 4096 > t); attempt 1: pd (spill to pd); out of routing: prfaas-0; "
                    "pd-decode-0: 900 KV tokens free, 64 reserved; capacity estimate 0.2 Mbit/s")
    assert why_routed({"recent": []}, 2048) == "no decision for 2048 tokens among the recent ones"


@pytest.mark.slow
def test_the_broken_hook_scaffold_stops_real_sglang_plugin_loading(tmp_path):
    """First on PYTHONPATH the scaffold adds its hook to every Python process (checked in a plain one, which
    need not import SGLang); with that hook, SGLang's own plugin loading stops with the hook's name and
    reason (checked in a process forked from the SGLang zygote: importing SGLang afresh took 10 CPU-s, and
    starved beside the suite's other phases it once ran past a 240 s timeout)."""
    import zygote

    site = e2e.broken_hook_site(tmp_path / "broken")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    names = subprocess.run([sys.executable, "-c", "from prfaas_sglang import plugin; print(plugin.HOOKS[-1].name)"],
                           capture_output=True, text=True, timeout=60, env=env, check=True).stdout
    assert names.split() == ["deliberately-broken"]
    code = (f"import runpy; runpy.run_path({str(site / 'sitecustomize.py')!r})\n"
            "from sglang.srt.plugins import load_plugins; load_plugins()")
    proc = zygote.run([sys.executable, "-c", code], timeout=240)
    assert proc.returncode != 0
    assert "deliberately-broken" in proc.stderr and "does not resolve" in proc.stderr, proc.stderr[-2000:]


def test_summary_is_ok_only_when_every_check_passed():
    results = [e2e.CheckResult("hooks", True, data={"n": 1}), e2e.CheckResult("routing", False, "went to pd-a")]
    out = e2e.summary(results, {"versions": {}})
    assert out["ok"] is False and out["passed"] == ["hooks"] and out["failed"] == {"routing": "went to pd-a"}
    assert [r.line() for r in results] == ["PASS hooks", "FAIL routing: went to pd-a"]
    assert e2e.summary([], {})["ok"] is False


def _root_with_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed"
    return None


@pytest.mark.skipif(_root_with_netns() is not None, reason=str(_root_with_netns()))
def test_the_shaped_namespace_binds_at_its_rate_and_is_removed():
    from pyroute2 import IPRoute, netns

    from prfaas_sglang.gpu.netlink import (
        HOST_IF,
        ShapedLinkBusy,
        asyncio_default_loops,
        shaped_namespace,
    )

    rate_mbit = 40.0
    received = []
    with shaped_namespace("prfaas-test-shaped", rate_mbit) as ns:
        with pytest.raises(ShapedLinkBusy, match=f"in use by process {os.getpid()}"):  # a second one waits its turn
            with shaped_namespace("prfaas-test-shaped-2", rate_mbit):
                pass
        assert "prfaas-test-shaped" in netns.listnetns()  # and the first's link is untouched
        server = socket.create_server((ns.host_ip, 0))
        port = server.getsockname()[1]

        def sink():
            conn, _ = server.accept()
            total, started = 0, None
            while data := conn.recv(1 << 16):
                started = started or time.monotonic()
                total += len(data)
            received.append((total, time.monotonic() - started))
            conn.close()

        thread = threading.Thread(target=sink)
        thread.start()
        send = (f"import socket; s = socket.create_connection(('{ns.host_ip}', {port})); "
                "s.sendall(b'x' * (8 << 20)); s.close()")
        proc = subprocess.run([sys.executable, "-c", send], preexec_fn=ns.enter, timeout=60, capture_output=True, text=True)
        thread.join(timeout=60)
        server.close()
        assert proc.returncode == 0, proc.stderr
    total, seconds = received[0]
    rate = total * 8 / seconds / 1e6
    assert total == 8 << 20
    assert 0.6 * rate_mbit < rate < 1.2 * rate_mbit, rate  # the tbf binds: 40 Mbit/s, not loopback speed
    assert "prfaas-test-shaped" not in netns.listnetns()
    with asyncio_default_loops(), IPRoute() as ipr:  # pyroute2 under SGLang's uvloop policy: see netlink.py
        assert ipr.link_lookup(ifname=HOST_IF) == []


def _connect_s_from_inside(ns) -> float:
    """The median seconds a TCP connect from inside ``ns`` to the veth's host end takes (a round trip)."""
    server = socket.create_server((ns.host_ip, 0), backlog=16)
    port = server.getsockname()[1]
    probe = (f"import socket, statistics, time\nts = []\nfor _ in range(5):\n    t = time.monotonic()\n"
             f"    socket.create_connection(('{ns.host_ip}', {port})).close()\n    ts.append(time.monotonic() - t)\n"
             "print(statistics.median(ts))")
    proc = subprocess.run([sys.executable, "-c", probe], preexec_fn=ns.enter, timeout=60, capture_output=True, text=True)
    server.close()
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout)


@pytest.mark.skipif(_root_with_netns() is not None, reason=str(_root_with_netns()))
def test_the_shaped_links_delay_adds_its_round_trip_or_says_why_not():
    """Where the kernel has netem, set_delay adds its round trip to a connect across the veth and
    takes it away again; where it has none (this dev machine), delay_unavailable names netem and
    leaves no qdisc behind on the veth's host end."""
    from pyroute2 import IPRoute

    from prfaas_sglang.gpu.netlink import (
        HOST_IF,
        asyncio_default_loops,
        delay_unavailable,
        set_delay,
        shaped_namespace,
    )

    with shaped_namespace("prfaas-test-delay", 40.0) as ns:
        why = delay_unavailable()
        if why is None:
            bare_s = _connect_s_from_inside(ns)
            set_delay(30.0)
            delayed_s = _connect_s_from_inside(ns)
            set_delay(None)
            assert delayed_s > bare_s + 0.025, (bare_s, delayed_s)
            assert _connect_s_from_inside(ns) < 0.015
        else:
            assert "netem" in why
            with asyncio_default_loops(), IPRoute() as ipr:
                host = ipr.link_lookup(ifname=HOST_IF)[0]
                assert [q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index=host)] in ([], ["noqueue"])


@pytest.mark.slow
@pytest.mark.skipif(_root_with_netns() is not None, reason=str(_root_with_netns()))
def test_inside_the_shaped_namespace_torchs_rendezvous_with_itself_completes():
    """The namespace reaches no DNS server; torch's TCPStore (SGLang's rank-0 rendezvous) timed out
    connecting to itself there, waiting on name lookups, and SGLang never started inside. A child
    started with ``ns.enter`` sees a resolv.conf that names no server (lookups fail at once); the
    host's is untouched."""
    from prfaas_sglang.gpu.netlink import shaped_namespace

    host_resolv = Path("/etc/resolv.conf").read_text()
    code = ("import datetime, torch.distributed as dist\n"
            "dist.TCPStore('{ip}', 0, 1, True, timeout=datetime.timedelta(seconds=4)).set('k', 'v')\n"
            "print(open('/etc/resolv.conf').read().strip())\n")
    with shaped_namespace("prfaas-test-dns", 40.0) as ns:
        proc = subprocess.run([sys.executable, "-c", code.format(ip=ns.inner_ip)], preexec_fn=ns.enter, timeout=120,
                              capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "nameserver" not in proc.stdout  # the child's resolv.conf is the namespace's
    assert Path("/etc/resolv.conf").read_text() == host_resolv


@pytest.mark.skipif(_root_with_netns() is not None, reason=str(_root_with_netns()))
def test_the_shaped_namespace_is_made_under_uvloops_policy_too():
    """Importing SGLang's tokenizer manager installs uvloop's event-loop policy process-wide, and
    uvloop cannot open pyroute2's netlink sockets ("invalid family 16"): the namespace is made on
    default loops anyway, and the process's policy is left as it was."""
    import asyncio

    import uvloop
    from pyroute2 import netns

    from prfaas_sglang.gpu.netlink import shaped_namespace

    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        with shaped_namespace("prfaas-test-uvloop", 40.0):
            assert "prfaas-test-uvloop" in netns.listnetns()
            assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
        assert "prfaas-test-uvloop" not in netns.listnetns()
        assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    finally:
        asyncio.set_event_loop_policy(before)


@pytest.mark.slow
@pytest.mark.serial  # it reads the session's real-SGLang deployment (tests/deployments.py), whose users run serial
@pytest.mark.xdist_group("sglang-cpu")
def test_every_sglang_process_reports_the_hooks_it_verified(sglang_cpu):
    """SGLang loads plugins before it configures logging, so the plugin's INFO lines never print;
    check a reads PRFAAS_HOOK_REPORT instead: one line per process, every hook verified. Read from every
    server of the session's deployment, on the release this session runs (an overlay included)."""
    from prfaas_sglang.plugin import HOOKS

    names = [h.name for h in HOOKS if h.applies()]  # the installed release's
    reports = {name: e2e.hook_report(sglang_cpu.work, name).read_text().splitlines() for name in sglang_cpu.dep.engines()}
    assert len(reports) >= 3
    for name, lines in reports.items():  # the HTTP server's process and the scheduler's each load the plugins
        assert len(lines) >= 2 and all(json.loads(line)["hooks"] == names for line in lines), (name, lines)
        assert e2e.hook_report_problems(lines, names) == [], name
    lines = reports["pd-decode-0"]
    assert e2e.hook_report_problems(lines[:1], names) == ["1 process(es) reported, at least 2 expected"]
    partial = json.dumps({"pid": 1, "hooks": names[:1]})
    assert "did not verify" in e2e.hook_report_problems([lines[0], partial], names)[0]
    assert "unreadable" in e2e.hook_report_problems(["{", *lines], names)[0]


@pytest.mark.slow
@pytest.mark.skipif(_root_with_netns() is not None, reason=str(_root_with_netns()))
def test_the_shaped_link_check_runs_end_to_end_on_emulated_engines(tmp_path, monkeypatch):
    """The harness's dry run (--engine mock: shaped-link, routing, kv-index, failover): the same namespace,
    launcher, router, kv-index and timing as on the GPU, emulated engines in place of SGLang. It found, before any GPU time was spent on
    them, that loopback is the namespace's own (the PD side now sits on the veth's host end) and that
    the route header names the cluster kind, not the cluster. The delay is taken as available (this
    kernel has no netem: test_the_shaped_links_delay_adds_its_round_trip_or_says_why_not) so the
    second round of timed prompts runs, on the same deployments, with its delay asked for and removed."""
    from prfaas_sglang.gpu import netlink
    from prfaas_sglang.gpu.tiny_model import make_model

    delays: list[float | None] = []
    monkeypatch.setattr(netlink, "delay_unavailable", lambda: None)
    monkeypatch.setattr(netlink, "set_delay", delays.append)
    profile = dataclasses.replace(e2e.GPU_PROFILE, shaped_repeats=1)  # the GPU's 5 add time, not coverage, here
    monkeypatch.setattr(checks, "profile_for", lambda engine: profile)
    make_model(tmp_path / "model", log=lambda _line: None)
    lines: list[str] = []

    def step(ctx):  # what gpu-e2e --predict runs here: on the same deployment, every server up, before failover
        return {"checks_before": [line.split()[1] for line in lines if line.startswith(("PASS", "FAIL"))],
                "prfaas_health": e2e.http("GET", ctx.dep.url("prfaas-0") + "/health")[0]}

    result = checks.run(None, tmp_path / "model", e2e.MOCK_CHECKS, lines.append, engine="mock", then=("step", step))
    assert result["ok"], result["failed"]
    assert result["passed"] == ["shaped-link", "routing", "kv-index", "failover"]  # the link first, then the shared deployment
    assert result["step"]["checks_before"] == ["shaped-link", "routing", "kv-index"] and result["step"]["prfaas_health"] == 200
    kv_rows = {r["prompt"]: r for r in result["checks"]["kv-index"]["rows"]}
    assert kv_rows["extend"]["cached_tokens"] == kv_rows["extend"]["predicted"] > 0
    assert result["checks"]["routing"]["routed"] == {"prfaas": 2, "pd": 2}
    # SGLang's own counters agree: each prefill served its route's two, the decode all four
    assert result["checks"]["routing"]["engines"] == {"prfaas-0": 2, "pd-prefill-0": 2, "pd-decode-0": 4}
    rows = result["checks"]["shaped-link"]["rows"]
    assert {(r["profile"], r["tokens"]) for r in rows} == {(p, n) for p in ("upstream", "wan", "wan-layerwise")
                                                           for n in e2e.LONG_TOKENS}
    assert len(rows) == 3 * len(e2e.LONG_TOKENS) * profile.shaped_repeats * 2  # the bare veth, then delayed
    assert {r["link"] for r in rows} == set(result["checks"]["shaped-link"]["by_link"]) == {"veth", "rtt-20ms"}
    assert delays == [None, e2e.SHAPED_DELAY_RTT_MS, None] * 3  # per profile: bare, delayed, removed
    assert all(r["status"] == 200 and r["route"].startswith("prfaas/prfaas-0/") and r["ttft_s"] > 0 for r in rows)
    assert set(result["checks"]["shaped-link"]["median_ttft_s"]) == {"upstream", "wan", "wan-layerwise"}
    # one deployment for every check; a profile switch restarted the PrfaaS server alone, twice
    assert sum("deployment healthy" in line for line in lines) == 1
    assert sum("prfaas-0 restarted as" in line for line in lines) == 2
    assert set(result["checks"]["shaped-link"]["prfaas_restart_s"]) == {"wan-layerwise", "wan"}
    assert (Path(result["logs"]) / "prfaas-0.0.log").is_file() and (Path(result["logs"]) / "prfaas-0.1.log").is_file()


def test_the_dry_run_and_the_cpu_engine_refuse_what_they_cannot_do(tmp_path):
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "gpu-e2e", "--engine", "mock", *extra],
                              capture_output=True, text=True, timeout=60)

    no_model = run()
    assert no_model.returncode == 2 and "--engine mock needs --model-config" in no_model.stderr
    (tmp_path / "tokenizer.json").write_text("{}")
    wrong = run("--model-config", str(tmp_path), "--checks", "hooks")
    assert wrong.returncode == 2 and "runs shaped-link, routing, kv-index, failover only" in wrong.stderr
    on_cpu = subprocess.run([sys.executable, "-m", "prfaas_sglang.bench", "gpu-e2e", "--engine", "sglang-cpu",
                             "--checks", "routing,state-events"], capture_output=True, text=True, timeout=60)
    assert on_cpu.returncode == 2 and "not ['state-events']; state-events: it needs a hybrid" in on_cpu.stderr
    assert "only where the CPU has AMX" in on_cpu.stderr


@pytest.mark.parametrize("release_has_it", [True, False])
def test_a_switchable_deployment_has_two_pd_prefills_that_switch_in_place(tmp_path, monkeypatch, release_has_it):
    """role-switch needs a PD prefill the router may convert (never the last of its role): the topology
    then has two, both ``role_switch: in-place``; on CPU, where the installed SGLang backs retracted
    decode requests with a CUDA-registered host pool (0.5.23), every server that decodes or may
    (the decode, the switchable prefills) gets SGLang's other backend, and no PD server runs the overlap
    scheduler whose early send records a CUDA event there; the GPU topology is unchanged."""
    import yaml

    from prfaas_sglang import _compat
    from prfaas_sglang.demo.cluster import PortPicker
    from prfaas_sglang.topology import load_topology

    markers = (_compat.DECODE_RETRACTION_BACKUP, _compat.OVERLAP_EARLY_SEND_CUDA_EVENT)
    monkeypatch.setattr(_compat, "installed_has", lambda marker, root=None: release_has_it and marker in markers)
    path = tmp_path / "t.yaml"
    (tmp_path / "config.json").write_text(json.dumps(tiny_cpu_config(4096, 2, 0)))
    path.write_text(yaml.safe_dump(e2e.e2e_topology(tmp_path, PortPicker(), profile=e2e.CPU_PROFILE, switchable=True)))
    nodes = {n.name: n for n in load_topology(path).nodes}
    assert [n for n in nodes if n.startswith("pd-prefill-")] == ["pd-prefill-0", "pd-prefill-1"]
    assert {nodes[n].role_switch for n in ("pd-prefill-0", "pd-prefill-1")} == {"in-place"}
    flag = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
    for name in ("pd-prefill-0", "pd-prefill-1", "pd-decode-0"):
        assert (nodes[name].extra_args[-2:] == flag) is release_has_it, name
    assert flag[0] not in nodes["prfaas-0"].extra_args  # it never decodes
    # and no overlap scheduler where 0.5.23's early send records a CUDA event, on every PD server
    assert all(("--disable-overlap-schedule" in n.extra_args) is release_has_it for n in nodes.values()
               if n.role in (Role.PRFAAS, Role.PD_PREFILL, Role.PD_DECODE))
    plain = e2e.e2e_topology(tmp_path, PortPicker(), profile=e2e.GPU_PROFILE)
    pd = plain["clusters"]["pd-a"]["nodes"]
    assert [n["name"] for n in pd] == ["pd-prefill-0", "pd-decode-0"] and not any("role_switch" in n for n in pd)
    assert not any("extra_args" in n for n in pd)  # the GPU profile: SGLang's defaults


def test_an_import_only_sgl_kernel_imports_every_name_and_refuses_every_call(tmp_path):
    """SGLang 0.5.23's CPU engine imports sgl_kernel's CPU build, which no registry carries: the harness's
    servers get an import-only copy, last on their path and only where none is installed, whose
    kernels raise, naming themselves, instead of computing anything."""
    code = ("import sgl_kernel\nfrom sgl_kernel import copy_all_layer_kv_cache_cpu as k\n"
            "try:\n    k(1, 2)\nexcept NotImplementedError as err:\n    print(type(err).__name__, err)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(e2e.IMPORT_ONLY_DIR)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("KernelNotBuilt sgl_kernel.copy_all_layer_kv_cache_cpu was called")
    env = e2e.bundle_env(None, REPO_ROOT, base={"PYTHONPATH": "/overlay"}, profile=e2e.CPU_PROFILE)
    assert (env["PYTHONPATH"].split(os.pathsep)[-1] == str(e2e.IMPORT_ONLY_DIR)) is e2e.needs_import_only_sgl_kernel()
    assert str(e2e.IMPORT_ONLY_DIR) not in e2e.bundle_env(tmp_path, REPO_ROOT, base={}, profile=e2e.GPU_PROFILE)["PYTHONPATH"]


def test_on_cpu_the_router_reckons_the_kv_the_served_model_ships(tmp_path):
    """The CPU profile's cost model is the tiny Llama's own config.json: the router's KV bytes per prompt
    are what the servers put on the link (4 layers x 2 KV heads x (64 + 64) x 4 bytes = 4 KiB a token),
    so a probe sized in bytes of the link fits a prompt that really crosses in its time."""
    import yaml

    from prfaas_sglang import runtime
    from prfaas_sglang.demo.cluster import PortPicker
    from prfaas_sglang.topology import load_topology

    (tmp_path / "config.json").write_text(json.dumps(tiny_cpu_config(4096, 2, 0)))
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(e2e.e2e_topology(tmp_path, PortPicker(), profile=e2e.CPU_PROFILE)))
    model = runtime.from_topology(load_topology(path))
    assert model.kv_bytes(4096) == 4096 * 4096
    gpu = e2e.e2e_topology(tmp_path, PortPicker(), profile=e2e.GPU_PROFILE)
    assert gpu["model"]["cost_model"] == "kimi-linear-1t-hybrid"  # the GPU profile names its catalog model


def test_the_link_watch_sums_what_the_router_showed_while_it_watched():
    watch = checks._LinkWatch("http://unused")
    watch.views = [{"link": {"capacity_bps": 1.5e8, "egress_bps": 6e7, "transfers_completed": 2}, "probes": 3,
                    "controller": {"capacity_est_bps": 2e8}},
                   {"link": {"capacity_bps": None, "congested": True}, "probes": 4, "controller": {"capacity_est_bps": 2e5}},
                   {"link": {}, "probes": 5, "controller": {"capacity_est_bps": 1e8}}]
    assert watch.summary() == {"samples": 3, "with_capacity": 1, "peak_capacity_bps": 1.5e8, "peak_egress_bps": 6e7,
                               "transfers_delivered_seen": 2, "transfers_failed_seen": 0, "congested_samples": 1,
                               "controller_capacity_est_bps": 1e8, "lowest_capacity_est_bps": 2e5, "probes": 2}


def test_a_step_after_the_checks_that_crashes_is_its_own_error_not_the_runs_end(monkeypatch):
    """``gpu-e2e --predict``'s step: a crash is logged and returned (the summary's ``ok`` then fails) and
    the failover check still runs after it; every server is restored before the step."""
    restored, lines = [], []
    monkeypatch.setattr(checks, "restore", restored.append)
    ctx = types.SimpleNamespace(log=lines.append)

    def crash(_ctx):
        raise RuntimeError("no router")

    got = checks.run_step(ctx, "predict", crash)
    assert got["error"] == "RuntimeError: no router" and got["seconds"] >= 0
    assert lines == ["FAIL predict: RuntimeError: no router"] and restored == [ctx]
    ran = checks.run_step(ctx, "predict", lambda _ctx: {"rows": 3})
    assert ran["rows"] == 3 and set(ran) == {"rows", "seconds"} and len(restored) == 2
