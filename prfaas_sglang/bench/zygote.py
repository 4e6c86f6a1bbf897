"""SGLang imported once, forked per process (benchmarks' peers and the tests' probes; test and bench side).

A benchmark's peer or a test's probe that drives SGLang's own classes runs in a process of its own (what
it registers and patches is process-global, and its failures must not take the caller down), and
importing SGLang costs that process about 10 CPU-seconds. A :class:`Zygote` (a process started by
:meth:`Zygote.start`, with its starter's environment: an overlay of another release included) imports
SGLang's heavy modules once, then forks a child per run. The child takes the run's arguments,
environment, working directory, network namespace and standard streams (passed over a Unix socket),
runs ``python SCRIPT|-m MODULE|-c CODE ARGS`` as python would, and exits with its status, skipping the
interpreter's teardown (``os._exit``): what a run reports, it prints before it ends. The plugin's hooks and
their targets are preloaded too (``prfaas_sglang.plugin:import_hook_modules``, registering nothing): a probe
that registers the plugin spent 1.4 of the registration's 2.1 CPU-seconds importing them (2026-12-01).

:meth:`Zygote.popen` stands in for ``subprocess.Popen`` and :meth:`Zygote.run` for ``subprocess.run``;
both start a plain subprocess instead where a fork would not see what the run asks for: another
interpreter or ``PYTHONPATH``, or another value of a variable the preload read by name (the zygote records
each while it preloads, and reports them when it is ready). The zygote forks only while it has no thread but
its main one, and exits when the process that started it does.

What it preloads is :data:`PRELOAD` unless given: ``Zygote(preload=("sglang_router.launch_router",))`` forks
a peer router that would otherwise import SGLang's server code afresh each start (its mini load balancer does).

Usage as a program: ``python -m prfaas_sglang.bench.zygote SOCKET [MODULE[:FUNCTION] ...]`` (what
:meth:`Zygote.start` runs; the modules to preload, each function called once its module is imported,
:data:`PRELOAD` when none).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# What a probe imports first: each preloaded where the installed release has it; MODULE:FUNCTION calls it.
PRELOAD = ("torch", "numpy", "zmq", "sglang.srt.server_args", "sglang.srt.disaggregation.base.conn",
           "sglang.srt.disaggregation.mooncake.conn", "sglang.srt.disaggregation.kv_events",
           "sglang.srt.mem_cache.radix_cache", "sglang.srt.managers.io_struct", "sglang.srt.plugins",
           "prfaas_sglang.plugin:import_hook_modules")
CLONE_NEWNET = 0x40000000
HEADER = struct.Struct("!I")  # the length of a JSON message that follows


def _send(conn: socket.socket, doc: dict, fds: list[int] = ()) -> None:
    data = json.dumps(doc).encode()
    socket.send_fds(conn, [HEADER.pack(len(data)) + data], list(fds)) if fds else conn.sendall(HEADER.pack(len(data)) + data)


def _recv_exactly(conn: socket.socket, num_bytes: int, data: bytes = b"") -> bytes | None:
    while len(data) < num_bytes:
        more = conn.recv(num_bytes - len(data))
        if not more:
            return None
        data += more
    return data


def _recv(conn: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) when the peer closed.

    It reads no byte past its message: a reply the peer sent right after (a run's exit status after its
    pid) stays in the socket for the next call.
    """
    first, fds, _, _ = socket.recv_fds(conn, HEADER.size, max_fds) if max_fds else (conn.recv(HEADER.size), [], 0, None)
    header = _recv_exactly(conn, HEADER.size, first) if first else None
    data = None if header is None else _recv_exactly(conn, HEADER.unpack(header)[0])
    return (None, fds) if data is None else (json.loads(data), fds)


# --- the zygote (its own process) ----------------------------------------------------------------------


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with open(f"/var/run/netns/{name}") as ns:
        if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the run (streams, namespace, directory, environment, argv), run it."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    code = 0
    try:
        if request.get("netns"):
            _enter_netns(request["netns"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - a probe's own code
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the run's traceback, as python would print it
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class _RecordingEnviron(os._Environ):
    """``os.environ`` (the very mapping: its data is shared) that records the names read through it one at a
    time (``environ[name]``, ``.get``, ``in``, ``os.getenv``), each with the value it first read (None: unset).
    A read of the whole environment reads no name in particular and is not recorded: a read while an
    iteration over it is under way (``for name in environ``, ``.items()``, ``.values()``), or one of the reads
    that follow ``.keys()`` in its order (``dict(environ)``, ``.copy()``)."""

    def __init__(self, environ: os._Environ) -> None:
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue,
                         environ.decodevalue)
        self.read: dict[str, str | None] = {}
        self._iterating = 0
        self._whole: list[str] = []  # the names .keys() gave, in its order, not yet read

    def __iter__(self):
        self._iterating += 1
        try:
            yield from super().__iter__()
        finally:
            self._iterating -= 1

    def keys(self):
        self._whole = list(super().__iter__())[::-1]
        return super().keys()

    def __getitem__(self, key: str) -> str:
        if self._whole and self._whole[-1] == key:
            self._whole.pop()
        elif not self._iterating:
            self._whole = []
            self.read.setdefault(key, super().__getitem__(key) if self.encodekey(key) in self._data else None)
        return super().__getitem__(key)


def _preload(preload: tuple[str, ...]) -> dict[str, list[str | None]]:
    """Import each of ``preload`` (``MODULE`` or ``MODULE:FUNCTION``) where it imports; the environment
    variables read meanwhile (through ``os.environ`` or ``os.getenv``), each with the value it first read and
    its value once the preload is done (a module may set what it read unset: a fresh process that has it set
    to that value ends the same)."""
    environ, os.environ = os.environ, _RecordingEnviron(os.environ)
    try:
        for entry in preload:
            name, _, function = entry.partition(":")
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
                if function:
                    getattr(module, function)()
        return {name: [first, environ.get(name)] for name, first in os.environ.read.items()}
    finally:
        os.environ = environ  # noqa: B003 - the recorder shares its data: putting it back changes no variable


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    """Preload ``preload`` (:func:`_preload`), then fork a child per request on ``path``; each client hears
    the child's pid, then its exit status. Exits when the parent process is gone. Its first line on
    standard output: ``ready`` and the JSON object of the variables the preload read (:func:`_preload`)."""
    read = _preload(preload)
    if threading.active_count() != 1:
        raise SystemExit(f"zygote: {threading.active_count()} threads after the preload; a fork would not be safe")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}  # child pid -> its client
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        print("ready", json.dumps(read, sort_keys=True), flush=True)
        while os.getppid() == parent:
            if selector.select(timeout=0.05):
                conn, _ = listener.accept()
                request, fds = _recv(conn, max_fds=3)
                if request is None or len(fds) != 3:
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    _child(request, fds)
                for fd in fds:
                    os.close(fd)
                _send(conn, {"pid": pid})
                waiting[pid] = conn
            while waiting:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = waiting.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                    conn.close()
    for pid in waiting:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


# --- the test side -------------------------------------------------------------------------------------


class ZygoteProcess:
    """A probe forked by the zygote, as much of :class:`subprocess.Popen` as the tests use: ``pid``,
    ``stdin``/``stdout``/``stderr`` (text; None where not piped), :meth:`poll`, :meth:`wait`, :meth:`kill`,
    ``returncode``. Its process group is its own (the child called ``setsid``)."""

    def __init__(self, conn: socket.socket, pid: int, stdin, stdout, stderr):
        self._conn, self.pid, self.stdin, self.stdout, self.stderr = conn, pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self.args = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._status()
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._conn.setblocking(True)
        return self.returncode

    def _status(self) -> None:
        message, _ = _recv(self._conn)
        self.returncode = -signal.SIGKILL if message is None else message["returncode"]
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._status()
            except TimeoutError:
                self._conn.settimeout(None)
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """One zygote process (:func:`serve`) and the runs it forks; ``with Zygote() as z:`` starts it (on first
    :meth:`popen` or :meth:`run` otherwise) and stops it, with every run still going."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = tuple(preload)
        self._dir = tempfile.mkdtemp(prefix="prfaas-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self.proc: subprocess.Popen | None = None
        self.read_at_import: dict[str, list[str | None]] = {}  # each variable the preload read -> its values (_preload)

    def __enter__(self) -> Zygote:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the zygote and wait for its preload (SGLang's: about 10 CPU-seconds); a no-op once started."""
        if self.proc is not None:
            return
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.path, *self.preload], stdout=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL)
        word, _, read = self.proc.stdout.readline().partition(" ")
        if word != "ready":  # the preload's import errors go to stderr
            raise RuntimeError(f"the zygote of {', '.join(self.preload)} did not start (exit {self.proc.wait()})")
        self.read_at_import = json.loads(read)

    def stop(self) -> None:
        """Stop the zygote (its runs' process groups are killed with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def sees_as_preloaded(self, env: dict[str, str]) -> bool:
        """Whether a run in ``env`` sees every variable the preload read as the preload did (the zygote is
        started to know)."""
        self.start()
        return all(env.get(name) in values for name, values in self.read_at_import.items())

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str, netns: str | None,
               streams: list[int]) -> tuple[socket.socket, int]:
        self.start()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        _send(conn, {"argv": argv, "env": env, "cwd": cwd, "netns": netns}, streams)
        reply, _ = _recv(conn)
        if reply is None:
            raise RuntimeError("the SGLang zygote closed the connection without forking")
        return conn, reply["pid"]

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              wrap: tuple[str, ...] = (), stdin=None, stdout=None, stderr=None):
        """``subprocess.Popen([*wrap, *argv], text=True, ...)``, forked from the zygote where :func:`forkable`
        and every variable the preload read has its value then (else that very Popen, in a session of its own as
        a forked run is: a caller may signal its process group). ``wrap``: none or ``ip
        netns exec NAME``. ``stdin``, ``stdout``, ``stderr``: ``subprocess.PIPE``, ``subprocess.DEVNULL``, a
        file object, ``subprocess.STDOUT`` (stderr) or None (this process's; stdin: none)."""
        env = dict(os.environ if env is None else env)
        if not (forkable(argv, env) and self.sees_as_preloaded(env)):
            return subprocess.Popen([*wrap, *argv], env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=True,
                                    start_new_session=True)  # its own process group, as a forked run's
        ours: list[int | None] = [None, None, None]
        theirs: list[int] = []
        for i, spec in enumerate((stdin, stdout, stderr)):
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                ours[i] = write if i == 0 else read
                theirs.append(read if i == 0 else write)
            elif spec == subprocess.DEVNULL or (i == 0 and spec is None):
                theirs.append(os.open(os.devnull, os.O_RDWR))
            elif i == 2 and spec == subprocess.STDOUT:
                theirs.append(os.dup(theirs[1]))
            else:
                theirs.append(os.dup(i if spec is None else spec.fileno()))
        try:
            conn, pid = self._spawn(argv[1:], env, str(cwd or os.getcwd()), _netns_of(tuple(wrap)), theirs)
        except BaseException:
            for fd in ours:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        files = [None if fd is None else os.fdopen(fd, "w" if i == 0 else "r", buffering=1 if i == 0 else -1)
                 for i, fd in enumerate(ours)]
        proc = ZygoteProcess(conn, pid, *files)
        proc.args = [*wrap, *argv]
        return proc

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
            wrap: tuple[str, ...] = (), timeout: float | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """``subprocess.run([*wrap, *argv], capture_output=True, text=True, ...)``, forked where it can be; past
        ``timeout`` the run is killed and :class:`subprocess.TimeoutExpired` raised."""
        proc = self.popen(argv, env=env, cwd=cwd, wrap=wrap, stdin=subprocess.PIPE if input is not None else None,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if isinstance(proc, ZygoteProcess):
            return _communicate(proc, input, timeout)
        with proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class Zygotes:
    """Zygotes by what they preload, each started on first use and all stopped together: what a run shares
    among the process groups it starts and stops (``with Zygotes() as zygotes:``)."""

    def __init__(self) -> None:
        self._by_preload: dict[tuple[str, ...], Zygote] = {}

    def __enter__(self) -> Zygotes:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def get(self, preload: tuple[str, ...]) -> Zygote:
        """The zygote of ``preload`` (made now if there is none; it starts on its first fork)."""
        if preload not in self._by_preload:
            self._by_preload[preload] = Zygote(preload=preload)
        return self._by_preload[preload]

    def stop(self) -> None:
        """Stop every zygote (and what still runs of its forks); a later :meth:`get` makes one afresh."""
        for zygote in self._by_preload.values():
            zygote.stop()
        self._by_preload.clear()


def forkable(argv: list[str], env: dict[str, str]) -> bool:
    """Whether ``argv`` is ``python SCRIPT|-m MODULE|-c CODE ...`` with this interpreter, run with this
    ``PYTHONPATH`` (what a zygote also needs: the values the preload read, :meth:`Zygote.popen`)."""
    return (len(argv) >= 2 and argv[0] == sys.executable and (argv[1] in ("-c", "-m") or argv[1].endswith(".py"))
            and env.get("PYTHONPATH", "") == os.environ.get("PYTHONPATH", ""))


def _netns_of(wrap: tuple[str, ...]) -> str | None:
    """``ip netns exec NAME`` -> NAME (None for no wrap); anything else is not a wrap the zygote can do."""
    if not wrap:
        return None
    if len(wrap) == 4 and wrap[:3] == ("ip", "netns", "exec"):
        return wrap[3]
    raise ValueError(f"not a network-namespace wrap: {wrap}")


def _communicate(proc: ZygoteProcess, input: str | None, timeout: float | None) -> subprocess.CompletedProcess:
    chunks: dict[str, list[str]] = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda f=f, k=k: chunks[k].append(f.read()), daemon=True)
               for f, k in ((proc.stdout, "out"), (proc.stderr, "err"))]
    for reader in readers:
        reader.start()
    if input is not None:
        proc.stdin.write(input)
        proc.stdin.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for reader in readers:
            reader.join(5)
        raise subprocess.TimeoutExpired(proc.args, timeout, "".join(chunks["out"]), "".join(chunks["err"])) from None
    for reader in readers:
        reader.join()
    proc.stdout.close()
    proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(chunks["out"]), "".join(chunks["err"]))


if __name__ == "__main__":
    serve(sys.argv[1], tuple(sys.argv[2:]) or PRELOAD)
