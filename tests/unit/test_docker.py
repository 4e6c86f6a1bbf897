"""docker/: no Docker engine runs here, so parse the Dockerfiles and check what they reference."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from prfaas_sglang._pin import PINNED_SGLANG_VERSION

DOCKERFILES = sorted((REPO_ROOT / "docker").glob("*.Dockerfile"))
INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "ENTRYPOINT", "CMD", "EXPOSE", "LABEL", "USER", "HEALTHCHECK", "SHELL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        joined.append(buf + line)
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    result = []
    for line in joined:
        word, _, rest = line.strip().partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def test_one_image_per_cluster_role():
    assert {p.name for p in DOCKERFILES} == {
        "prfaas-prefill.Dockerfile",
        "local-pd.Dockerfile",
        "control-plane.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
class TestDockerfile:
    def test_parses_with_known_instructions(self, path):
        parsed = instructions(path)
        assert parsed and all(word in INSTRUCTIONS for word, _ in parsed), parsed
        assert any(word == "FROM" for word, _ in parsed)
        assert parsed[-1][0] in ("ENTRYPOINT", "CMD")

    def test_copy_sources_exist_in_the_build_context(self, path):
        for word, args in instructions(path):
            if word not in ("COPY", "ADD"):
                continue
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            if "--from=" in args:
                continue
            for src in parts[:-1]:
                assert (REPO_ROOT / src).exists(), f"{path.name}: COPY source {src} does not exist"

    def test_copy_from_names_a_stage(self, path):
        parsed = instructions(path)
        stages = {args.split()[-1] for word, args in parsed if word == "FROM" and " AS " in args.upper()}
        for word, args in parsed:
            match = re.search(r"--from=(\S+)", args)
            if word == "COPY" and match:
                assert match.group(1) in stages

    def test_python_modules_it_runs_exist(self, path):
        text = path.read_text()
        modules = set(re.findall(r"-m[\"', ]+(prfaas_sglang[\w.]*)", text))
        assert modules, f"{path.name} runs no prfaas_sglang module"
        for module in modules:
            assert importlib.util.find_spec(module) is not None, module

    def test_engine_images_use_the_pinned_sglang(self, path):
        text = path.read_text()
        if "SGLANG_IMAGE" not in text:
            return
        (image,) = re.findall(r"ARG SGLANG_IMAGE=(\S+)", text)
        assert f":v{PINNED_SGLANG_VERSION}-" in image
        assert "patches apply --wheel-out" in text and "patches check" in text


@pytest.mark.parametrize("name", ["prfaas-prefill.Dockerfile", "control-plane.Dockerfile"])
def test_images_that_publish_link_telemetry_carry_ss(name):
    """A PrfaaS worker's telemetry reads its Mooncake lanes' TCP state with ``ss`` (adapters/tcpinfo.py);
    the images that run one (SGLang's, and the emulated engine's) install it."""
    runs = " ".join(args for word, args in instructions(REPO_ROOT / "docker" / name) if word == "RUN")
    installs = re.findall(r"apt-get install[^&]*", runs)
    assert any(re.search(r"\biproute2\b", cmd) for cmd in installs), installs


@pytest.mark.parametrize("name", ["prfaas-prefill.Dockerfile", "local-pd.Dockerfile", "control-plane.Dockerfile"])
def test_every_image_can_hold_its_pods_tunnel(name):
    """A pod on an encrypted link runs ``launch --tunnel`` in its ``tunnel`` container (launch/k8s.py): every image
    has ``ip``, ``wg`` and ``nft``, and wireguard-go for hosts whose kernel lacks the module: the binary of a Debian
    stage that ran ``scripts/install-wireguard-go.sh`` (trixie's; bookworm's package misses the tunnel's throughput
    target), not the base's own package, on the final image's path."""
    steps = instructions(REPO_ROOT / "docker" / name)
    runs = " ".join(args for word, args in steps if word == "RUN")
    installs = " ".join(re.findall(r"apt-get install[^&]*", runs.replace("\\", " "))).split()
    assert {"iproute2", "wireguard-tools", "nftables"} <= set(installs) and "wireguard-go" not in installs, installs
    stage = [args for word, args in steps if word == "FROM" and args.endswith(" AS wireguard-go")]
    assert stage == ["${WIREGUARD_GO_BASE} AS wireguard-go"], stage
    assert "bash /tmp/install-wireguard-go.sh /opt/wireguard-go" in runs
    copies = [args for word, args in steps if word == "COPY" and args.startswith("--from=wireguard-go ")]
    assert copies == ["--from=wireguard-go /opt/wireguard-go/wireguard-go /usr/local/bin/wireguard-go"], copies


# The system libraries Mooncake's TCP engine links that a slim Python image lacks, by the Debian package that has
# them; the C runtime is in every base. A library neither here, in the base, nor in the wheel fails the test below.
DEBIAN_PACKAGE_OF = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1", "libcurl.so.4": "libcurl4"}
C_RUNTIME = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libstdc++.so.6", "libgcc_s.so.1",
             "ld-linux-x86-64.so.2"}


def test_the_emulated_engines_image_has_every_library_mooncakes_engine_links():
    """The control-plane image runs the emulated engine, which imports ``mooncake.engine``: every shared library the
    installed wheel's engine names (its ELF NEEDED entries) is bundled in the wheel, in the C runtime, or installed
    by the image's apt-get (an image without libnuma1 and libcurl4 failed ``import mooncake.engine`` at start)."""
    import mooncake

    engine = Path(mooncake.__file__).parent / "engine.so"
    dynamic = subprocess.run(["readelf", "-d", str(engine)], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
    assert "libc.so.6" in needed, dynamic  # read as expected
    bundled = {p.name for d in (engine.parent, engine.parent.parent / "mooncake_transfer_engine_non_cuda.libs")
               if d.is_dir() for p in d.iterdir()}
    system = needed - bundled - C_RUNTIME
    assert not system - DEBIAN_PACKAGE_OF.keys(), f"map these to their Debian packages: {system - DEBIAN_PACKAGE_OF.keys()}"
    runs = " ".join(args for word, args in instructions(REPO_ROOT / "docker" / "control-plane.Dockerfile") if word == "RUN")
    installs = " ".join(re.findall(r"apt-get install[^&]*", runs)).split()
    assert {DEBIAN_PACKAGE_OF[lib] for lib in system} <= set(installs), installs


def test_the_control_plane_extras_carry_the_tokenizer_they_load():
    """``[router,mock]`` (the control-plane image) loads the topology's tokenizer with ``transformers``
    (``prfaas_sglang/tokenizer``) and renders chat templates with ``jinja2``: both extras carry them (the image's
    router crashed at start on ``No module named 'transformers'``)."""
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("router", "mock"):
        names = {re.split(r"[<>=!~; \[]", req, maxsplit=1)[0].lower() for req in extras[extra]}
        assert {"transformers", "jinja2"} <= names, (extra, names)
    source = (REPO_ROOT / "prfaas_sglang" / "tokenizer" / "__init__.py").read_text()
    assert "from transformers import AutoTokenizer" in source and "import jinja2" in source


def test_dockerignore_keeps_local_environments_out():
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".cache" in ignored


@pytest.mark.slow
def test_installed_wheel_finds_its_packaged_series(tmp_path):
    """What the images do: install this package from its wheel and read the series from it."""
    proc = subprocess.run(
        # the build backend from the test environment (the test extra carries hatchling), not a fresh one from PyPI
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"),
         str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "w").glob("prfaas_sglang-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    assert (site / "prfaas_sglang" / "_patches" / "series").read_text() == (REPO_ROOT / "patches" / "series").read_text()
    # the images build the bind shim from the installed package's source
    assert (site / "prfaas_sglang" / "native" / "bindshim.c").read_bytes() == (REPO_ROOT / "prfaas_sglang" / "native" / "bindshim.c").read_bytes()
    out = subprocess.run(
        [sys.executable, "-c", "from prfaas_sglang.patches.tree import default_patches_dir, is_checkout; "
         "print(is_checkout(), default_patches_dir())"],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(site / "prfaas_sglang" / "_patches")]


def test_make_images_builds_every_dockerfile_and_checks_what_each_role_imports():
    """``make images`` (``launch/images.py``) covers every Dockerfile under the tag the Kubernetes output deploys,
    and each image's import list names modules that exist (here, in the development environment, the control
    plane's all import; the engine images' GPU-stack ones are the only ones a CPU stand-in may lack)."""
    from prfaas_sglang.launch.images import IMAGES, check
    from prfaas_sglang.launch.k8s import DEFAULT_IMAGES

    assert {REPO_ROOT / i.dockerfile for i in IMAGES.values()} == set(DOCKERFILES)
    assert {i.tag for i in IMAGES.values()} == set(DEFAULT_IMAGES.values())
    for name, image in IMAGES.items():
        args = re.findall(r"^ARG (\w+)=(\S+)", (REPO_ROOT / image.dockerfile).read_text(), re.M)
        assert (image.base_arg, image.default_base) in args, name
        assert set(image.needs_gpu_stack) <= set(image.imports)
        assert all(importlib.util.find_spec(m.split(".")[0]) is not None for m in image.imports), name
    assert check("control-plane")["failed"] == {}


@pytest.mark.parametrize("version, recent", [("0.0.20220316", False), ("0.0.20230223", True), ("0.0.20250522", True),
                                             (None, False)])
def test_the_wireguard_go_installer_keeps_a_recent_one_and_replaces_an_older_one(tmp_path, version, recent):
    """``scripts/install-wireguard-go.sh --check DIR`` (setup-env's test before it installs): 0 when DIR's
    wireguard-go is at least trixie's v0.0.20230223, 1 when older (bookworm's) or absent; a recent one is kept as
    it is, without the network."""
    if version is not None:
        fake = tmp_path / "wireguard-go"
        fake.write_text(f"#!/bin/sh\necho 'wireguard-go v{version}'\necho\necho 'Userspace WireGuard daemon'\n")
        fake.chmod(0o755)
    script = REPO_ROOT / "scripts" / "install-wireguard-go.sh"
    check = subprocess.run(["bash", str(script), "--check", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == (0 if recent else 1), check.stderr
    if recent:  # nothing to do: no apt, no change
        before = (tmp_path / "wireguard-go").read_text()
        kept = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "http_proxy": "http://127.0.0.1:9"})
        assert kept.returncode == 0 and (tmp_path / "wireguard-go").read_text() == before, kept.stderr
