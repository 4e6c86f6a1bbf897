"""An import-only ``sgl_kernel`` for real SGLang on a CPU that has no CPU build of it (``gpu.e2e.bundle_env``).

SGLang 0.5.23's CPU engine imports kernels from ``sgl_kernel``'s CPU build when its modules load
(``sglang/kernels/ops/kvcache/cache_move.py``, ``sglang/srt/mem_cache/allocation.py``, the speculative
ops), and PyPI carries no such build (``sglang-kernel`` 0.4.10 is CUDA-only and has no sdist). The
tiny Llama on the ``torch_native`` attention backend never calls one of them, so here every name
imports and **every call raises**: a path that does need a kernel fails at once, naming it, instead of
computing anything. Never on a path where a real ``sgl_kernel`` can be found: the harness puts this
directory on ``PYTHONPATH`` only when none is installed, and after everything else.
"""

from __future__ import annotations

IO_MODULES = ()  # the layering map (tests/unit/test_layering.py): nothing here does I/O


class KernelNotBuilt(NotImplementedError):
    """A kernel of ``sgl_kernel``'s CPU build was called where only this import-only copy is present."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise KernelNotBuilt(f"sgl_kernel.{name} was called, but this machine has no CPU build of sgl_kernel "
                             "(prfaas_sglang/gpu/import_only: imports only); run this model where one is installed")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel
