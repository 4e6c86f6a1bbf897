"""Native helpers, built from source on the machine that runs them (a C compiler; no binary is kept
in the repository): the bind shim (``bindshim.c``), which makes Mooncake's listeners bind the
node's address (Mooncake issue #1938). ``python -m prfaas_sglang.native build`` builds it ahead of
time (the engine images do); the launcher builds it on first use otherwise.

Built once per source: the library's name carries the source's digest, so an upgraded source is
rebuilt and an old library is never loaded for a new source.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from prfaas_sglang.envs import envs

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): an I/O package;
# these modules of it are pure.
PURE_MODULES = ()

SHIM_SOURCE = Path(__file__).with_name("bindshim.c")


class NativeBuildError(RuntimeError):
    """The shim could not be built here (no C compiler, a compile error, an unwritable directory)."""


def native_dir() -> Path:
    """Where built libraries go: ``PRFAAS_NATIVE_DIR``, else ``~/.cache/prfaas-sglang/native``."""
    given = envs.NATIVE_DIR.get()
    return Path(given) if given else Path.home() / ".cache" / "prfaas-sglang" / "native"


def bind_shim_path() -> Path:
    """Where the shim for this source lives (built or not)."""
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:16]
    return native_dir() / f"libprfaas_bindshim-{digest}.so"


def build_bind_shim() -> Path:
    """The shim's path, building it first if needed (``$CC`` or ``cc``). Safe to call from several
    processes at once: each compiles to its own temporary file and renames it into place. Raises
    NativeBuildError saying why it cannot be built."""
    target = bind_shim_path()
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"no C compiler ({compiler!r} not found) to build {SHIM_SOURCE.name}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".bindshim-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as err:
        raise NativeBuildError(f"cannot write under {target.parent}: {err}") from None
    try:
        done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", tmp, str(SHIM_SOURCE), "-ldl"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler} failed on {SHIM_SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise NativeBuildError(f"{compiler} took over 120 s on {SHIM_SOURCE.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
