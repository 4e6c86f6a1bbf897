"""The zygote (prfaas_sglang.bench.zygote): a run is forked only where it would see what the preload saw.

A preload module of this test's own (on PYTHONPATH) reads one variable by name, copies the whole environment, and
sets another variable it read unset; a ``MODULE:FUNCTION`` entry is called after its import. Forked and plain
runs are told apart by the object ``popen`` returns."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from prfaas_sglang.bench.zygote import Zygote, ZygoteProcess, _recv, _send

PRELOADED = textwrap.dedent("""
    import os
    NAMED = os.environ.get("ZYG_NAMED")          # read by name: a run must see it as this did
    WHOLE = dict(os.environ)                     # a copy of everything reads no name in particular
    if "ZYG_SET" not in os.environ:              # read unset, then set: a run with this value ends the same
        os.environ["ZYG_SET"] = "default"
    CALLED = []

    def prepare():
        CALLED.append(os.environ.get("ZYG_NAMED"))
""")
REPORT = "import zyg_preloaded as m; print(m.NAMED, m.CALLED)"


@pytest.fixture
def zygote(tmp_path, monkeypatch):
    (tmp_path / "zyg_preloaded.py").write_text(PRELOADED)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("ZYG_NAMED", "seen")
    monkeypatch.setenv("ZYG_UNREAD", "a")
    monkeypatch.delenv("ZYG_SET", raising=False)
    with Zygote(preload=("zyg_preloaded:prepare",)) as z:
        yield z


def _run(z: Zygote, **changes: str | None):
    """(forked, what the run printed); every run, forked or not, leads a process group of its own."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in changes}
    env.update({k: v for k, v in changes.items() if v is not None})
    proc = z.popen([sys.executable, "-c", REPORT + "; import os; print(os.getpgid(0) == os.getpid())"], env=env,
                   stdout=subprocess.PIPE)
    report, own_group = proc.stdout.read().strip().splitlines()
    assert proc.wait() == 0 and own_group == "True"
    return isinstance(proc, ZygoteProcess), report


def test_a_run_is_forked_only_where_it_sees_every_variable_the_preload_read_by_name(zygote):
    assert zygote.read_at_import["ZYG_NAMED"] == ["seen", "seen"]
    assert "ZYG_UNREAD" not in zygote.read_at_import  # only the whole copy read it
    assert _run(zygote) == (True, "seen ['seen']")  # forked: the preload's module, its function called
    assert _run(zygote, ZYG_UNREAD="b") == (True, "seen ['seen']")
    assert _run(zygote, ZYG_SET="default") == (True, "seen ['seen']")  # what the preload set itself
    assert _run(zygote, ZYG_NAMED="other") == (False, "other []")  # a fresh process imports it afresh
    assert _run(zygote, ZYG_NAMED=None) == (False, "None []")
    assert _run(zygote, ZYG_SET="mine") == (False, "seen []")



def test_two_messages_sent_back_to_back_are_read_as_two():
    """A run that ends at once has its pid and its exit status in the socket together (CI, 2026-11-30);
    a request's descriptors come with its first message."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    with ours, theirs:
        _send(ours, {"pid": 7})
        _send(ours, {"returncode": 0})
        _send(ours, {"argv": ["-c", "pass"]}, [write_end])
        ours.shutdown(socket.SHUT_WR)
        assert _recv(theirs) == ({"pid": 7}, [])
        assert _recv(theirs) == ({"returncode": 0}, [])
        request, fds = _recv(theirs, max_fds=3)
        assert request == {"argv": ["-c", "pass"]} and len(fds) == 1
        assert _recv(theirs) == (None, [])
    for fd in (read_end, write_end, *fds):
        os.close(fd)
