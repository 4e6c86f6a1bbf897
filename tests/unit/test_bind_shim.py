"""The bind shim (prfaas_sglang/native/bindshim.c) and how the launcher preloads it.

The shim is built from source with the machine's C compiler (scripts/setup-env.sh installs one)
and exercised in a child Python process on real sockets: which binds it rewrites, which it leaves,
and its fallback when the rewritten bind cannot work. Mooncake's own listeners under it are checked
in the socket table of a live deployment (tests/router/test_security_e2e.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.launch.command import mock_command, with_bind_shim
from prfaas_sglang.native import NativeBuildError, bind_shim_path, build_bind_shim
from prfaas_sglang.roles import Role
from prfaas_sglang.topology import Node

PROBE = r"""
import json, socket, sys
out = []
for family, host, port, v6only in json.loads(sys.argv[1]):
    s = socket.socket(getattr(socket, family), socket.SOCK_STREAM)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind((host, port))
    out.append(s.getsockname()[0])
    s.close()
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(binds, env) -> tuple[list[str], str]:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(binds)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    os.environ["PRFAAS_NATIVE_DIR"] = str(tmp_path_factory.mktemp("native"))
    try:
        yield str(build_bind_shim())
    finally:
        os.environ.pop("PRFAAS_NATIVE_DIR", None)


def test_wildcard_binds_in_the_listed_ports_take_the_host_and_nothing_else_changes(shim):
    inside, outside = free_port(), free_port()
    env = {"LD_PRELOAD": shim, "PRFAAS_BIND_HOST": "127.0.0.1", "PRFAAS_BIND_PORTS": f"1-2,{inside}-{inside}"}
    got, _ = probe([("AF_INET", "0.0.0.0", inside, None),  # Mooncake's handshake listener
                    ("AF_INET6", "::", inside, 0),  # its dual-stack data listener: v4-mapped
                    ("AF_INET", "0.0.0.0", outside, None),  # a port not listed: as asked
                    ("AF_INET", "127.0.0.1", inside, None)], env)  # not a wildcard: as asked
    assert got == ["127.0.0.1", "::ffff:127.0.0.1", "0.0.0.0", "127.0.0.1"]
    # without the launcher's variables the shim does nothing
    got, _ = probe([("AF_INET", "0.0.0.0", inside, None)], {"LD_PRELOAD": shim})
    assert got == ["0.0.0.0"]


def test_a_rewrite_that_cannot_bind_falls_back_to_the_address_asked_for_and_says_so(shim):
    port = free_port()
    env = {"LD_PRELOAD": shim, "PRFAAS_BIND_HOST": "127.0.0.1", "PRFAAS_BIND_PORTS": str(port)}
    got, stderr = probe([("AF_INET6", "::", port, 1)], env)  # a v6-only socket cannot take an IPv4 address
    assert got == ["::"] and "prfaas bind shim: could not bind 127.0.0.1" in stderr
    got, _ = probe([("AF_INET", "0.0.0.0", port, None)], {**env, "PRFAAS_BIND_HOST": "not-an-address"})
    assert got == ["0.0.0.0"]


def test_built_once_per_source_and_a_missing_compiler_is_a_typed_error(shim, tmp_path, monkeypatch):
    assert shim == str(bind_shim_path()) and build_bind_shim() == bind_shim_path()  # reused, not rebuilt
    monkeypatch.setenv("PRFAAS_NATIVE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        build_bind_shim()


def test_the_launcher_preloads_it_for_an_engine_with_a_host(monkeypatch):
    node = Node("p0", "prfaas", Role.PRFAAS, port=30000, bootstrap_port=8998, host="10.0.0.5")
    command = mock_command(node, "python", "h200x8")
    bound = with_bind_shim(command, {"LD_PRELOAD": "/lib/other.so", "MC_MIN_RPC_PORT": "16000"}, "/x/shim.so", "10.0.0.5")
    assert bound.env["LD_PRELOAD"] == "/x/shim.so:/lib/other.so"  # an operator's preload is kept, after ours
    assert (bound.env["PRFAAS_BIND_HOST"], bound.env["PRFAAS_BIND_PORTS"]) == ("10.0.0.5", "16000-17000")
    unbound = with_bind_shim(command, {}, None, None, "no C compiler")
    assert "LD_PRELOAD" not in unbound.env and unbound.notes[-1].endswith("bind all interfaces: no C compiler")
    # SGLang then advertises the bound address, not its guess of the host's (the default route's
    # interface), where every peer's KV connection was refused (real SGLang on CPU, bench gpu-e2e)
    assert bound.env["SGLANG_HOST_IP"] == "10.0.0.5" and "SGLANG_HOST_IP" not in unbound.env
    told = with_bind_shim(command, {"SGLANG_HOST_IP": "10.0.0.9"}, "/x/shim.so", "10.0.0.5")
    assert "SGLANG_HOST_IP" not in told.env and told.env_kept["SGLANG_HOST_IP"] == "10.0.0.5"  # the operator's wins

    from prfaas_sglang.launch.__main__ import _bound

    monkeypatch.setenv("PRFAAS_BIND_SHIM", "require")
    monkeypatch.setenv("PRFAAS_NATIVE_DIR", "/nonexistent/dir")
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(ConfigError, match="PRFAAS_BIND_SHIM"):
        _bound(command)
    monkeypatch.setenv("PRFAAS_BIND_SHIM", "auto")  # the same failure: a note, the engine still starts
    assert "LD_PRELOAD" not in _bound(command).env and "no C compiler" in _bound(command).notes[-1]
    wildcard = mock_command(Node("p0", "prfaas", Role.PRFAAS, port=30000, bootstrap_port=8998, host="0.0.0.0"),
                            "python", "h200x8")
    assert _bound(wildcard) == wildcard  # configured to listen everywhere: left alone
    monkeypatch.setenv("PRFAAS_BIND_SHIM", "sometimes")
    with pytest.raises(ConfigError, match="auto, require or off"):
        _bound(command)
