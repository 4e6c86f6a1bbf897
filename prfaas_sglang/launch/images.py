"""Build every image in ``docker/`` and check each imports what its role runs (``make images``).

    python -m prfaas_sglang.launch.images build [--only control-plane,...] [--builder podman|docker]
    python -m prfaas_sglang.launch.images check IMAGE_NAME      (inside a built image: its role's imports)

Bases: each Dockerfile's own (``python:3.11-slim``, ``lmsysorg/sglang:v<pin>-cu130``) when the builder can pull
it. Where it cannot (no container registry reachable), the control plane builds on a Debian bookworm root
with Debian's Python 3.11 bootstrapped here by ``mmdebstrap`` (the same Python as the slim image), and the
engine images build their own layers (this package's wheel, the patched SGLang wheel, ``patches check``, the
bind shim) on ``docker/stand-in/sglang-cpu.Containerfile``: that root plus the pinned SGLang wheel without
its dependencies. Every image's ``wireguard-go`` stage (``WIREGUARD_GO_BASE``, ``debian:bookworm-slim``) runs on
that root too when its default cannot be pulled. Every image built on a stand-in says so in its ``io.prfaas.stand-in`` label, and the report
names it. pip inside a build reaches the package index with the host's CA bundle mounted for the build only
(never in a layer). After each build, ``check`` runs inside the image: every module of :data:`IMAGES`'s
``imports`` must import; ``needs_gpu_stack`` ones are reported apart on a stand-in (they need the CUDA
base's torch). Needs podman (or docker) and, to bootstrap, mmdebstrap.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prfaas_sglang._pin import PINNED_SGLANG_VERSION
from prfaas_sglang.launch.k8s import DEFAULT_IMAGES

HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
BASE_TAG = "localhost/prfaas-sglang/debian-python:3.11-bookworm"
STAND_IN_TAG = f"localhost/prfaas-sglang/sglang-cpu-stand-in:{PINNED_SGLANG_VERSION}"
STAND_IN_FILE = "docker/stand-in/sglang-cpu.Containerfile"
WIREGUARD_GO_ARG, WIREGUARD_GO_BASE = "WIREGUARD_GO_BASE", "debian:bookworm-slim"  # every Dockerfile's wireguard-go stage


@dataclass(frozen=True)
class Image:
    dockerfile: str
    tag: str
    base_arg: str  # the Dockerfile's ARG naming its base
    default_base: str
    imports: tuple[str, ...]  # what its roles run: every one must import in the image
    needs_gpu_stack: tuple[str, ...] = ()  # of those, what needs the CUDA base's torch (a stand-in lacks it)


_LAUNCH = ("prfaas_sglang.launch.__main__", "prfaas_sglang.launch.images")
IMAGES = {
    "control-plane": Image("docker/control-plane.Dockerfile", DEFAULT_IMAGES["control"], "PYTHON_IMAGE", "python:3.11-slim",
                           (*_LAUNCH, "prfaas_sglang.router.__main__", "prfaas_sglang.router.app",
                            "prfaas_sglang.router.front", "prfaas_sglang.kvindex.__main__",
                            "prfaas_sglang.engine.mock.__main__", "mooncake.engine", "transformers", "jinja2",
                            "prfaas_sglang.adapters.wireguard")),
    "prfaas-prefill": Image("docker/prfaas-prefill.Dockerfile", DEFAULT_IMAGES["prfaas"], "SGLANG_IMAGE",
                            f"lmsysorg/sglang:v{PINNED_SGLANG_VERSION}-cu130",
                            (*_LAUNCH, "prfaas_sglang.plugin", "prfaas_sglang.patches", "prfaas_sglang.native",
                             "sglang.launch_server", "mooncake.engine"),
                            needs_gpu_stack=("sglang.launch_server", "mooncake.engine")),
    "local-pd": Image("docker/local-pd.Dockerfile", DEFAULT_IMAGES["pd"], "SGLANG_IMAGE",
                      f"lmsysorg/sglang:v{PINNED_SGLANG_VERSION}-cu130",
                      (*_LAUNCH, "prfaas_sglang.plugin", "prfaas_sglang.patches", "prfaas_sglang.native",
                       "sglang.launch_server", "mooncake.engine"),
                      needs_gpu_stack=("sglang.launch_server", "mooncake.engine")),
}


class BuildError(RuntimeError):
    pass


TUNNEL_PROGRAMS = ("ip", "wg", "nft", "wireguard-go")  # what launch --tunnel runs, in every image (a pod's tunnel)


def check(name: str) -> dict:
    """Inside an image: import each module of ``IMAGES[name].imports`` and find each of :data:`TUNNEL_PROGRAMS`;
    {"ok": [...], "failed": {module or program: error}, "wireguard_go": its version line}."""
    ok, failed = [], {}
    for module in IMAGES[name].imports:
        try:
            importlib.import_module(module)
            ok.append(module)
        except Exception as err:  # noqa: BLE001 - every kind of import failure is the report
            failed[module] = f"{type(err).__name__}: {err}"[:300]
    for program in TUNNEL_PROGRAMS:
        if shutil.which(program):
            ok.append(program)
        else:
            failed[program] = "not on PATH"
    version = None
    if "wireguard-go" in ok:
        out = subprocess.run(["wireguard-go", "--version"], capture_output=True, text=True, timeout=30).stdout
        version = out.splitlines()[0] if out else None
    return {"image": name, "ok": ok, "failed": failed, "wireguard_go": version}


class Builder:
    """podman (or docker) with what this host needs: the host's CA bundle for pip during builds, the caller's process
    and file limits for runs (runc cannot raise them), host networking."""

    def __init__(self, tool: str, repo: Path, log):
        self.tool, self.repo, self.log = tool, repo, log

    def _run(self, *args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess:
        return subprocess.run([self.tool, *args], cwd=self.repo, capture_output=True, text=True, timeout=timeout_s)

    def exists(self, tag: str) -> bool:
        return self._run("image", "inspect", tag, timeout_s=60).returncode == 0

    def pull(self, ref: str) -> bool:
        return self._run("pull", ref, timeout_s=600).returncode == 0

    def build(self, dockerfile: str, tag: str, build_args: dict[str, str]) -> float:
        t0 = time.monotonic()
        args = ["build", "--network", "host", "-f", dockerfile, "-t", tag]
        if os.path.exists(HOST_CA):
            args += ["-v", f"{HOST_CA}:{HOST_CA}:ro"]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        proc = self._run(*args, ".")
        if proc.returncode != 0:
            raise BuildError(f"{dockerfile}: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        return time.monotonic() - t0

    def run_python(self, tag: str, *args: str) -> subprocess.CompletedProcess:
        from prfaas_sglang.demo.containers import ulimits

        return self._run("run", "--rm", "--network", "host", *ulimits(), "--entrypoint", "python3", tag, *args, timeout_s=300)

    def size_mb(self, tag: str) -> float:
        out = self._run("image", "inspect", "--format", "{{.Size}}", tag, timeout_s=60).stdout.strip()
        return round(int(out) / 1e6, 1) if out.isdigit() else 0.0


def bootstrap_base(builder: Builder, log) -> str:
    """The Debian bookworm root with Python 3.11 (mmdebstrap), imported as :data:`BASE_TAG` (once)."""
    if builder.exists(BASE_TAG):
        return BASE_TAG
    if shutil.which("mmdebstrap") is None:
        raise BuildError("no base can be pulled and mmdebstrap (to bootstrap one) is not installed")
    log("bootstrapping a Debian bookworm root with Python 3.11 (mmdebstrap)")
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "root.tar"
        proc = subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3.11,python3-pip,ca-certificates",
                               "bookworm", str(tar), "http://deb.debian.org/debian"], capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise BuildError(f"mmdebstrap: {proc.stderr[-1500:]}")
        # Debian marks its Python externally managed; an image's pip owns it, as in the slim image
        imported = builder._run("import", "--change", "ENV PIP_BREAK_SYSTEM_PACKAGES=1", "--change", 'CMD ["python3"]',
                                str(tar), BASE_TAG, timeout_s=600)
        if imported.returncode != 0:
            raise BuildError(f"import of the bootstrapped root: {imported.stderr[-1500:]}")
    return BASE_TAG


def build(names: tuple[str, ...], builder: Builder, log) -> dict:
    """Build ``names`` (each on its own base where pullable, else the stand-ins), then check each; the report."""
    report, wireguard_go_base = {"builder": builder.tool, "images": {}}, None
    for name in names:
        image = IMAGES[name]
        stand_in = None
        base = image.default_base
        if not builder.exists(base) and not builder.pull(base):
            python_base = bootstrap_base(builder, log)
            if image.base_arg == "PYTHON_IMAGE":
                base, stand_in = python_base, f"Debian bookworm + Python 3.11 (mmdebstrap) for {image.default_base}"
            else:
                if not builder.exists(STAND_IN_TAG):
                    log(f"building the CPU stand-in for {image.default_base}")
                    builder.build(STAND_IN_FILE, STAND_IN_TAG, {"PYTHON_IMAGE": python_base,
                                                                "SGLANG_VERSION": PINNED_SGLANG_VERSION})
                base, stand_in = STAND_IN_TAG, f"{STAND_IN_FILE} for {image.default_base} (no torch, CUDA or kernels)"
        if wireguard_go_base is None:  # once per build: every image's stage uses the same
            wireguard_go_base = (WIREGUARD_GO_BASE if builder.exists(WIREGUARD_GO_BASE) or builder.pull(WIREGUARD_GO_BASE)
                                 else bootstrap_base(builder, log))
        log(f"building {image.tag} on {base}")
        seconds = builder.build(image.dockerfile, image.tag, {image.base_arg: base, WIREGUARD_GO_ARG: wireguard_go_base})
        proc = builder.run_python(image.tag, "-m", "prfaas_sglang.launch.images", "check", name)
        try:
            checked = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            checked = {"ok": [], "failed": {"(check)": (proc.stderr or proc.stdout)[-500:]}}
        expected_missing = set(image.needs_gpu_stack) if stand_in else set()
        report["images"][name] = {"tag": image.tag, "base": base, "stand_in": stand_in, "build_s": round(seconds, 1),
                                  "size_mb": builder.size_mb(image.tag), "imports_ok": checked["ok"],
                                  "wireguard_go": checked.get("wireguard_go"),
                                  "needs_gpu_stack": {m: e for m, e in checked["failed"].items() if m in expected_missing},
                                  "failed": {m: e for m, e in checked["failed"].items() if m not in expected_missing}}
    return report


def render(report: dict) -> str:
    lines = ["| image | base | build s | size MB | imports and tunnel programs | wireguard-go | not on this base |",
             "|---|---|---|---|---|---|---|"]
    for r in report["images"].values():
        imports = f"{len(r['imports_ok'])} ok" + (f", FAILED {sorted(r['failed'])}" if r["failed"] else "")
        lines.append(f"| {r['tag']} | {r['stand_in'] or r['base']} | {r['build_s']} | {r['size_mb']} | {imports} | "
                     f"{r.get('wireguard_go') or '-'} | "
                     f"{'; '.join(f'{m} ({e})' for m, e in r['needs_gpu_stack'].items()) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.launch.images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build every image (or --only), then check each")
    b.add_argument("--only", default=None, help=f"comma list of: {', '.join(IMAGES)}")
    b.add_argument("--builder", default=None, help="podman or docker (default: podman where installed)")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    c = sub.add_parser("check", help="inside an image: import its role's modules; one JSON line")
    c.add_argument("image", choices=sorted(IMAGES),
                   help="the image this runs in: whose modules to import")
    args = parser.parse_args(argv)
    if args.command == "check":
        result = check(args.image)
        print(json.dumps(result))
        return 0 if not result["failed"] else 1
    names = tuple(IMAGES) if args.only is None else tuple(n.strip() for n in args.only.split(",") if n.strip())
    if unknown := [n for n in names if n not in IMAGES]:
        parser.error(f"unknown images {unknown}; choose from {', '.join(IMAGES)}")
    tool = args.builder or next((t for t in ("podman", "docker") if shutil.which(t)), None)
    if tool is None or shutil.which(tool) is None:
        print("error: --builder: neither podman nor docker is installed", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "docker").is_dir():
        print("error: run from a checkout (the build context is the repository)", file=sys.stderr)
        return 2
    try:
        report = build(names, Builder(tool, repo, lambda m: print(m, file=sys.stderr, flush=True)),
                       lambda m: print(m, file=sys.stderr, flush=True))
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if not any(r["failed"] for r in report["images"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
