"""prfaas-sglang: Prefill-as-a-Service on a pinned SGLang.

Not a fork of the SGLang tree: the pinned upstream release, a quilt-style
series of small seam patches (``patches/``), and this package, loaded into
SGLang through its ``sglang.srt.plugins`` entry point.

Importing this package imports nothing from SGLang; modules that do are named
``*_adapter``/``plugin``/``hooks`` and import it lazily.
"""

from prfaas_sglang._pin import PINNED_SGLANG_VERSION

__version__ = "0.1.0"
__all__ = ["PINNED_SGLANG_VERSION", "__version__"]
