"""The GPU carry bundle: its pure rules, wheel selection and range reads, and a whole build from a
local wheelhouse (no network, no GPU)."""

from __future__ import annotations

import http.server
import io
import json
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from prfaas_sglang.gpu import builder
from prfaas_sglang.gpu import bundle as spec
from prfaas_sglang.gpu.wheels import RangeFile, WheelSource, extract, pick_wheel, supported_tags

# --- pure rules ---------------------------------------------------------------------------


def test_file_key_matches_twins_across_interpreters_and_wheel_variants():
    assert spec.file_key("orjson/orjson.cpython-311-x86_64-linux-gnu.so") == spec.file_key(
        "orjson/orjson.cpython-312-x86_64-linux-gnu.so")
    assert spec.file_key("sgl_kernel/sm90/common_ops.abi3.so") == "sgl_kernel/sm90/common_ops.so"
    assert spec.file_key("mooncake_transfer_engine_non_cuda.libs/libglog-6ed04f2c.so.0.0.0") == spec.file_key(
        "mooncake_transfer_engine_cuda13.libs/libglog-1a2b3c4d.so.0.0.0")
    assert spec.file_key("pkg/mod.py") == "pkg/mod.py"
    assert spec.file_key("pkg/a.so") != spec.file_key("pkg/b.so")


def test_drop_rules_leave_what_an_h100_loads():
    assert spec.dropped("sglang_kernel", "sgl_kernel/flash_ops.abi3.so")
    assert spec.dropped("sglang-kernel", "sgl_kernel/sm100/common_ops.abi3.so")
    assert not spec.dropped("sglang-kernel", "sgl_kernel/sm90/common_ops.abi3.so")
    assert not spec.dropped("sglang-kernel", "sgl_kernel/__init__.py")
    assert spec.dropped("mooncake-transfer-engine-cuda13", "mooncake/libmooncake_pg.so")
    assert not spec.dropped("mooncake-transfer-engine-cuda13", "mooncake/engine.so")
    assert not spec.dropped("mooncake-transfer-engine-cuda13", "mooncake/store.so")
    assert spec.dropped("anything", "pkg/__pycache__/mod.cpython-312.pyc")


def test_sglang_pin_reads_extras_and_markers():
    requires = ["flashinfer_python[cu13]==0.6.12", "sglang-kernel==0.4.4", "torch==2.11.0",
                "av; sys_platform == 'linux'", "apache-tvm-ffi==0.1.11", "openai>=2"]
    assert spec.sglang_pin(requires, "flashinfer-python") == "0.6.12"
    assert spec.sglang_pin(requires, "sglang_kernel") == "0.4.4"
    assert spec.sglang_pin(requires, "openai") is None
    assert spec.sglang_pin(requires, "nothing") is None


def test_wanted_drops_the_preinstalled_swaps_mooncake_and_adds_the_gpu_only():
    traced = {"sglang": {"version": "0.5.15", "files": []}, "torch": {"version": "2.14.1", "files": []},
              "nvidia-cuda-runtime": {"version": "13", "files": []}, "orjson": {"version": "3.13.0", "files": []},
              "mooncake-transfer-engine-non-cuda": {"version": "0.3.13.post1", "files": []},
              "prfaas-sglang": {"version": "0.1.0", "files": []},
              "scipy": {"version": "1.17.1", "files": []}}  # only transformers' probe loads it
    got = {spec.normalize(w.name): w.version for w in spec.wanted(traced, ["sglang-kernel==0.4.4"])}
    assert got == {"sglang": "0.5.15", "orjson": "3.13.0", "mooncake-transfer-engine-cuda13": "0.3.13.post1",
                   "sglang-kernel": "0.4.4"}
    with pytest.raises(spec.BundleError, match="sglang-kernel"):
        spec.wanted(traced, [])


CUDA_SOURCE = """
import os
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from typing_only import Thing
if _is_cuda:
    from flashinfer.sampling import top_k
    if _is_hopper:
        import deep.hopper
elif _is_hip:
    from aiter import ops
if not _is_cuda:
    import cpu_only
if is_cuda():
    import sgl_kernel
try:
    import optional
except ImportError:
    pass
def f():
    if _is_cuda:
        import inside_function
"""


def test_cuda_branch_imports_are_those_only_a_gpu_runs():
    assert spec.cuda_branch_imports(CUDA_SOURCE) == {"flashinfer.sampling", "deep.hopper", "sgl_kernel"}
    assert spec.cuda_branch_imports("if _is_cuda:\n  x = (") == set()


def test_module_imports_are_unconditional_and_resolved():
    source = ("import a.b\nfrom . import sib\nfrom ..up import x\ntry:\n  import opt\nexcept ImportError:\n  pass\n"
              "if cond:\n  import branch\nif sys.platform == 'darwin':\n  import mac_only\nelse:\n  import linux\n")
    assert spec.module_imports(source, "pkg.sub") == {"a.b", "pkg.sub", "pkg.sub.sib", "pkg.up", "pkg.up.x"}
    assert spec.module_imports(source, "pkg.sub", branches=True) == {
        "a.b", "pkg.sub", "pkg.sub.sib", "pkg.up", "pkg.up.x", "branch", "linux"}


def test_an_untraceable_package_is_followed_from_what_sglang_imports():
    sources = {"k": "import sys\nif sys.platform == 'darwin':\n  from k.metal import *\nelse:\n  import torch\n  from k.ops import f\n",
               "k.ops": "import numpy\nfrom .utils import g\n", "k.utils": "import triton\n",
               "k.metal": "import mlx\n", "k.roofline": "import matplotlib\n"}
    assert spec.reachable_imports(sources, ["k"]) == {"k": {"sys", "torch"}, "k.ops": {"numpy"}, "k.utils": {"triton"}}


def test_verify_names_each_gap():
    traced = {"orjson": {"version": "3", "files": ["orjson/__init__.py", "orjson/orjson.cpython-311-x86_64-linux-gnu.so"]},
              "torch": {"version": "2", "files": ["torch/__init__.py"]}}
    files = ["orjson/__init__.py", "orjson/orjson.cpython-312-x86_64-linux-gnu.so", "flashinfer/__init__.py"]
    ok = spec.verify(traced, files, spec.top_level_modules(files), {"sglang/x.py": {"flashinfer.sampling", "torch.cuda"}},
                     size_bytes=10, budget_bytes=100)
    assert ok.ok and ok.checked_files == 2 and ok.cuda_imports == {"flashinfer": "bundle", "torch": "preinstalled"}
    bad = spec.verify(traced, files[:1], {"orjson"}, {"sglang/x.py": {"flashinfer"}}, size_bytes=200, budget_bytes=100)
    assert len(bad.problems) == 3
    assert "orjson 3: 1 loaded file(s) not in the bundle: orjson/orjson.cpython-311" in bad.problems[0]
    assert "sglang/x.py imports flashinfer on a GPU" in bad.problems[1]
    assert "over its budget" in bad.problems[2]


def test_top_level_modules():
    assert spec.top_level_modules(["a/__init__.py", "b.py", "c.cpython-312-x86_64-linux-gnu.so", "a-1.dist-info/RECORD",
                                   "pillow.libs/libz.so", "d/e/f.py"]) == {"a", "b", "c", "d"}


# --- wheels ---------------------------------------------------------------------------------


def test_pick_wheel_prefers_the_interpreter_and_newest_glibc_it_accepts():
    tags = supported_tags("3.12", spec.PLATFORM_TAGS)
    files = ["x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "x-1.0-cp312-abi3-manylinux_2_17_x86_64.whl",
             "x-1.0-cp312-cp312-manylinux_2_34_x86_64.whl", "x-1.0-cp312-cp312-manylinux_2_40_x86_64.whl",
             "x-1.1-cp312-cp312-manylinux_2_34_x86_64.whl", "x-1.0-py3-none-any.whl", "x-1.0.tar.gz"]
    assert pick_wheel(files, "x", "1.0", tags) == "x-1.0-cp312-cp312-manylinux_2_34_x86_64.whl"
    assert pick_wheel(files[:2], "x", "1.0", tags) == "x-1.0-cp312-abi3-manylinux_2_17_x86_64.whl"
    assert pick_wheel(["x-1.0-py3-none-any.whl"], "X", "1.0", tags) == "x-1.0-py3-none-any.whl"
    assert pick_wheel(files[:1], "x", "1.0", tags) is None  # cp311 only
    assert pick_wheel(["x-1.0-cp312-cp312-manylinux_2_40_x86_64.whl"], "x", "1.0", tags) is None  # glibc too new


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    payload = b""
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        spec_range = self.headers.get("Range", "")
        type(self).requests.append(spec_range)
        start, end = (int(x) for x in spec_range.removeprefix("bytes=").split("-"))
        body = self.payload[start:end + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.payload)}")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _zip(members: dict[str, bytes], stored: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_a_wheel_is_read_in_place_by_ranges_and_dropped_members_are_not_fetched(tmp_path):
    import os

    big = os.urandom(8 << 20)  # incompressible: a dropped 8 MiB member must not be downloaded
    _RangeHandler.payload = _zip({"sgl_kernel/__init__.py": b"x = 1\n", "sgl_kernel/flash_ops.abi3.so": big,
                                  "sgl_kernel/sm90/common_ops.abi3.so": b"\x7fELF" + b"\0" * 1000,
                                  "sglang_kernel-0.4.4.dist-info/RECORD": b""}, stored=True)
    _RangeHandler.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/w.whl"
        raw = RangeFile(url, len(_RangeHandler.payload), block_bytes=64 << 10)
        assert zipfile.ZipFile(raw).read("sgl_kernel/__init__.py") == b"x = 1\n"
        from prfaas_sglang.gpu.wheels import WheelFile

        done = extract(WheelSource(), WheelFile("sglang_kernel-0.4.4-cp310-abi3-manylinux2014_x86_64.whl", url,
                                                len(_RangeHandler.payload)), "sglang-kernel", tmp_path)
    finally:
        server.shutdown()
    assert (tmp_path / "sgl_kernel/__init__.py").read_text() == "x = 1\n"
    assert (tmp_path / "sgl_kernel/sm90/common_ops.abi3.so").is_file()
    assert not (tmp_path / "sgl_kernel/flash_ops.abi3.so").exists()
    assert done.kept_files == 3 and done.dropped_files == 1 and done.dropped_bytes == len(big)
    assert done.fetched_bytes < len(big) / 4
    assert all(r.startswith("bytes=") for r in _RangeHandler.requests)


# --- a whole build from a local wheelhouse --------------------------------------------------


def _wheel(house: Path, name: str, version: str, files: dict[str, bytes], tag: str = "py3-none-any") -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    record = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
    members = {**files, f"{dist}.dist-info/METADATA": f"Name: {name}\nVersion: {version}\n".encode(),
               f"{dist}.dist-info/RECORD": record.encode()}
    (house / f"{dist}-{tag}.whl").write_bytes(_zip(members))


def _pristine_sglang_files() -> dict[str, bytes]:
    """The files the patch series edits, as the pinned wheel has them (the build applies the series)."""
    from prfaas_sglang._pin import PINNED_SGLANG_VERSION
    from prfaas_sglang.patches.series import load_series
    from prfaas_sglang.patches.tree import default_patches_dir, find_or_download_wheel

    paths = {f.old_path for p in load_series(default_patches_dir()).patches for f in p.files if f.old_path}
    with zipfile.ZipFile(find_or_download_wheel(PINNED_SGLANG_VERSION)) as whl:
        return {path: whl.read(path) for path in paths}


# sglang-kernel 0.4.4's sgl_kernel/elementwise.py opens so
SGL_KERNEL_ELEMENTWISE = (b"try:\n    import flashinfer.norm as _flashinfer_norm\n\n    _has_flashinfer = True\n"
                          b"except ImportError:\n    _has_flashinfer = False\n")


@pytest.fixture
def wheelhouse(tmp_path) -> Path:
    house = tmp_path / "wheels"
    house.mkdir()
    sglang_files = {"sglang/__init__.py": b"", "sglang/srt/sampler.py": b"if _is_cuda:\n    from flashinfer.sampling import f\n    from sgl_kernel import ops\n",
                    "sglang/srt/native.cpython-312-x86_64-linux-gnu.so": b"\x7fELF", "sglang/multimodal_gen/big.py": b"#" * 1000,
                    **_pristine_sglang_files()}
    _wheel(house, "sglang", "0.5.15", sglang_files, "cp312-cp312-manylinux_2_34_x86_64")
    _wheel(house, "sglang-kernel", "0.4.4", {"sgl_kernel/__init__.py": b"import torch\nfrom sgl_kernel import ops\n",
                                             "sgl_kernel/elementwise.py": SGL_KERNEL_ELEMENTWISE,
                                             "sgl_kernel/flash_ops.abi3.so": b"\0" * 5000}, "cp310-abi3-manylinux2014_x86_64")
    _wheel(house, "prfaas-sglang", "0.1.0", {"prfaas_sglang/__init__.py": b"",
                                              "prfaas_sglang-0.1.0.dist-info/entry_points.txt": b"[sglang.srt.plugins]\n"})
    _wheel(house, "orjson", "3.13.0", {"orjson/__init__.py": b""}, "cp312-cp312-manylinux_2_17_x86_64")
    for name, version in (("flashinfer-python", "0.6.12"), ("apache-tvm-ffi", "0.1.11"), ("nvidia-ml-py", "13.615.71"),
                          ("python-multipart", "0.0.34")):
        top = {"flashinfer-python": "flashinfer", "apache-tvm-ffi": "tvm_ffi", "nvidia-ml-py": "pynvml",
               "python-multipart": "multipart"}[name]
        _wheel(house, name, version, {f"{top}/__init__.py": b"", f"{top}/data/blob.bin": b"\0" * 100})
    _wheel(house, "mooncake-transfer-engine-cuda13", "0.3.13.post1",
           {"mooncake/__init__.py": b"", "mooncake/engine.so": b"\x7fELF", "mooncake/libmooncake_pg.so": b"\0" * 5000},
           "cp312-cp312-manylinux_2_28_x86_64")
    return house


def _fake_trace(extra_sglang: tuple[str, ...] = ()):
    calls = []

    def trace(modules, overlay):
        calls.append((list(modules), overlay))
        return {"python": "3.11", "failed": {}, "unowned": [], "dists": {
            "sglang": {"version": "0.5.15", "files": ["sglang/__init__.py", "sglang/srt/sampler.py",
                                                       "sglang/srt/native.cpython-311-x86_64-linux-gnu.so", *extra_sglang]},
            "orjson": {"version": "3.13.0", "files": ["orjson/__init__.py"]},
            "flashinfer-python": {"version": "0.6.12", "files": ["flashinfer/__init__.py"]},
            "mooncake-transfer-engine-non-cuda": {"version": "0.3.13.post1", "files": ["mooncake/engine.so"]},
            "torch": {"version": "2.14.1", "files": ["torch/__init__.py"]},
        }}
    return trace, calls


REQUIRES = ["flashinfer_python[cu13]==0.6.12", "apache-tvm-ffi==0.1.11", "sglang-kernel==0.4.4"]


def test_build_from_a_wheelhouse_verifies_packs_and_records(tmp_path, wheelhouse):
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    trace, calls = _fake_trace()
    manifest = builder.build(out, "3.12", wheelhouse, log=lambda _line: None, trace=trace, requires=lambda: REQUIRES,
                             extra_dirs=("model",))
    assert manifest["ok"] and manifest["problems"] == []
    assert set(manifest["dists"]) == {"sglang", "orjson", "flashinfer-python", "mooncake-transfer-engine-cuda13",
                                      "sglang-kernel", "prfaas-sglang"}
    assert manifest["preinstalled_expected"] == {"torch": "2.14.1"}
    # the second trace adds what a traced SGLang file imports under CUDA; the overlay is on its path
    assert calls[1][0][-1] == "flashinfer.sampling" and calls[0][1] == out / "trace-overlay"
    assert (out / "trace-overlay" / "pynvml" / "__init__.py").is_file()
    assert manifest["cuda_imports"] == {"flashinfer": "bundle", "sgl_kernel": "bundle", "torch": "preinstalled"}
    assert manifest["dists"]["prfaas-sglang"]["reason"].startswith("this project")
    with tarfile.open(out / "bundle.tar.xz") as tar:
        names = set(tar.getnames())
    assert {"site/sglang/srt/sampler.py", "site/sgl_kernel/__init__.py", "site/mooncake/engine.so",
            "site/prfaas_sglang-0.1.0.dist-info/entry_points.txt", "model/config.json"} <= names
    assert not {"site/sgl_kernel/flash_ops.abi3.so", "site/mooncake/libmooncake_pg.so",
                "site/sglang/multimodal_gen/big.py"} & names
    assert json.loads((out / "manifest.json").read_text())["packed_bytes"] == (out / "bundle.tar.xz").stat().st_size
    # the patch series is applied to the bundle's SGLang, and recorded
    assert manifest["patches"] == ["0001-cache-ask-before-refusing-hybrid-decode-radix.patch"]
    with tarfile.open(out / "bundle.tar.xz") as tar:
        patched = tar.extractfile("site/sglang/srt/mem_cache/kv_cache_builder.py").read().decode()
    assert "if is_hybrid_ssm and not allows_hybrid_decode_radix(server_args):  # PrfaaS(0001)" in patched
    # sgl_kernel's norms stay on its own kernels: flashinfer's would be built from sources not carried
    assert manifest["rewrites"] == ["sgl_kernel/elementwise.py"]
    with tarfile.open(out / "bundle.tar.xz") as tar:
        elementwise = tar.extractfile("site/sgl_kernel/elementwise.py").read().decode()
    namespace: dict = {}
    exec(elementwise.replace("import flashinfer.norm as _flashinfer_norm", "pass"), namespace)
    assert namespace["_has_flashinfer"] is False


def test_a_rewrite_whose_text_moved_fails_naming_the_file():
    assert spec.rewrite("a\nb\n", "b\n", "c\n", "x.py") == "a\nc\n"
    for text in ("a\n", "b\nb\n"):
        with pytest.raises(spec.BundleError, match=r"x\.py: expected the text 'b' once"):
            spec.rewrite(text, "b\n", "c\n", "x.py")


def test_build_fails_naming_a_loaded_file_the_bundle_lacks(tmp_path, wheelhouse):
    trace, _ = _fake_trace(extra_sglang=("sglang/multimodal_gen/big.py",))  # loaded, yet dropped by DROP
    with pytest.raises(spec.BundleError, match="sglang/multimodal_gen/big.py"):
        builder.build(tmp_path / "out", "3.12", wheelhouse, log=lambda _line: None, trace=trace, requires=lambda: REQUIRES)


def test_build_fails_on_an_over_budget_bundle_and_on_a_missing_wheel(tmp_path, wheelhouse):
    trace, _ = _fake_trace()
    with pytest.raises(spec.BundleError, match="over its budget"):
        builder.build(tmp_path / "a", "3.12", wheelhouse, budget_bytes=100, log=lambda _line: None, trace=trace,
                      requires=lambda: REQUIRES)
    (next(wheelhouse.glob("orjson-*.whl"))).unlink()
    (wheelhouse / "orjson-3.13.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(_zip({"orjson/__init__.py": b""}))
    with pytest.raises(spec.BundleError, match=r"no wheel of orjson==3.13.0 for cp312"):
        builder.build(tmp_path / "b", "3.12", wheelhouse, log=lambda _line: None, trace=trace, requires=lambda: REQUIRES)


def test_build_stops_when_an_entry_module_does_not_import(tmp_path, wheelhouse):
    def trace(modules, overlay):
        return {"python": "3.11", "failed": {"sglang.launch_server": "ModuleNotFoundError: No module named 'x'"},
                "unowned": [], "dists": {}}
    with pytest.raises(spec.BundleError, match="sglang.launch_server: ModuleNotFoundError"):
        builder.build(tmp_path / "out", "3.12", wheelhouse, log=lambda _line: None, trace=trace, requires=lambda: REQUIRES)
