"""prfaas-sglang: Prefill-as-a-Service on a pinned SGLang.

Not a fork of the SGLang tree: the pinned upstream release, a quilt-style
series of small seam patches (``patches/``), and this package, loaded into
SGLang through its ``sglang.srt.plugins`` entry point.

Importing this package imports nothing from SGLang; the modules that touch it
(``plugin``, ``hooks/``, the patch tooling) import it lazily.

Layout, by dependency direction (adapters -> pure core, never back): ``docs/architecture.md``.
Each package's ``__init__`` says which of its modules do I/O (``IO_MODULES``) or which are pure
(``PURE_MODULES``); ``tests/unit/test_layering.py`` checks the map against the import graph.
"""

from prfaas_sglang._pin import PINNED_SGLANG_VERSION

# The layering map (docs/architecture.md, checked by tests/unit/test_layering.py): a pure package;
# these modules of it do I/O, and every other module is pure.
IO_MODULES = ("plugin", "security")

__version__ = "0.1.0"
__all__ = ["PINNED_SGLANG_VERSION", "__version__"]
