"""``python -m prfaas_sglang.bench gpu-bundle --out DIR``: build and verify the GPU carry bundle.

Steps (each one's output lands under DIR; DIR is git-ignored by the caller's choice, e.g. ``out/``):

1. ``trace-overlay/``: the distributions SGLang imports only under CUDA that import on a CPU
   (:data:`bundle.TRACE_OVERLAY`), unpacked for *this* interpreter, so the trace can load them.
2. Trace the server's entry modules in this environment (``gpu/trace.py``, a subprocess), then
   again with every module a loaded SGLang file imports under a CUDA branch.
3. ``site/``: every wanted distribution's wheel for the GPU's interpreter, less what
   :data:`bundle.DROP` names; the patch series applied to its ``sglang``.
4. Verify (:func:`bundle.verify`), pack ``bundle.tar.xz``, write ``manifest.json``.

Raises BundleError on any failure, with what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prfaas_sglang.gpu import bundle as spec
from prfaas_sglang.gpu.wheels import WheelSource, extract, supported_tags

TRACE_TIMEOUT_S = 600.0
BUNDLE_NAME = "bundle.tar.xz"
MANIFEST_NAME = "manifest.json"


def run_trace(modules: list[str], overlay: Path | None, python: str = sys.executable) -> dict:
    """The trace of ``modules`` in a fresh interpreter (``python``), ``overlay`` first on its path."""
    env = dict(os.environ)
    if overlay is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(overlay), env.get("PYTHONPATH", "")) if p)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "0")
    proc = subprocess.run([python, "-m", "prfaas_sglang.gpu.trace", *modules], capture_output=True, text=True,
                          timeout=TRACE_TIMEOUT_S, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise spec.BundleError(f"the import trace failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def sglang_requires(python: str = sys.executable) -> list[str]:
    out = subprocess.run([python, "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('sglang') or []))"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise spec.BundleError(f"sglang is not installed in {python}: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def _cuda_modules(site: Path, traced: dict) -> dict[str, set[str]]:
    """Per traced SGLang file (as the bundle has it), the modules it imports only under CUDA."""
    found: dict[str, set[str]] = {}
    for rel in traced.get("sglang", {}).get("files", ()):
        path = site / rel
        if rel.endswith(".py") and path.is_file():
            modules = spec.cuda_branch_imports(path.read_text(errors="replace"))
            if modules:
                found[rel] = modules
    return found


def _untraceable_imports(site: Path, files: list[str], roots: set[str]) -> dict[str, set[str]]:
    """For a distribution that cannot be imported here: per module reachable from ``roots`` (its
    import names), the other packages it imports at module level."""
    sources = {}
    for rel in files:
        if rel.endswith(".py"):
            name = rel[:-3].replace("/", ".").removesuffix(".__init__")
            sources[name] = (site / rel).read_text(errors="replace")
    return {f"{module} (not traceable here)": names for module, names in spec.reachable_imports(sources, roots).items()}


def _add_project(source: WheelSource, site: Path, out: Path, tags, log: Callable[[str], None]) -> dict:
    """This project's wheel (from the wheelhouse, else built from the checkout) unpacked into ``site``."""
    import importlib.metadata

    from prfaas_sglang.gpu.wheels import WheelFile

    version = importlib.metadata.version(spec.PROJECT)
    try:
        wheel = source.find(spec.PROJECT, version, tags) if source.wheelhouse is not None else None
    except spec.BundleError:
        wheel = None
    if wheel is None:
        built = out / "project-wheel"
        subprocess.run(["rm", "-rf", str(built)], check=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(built),
                               str(Path(__file__).resolve().parents[2])], capture_output=True, text=True, timeout=600)
        found = sorted(built.glob("*.whl"))
        if proc.returncode != 0 or not found:
            raise spec.BundleError(f"cannot build this project's wheel: {proc.stderr.strip()[-500:]}")
        wheel = WheelFile(found[0].name, str(found[0]), found[0].stat().st_size)
    done = extract(source, wheel, spec.PROJECT, site)
    log(f"[gpu-bundle] {spec.PROJECT}=={version}: {wheel.filename}, kept {done.kept_bytes / 2**20:.1f} MiB")
    return {"name": spec.PROJECT, "version": version, "reason": "this project (its sglang.srt.plugins entry point)",
            "wheel": wheel.filename, "kept_bytes": done.kept_bytes, "dropped_bytes": done.dropped_bytes,
            "dropped_files": done.dropped_files, "fetched_bytes": done.fetched_bytes}


def _strip_debug(site: Path, log: Callable[[str], None]) -> int:
    """Remove debug sections (``strip --strip-debug``: symbols and code stay) from the shared
    objects in ``site`` that carry them; the bytes saved. Skipped, with a line, without ``strip``."""
    import shutil

    strip = shutil.which("strip")
    if strip is None:
        log("[gpu-bundle] no `strip` here (binutils): shared objects keep their debug sections")
        return 0
    saved = 0
    for path in sorted(site.rglob("*.so*")):
        if not path.is_file() or path.is_symlink():
            continue
        with open(path, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        before = path.stat().st_size
        proc = subprocess.run([strip, "--strip-debug", str(path)], capture_output=True, text=True)
        if proc.returncode == 0:
            saved += before - path.stat().st_size
    log(f"[gpu-bundle] debug sections stripped: {saved / 2**20:.1f} MiB")
    return saved


def _site_files(site: Path) -> list[str]:
    return sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())


def _apply_patches(site: Path) -> list[str]:
    from prfaas_sglang.patches.applier import apply_to_tree
    from prfaas_sglang.patches.series import load_series
    from prfaas_sglang.patches.tree import SourceTree, default_patches_dir

    series = load_series(default_patches_dir())
    apply_to_tree(series, SourceTree(site, "the GPU bundle's sglang"))
    return [p.name for p in series.patches]


def _pack(out: Path, names: list[str], target: Path) -> int:
    target.unlink(missing_ok=True)
    env = dict(os.environ, XZ_OPT="-6 -T0")
    proc = subprocess.run(["tar", "-C", str(out), "-cJf", str(target), *names], capture_output=True, text=True,
                          env=env, timeout=1800)
    if proc.returncode != 0:
        raise spec.BundleError(f"tar failed: {proc.stderr.strip()[-300:]}")
    return target.stat().st_size


def _git_commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return proc.stdout.strip() or None


def build(out: Path, python_version: str = spec.PYTHON_VERSION, wheelhouse: Path | None = None,
          budget_bytes: int = spec.BUNDLE_BUDGET_BYTES, log: Callable[[str], None] = print,
          trace: Callable[[list[str], Path | None], dict] = run_trace,
          requires: Callable[[], list[str]] = sglang_requires, extra_dirs: tuple[str, ...] = ()) -> dict:
    """Build the bundle under ``out``; the manifest (also written to ``out/manifest.json``).

    ``extra_dirs``: directories under ``out`` packed beside ``site/`` (the model).
    ``trace`` and ``requires`` are this environment's (tests pass their own). Raises BundleError
    when a wheel is missing, the trace fails or the bundle does not verify; ``out`` then holds
    what was built so far.
    """
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    source = WheelSource(wheelhouse)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    sglang_reqs = requires()

    overlay = out / "trace-overlay"
    here_tags = supported_tags(here, spec.PLATFORM_TAGS)
    for name, ours in spec.TRACE_OVERLAY.items():
        version = spec.pinned_version(name, ours, sglang_reqs)
        marker = overlay / f".{spec.normalize(name)}-{version}"
        if not marker.exists():
            log(f"[gpu-bundle] trace overlay: {name}=={version} for Python {here}")
            extract(source, source.find(name, version, here_tags), name, overlay)
            marker.touch()

    log(f"[gpu-bundle] tracing {len(spec.ENTRY_MODULES)} entry modules")
    first = trace(list(spec.ENTRY_MODULES), overlay)
    failed = {m: why for m, why in first["failed"].items() if m in spec.ENTRY_MODULES}
    if failed:
        raise spec.BundleError("entry modules do not import in this environment: "
                               + "; ".join(f"{m}: {why}" for m, why in failed.items()))

    tags = supported_tags(python_version, spec.PLATFORM_TAGS)
    site = out / "site"
    if site.exists():
        subprocess.run(["rm", "-rf", str(site)], check=True)
    site.mkdir(parents=True)

    def fetch(dists: list[spec.Wanted]) -> dict[str, dict]:
        got = {}
        for want in dists:
            wheel = source.find(want.name, want.version, tags)
            done = extract(source, wheel, want.name, site)
            log(f"[gpu-bundle] {want.name}=={want.version}: {wheel.filename}, kept {done.kept_bytes / 2**20:.1f} MiB, "
                f"dropped {done.dropped_bytes / 2**20:.1f} MiB, fetched {done.fetched_bytes / 2**20:.1f} MiB")
            got[spec.normalize(want.name)] = {"name": want.name, "version": want.version, "reason": want.reason,
                                              "wheel": wheel.filename, "kept_bytes": done.kept_bytes,
                                              "dropped_bytes": done.dropped_bytes, "dropped_files": done.dropped_files,
                                              "fetched_bytes": done.fetched_bytes}
        return got

    sglang_only = [w for w in spec.wanted(first["dists"], sglang_reqs) if spec.normalize(w.name) == "sglang"]
    fetched = fetch(sglang_only)
    cuda_first = _cuda_modules(site, first["dists"])
    untraceable_tops = {"sgl_kernel"}
    second_entries = sorted({m for mods in cuda_first.values() for m in mods if m.split(".")[0] not in untraceable_tops})
    log(f"[gpu-bundle] tracing again with {len(second_entries)} modules imported under CUDA branches")
    traced = trace(list(spec.ENTRY_MODULES) + second_entries, overlay)
    unresolved = {m: why for m, why in traced["failed"].items() if "No module named" in why}
    wants = spec.wanted(traced["dists"], sglang_reqs)
    fetched.update(fetch([w for w in wants if spec.normalize(w.name) not in fetched]))

    fetched[spec.PROJECT] = _add_project(source, site, out, tags, log)
    patches = _apply_patches(site)
    for path, old, new in spec.REWRITES:
        target = site / path
        target.write_text(spec.rewrite(target.read_text(), old, new, path))
    stripped_bytes = _strip_debug(site, log)
    files = _site_files(site)
    cuda_imports = _cuda_modules(site, traced["dists"])
    for name in spec.GPU_ONLY:  # not traceable: their own unconditional imports must resolve
        tops = _dist_tops(site, name)
        roots = {m for mods in cuda_imports.values() for m in mods if m.split(".")[0] in tops}
        cuda_imports.update(_untraceable_imports(site, [f for f in files if f.split("/", 1)[0] in tops],
                                                 roots | {m.split(".")[0] for m in roots}))
    log("[gpu-bundle] packing")
    size = _pack(out, ["site", *extra_dirs], out / BUNDLE_NAME)
    verdict = spec.verify(traced["dists"], files, spec.top_level_modules(files), cuda_imports, size, budget_bytes)
    for module, why in unresolved.items():
        if module.split(".")[0] not in verdict.cuda_imports:
            verdict.problems.append(f"{module} (imported under CUDA) does not import here: {why}")
    manifest = {
        "python_version": python_version, "traced_with": here, "commit": _git_commit(),
        "entry_modules": list(spec.ENTRY_MODULES), "cuda_branch_modules": second_entries,
        "dists": dict(sorted(fetched.items())),
        "preinstalled_expected": {name: entry["version"] for name, entry in sorted(traced["dists"].items())
                                  if spec.is_preinstalled(name)},
        "patches": patches, "rewrites": [path for path, _, _ in spec.REWRITES], "extra_dirs": list(extra_dirs), "files": len(files), "debug_info_stripped_bytes": stripped_bytes, "packed_bytes": size, "budget_bytes": budget_bytes,
        "verified_files": verdict.checked_files, "cuda_imports": verdict.cuda_imports,
        "problems": verdict.problems, "ok": verdict.ok, "build_s": round(time.monotonic() - started, 1),
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    if not verdict.ok:
        raise spec.BundleError("the bundle does not verify:\n  " + "\n  ".join(verdict.problems))
    return manifest


def _dist_tops(site: Path, name: str) -> set[str]:
    """The top-level names (directories or files) a distribution unpacked into ``site`` owns, by its RECORD."""
    norm = spec.normalize(name).replace("-", "_")
    tops: set[str] = set()
    for info in site.glob("*.dist-info"):
        if spec.normalize(info.name.removesuffix(".dist-info").rsplit("-", 1)[0]).replace("-", "_") != norm:
            continue
        record = info / "RECORD"
        if record.is_file():
            for line in record.read_text().splitlines():
                head = line.split(",", 1)[0].split("/", 1)[0]
                if head and not head.endswith(".dist-info"):
                    tops.add(head)
    return tops

