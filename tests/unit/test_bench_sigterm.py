"""``python -m prfaas_sglang.bench`` and SIGTERM: the process that installed the handler unwinds (its
``finally`` blocks stop servers and remove namespaces); a child forked from it without exec (pyroute2's
netns helpers) exits at once and runs none of them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent("""
    import os, signal, sys, time
    from prfaas_sglang.bench.__main__ import exit_on_sigterm
    exit_on_sigterm()
    owner = os.getpid()
    marker = sys.argv[1]
    def unwound():
        if os.getpid() != owner:
            with open(marker, "a") as f:
                f.write(f"{os.getpid()}\\n")
""")


def _run(body: str, marker) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(marker)],
                          capture_output=True, text=True, timeout=120)


def test_the_owner_unwinds_through_finally_and_exits_143(tmp_path):
    proc = _run("""
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        finally:
            print("cleaned up", flush=True)
    """, tmp_path / "marker")
    assert proc.returncode == 143 and proc.stdout == "cleaned up\n", proc


def test_a_forked_child_stopped_with_sigterm_runs_none_of_its_parents_finally_blocks(tmp_path):
    marker = tmp_path / "marker"
    proc = _run("""
        r, w = os.pipe()
        try:
            pid = os.fork()
            if pid == 0:
                os.write(w, b"x")
                time.sleep(30)
                os._exit(0)
            os.read(r, 1)
            os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
        finally:
            unwound()
    """, marker)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["143"]
    assert not marker.exists(), "the child ran its parent's finally"


def test_pyroute2s_helpers_never_unwind_into_the_parents_cleanup(tmp_path):
    """What hit ``gpu-e2e``: pyroute2 stops each netns helper with SIGTERM once it has answered, while the
    helper is still on its way to ``os._exit``. With ``sys.exit`` in every process, most unwound."""
    marker = tmp_path / "marker"
    proc = _run("""
        from pyroute2.process import ChildProcess
        try:
            for _ in range(100):
                with ChildProcess(target=lambda: b"", args=[]) as helper:
                    helper.get_data()
        finally:
            unwound()
    """, marker)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), f"{len(marker.read_text().split())} of 100 helpers ran the parent's finally"
