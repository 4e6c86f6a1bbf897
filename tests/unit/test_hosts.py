"""prfaas_sglang.hosts: one wildcard rule for the launcher, the hooks and the emulated engine."""

import pytest

from prfaas_sglang.hosts import bracketed, is_wildcard, local_host, zmq_bind_host


@pytest.mark.parametrize("host", [None, "", "0.0.0.0", "::", "[::]", "*", " 0.0.0.0 "])
def test_wildcards_bind_everything_and_are_reached_on_loopback(host):
    assert is_wildcard(host) and local_host(host) == "127.0.0.1" and zmq_bind_host(host) == "*"


@pytest.mark.parametrize("host,url,zmq", [("10.0.0.5", "10.0.0.5", "10.0.0.5"), ("::1", "[::1]", "[::1]"),
                                          ("fe80::1", "[fe80::1]", "[fe80::1]"),
                                          ("pd-d-0.pd-d.pd.svc.cluster.local", "pd-d-0.pd-d.pd.svc.cluster.local",
                                           "pd-d-0.pd-d.pd.svc.cluster.local")])
def test_named_hosts_are_kept_and_ipv6_literals_bracketed(host, url, zmq):
    assert not is_wildcard(host) and local_host(host) == host
    assert bracketed(local_host(host)) == url and zmq_bind_host(host) == zmq
    assert bracketed(url) == url  # already bracketed: unchanged
