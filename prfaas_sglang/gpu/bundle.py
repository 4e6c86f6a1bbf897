"""What the GPU carry bundle holds, what it drops, and how it is verified (pure).

The lent GPU machine has Python 3.12 with a CUDA torch stack and transformers preinstalled,
reaches no registry, and receives only the checkout plus 64 MiB of carried files. The bundle
is one site directory, packed as ``bundle.tar.xz``, that goes on ``PYTHONPATH`` there:

    SGLang (the pinned wheel, the patch series applied), sglang-kernel (one GPU
    architecture's ops), Mooncake's CUDA 13 transfer engine, and every other
    distribution the server's modules load that the machine does not have.

Which distributions: the ones a trace of the server's entry modules loads in the CPU test
environment (same pins, ``gpu/trace.py``), less :data:`PREINSTALLED`, with the CPU-only
Mooncake wheel swapped for the CUDA one and :data:`GPU_ONLY` added (imported only where CUDA
is present). Versions are the traced ones, so the bundle is the environment the tests ran.

Verification (:func:`verify`): every file the trace loaded from a bundled distribution is in
the bundle (a compiled extension by its module name, whatever the interpreter tag), every
module imported under a CUDA-only branch of a loaded SGLang module resolves in the bundle or
among the preinstalled packages, and the packed size fits the budget.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

CARRY_BUDGET_BYTES = 64 * 1024 * 1024  # the device tool's limit for the checkout plus carried paths
CHECKOUT_RESERVE_BYTES = 8 * 1024 * 1024  # left for the checkout itself (it is about 3 MB)
BUNDLE_BUDGET_BYTES = CARRY_BUDGET_BYTES - CHECKOUT_RESERVE_BYTES

PYTHON_VERSION = "3.12"  # the lent machine's interpreter (shared/notes/gpu.md)
GLIBC_MINOR = 39  # Ubuntu 24.04's glibc 2.39 (the lent machine); this machine's Debian 12 has 2.36
# Most specific first, as pip orders them.
PLATFORM_TAGS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64")

# The modules whose imports the server needs: the entry our launcher runs, the HTTP server, the
# scheduler's and the detokenizer's processes, the PD and Mooncake code, the hybrid model and its
# attention/cache path, and our hooks. Imports made later, inside functions, are not traced: list
# the module here when one is found missing on the GPU.
ENTRY_MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
    "sglang.srt.models.qwen3_next",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend",
    "sglang.srt.layers.moe.fused_moe_triton",
    "sglang.srt.mem_cache.mamba_radix_cache",
    "sglang.srt.sampling.sampling_batch_info",
    "mooncake.engine",
    "prfaas_sglang.plugin",
    "prfaas_sglang.gpu.netlink",  # the harness's shaped link (pyroute2): the GPU machine has no iproute2
    "pyroute2",
)

# Distributions the lent machine has (shared/notes/gpu.md, [RUN]): its CUDA torch stack and
# transformers' dependencies. ``bench gpu-e2e`` checks them before it starts anything. Not
# transformers, nor the tokenizers and huggingface-hub it checks at import: the bundle carries the
# CPU environment's (the trace's pins), since the machine's (5.17 on 2026-11-26) already registers
# configs SGLang 0.5.15 registers again at import (``qwen3_asr``), which stopped every server at
# ``sglang.srt.configs``.
PREINSTALLED = frozenset({
    "torch", "triton", "torchvision", "cuda-bindings", "cuda-pathfinder", "cuda-toolkit",
    "hf-xet", "safetensors",
    "numpy", "filelock", "fsspec", "jinja2", "markupsafe", "sympy", "mpmath", "networkx",
    "typing-extensions", "packaging", "pyyaml", "regex", "tqdm", "setuptools",
})
PREINSTALLED_PREFIXES = ("nvidia-cu", "nvidia-nccl", "nvidia-nvjitlink", "nvidia-nvtx", "nvidia-nvshmem",
                         "nvidia-cusparse", "nvidia-cufile", "nvidia-curand", "nvidia-cufft")
# Import names of the preinstalled distributions, for modules imported only under CUDA.
PREINSTALLED_MODULES = frozenset({
    "torch", "triton", "torchvision", "cuda", "safetensors",
    "numpy", "filelock", "fsspec", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "typing_extensions",
    "packaging", "yaml", "regex", "tqdm", "setuptools", "pkg_resources", "nvidia",
})

# CPU wheels the trace sees, and the wheel the GPU machine needs instead.
GPU_SWAPS = {"mooncake-transfer-engine-non-cuda": "mooncake-transfer-engine-cuda13"}
# Imported by SGLang only where CUDA is present, so the CPU environment does not have them.
# Those that import on a CPU are put on the trace's path (an overlay of their wheels for the
# tracing interpreter) and traced like the rest; sglang-kernel loads its ops at import and cannot
# be, so its own imports are checked statically. Versions: SGLang's pin where it has one.
TRACE_OVERLAY = {
    "flashinfer-python": None,    # sampler.py, vision.py: `if is_cuda(): from flashinfer... import`
    "apache-tvm-ffi": None,       # flashinfer.jit.core
    "nvidia-ml-py": "13.615.71",  # flashinfer (pynvml); unpinned by sglang
    "python-multipart": "0.0.34",  # http_server's form parsing (fastapi checks at route creation)
}
GPU_ONLY = {"sglang-kernel": None}
# Where a wheel is mostly data the server never reads at import or with the flags gpu-e2e uses.
# Added apart from the trace (an editable install owns no module file): this project, as a wheel
# of the checkout, for its ``sglang.srt.plugins`` entry point (SGLang finds plugins by
# distribution metadata, not by path). The checkout goes first on PYTHONPATH on the GPU machine,
# so its code is what runs.
PROJECT = "prfaas-sglang"
# Loaded in the trace only because the CPU environment has it: transformers imports scipy at import
# when it is installed (its availability probes), and nothing on the server's path calls it; this
# environment has it for the planner's LP and the capacity bench's statistics. Carried, it is 109 MiB
# unpacked and put the bundle 19 MiB over its budget (2026-11-29).
PROBED_ONLY = frozenset({"scipy"})
NOT_CARRIED = frozenset({PROJECT}) | PROBED_ONLY

# Members never loaded on an H100 with the triton attention backend (shared/notes/gpu.md):
# sglang-kernel's FlashAttention and FlashMLA builds and its sm100 ops (an H100 is sm90);
# Mooncake's store, expert-parallel and process-group plugins and tools (a TCP transfer engine
# needs only ``mooncake.engine`` and the libraries it links); SGLang's diffusion server.
# Compiled bytecode and test suites go everywhere.
DROP = {
    "*": ("*.pyc", "*/__pycache__/*"),
    "sglang-kernel": ("sgl_kernel/flash_ops.*", "sgl_kernel/flashmla_ops.*", "sgl_kernel/sm100/*"),
    # (`import mooncake` loads store.so and engine.so loads libetcd_wrapper.so: both stay; the
    # .libs copy of libetcd_wrapper is linked only by the expert-parallel module.)
    "mooncake-transfer-engine-cuda13": ("mooncake/libmooncake_pg*", "mooncake/pg_*", "mooncake/libmooncake_ep*",
                                        "mooncake/_ep*", "mooncake/ep*", "mooncake/transfer_engine_bench",
                                        "mooncake/mooncake_client", "mooncake/mooncake_master",
                                        "mooncake_transfer_engine_cuda13.libs/libetcd_wrapper-*"),
    "sglang": ("sglang/multimodal_gen/*", "sglang/test/*"),
    # JIT sources and prebuilt cubins (74 MB): the triton attention and pytorch sampling
    # backends never JIT-compile a flashinfer kernel; only `import flashinfer.sampling` runs.
    "flashinfer-python": ("flashinfer/data/*",),
}

_EXT_RE = re.compile(r"\.(?:cpython-\d+[a-z]*-[^./]+|abi3|cp\d+-[^./]+)?\.so$")
_LIBS_DIR_RE = re.compile(r"^[^/]+\.libs/")  # auditwheel's vendored libraries: <dist>.libs/
_LIBS_HASH_RE = re.compile(r"-[0-9a-f]{8}(?=\.so)")  # and the hash it puts in their names


# Edits to carried files, each (path in site/, exact text, replacement), applied once the wheels are
# unpacked; a text not found exactly once fails the build. sgl_kernel's RMSNorm family calls
# flashinfer's norm kernels whenever `flashinfer.norm` imports, and flashinfer builds those by JIT
# from the sources DROP leaves out (seen on the lent H200, 2026-11-26: every server's first forward
# failed in ninja on flashinfer/data/csrc/norm.cu); sgl_kernel's own ahead-of-time kernels remain.
REWRITES = (
    ("sgl_kernel/elementwise.py", "    _has_flashinfer = True\n",
     "    _has_flashinfer = False  # prfaas gpu-bundle: no flashinfer JIT sources carried (gpu/bundle.py REWRITES)\n"),
)


def rewrite(text: str, old: str, new: str, path: str) -> str:
    """``text`` with ``old`` replaced by ``new``; raises :class:`BundleError` unless ``old`` occurs once."""
    if (count := text.count(old)) != 1:
        raise BundleError(f"{path}: expected the text {old.strip()!r} once, found it {count} times "
                          "(the carried wheel changed; revisit gpu/bundle.py REWRITES)")
    return text.replace(old, new)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_preinstalled(name: str) -> bool:
    norm = normalize(name)
    return norm in PREINSTALLED or norm.startswith(PREINSTALLED_PREFIXES)


def file_key(path: str) -> str:
    """``path`` with a compiled extension's interpreter tag removed (``a/b.cpython-311-x86_64-linux-gnu.so``
    and ``a/b.abi3.so`` are both ``a/b.so``), and a vendored library's directory and hash
    (``x_non_cuda.libs/libglog-6ed04f2c.so.0`` is ``LIBS/libglog.so.0``), so a file traced under one
    Python or wheel variant matches its twin in another."""
    if _LIBS_DIR_RE.match(path):  # a vendored library: the same one whichever wheel variant vendored it
        return _LIBS_HASH_RE.sub("", _LIBS_DIR_RE.sub("LIBS/", path))
    return _EXT_RE.sub(".so", path)


def dropped(dist: str, member: str) -> bool:
    """Whether the bundle leaves out wheel member ``member`` of distribution ``dist``."""
    patterns = DROP["*"] + DROP.get(normalize(dist), ())
    return any(fnmatch.fnmatchcase(member, pattern) for pattern in patterns)


@dataclass(frozen=True)
class Wanted:
    """One distribution to carry: its name (as the index spells it), version and why."""

    name: str
    version: str
    reason: str


def sglang_pin(requires: Iterable[str], name: str) -> str | None:
    """The ``==`` version SGLang's metadata pins ``name`` to, or None."""
    for req in requires:
        head = req.split(";", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*==\s*([^,\s]+)$", head)
        if match and normalize(match.group(1)) == normalize(name):
            return match.group(2)
    return None


class BundleError(Exception):
    """The bundle cannot be built or does not verify; the message says what is missing."""


def pinned_version(name: str, ours: str | None, sglang_requires: Iterable[str]) -> str:
    """SGLang's ``==`` pin of ``name``, else ``ours``; BundleError when neither exists."""
    version = sglang_pin(sglang_requires, name) or ours
    if version is None:
        raise BundleError(f"neither sglang's metadata nor the bundle spec pins a version of {name}")
    return version


def wanted(traced: Mapping[str, Mapping], sglang_requires: Iterable[str]) -> list[Wanted]:
    """The distributions to carry, from a trace's ``dists`` and SGLang's ``Requires-Dist``."""
    out: dict[str, Wanted] = {}
    for name, entry in traced.items():
        norm = normalize(name)
        if is_preinstalled(norm) or norm in NOT_CARRIED:
            continue
        swapped = GPU_SWAPS.get(norm)
        if swapped is not None:
            out[swapped] = Wanted(swapped, entry["version"], f"the GPU build of {name} (traced)")
        else:
            out[norm] = Wanted(name, entry["version"], "loaded by the server's modules (traced)")
    requires = list(sglang_requires)
    for name, ours in GPU_ONLY.items():
        out[normalize(name)] = Wanted(name, pinned_version(name, ours, requires), "imported only under CUDA (not traceable)")
    return sorted(out.values(), key=lambda w: normalize(w.name))


def cuda_branch_imports(source: str) -> set[str]:
    """Modules (dotted) imported at module level under an ``if`` whose test names CUDA
    (``if _is_cuda:``, ``if is_cuda():``, ``elif _is_cuda_alike``), in its body only. Those imports
    never run on the CPU that traced the module, and do run on the GPU."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()

    def names_cuda(test: ast.expr) -> bool:
        for node in ast.walk(test):
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if ident and "cuda" in ident.lower() and "not" not in ident.lower():
                return True
        return False

    def collect(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found.update(alias.name for alias in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
                found.add(stmt.module)
            elif isinstance(stmt, ast.If):
                collect(stmt.body)
                collect(stmt.orelse)

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If):
                negated = isinstance(stmt.test, ast.UnaryOp) and isinstance(stmt.test.op, ast.Not)
                if names_cuda(stmt.test) and not negated:
                    collect(stmt.body)
                    visit(stmt.orelse)
                else:
                    visit(stmt.body)
                    visit(stmt.orelse)

    visit(tree.body)
    return found


# An ``if`` whose test names one of these selects another platform than a Linux CUDA machine.
OTHER_PLATFORMS = ("darwin", "win32", "hip", "rocm", "npu", "xpu", "musa", "metal", "is_cpu", "mps")


def module_imports(source: str, package: str, branches: bool = False) -> set[str]:
    """Modules (dotted, absolute) a module imports at module level: not inside a function or
    ``try``; inside ``if``/``else`` bodies too when ``branches`` (less a body whose test names
    :data:`OTHER_PLATFORMS`). ``package`` resolves relative
    imports (``from .x import y`` also names ``package.x.y``, which may be a submodule)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found.update(alias.name for alias in stmt.names)
            elif isinstance(stmt, ast.ImportFrom):
                if stmt.level == 0:
                    base = stmt.module or ""
                else:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (stmt.level - 1)] + ([stmt.module] if stmt.module else []))
                found.add(base)
                if stmt.level:
                    found.update(f"{base}.{alias.name}" for alias in stmt.names if alias.name != "*")
            elif branches and isinstance(stmt, ast.If):
                if not any(marker in ast.unparse(stmt.test).lower() for marker in OTHER_PLATFORMS):
                    visit(stmt.body)
                visit(stmt.orelse)

    visit(tree.body)
    return {name for name in found if name}


def reachable_imports(sources: Mapping[str, str], roots: Iterable[str]) -> dict[str, set[str]]:
    """For a package that cannot be imported here: starting from ``roots`` (module names), follow
    its module-level imports (branches included) through ``sources`` (module name -> source of
    its own modules); per module reached, the modules it imports from elsewhere."""
    own_tops = {name.split(".")[0] for name in sources}
    out: dict[str, set[str]] = {}
    todo = [root for root in roots if root in sources]
    seen = set(todo)
    while todo:
        module = todo.pop()
        is_package = module + ".__init__" in sources or any(name.startswith(module + ".") for name in sources)
        package = module if is_package else module.rpartition(".")[0]
        imports = module_imports(sources[module], package, branches=True)
        out[module] = {name for name in imports if name.split(".")[0] not in own_tops}
        for name in imports:
            if name in sources and name not in seen:
                seen.add(name)
                todo.append(name)
    return {module: names for module, names in out.items() if names}


@dataclass
class Verdict:
    """What :func:`verify` found: ``problems`` empty means the bundle verifies."""

    problems: list[str] = field(default_factory=list)
    checked_files: int = 0
    cuda_imports: dict[str, str] = field(default_factory=dict)  # module -> where it resolves

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(traced: Mapping[str, Mapping], bundle_files: Iterable[str], bundle_modules: Iterable[str],
           cuda_imports: Mapping[str, set[str]], size_bytes: int | None = None,
           budget_bytes: int = BUNDLE_BUDGET_BYTES) -> Verdict:
    """Check a bundle against a trace.

    ``traced``: the trace's ``dists``. ``bundle_files``: every path in the bundle's site directory.
    ``bundle_modules``: the top-level import names the bundle provides. ``cuda_imports``: per file,
    the modules it imports only on a GPU (:func:`cuda_branch_imports` of a traced SGLang module;
    :func:`module_imports` of an untraceable GPU-only distribution's modules). ``size_bytes``: the
    packed size, checked against ``budget_bytes`` when given.
    """
    verdict = Verdict()
    keys = {file_key(path) for path in bundle_files}
    for name, entry in sorted(traced.items()):
        norm = normalize(name)
        if is_preinstalled(norm) or norm in NOT_CARRIED:
            continue
        missing = [rel for rel in entry["files"] if file_key(rel) not in keys]
        verdict.checked_files += len(entry["files"])
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            verdict.problems.append(f"{name} {entry['version']}: {len(missing)} loaded file(s) not in the bundle: {shown}")
    provided = set(bundle_modules)
    for where, modules in sorted(cuda_imports.items()):
        for module in sorted({name.split(".")[0] for name in modules}):
            if module in sys.stdlib_module_names:
                continue
            if module in provided:
                verdict.cuda_imports.setdefault(module, "bundle")
            elif module in PREINSTALLED_MODULES:
                verdict.cuda_imports.setdefault(module, "preinstalled")
            else:
                verdict.problems.append(f"{where} imports {module} on a GPU; neither the bundle "
                                        "nor the GPU machine's preinstalled packages provide it")
    if size_bytes is not None and size_bytes > budget_bytes:
        verdict.problems.append(f"the packed bundle is {size_bytes / 2**20:.1f} MiB, over its budget of "
                                f"{budget_bytes / 2**20:.0f} MiB (the carry limit less the checkout)")
    return verdict


def top_level_modules(paths: Iterable[str]) -> set[str]:
    """The import names a site directory's files provide (packages and single-file modules)."""
    out: set[str] = set()
    for path in paths:
        head = path.split("/", 1)[0]
        if "/" in path:
            if not head.endswith((".dist-info", ".data")) and not head.endswith(".libs"):
                out.add(head)
        elif head.endswith(".py"):
            out.add(head[:-3])
        elif head.endswith(".so"):
            out.add(head.split(".", 1)[0])
    return out
