"""``python -m prfaas_sglang.gpu.trace MODULE...``: import the modules, print what they loaded (JSON).

Run in a subprocess of the environment to trace (the CPU test venv): one JSON object on the last
line of stdout::

    {"python": "3.11", "failed": {module: "ErrorType: message"},
     "dists": {name: {"version": v, "files": [path relative to site-packages, ...]}},
     "unowned": [file, ...]}

``dists`` holds every installed distribution that owns a loaded file (by its RECORD): a module's
file, or a shared object mapped into the process (``/proc/self/maps``: the libraries extension
modules link, which no module names). ``unowned``: loaded module files no distribution owns (the
standard library excluded; a checkout on ``sys.path`` shows here). Import failures are
reported, not raised.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
import sys
import sysconfig
import warnings


def _owners() -> dict[str, tuple[str, str, str]]:
    """Absolute file path (symlinks resolved, as ``os.path.realpath`` gives it) -> (dist name, version,
    path relative to its site directory). Each directory is resolved once and each file only when it
    is a link itself, and each distribution's metadata is parsed once (``dist.version`` parses it
    again on every call: per file, that was most of a 30-s trace)."""
    real_dir = functools.lru_cache(maxsize=None)(os.path.realpath)
    owners: dict[str, tuple[str, str, str]] = {}
    for dist in importlib.metadata.distributions():
        name, version = dist.metadata["Name"], dist.version
        for rel in dist.files or ():
            head, tail = os.path.split(str(dist.locate_file(rel)))
            path = os.path.join(real_dir(head), tail)
            if os.path.islink(path):
                path = os.path.realpath(path)
            owners[path] = (name, version, str(rel))
    return owners


def _mapped_files() -> set[str]:
    """Files mapped into this process (shared objects), by /proc/self/maps; empty where there is none."""
    try:
        with open("/proc/self/maps") as maps:
            return {os.path.realpath(line.split(None, 5)[5].strip()) for line in maps
                    if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith("/")}
    except OSError:
        return set()


def trace(modules: list[str]) -> dict:
    failed: dict[str, str] = {}
    warnings.simplefilter("ignore")
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as err:  # noqa: BLE001 - reported, the caller decides
            failed[module] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    stdlib = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")}
    owners = _owners()
    dists: dict[str, dict] = {}
    unowned: list[str] = []
    loaded = {os.path.realpath(f) for f in (getattr(m, "__file__", None) for m in list(sys.modules.values())) if f}
    mapped = _mapped_files()
    for path in sorted(loaded | mapped):
        owner = owners.get(path)
        if owner is None:
            if path in loaded and os.path.isfile(path) and not any(path.startswith(root + os.sep) for root in stdlib):
                unowned.append(path)
            continue
        name, version, rel = owner
        entry = dists.setdefault(name, {"version": version, "files": []})
        entry["files"].append(rel)
    for entry in dists.values():
        entry["files"] = sorted(set(entry["files"]))
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "failed": failed,
            "dists": dict(sorted(dists.items())), "unowned": sorted(set(unowned))}


if __name__ == "__main__":
    print(json.dumps(trace(sys.argv[1:])))
